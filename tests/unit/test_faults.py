"""Fault, reload, shutdown and memory-budget paths of the real proxy against fake Tritons.

The fakes (``faketriton``) are small aiohttp servers: they make a server fail in one exact way
(refuse, drop a connection before answering, answer late, lose a model) in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from proxy.app import ProxyServer
from proxy.config import ProxyConfig, parse
from proxy.dispatch import says_model_absent
from proxy.fleet.upstream import (
    UpstreamConnectError,
    UpstreamLostError,
    UpstreamTimeoutError,
    http_failure,
)
from tests.unit.faketriton import fakes, policy, proxy_for

FAST_HEALTH = {"interval_s": 0.05, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}


def infer_body(nbytes: int = 0, **parameters: Any) -> bytes:
    doc: dict[str, Any] = {"inputs": [], "pad": "x" * nbytes}
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


async def infer(
    proxy: ProxyServer, model: str = "m", body: bytes | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert proxy.ports is not None
    url = f"http://127.0.0.1:{proxy.ports.http}/v2/models/{model}/infer"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=body if body is not None else infer_body()) as r,
    ):
        return r.status, json.loads(await r.read()), dict(r.headers)


async def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    ("exc", "kind", "retry_safe"),
    [
        (aiohttp.ConnectionTimeoutError("connect"), UpstreamConnectError, True),
        (aiohttp.ServerDisconnectedError(), UpstreamLostError, True),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), UpstreamLostError, True),
        (aiohttp.SocketTimeoutError("read"), UpstreamTimeoutError, False),
        (aiohttp.ClientPayloadError("cut"), UpstreamLostError, False),
    ],
)
def test_http_failures_are_sorted(exc: Exception, kind: type, retry_safe: bool) -> None:
    failure = http_failure(exc, before_response=True)  # type: ignore[arg-type]
    assert isinstance(failure, kind)
    if isinstance(failure, UpstreamLostError):
        assert failure.before_response is retry_safe


async def test_refused_connection_is_retried_and_ejects_at_once() -> None:
    async with fakes(2) as (f0, f1):
        doc = policy([f0, f1], health={"eject_after_failures": 3, "interval_s": 60})
        async with proxy_for(doc) as proxy:
            await f0.stop()  # nothing listens there now
            answers = [await infer(proxy) for _ in range(4)]
            assert [a[0] for a in answers] == [200] * 4
            assert {a[1]["served_by"] for a in answers} == {"f1"}
            inst = proxy.runtime.fleet.get("f0")
            assert not inst.healthy and "connection failed" in inst.ejected_reason


async def test_connection_broken_before_any_answer_byte_is_retried_if_stateless() -> None:
    async with fakes(2) as (f0, f1):
        for f in (f0, f1):
            f.models["dec"] = {"model_transaction_policy": {"decoupled": True}}
        doc = policy([f0, f1], health={"eject_after_failures": 3, "interval_s": 60})
        async with proxy_for(doc) as proxy:
            f0.drop_next = 1
            answers = [await infer(proxy) for _ in range(2)]
            assert [(a[0], a[1]["served_by"]) for a in answers] == [(200, "f1")] * 2
            fleet = proxy.runtime.fleet
            assert fleet.get("f0").healthy  # one broken connection does not eject
            assert proxy.runtime.telemetry.retries._value.get() == 1

            # A decoupled model's request may have started streaming work: not resent.
            f0.drop_next = f1.drop_next = 1
            status, body, _ = await infer(proxy, "dec")
            assert status == 503 and "was lost" in body["error"]
            # Nor is a request of a sequence.
            f0.drop_next = f1.drop_next = 1
            seq = infer_body(sequence_id=5, sequence_start=True)
            status, body, _ = await infer(proxy, "m", seq)
            assert status == 503 and "was lost" in body["error"]


async def test_read_timeout_answers_504_without_ejecting() -> None:
    async with fakes(1) as (f0,):
        f0.delay_s = 2.0
        doc = policy([f0], limits={"request_timeout_s": 0.2})
        async with proxy_for(doc) as proxy:
            status, body, _ = await infer(proxy)
            assert status == 504
            assert "request_timeout_s" in body["error"] and "f0" in body["error"]
            assert proxy.runtime.fleet.get("f0").healthy


async def test_model_missing_on_one_instance_leaves_only_that_model() -> None:
    async with fakes(2) as (f0, f1):
        f0.models["other"] = {}
        doc = policy([f0, f1], health=FAST_HEALTH)
        async with proxy_for(doc) as proxy:
            fleet = proxy.runtime.fleet
            saved = f0.models.pop("m")  # "unloaded" on f0
            answers = [await infer(proxy) for _ in range(4)]
            assert [(a[0], a[1]["served_by"]) for a in answers] == [(200, "f1")] * 4
            f0_inst = fleet.get("f0")
            assert f0_inst.healthy and "m" in f0_inst.models_out
            assert (await infer(proxy, "other"))[1]["served_by"] == "f0"

            f0.models["m"] = saved  # loaded again: the model probe brings it back
            await wait_for(lambda: "m" not in f0_inst.models_out)
            served = {(await infer(proxy))[1]["served_by"] for _ in range(4)}
            assert served == {"f0", "f1"}


async def test_model_missing_everywhere_gets_tritons_answer() -> None:
    async with fakes(2) as (f0, f1), proxy_for(policy([f0, f1])) as proxy:
        assert (await infer(proxy))[0] == 200
        assert await proxy.runtime.catalog.info("m") is not None  # known, as if just unloaded
        f0.models.clear()
        f1.models.clear()
        for _ in range(3):
            status, body, _ = await infer(proxy)
            assert status == 404 and "unknown model" in body["error"]
        # The last instance serving a model keeps it: no self-made outage.
        assert len(proxy.runtime.fleet.serving("m")) == 1


async def test_byte_budget_refuses_with_429_and_releases_once() -> None:
    async with fakes(1) as (f0,):
        f0.delay_s = 0.5
        doc = policy([f0], limits={"max_body_bytes": 1024, "max_buffered_bytes": 2048})
        async with proxy_for(doc) as proxy:
            budget = proxy.runtime.budget
            first = [asyncio.create_task(infer(proxy, body=infer_body(900))) for _ in range(2)]
            await wait_for(lambda: budget.in_use > 1800)
            gauge = [
                float(line.split()[1])
                for line in proxy.telemetry.exposition().decode().splitlines()
                if line.startswith("triton_proxy_buffered_bytes ")
            ]
            assert gauge == [budget.in_use]
            status, body, headers = await infer(proxy, body=infer_body(900))
            assert status == 429 and "max_buffered_bytes" in body["error"]
            assert headers["Retry-After"] == "1"

            async def chunks() -> AsyncIterator[bytes]:
                yield b'{"inputs": [], "pad": "'
                yield b"x" * 800
                yield b'"}'

            status, _, _ = await infer(proxy, body=chunks())  # type: ignore[arg-type]
            assert status == 429  # a chunked body is counted as it arrives
            assert [(await t)[0] for t in first] == [200, 200]
            assert budget.in_use == 0
            assert (await infer(proxy, body=infer_body(900)))[0] == 200
            assert budget.in_use == 0


async def test_sequence_on_instance_removed_by_reload_gets_a_clear_error() -> None:
    async with fakes(2) as (f0, f1):
        doc = policy([f0, f1])
        async with proxy_for(doc) as proxy:
            status, body, _ = await infer(
                proxy, body=infer_body(sequence_id=7, sequence_start=True)
            )
            assert status == 200
            holder = body["served_by"]
            keep = [i for i in doc["instances"] if i["name"] != holder]
            await proxy.runtime.apply(parse({**doc, "instances": keep}, "<reload>"))
            status, body, _ = await infer(proxy, body=infer_body(sequence_id=7))
            assert status == 400
            assert "removed by a policy reload" in body["error"] and "7" in body["error"]
            # A new start of the same id is placed afresh.
            again = infer_body(sequence_id=7, sequence_start=True)
            assert (await infer(proxy, body=again))[0] == 200
            assert (await infer(proxy, body=infer_body(sequence_id=7)))[0] == 200


async def test_reload_retires_a_pool_only_after_its_requests_finish() -> None:
    async with fakes(2) as (f0, f1):
        f0.delay_s = 0.5
        doc = policy([f0])
        async with proxy_for(doc) as proxy:
            rt = proxy.runtime
            slow = asyncio.create_task(infer(proxy))
            await wait_for(lambda: rt.fleet.total_in_flight() == 1)
            await rt.apply(parse(policy([f1]), "<reload>"))
            assert rt.upstreams.retiring() == 1
            status, body, _ = await slow
            assert (status, body["served_by"]) == (200, "f0")
            assert (await infer(proxy))[1]["served_by"] == "f1"
            await wait_for(lambda: rt.upstreams.retiring() == 0)


async def test_shutdown_closes_listeners_drains_and_answers_queued_503() -> None:
    async with fakes(1) as (f0,):
        f0.delay_s = 0.3
        doc = policy(
            [f0],
            limits={"drain_timeout_s": 0.5},
            scheduling={"concurrency": 1, "classes": {"online": {"rank": 0}}},
        )
        proxy = ProxyServer(parse(doc, "<test>"))
        await proxy.start()
        rt = proxy.runtime
        requests = [asyncio.create_task(infer(proxy)) for _ in range(6)]
        await wait_for(lambda: rt.gates is not None and rt.gates.queued_total() >= 4)
        stopping = asyncio.create_task(proxy.stop())
        await wait_for(lambda: rt.draining)
        assert not rt.ready()
        with pytest.raises(aiohttp.ClientConnectionError):
            await infer(proxy)  # the listener is closed
        await stopping
        statuses = sorted([(await t)[0] for t in requests])
        assert 200 in statuses and 503 in statuses
        assert set(statuses) == {200, 503}
        assert rt.fleet.total_in_flight() == 0


async def test_policy_watch_survives_an_unexpected_error(tmp_path: Path) -> None:
    async with fakes(1) as (f0,):
        doc = policy([f0])
        path = tmp_path / "policy.yaml"
        path.write_text("{}")
        calls: list[int] = []

        def loader(p: Path) -> ProxyConfig:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in a loader")
            return parse(policy([f0], routing={"policy": {"name": "random"}}), str(p))

        async with proxy_for(
            doc, policy_path=path, watch_interval_s=0.02, policy_loader=loader
        ) as proxy:
            reloads = proxy.telemetry.reloads
            proxy.request_reload()
            await wait_for(lambda: reloads.labels("error")._value.get() == 1)
            proxy.request_reload()
            await wait_for(lambda: reloads.labels("ok")._value.get() == 1)
            assert proxy.runtime.router.policy("m")[0] == "random"


@pytest.mark.parametrize(
    ("message", "absent"),
    [
        ("Request for unknown model: 'simple' has no available versions", True),
        ("Request for unknown model: 'simple' is not found", True),
        ("Request for unknown model: 'simple' version 7 is not found", False),
        ("unexpected shape for input 'INPUT0' for model 'simple'", False),
        ('{"error":"Request for unknown model: \'simple\' is not found"}', True),
        ("Stub process 'simple_0_0' is not healthy.", True),
        ('{"error":"Stub process \'simple_0_0\' is not healthy."}', True),
        # Quoted inside another error (a client's input name echoed back): not Triton's answer.
        ("unexpected inference input 'Stub process 'x' is not healthy.' for model 's'", False),
        (
            json.dumps({"error": "input 'Request for unknown model: 's' is not found'"}),
            False,
        ),
        ('{"error": 5}', False),
        ("{not json", False),
    ],
)
def test_only_a_missing_model_takes_it_out_of_rotation(message: str, absent: bool) -> None:
    assert says_model_absent(message) is absent


async def test_connect_timeout_is_retried_elsewhere_without_ejecting() -> None:
    # A listener that never accepts, its queue already full: connecting to it hangs.
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(black_hole.getsockname())
        fillers.append(s)
    try:
        async with fakes(1) as (f0,):
            doc = policy([f0])
            doc["instances"].insert(
                0, {"name": "hole", "http": "http://{}:{}".format(*black_hole.getsockname())}
            )
            doc["limits"] = {"connect_timeout_s": 0.2}
            doc["health"] = {"timeout_s": 0.2, "interval_s": 60, "eject_after_failures": 3}
            async with proxy_for(doc) as proxy:
                hole = proxy.runtime.fleet.get("hole")
                hole.next_probe_at = float("inf")  # only requests meet it from now on
                await asyncio.sleep(0.3)  # a probe already under way times out
                hole.healthy, hole.failures = True, 0  # whatever the probes found
                answers = [await infer(proxy) for _ in range(2)]  # round robin: one to the hole
                assert [(a[0], a[1]["served_by"]) for a in answers] == [(200, "f0")] * 2
                # Never reached, so retried; and a connect timeout alone does not eject.
                assert hole.healthy and hole.failures >= 1
                assert proxy.runtime.telemetry.retries._value.get() == hole.failures
    finally:
        for s in fillers:
            s.close()
        black_hole.close()


async def test_grpc_request_over_the_byte_budget_is_resource_exhausted() -> None:
    async with fakes(1) as (f0,):
        doc = policy([f0])
        doc["instances"][0]["grpc"] = "127.0.0.1:1"  # never reached: refused before dispatch
        async with proxy_for(doc) as proxy:
            assert proxy.ports is not None and proxy.ports.grpc is not None
            budget = proxy.runtime.budget
            budget.in_use = budget.limit - 10  # as if other requests held the rest
            request = pb.ModelInferRequest(model_name="m", id="x" * 64).SerializeToString()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.ports.grpc}") as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_buffered_bytes" in (info.value.details() or "")
            trailing = dict(info.value.trailing_metadata() or ())
            assert trailing.get("retry-after") == "1"
            assert budget.in_use == budget.limit - 10  # the refused request holds nothing
