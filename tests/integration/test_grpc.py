"""The gRPC frontend against real Triton servers, through the real tritonclient (sync and aio)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from proxy.frontends.common import SHARED_MEMORY_MESSAGE
from proxy.frontends.grpc import SERVICE, method_path
from tests.integration.harness import ProxyThread, running_proxy, until

pytestmark = pytest.mark.integration

MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def proxy(triton_fleet: Any) -> Iterator[ProxyThread]:
    with running_proxy(triton_fleet.servers, {"limits": {"max_body_bytes": MAX_BODY}}) as p:
        yield p


@pytest.fixture(scope="module")
def direct(triton_fleet: Any) -> str:
    return str(triton_fleet.servers[0].grpc_address)


def unary(address: str, method: str, request: bytes, **kwargs: Any) -> tuple[Any, Any]:
    """(OK, response message) or (status code, details) of one raw call."""
    with grpc.insecure_channel(address) as channel:
        try:
            data = channel.unary_unary(method_path(method))(request, timeout=30, **kwargs)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    # Parsed, not bytes: Triton serialises its maps in no fixed order.
    return grpc.StatusCode.OK, getattr(pb, f"{method}Response").FromString(data)


def status_of(exc: InferenceServerException) -> tuple[str | None, str | None]:
    return exc.status(), exc.message()


# --- every method but inference and model control -------------------------------------------

UNARY_CASES: dict[str, tuple[str, Any]] = {
    "live": ("ServerLive", pb.ServerLiveRequest()),
    "ready": ("ServerReady", pb.ServerReadyRequest()),
    "server metadata": ("ServerMetadata", pb.ServerMetadataRequest()),
    "model ready": ("ModelReady", pb.ModelReadyRequest(name="simple")),
    "model ready, unknown": ("ModelReady", pb.ModelReadyRequest(name="no_such_model")),
    "model metadata": ("ModelMetadata", pb.ModelMetadataRequest(name="text_generator")),
    "model metadata, version": (
        "ModelMetadata",
        pb.ModelMetadataRequest(name="simple", version="1"),
    ),
    "model metadata, unknown": ("ModelMetadata", pb.ModelMetadataRequest(name="no_such_model")),
    "model config": ("ModelConfig", pb.ModelConfigRequest(name="accumulator")),
    "model config, unknown": ("ModelConfig", pb.ModelConfigRequest(name="no_such_model")),
    "statistics, unknown": ("ModelStatistics", pb.ModelStatisticsRequest(name="no_such_model")),
    "trace settings (read)": ("TraceSetting", pb.TraceSettingRequest()),
    "log settings (read)": ("LogSettings", pb.LogSettingsRequest()),
    "system shm status": ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
    "system shm unregister all": (
        "SystemSharedMemoryUnregister",
        pb.SystemSharedMemoryUnregisterRequest(),
    ),
    "system shm unregister one": (
        "SystemSharedMemoryUnregister",
        pb.SystemSharedMemoryUnregisterRequest(name="region"),
    ),
    "cuda shm status": ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest()),
    "cuda shm unregister one": (
        "CudaSharedMemoryUnregister",
        pb.CudaSharedMemoryUnregisterRequest(name="region"),
    ),
}


@pytest.mark.parametrize("case", list(UNARY_CASES))
def test_method_answers_as_triton_does(proxy: ProxyThread, direct: str, case: str) -> None:
    method, message = UNARY_CASES[case]
    request = message.SerializeToString()
    assert unary(proxy.grpc, method, request) == unary(direct, method, request)


def test_client_api_answers_as_triton_does(proxy: ProxyThread, direct: str) -> None:
    answers = []
    for url in (direct, proxy.grpc):
        with grpcclient.InferenceServerClient(url) as c:
            answers.append(
                (
                    c.is_server_live(),
                    c.is_server_ready(),
                    c.get_server_metadata(as_json=True),
                    c.is_model_ready("accel_sim"),
                    c.get_model_metadata("text_encoder", as_json=True),
                    c.get_model_config("accel_sim", as_json=True),
                    c.get_inference_statistics("text_generator", as_json=True)["model_stats"][0][
                        "name"
                    ],
                    c.get_system_shared_memory_status(as_json=True),
                    c.get_cuda_shared_memory_status(as_json=True),
                )
            )
    assert answers[0] == answers[1]


# --- inference ------------------------------------------------------------------------------


def simple_inputs(n: int = 16) -> list[grpcclient.InferInput]:
    a = np.arange(n, dtype=np.int32).reshape(1, n)
    b = np.full((1, n), 3, dtype=np.int32)
    inputs = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        i = grpcclient.InferInput(name, list(arr.shape), "INT32")
        i.set_data_from_numpy(arr)
        inputs.append(i)
    return inputs


def test_infer_simple_is_identical(proxy: ProxyThread, direct: str) -> None:
    responses = []
    for url in (direct, proxy.grpc):
        with grpcclient.InferenceServerClient(url) as c:
            result = c.infer("simple", simple_inputs(), request_id="r-1")
            responses.append(result.get_response())
    assert responses[0] == responses[1]
    out = grpcclient.InferResult(responses[1]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, np.arange(16, dtype=np.int32).reshape(1, 16) + 3)


async def test_aio_infer_is_identical(proxy: ProxyThread, direct: str) -> None:
    responses = []
    for url in (direct, proxy.grpc):
        async with aiogrpcclient.InferenceServerClient(url) as c:
            result = await c.infer("simple", simple_inputs(), request_id="aio")
            responses.append(result.get_response())
    assert responses[0] == responses[1]


def text_inputs(prompt: str, max_tokens: int, stream: bool = True) -> list[grpcclient.InferInput]:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    tokens.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    flag = grpcclient.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    return [text, tokens, flag]


@dataclass
class StreamEvent:
    request_id: str
    text: str | None
    final: bool
    error: str | None


def _event(result: Any, error: Any) -> StreamEvent:
    if error is not None:
        return StreamEvent("", None, True, str(error))
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param
    out = result.as_numpy("text_output") if response.outputs else None
    text = None if out is None else out.reshape(-1)[0].decode()
    return StreamEvent(response.id, text, final, None)


def stream_generate(url: str, prompts: list[str], max_tokens: int) -> list[list[StreamEvent]]:
    """Events per prompt, from one stream carrying every prompt (interleaved by Triton)."""
    events: queue.Queue[StreamEvent] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=lambda result, error: events.put(_event(result, error)))
        for n, prompt in enumerate(prompts):
            c.async_stream_infer(
                "text_generator",
                text_inputs(prompt, max_tokens),
                request_id=str(n),
                enable_empty_final_response=True,
            )
        got: dict[str, list[StreamEvent]] = {str(n): [] for n in range(len(prompts))}
        done = 0
        while done < len(prompts):
            e = events.get(timeout=30)
            assert e.error is None, e.error
            got[e.request_id].append(e)
            done += e.final
        c.stop_stream()
    return [got[str(n)] for n in range(len(prompts))]


def test_stream_infer_tokens_are_identical(proxy: ProxyThread, direct: str) -> None:
    prompts = ["Hello, Triton", "the quick brown fox", "x"]
    direct_events = stream_generate(direct, prompts, max_tokens=12)
    proxied_events = stream_generate(proxy.grpc, prompts, max_tokens=12)
    assert proxied_events == direct_events
    for events in proxied_events:
        # One response per token, then the empty final one.
        assert [e.text is not None for e in events] == [True] * 12 + [False]


def upstream_streams(proxy: ProxyThread) -> dict[str, float]:
    """The proxy's ModelStreamInfer calls opened to Triton so far, by kind of model."""
    registry = proxy.proxy.runtime.telemetry.registry
    return {
        kind: registry.get_sample_value("triton_proxy_upstream_streams_total", {"kind": kind})
        or 0.0
        for kind in ("decoupled", "other")
    }


async def aio_stream(url: str, requests: list[dict[str, Any]]) -> list[Any]:
    """Every answer of one aio stream carrying ``requests`` at once: (id, outputs or error),
    grouped by request id in each request's own order (Triton interleaves requests)."""

    async def gen() -> Any:
        for request in requests:
            yield request

    got: list[Any] = []
    async with aiogrpcclient.InferenceServerClient(url) as c:
        async for result, error in c.stream_infer(gen(), stream_timeout=30):
            if error is not None:
                got.append(("error", str(error)))
                continue
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}
            got.append((response.id, outputs))
    return sorted(got, key=lambda answer: answer[0])


async def test_stream_mixing_model_kinds_is_split_upstream(proxy: ProxyThread, direct: str) -> None:
    """A client stream carrying a decoupled model (text_generator) and a non-decoupled one
    (simple) gets Triton's answers, each request's in its own order, as directly; the proxy
    relays it as two upstream calls, one per kind, because Triton can abort on a stream that
    mixes their errors (docs/triton-notes.md)."""
    requests = [
        {"model_name": "text_generator", "inputs": text_inputs("first", 5), "request_id": "g1"},
        {"model_name": "simple", "inputs": simple_inputs(), "request_id": "s1"},
        {"model_name": "text_generator", "inputs": text_inputs("second", 3), "request_id": "g2"},
        {"model_name": "simple", "inputs": simple_inputs(), "request_id": "s2"},
    ]
    direct_answers = await aio_stream(direct, requests)
    before = upstream_streams(proxy)
    proxied = await aio_stream(proxy.grpc, requests)
    after = upstream_streams(proxy)
    assert proxied == direct_answers
    assert [a[0] for a in proxied] == ["g1"] * 5 + ["g2"] * 3 + ["s1", "s2"]
    assert {k: after[k] - before[k] for k in after} == {"decoupled": 1, "other": 1}

    # A stream of one kind stays one call.
    await aio_stream(proxy.grpc, requests[1::2])
    assert upstream_streams(proxy)["other"] - after["other"] == 1
    assert upstream_streams(proxy)["decoupled"] == after["decoupled"]


async def test_stream_mixing_model_kinds_errors(proxy: ProxyThread) -> None:
    """The stream that aborted Triton 2.51 about once in 3,000 sent directly (unknown model,
    a decoupled model's error, a wrong shape; docs/triton-notes.md) gets each request's error
    through the proxy, which never puts the decoupled model's request on the same upstream
    call as the others. Not sent directly: it would risk the test fleet's server."""
    requests = [
        {"model_name": "no_such_model", "inputs": simple_inputs(), "request_id": "u"},
        {"model_name": "text_generator", "inputs": text_inputs("x", 0), "request_id": "g"},
        {"model_name": "simple", "inputs": simple_inputs(8), "request_id": "s"},
    ]
    before = upstream_streams(proxy)
    got = await aio_stream(proxy.grpc, requests)
    after = upstream_streams(proxy)
    assert [a[0] for a in got] == ["error"] * 3
    errors = " | ".join(sorted(a[1] for a in got))
    assert "no_such_model" in errors and "max_tokens" in errors and "shape" in errors, errors
    assert {k: after[k] - before[k] for k in after} == {"decoupled": 1, "other": 1}


async def test_aio_stream_infer_is_identical(proxy: ProxyThread, direct: str) -> None:
    async def tokens(url: str) -> list[str]:
        async def requests() -> Any:
            yield {
                "model_name": "text_generator",
                "inputs": text_inputs("aio stream", 8),
                "enable_empty_final_response": True,
            }

        out = []
        async with aiogrpcclient.InferenceServerClient(url) as c:
            async for result, error in c.stream_infer(requests()):
                assert error is None
                e = _event(result, None)
                if e.final:
                    break
                out.append(e.text or "")
        return out

    proxied = await tokens(proxy.grpc)
    assert proxied == await tokens(direct)
    assert len(proxied) == 8


def test_stream_errors_come_back_in_the_stream(proxy: ProxyThread, direct: str) -> None:
    answers = []
    for url in (direct, proxy.grpc):
        events: queue.Queue[tuple[Any, Any]] = queue.Queue()
        with grpcclient.InferenceServerClient(url) as c:
            c.start_stream(callback=lambda result, error, q=events: q.put((result, error)))
            # One at a time: Triton 2.51 can abort writing concurrent errors to one stream
            # (docs/triton-notes.md).
            c.async_stream_infer("no_such_model", simple_inputs())
            first = events.get(timeout=30)
            c.async_stream_infer("text_generator", text_inputs("x", 100_000))
            second = events.get(timeout=30)
            c.stop_stream()
        answers.append(sorted(str(e[1]) for e in (first, second)))
    assert answers[0] == answers[1]
    assert any("no_such_model" in a for a in answers[1])


def _inference_counts(triton_fleet: Any, model: str) -> list[int]:
    counts = []
    for server in triton_fleet.servers:
        with grpcclient.InferenceServerClient(server.grpc_address) as c:
            stats = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
            counts.append(int(stats.get("inference_count", 0)))
    return counts


def accumulate(
    client: grpcclient.InferenceServerClient, value: int, seq: int | str, start: bool, end: bool
) -> int:
    i = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    r = client.infer("accumulator", [i], sequence_id=seq, sequence_start=start, sequence_end=end)
    return int(r.as_numpy("OUTPUT").reshape(-1)[0])


@pytest.mark.parametrize("seq", [4242, "session-a"], ids=["int", "string"])
def test_sequence_sticks_to_one_instance(
    proxy: ProxyThread, triton_fleet: Any, seq: int | str
) -> None:
    values = [1, 2, 3, 4, 5, 6]
    before = _inference_counts(triton_fleet, "accumulator")
    with grpcclient.InferenceServerClient(proxy.grpc) as c:
        sums = [
            accumulate(c, v, seq, start=n == 0, end=n == len(values) - 1)
            for n, v in enumerate(values)
        ]
    after = _inference_counts(triton_fleet, "accumulator")
    assert sums == list(np.cumsum(values))
    served = sorted(a - b for a, b in zip(after, before, strict=True))
    assert served == [0] * (len(served) - 1) + [len(values)]
    assert not proxy.runtime.affinity._table, "ended sequence still bound"


def test_sequences_in_a_stream_stay_together(proxy: ProxyThread) -> None:
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    values = [10, 20, 30]
    with grpcclient.InferenceServerClient(proxy.grpc) as c:
        c.start_stream(callback=lambda result, error: events.put((result, error)))
        for n, v in enumerate(values):
            i = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            i.set_data_from_numpy(np.array([[v]], dtype=np.int32))
            c.async_stream_infer(
                "accumulator",
                [i],
                sequence_id=777,
                sequence_start=n == 0,
                sequence_end=n == len(values) - 1,
            )
        results = [events.get(timeout=30) for _ in values]
        c.stop_stream()
    assert [e for _, e in results] == [None] * 3
    assert [int(r.as_numpy("OUTPUT")[0][0]) for r, _ in results] == [10, 30, 60]


ERROR_CASES: dict[str, tuple[str, Any]] = {
    "unknown model": ("no_such_model", lambda: simple_inputs()),
    "bad input shape": ("simple", lambda: simple_inputs(8)),
    "missing input": ("simple", lambda: simple_inputs()[:1]),
    "unknown version": ("simple", lambda: simple_inputs()),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_are_identical(proxy: ProxyThread, direct: str, case: str) -> None:
    model, make_inputs = ERROR_CASES[case]
    version = "7" if case == "unknown version" else ""
    answers = []
    for url in (direct, proxy.grpc):
        with (
            grpcclient.InferenceServerClient(url) as c,
            pytest.raises(InferenceServerException) as info,
        ):
            c.infer(model, make_inputs(), model_version=version)
        answers.append(status_of(info.value))
    assert answers[0] == answers[1]
    assert answers[1][0] != "StatusCode.OK"


def test_malformed_message_is_refused_with_a_clear_error(proxy: ProxyThread, direct: str) -> None:
    """Triton answers INTERNAL; the proxy refuses a message it cannot read before it reaches
    Triton (a message read one way by the proxy and another by Triton could carry a priority
    the class does not grant), with INVALID_ARGUMENT, never a 5xx-like status of its own."""
    garbage = b"\x0a\x05sim"
    direct_code, _ = unary(direct, "ModelInfer", garbage)
    assert direct_code == grpc.StatusCode.INTERNAL
    code, details = unary(proxy.grpc, "ModelInfer", garbage)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not parse the ModelInferRequest" in details


async def test_client_cancel_ends_the_upstream_stream(proxy: ProxyThread) -> None:
    async def requests() -> Any:
        yield {"model_name": "text_generator", "inputs": text_inputs("long", 500)}
        await asyncio.sleep(3600)  # keep the stream open

    async with aiogrpcclient.InferenceServerClient(proxy.grpc) as c:
        stream = c.stream_infer(requests())
        async for _result, error in stream:
            assert error is None
            break  # got the first token
        assert proxy.runtime.fleet.total_in_flight() == 1
        stream.cancel()
    # The whole generation would take 15 s; the proxy lets go of it as soon as the client does.
    await until(lambda: proxy.runtime.fleet.total_in_flight() == 0)


# --- what reaches the instance: a fake Triton records it ------------------------------------


@dataclass(frozen=True)
class _Server:
    name: str
    http_url: str
    grpc_address: str
    metrics_url: str


@dataclass(frozen=True)
class Seen:
    request: bytes
    metadata: list[tuple[str, Any]]
    time_remaining: float | None


class FakeTriton:
    """A gRPC server posing as a Triton instance's ModelInfer; records what the proxy sends."""

    def __init__(self) -> None:
        self.seen: queue.Queue[Seen] = queue.Queue()
        self.cancelled = threading.Event()
        handlers = {"ModelInfer": grpc.unary_unary_rpc_method_handler(self.infer)}
        self.server = grpc.server(ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, handlers)]
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def infer(self, request: bytes, context: Any) -> bytes:
        self.seen.put(Seen(request, list(context.invocation_metadata()), context.time_remaining()))
        # Behaviour by request id: the model must be one the fleet knows (the proxy answers
        # 404 itself for any other), here always "simple".
        parsed = pb.ModelInferRequest.FromString(request)
        if parsed.id == "hold":
            while context.is_active():
                time.sleep(0.01)
            self.cancelled.set()
            return b""
        if parsed.id == "busy":
            context.abort(grpc.StatusCode.UNAVAILABLE, "Exceeds maximum queue size")
        return pb.ModelInferResponse(model_name=parsed.model_name, id="fake").SerializeToString()


@pytest.fixture
def fake(triton_fleet: Any) -> Iterator[tuple[FakeTriton, ProxyThread]]:
    """A proxy whose only instance is a fake (health and metrics from a real server)."""
    fake = FakeTriton()
    s0 = triton_fleet.servers[0]
    try:
        with running_proxy([_Server("fake", s0.http_url, fake.address, s0.metrics_url)]) as p:
            yield fake, p
    finally:
        fake.server.stop(None)


def test_bytes_metadata_and_deadline_reach_the_instance(
    fake: tuple[FakeTriton, ProxyThread],
) -> None:
    triton, p = fake
    request = pb.ModelInferRequest(model_name="simple", id="abc")
    request.parameters["sequence_id"].int64_param = 5
    request.raw_input_contents.append(bytes(range(256)) * 16)
    data = request.SerializeToString()
    metadata = (("x-custom", "one"), ("x-trace-bin", b"\x00\xff"), ("x-session-id", "s1"))
    code, answer = unary(p.grpc, "ModelInfer", data, metadata=metadata)
    assert (code, answer.id) == (grpc.StatusCode.OK, "fake")
    seen = triton.seen.get(timeout=5)
    assert seen.request == data
    for item in metadata:
        assert item in seen.metadata
    assert [k for k, _ in seen.metadata].count("user-agent") == 1
    # The client gave 30 s; without a deadline the instance would see None.
    assert seen.time_remaining is not None and 0 < seen.time_remaining < 31


def test_tritons_own_unavailable_is_relayed_not_retried(
    fake: tuple[FakeTriton, ProxyThread],
) -> None:
    triton, p = fake
    data = pb.ModelInferRequest(model_name="simple", id="busy").SerializeToString()
    code, details = unary(p.grpc, "ModelInfer", data)
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "Exceeds maximum queue size")
    assert triton.seen.qsize() == 1
    assert p.runtime.fleet.get("fake").failures == 0


async def test_client_cancel_cancels_the_upstream_call(
    fake: tuple[FakeTriton, ProxyThread],
) -> None:
    triton, p = fake
    async with grpc.aio.insecure_channel(p.grpc) as channel:
        call = channel.unary_unary(method_path("ModelInfer"))(
            pb.ModelInferRequest(model_name="simple", id="hold").SerializeToString()
        )
        await asyncio.to_thread(triton.seen.get, timeout=10)
        call.cancel()
    assert await asyncio.to_thread(triton.cancelled.wait, 10)
    await until(lambda: p.runtime.fleet.total_in_flight() == 0)


# --- limits, retries, model control, shared memory ------------------------------------------


def test_oversized_message_is_refused(proxy: ProxyThread) -> None:
    with grpcclient.InferenceServerClient(proxy.grpc) as c:
        with pytest.raises(InferenceServerException) as info:
            c.infer("simple", simple_inputs(MAX_BODY // 4))
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert c.infer("simple", simple_inputs()).as_numpy("OUTPUT0") is not None


def test_unreachable_grpc_endpoint_is_retried_elsewhere(triton_fleet: Any) -> None:
    s0 = triton_fleet.servers[0]
    # Healthy over HTTP (the probe passes), but nothing listens on its gRPC port.
    broken = _Server("broken", s0.http_url, "127.0.0.1:9", s0.metrics_url)
    # Round robin places every third stream on the broken instance, whatever chance does.
    policy = {"routing": {"policy": {"name": "round_robin"}}}
    with running_proxy([broken, *triton_fleet.servers[1:]], policy) as p:
        with grpcclient.InferenceServerClient(p.grpc) as c:
            for _ in range(6):
                assert c.infer("simple", simple_inputs()).as_numpy("OUTPUT0") is not None
        # A stream placed on it moves on too, before anything of it was taken from the client.
        fleet = p.runtime.fleet
        broken_streams = 0
        for _ in range(20):
            p.call(_readmit(fleet, "broken"))
            [events] = stream_generate(p.grpc, ["retry"], max_tokens=2)
            assert [e.text is not None for e in events] == [True, True, False]
            broken_streams += fleet.get("broken").failures
            if broken_streams >= 3:
                break
        assert broken_streams >= 3


async def _readmit(fleet: Any, name: str) -> None:
    """Put an ejected instance back in rotation at once (the probe would, after a backoff)."""
    fleet.report_success(fleet.get(name))


def test_model_control_needs_the_admin_token(proxy: ProxyThread) -> None:
    calls = {
        "index": lambda c: c.get_model_repository_index(),
        "load": lambda c: c.load_model("simple"),
        "unload": lambda c: c.unload_model("simple"),
        "trace update": lambda c: c.update_trace_settings(settings={"trace_rate": "5"}),
        "log update": lambda c: c.update_log_settings({"log_verbose_level": 1}),
    }
    with grpcclient.InferenceServerClient(proxy.grpc) as c:
        for name, call in calls.items():
            with pytest.raises(InferenceServerException) as info:
                call(c)
            assert info.value.status() == "StatusCode.PERMISSION_DENIED", name
            assert "disabled" in (info.value.message() or ""), name
        assert c.is_model_ready("simple")


def test_admin_token_enables_model_control(triton_fleet: Any, direct: str) -> None:
    policy = {"admin": {"enabled": True, "token": "s3cret"}}
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(running_proxy(triton_fleet.servers, policy))
        c = stack.enter_context(grpcclient.InferenceServerClient(p.grpc))
        with pytest.raises(InferenceServerException) as info:
            c.get_model_repository_index(headers={"authorization": "Bearer wrong"})
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        good = {"authorization": "Bearer s3cret"}
        index = c.get_model_repository_index(headers=good, as_json=True)
        d = stack.enter_context(grpcclient.InferenceServerClient(direct))
        assert index == d.get_model_repository_index(as_json=True)
        # Loading an already loaded model is a no-op on every instance.
        c.load_model("simple", headers=good)
        answers = []
        for client, headers in ((d, {}), (c, good)):
            with pytest.raises(InferenceServerException) as info:
                client.load_model("no_such_model", headers=headers)
            answers.append(status_of(info.value))
        (direct_code, direct_message), (code, message) = answers
        assert code == direct_code
        assert message == f"{direct_message} (on instance 'triton-0'; 3 of 3 instances failed)"


def test_shared_memory_is_refused_clearly(proxy: ProxyThread) -> None:
    with grpcclient.InferenceServerClient(proxy.grpc) as c:
        with pytest.raises(InferenceServerException) as info:
            c.register_system_shared_memory("region", "/key", 64)
        assert status_of(info.value) == ("StatusCode.UNIMPLEMENTED", SHARED_MEMORY_MESSAGE)
        with pytest.raises(InferenceServerException) as info:
            c.register_cuda_shared_memory("region", base64.b64encode(b"handle"), 0, 64)
        assert status_of(info.value) == ("StatusCode.UNIMPLEMENTED", SHARED_MEMORY_MESSAGE)
        with pytest.raises(InferenceServerException) as info:
            c.get_system_shared_memory_status("region")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        assert "Unable to find system shared memory region: 'region'" in (
            info.value.message() or ""
        )
        # Clean-up calls succeed, as on a Triton with nothing registered.
        c.unregister_system_shared_memory()
        c.unregister_cuda_shared_memory("region")


def test_class_priority_is_set_on_forwarded_requests(triton_fleet: Any) -> None:
    # With scheduling on, accel_sim (priority_levels: 3) gets its class's Triton priority
    # appended to the request bytes; Triton accepts and serves it.
    keys = {f"{k}-key": {"class_name": k} for k in ("realtime", "online", "offline")}
    with running_proxy(triton_fleet.servers, {"scheduling": {"api_keys": keys}}) as p:
        ids = grpcclient.InferInput("INPUT_IDS", [1, 8], "INT64")
        ids.set_data_from_numpy(np.arange(8, dtype=np.int64).reshape(1, 8))
        with grpcclient.InferenceServerClient(p.grpc) as c:
            for key in keys:
                r = c.infer("accel_sim", [ids], headers={"authorization": f"Bearer {key}"})
                assert r.as_numpy("OUTPUT").shape == (1, 8)


SHARED_MEMORY_HTTP = [
    ("GET", "/v2/systemsharedmemory/status"),
    ("GET", "/v2/cudasharedmemory/status"),
    ("POST", "/v2/systemsharedmemory/unregister"),
    ("POST", "/v2/cudasharedmemory/region/r/unregister"),
    ("GET", "/v2/systemsharedmemory/region/r/status"),
]


@pytest.mark.parametrize(("method", "path"), SHARED_MEMORY_HTTP)
def test_shared_memory_over_http_answers_as_over_grpc(
    proxy: ProxyThread, triton_fleet: Any, method: str, path: str
) -> None:
    """Status with no regions and unregister succeed over both protocols, as on Triton."""
    answers = []
    for address in (triton_fleet.servers[0].http_url.removeprefix("http://"), proxy.http):
        host, port = address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(method, path, body=b"" if method == "POST" else None)
            response = conn.getresponse()
            answers.append((response.status, response.read()))
        finally:
            conn.close()
    (direct_status, direct_body), (status, body) = answers
    assert status == direct_status
    if status == 200:
        assert body == direct_body
    else:
        # Triton's message, then why no region can ever exist behind the proxy.
        direct_error = json.loads(direct_body)["error"]
        assert json.loads(body)["error"] == f"{direct_error} ({SHARED_MEMORY_MESSAGE})"
