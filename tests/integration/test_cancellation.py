"""Abandoned work and client deadlines (issue 14), against a real Triton server.

Every test reads what Triton did from the far side: the ``sleeper`` model counts the requests it
completed and those it found cancelled while running (``model_repository/README.md``), and
Triton's own statistics count what its scheduler dropped. The proxy stands in front of one
server only, so every request lands where the counters are read.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from proxy.frontends.grpc import method_path
from proxy.local import TritonServer
from tests.integration.harness import ProxyThread, running_proxy, sleeper_body, until

pytestmark = pytest.mark.integration

MODEL = "sleeper"
URL = f"/v2/models/{MODEL}/infer"
HOLD_MS = 1500
LONG_MS = 3000
GRPC_WIRE_SLACK_US = 50_000
# One dispatch slot for the one instance: a second request waits in the proxy's class queue.
# No nudge: with classes the default wake sends sleeper (it honours a request's timeout)
# expired copies, which Triton counts as failures, and these tests count what reaches it.
QUEUEING: dict[str, Any] = {
    "routing": {"wake": {"nudge": False}},
    "scheduling": {
        "default_class": "online",
        "concurrency": 1,
        "classes": {"online": {"rank": 0, "triton_priority": 1}},
    },
}


@dataclass(frozen=True)
class Counters:
    completed: int
    cancelled: int
    cancelled_ms: int
    timeout_us: int


def grpc_request(delay_ms: int, parameters: dict[str, int] | None = None) -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="DELAY_MS", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[delay_ms]], dtype=np.int32).tobytes())
    for name, value in (parameters or {}).items():
        request.parameters[name].int64_param = value
    return request.SerializeToString()


def counters_of(answer: dict[str, Any]) -> Counters:
    values = {o["name"]: o["data"][0] for o in answer["outputs"]}
    return Counters(
        values["COMPLETED"], values["CANCELLED"], values["CANCELLED_MS"], values["TIMEOUT_US"]
    )


def read_counters(server: TritonServer) -> Counters:
    """The model's counters, asked of Triton directly (the query itself then counts as one
    completed request)."""
    r = requests.post(server.http_url + URL, data=sleeper_body(0), timeout=30)
    assert r.status_code == 200, r.text
    return counters_of(r.json())


def ran(before: Counters, after: Counters) -> int:
    """Requests completed between two reads, not counting the first read itself."""
    return after.completed - before.completed - 1


def stats(server: TritonServer) -> dict[str, Any]:
    r = requests.get(f"{server.http_url}/v2/models/{MODEL}/stats", timeout=10)
    inference: dict[str, Any] = r.json()["model_stats"][0]["inference_stats"]
    return inference


async def running_in_triton(p: ProxyThread, count: int = 1) -> None:
    """Wait until ``count`` requests are in flight from the proxy, and Triton has begun them."""
    await until(lambda: p.runtime.fleet.total_in_flight() == count)
    await asyncio.sleep(0.3)  # the request reaches the model's execute()


def proxy_results(p: ProxyThread, result: str) -> float:
    """Requests of the model that ended with ``result``, on any instance or none ("-")."""
    total = 0.0
    for family in p.runtime.telemetry.registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "triton_proxy_requests_total"
                and labels.get("model") == MODEL
                and labels.get("class") == "default"
                and labels.get("outcome") == result
                and labels.get("arm") == "main"
            ):
                total += sample.value
    return total


@pytest.fixture
def server(triton_fleet: Any) -> TritonServer:
    s: TritonServer = triton_fleet.server(0)
    return s


async def post(
    session: aiohttp.ClientSession,
    p: ProxyThread,
    data: bytes,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    async with session.post(f"http://{p.http}{URL}", data=data, headers=headers) as r:
        return r.status, await r.text()


# --- in flight -------------------------------------------------------------------------------


async def test_grpc_cancel_while_running_reaches_triton(server: TritonServer) -> None:
    before = await asyncio.to_thread(read_counters, server)
    with running_proxy([server]) as p:
        async with grpc.aio.insecure_channel(p.grpc) as channel:
            call = channel.unary_unary(method_path("ModelInfer"))(grpc_request(LONG_MS))
            await running_in_triton(p)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        await until(lambda: p.runtime.fleet.total_in_flight() == 0)
        after = await asyncio.to_thread(read_counters, server)
    assert after.cancelled == before.cancelled + 1
    assert ran(before, after) == 0


async def test_grpc_deadline_while_running_reaches_triton(server: TritonServer) -> None:
    before = await asyncio.to_thread(read_counters, server)
    with running_proxy([server]) as p:
        with grpcclient.InferenceServerClient(p.grpc) as client:
            tensor = grpcclient.InferInput("DELAY_MS", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[LONG_MS]], dtype=np.int32))
            with pytest.raises(InferenceServerException) as info:
                await asyncio.to_thread(client.infer, MODEL, [tensor], client_timeout=0.5)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        await until(lambda: p.runtime.fleet.total_in_flight() == 0)
        after = await asyncio.to_thread(read_counters, server)
    assert after.cancelled == before.cancelled + 1
    assert ran(before, after) == 0
    # Stopped early: Triton did not run the 3 s of work nobody waited for.
    assert after.cancelled_ms - before.cancelled_ms < LONG_MS


async def test_http_disconnect_while_running_stops_the_proxy_not_triton(
    server: TritonServer,
) -> None:
    """The proxy notices and counts the request as cancelled; Triton's HTTP frontend does not
    notice a closed connection (server issue #7077), so the work runs to its end there, and the
    proxy holds its slot and token until then. The remedy for what waits in Triton's queue is
    the handed-on ``timeout`` (next tests)."""
    before = await asyncio.to_thread(read_counters, server)
    with running_proxy([server]) as p:
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(post(session, p, sleeper_body(HOLD_MS)))
            await running_in_triton(p)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The proxy counts the request as cancelled, and holds its token until Triton is done.
        await until(lambda: p.runtime.fleet.total_in_flight() == 0)
        assert proxy_results(p, "cancelled") == 1
        after = await asyncio.to_thread(read_counters, server)
    assert after.cancelled == before.cancelled
    assert ran(before, after) == 1  # Triton ran it to the end


# --- queued in the proxy -----------------------------------------------------------------------


async def test_clients_that_leave_the_proxys_queue_never_reach_triton(
    server: TritonServer,
) -> None:
    before = await asyncio.to_thread(read_counters, server)
    with running_proxy([server], QUEUEING) as p:
        async with aiohttp.ClientSession() as session:
            holder = asyncio.ensure_future(post(session, p, sleeper_body(HOLD_MS)))
            await running_in_triton(p)
            gate = p.runtime.gates.gates[MODEL]
            # HTTP: the client disconnects while queued.
            http_waiter = asyncio.ensure_future(post(session, p, sleeper_body(10)))
            await until(lambda: gate.queued() == 1)
            http_waiter.cancel()
            await until(lambda: gate.queued() == 0)
            # gRPC: the client cancels while queued.
            async with grpc.aio.insecure_channel(p.grpc) as channel:
                call = channel.unary_unary(method_path("ModelInfer"))(grpc_request(10))
                await until(lambda: gate.queued() == 1)
                call.cancel()
                await until(lambda: gate.queued() == 0)
            assert gate.in_flight() == 1  # the holder still runs
            assert (await holder)[0] == 200
        await until(lambda: p.runtime.fleet.total_in_flight() == 0 and gate.in_flight() == 0)
        after = await asyncio.to_thread(read_counters, server)
    assert ran(before, after) == 1  # the holder alone
    assert after.cancelled == before.cancelled


# --- deadlines -----------------------------------------------------------------------------------


async def test_expired_deadline_is_shed_before_dispatch(server: TritonServer) -> None:
    before = await asyncio.to_thread(read_counters, server)
    stats_before = await asyncio.to_thread(stats, server)
    with running_proxy([server], QUEUEING) as p:
        async with aiohttp.ClientSession() as session:
            # Past at arrival: a KServe timeout of 1 µs.
            status, text = await post(session, p, sleeper_body(10, {"timeout": 1}))
            assert status == 429, text
            assert "deadline" in json.loads(text)["error"]
            async with grpc.aio.insecure_channel(p.grpc) as channel:
                infer = channel.unary_unary(method_path("ModelInfer"))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await infer(grpc_request(10, {"timeout": 1}))
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                # Past while queued behind a running request: answered at the deadline, and
                # never sent.
                holder = asyncio.ensure_future(post(session, p, sleeper_body(HOLD_MS)))
                await running_in_triton(p)
                status, text = await post(
                    session, p, sleeper_body(10), {"Triton-Timeout-Ms": "300"}
                )
                assert status == 429, text
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await infer(grpc_request(10), timeout=0.3)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                gate = p.runtime.gates.gates[MODEL]
                # The client's own deadline fires first; the proxy sees the cancellation a
                # moment later and takes the request out of its queue.
                await until(lambda: gate.queued() == 0)
                assert gate.in_flight() == 1
                assert (await holder)[0] == 200
        after = await asyncio.to_thread(read_counters, server)
    assert ran(before, after) == 1  # the holder alone
    stats_after = await asyncio.to_thread(stats, server)
    assert stats_after["fail"]["count"] == stats_before["fail"]["count"]


async def test_the_rest_of_the_deadline_is_handed_to_triton(server: TritonServer) -> None:
    with running_proxy([server]) as p:
        async with aiohttp.ClientSession() as session:
            status, text = await post(session, p, sleeper_body(0), {"Triton-Timeout-Ms": "5000"})
            assert status == 200, text
            assert 4_000_000 < counters_of(json.loads(text)).timeout_us <= 5_000_000
            # A KServe timeout the client set is replaced by what is left of it.
            status, text = await post(session, p, sleeper_body(0, {"timeout": 4_000_000}))
            assert 3_000_000 < counters_of(json.loads(text)).timeout_us <= 4_000_000
        with grpcclient.InferenceServerClient(p.grpc) as client:
            tensor = grpcclient.InferInput("DELAY_MS", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[0]], dtype=np.int32))
            result = await asyncio.to_thread(client.infer, MODEL, [tensor], client_timeout=5)
            timeout_us = int(result.as_numpy("TIMEOUT_US").reshape(-1)[0])
            # gRPC itself may lengthen a deadline on the wire: grpc core encodes a 1-10 s
            # ``grpc-timeout`` rounded up to 10 ms, from a cached clock that can lag by ms
            # (CI once saw 5,009,289 us). The proxy hands on what gRPC reports, no more.
            assert 4_000_000 < timeout_us <= 5_000_000 + GRPC_WIRE_SLACK_US


async def test_without_cancel_upstream_abandoned_work_runs_in_triton(
    server: TritonServer,
) -> None:
    """``limits.cancel_upstream: false`` (the benchmark's comparison arm) runs it all."""
    before = await asyncio.to_thread(read_counters, server)
    with running_proxy([server], {"limits": {"cancel_upstream": False}}) as p:
        async with aiohttp.ClientSession() as session:
            status, text = await post(session, p, sleeper_body(0), {"Triton-Timeout-Ms": "5000"})
            assert status == 200, text
            assert counters_of(json.loads(text)).timeout_us == 0  # not handed on
        with grpcclient.InferenceServerClient(p.grpc) as client:
            tensor = grpcclient.InferInput("DELAY_MS", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[HOLD_MS]], dtype=np.int32))
            with pytest.raises(InferenceServerException):
                await asyncio.to_thread(client.infer, MODEL, [tensor], client_timeout=0.3)
        await until(lambda: p.runtime.fleet.total_in_flight() == 0, timeout_s=HOLD_MS / 1000 * 4)
        after = await asyncio.to_thread(read_counters, server)
    assert after.cancelled == before.cancelled
    assert ran(before, after) == 2


async def test_a_request_that_expires_in_the_queue_wakes_the_batcher_and_never_runs(
    server: TritonServer,
) -> None:
    """What ``routing.wake.expired_copy`` rests on, asked of Triton itself: a request with a
    ``timeout`` of 1 µs (the nudge's copy) is rejected as expired when the batcher forms the
    batch, before the model sees it, and a request queued behind a running one still runs."""
    before = await asyncio.to_thread(read_counters, server)
    rejected_before = stats(server)["fail"]["count"]
    async with aiohttp.ClientSession() as session:
        url = server.http_url + URL
        running = asyncio.create_task(session.post(url, data=sleeper_body(300)))
        await asyncio.sleep(0.1)  # it runs; the next two queue behind it
        queued = asyncio.create_task(session.post(url, data=sleeper_body(0)))
        expired = await session.post(url, data=sleeper_body(0, {"timeout": 1}))
        assert expired.status >= 400, await expired.text()
        assert "timeout" in (await expired.text()).lower()
        for task in (running, queued):
            answer = await task
            assert answer.status == 200, await answer.text()
    after = await asyncio.to_thread(read_counters, server)
    assert ran(before, after) == 2  # the running and the queued one; not the copy
    assert stats(server)["fail"]["count"] == rejected_before + 1
