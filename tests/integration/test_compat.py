"""Compatibility: every tritonclient call answers the same through the proxy as from Triton.

Table-driven: each (client kind, call) pair is one test. The call runs once against one Triton
server directly and once through the proxy, with the same client kind (``tritonclient.http``,
``tritonclient.grpc``, ``tritonclient.http.aio``, ``tritonclient.grpc.aio``), and the two
results must be equal. Results are reduced to plain values by the ``*_view`` helpers, which
normalise only what legitimately differs between two Triton instances, each at the place where
it happens and saying why:

- statistics: counts, durations and timestamps (every instance has served different traffic);
- float tensors: compared to 1e-5 (another instance's torch may round the last bit otherwise);
- HTTP framing of non-streamed bodies (Triton answers chunked, the proxy with a Content-Length);
  only the status, the ``Content-Type`` and the body are compared.

Where the proxy itself legitimately differs from one Triton server, the test says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import inspect
import itertools
import json
import queue
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from google.protobuf.json_format import MessageToDict
from tritonclient.utils import InferenceServerException

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

TIMEOUT_S = 60


# --- client kinds and targets ------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    name: str
    grpc: bool
    aio: bool

    @property
    def mod(self) -> Any:
        """The module whose InferInput / InferRequestedOutput this kind's client takes."""
        return grpcclient if self.grpc else httpclient


HTTP = Kind("http", grpc=False, aio=False)
GRPC = Kind("grpc", grpc=True, aio=False)
HTTP_AIO = Kind("http_aio", grpc=False, aio=True)
GRPC_AIO = Kind("grpc_aio", grpc=True, aio=True)
ALL = (HTTP, GRPC, HTTP_AIO, GRPC_AIO)
HTTP_KINDS = (HTTP, HTTP_AIO)
GRPC_KINDS = (GRPC, GRPC_AIO)


@dataclass(frozen=True)
class Target:
    """One endpoint pair: a Triton server's, or the proxy's. Addresses are ``host:port``."""

    http: str
    grpc: str


@dataclass
class Ctx:
    kind: Kind
    target: Target
    client: Any


async def maybe(value: Any) -> Any:
    """The value of a sync client's call, or the awaited value of an aio client's."""
    return await value if inspect.isawaitable(value) else value


@contextlib.asynccontextmanager
async def open_client(kind: Kind, target: Target) -> AsyncIterator[Any]:
    url = target.grpc if kind.grpc else target.http
    client: Any
    if kind is HTTP:
        # concurrency > 1: async_infer runs requests side by side.
        client = httpclient.InferenceServerClient(url, concurrency=4, network_timeout=TIMEOUT_S)
    elif kind is GRPC:
        client = grpcclient.InferenceServerClient(url)
    elif kind is HTTP_AIO:
        client = aiohttpclient.InferenceServerClient(url, conn_timeout=TIMEOUT_S)
    else:
        client = aiogrpcclient.InferenceServerClient(url)
    try:
        yield client
    finally:
        await maybe(client.close())


async def api(ctx: Ctx, method: str, *args: Any, **kwargs: Any) -> Any:
    """A client method's answer as JSON-like data (gRPC clients are asked for ``as_json``)."""
    if ctx.kind.grpc:
        kwargs["as_json"] = True
    return await maybe(getattr(ctx.client, method)(*args, **kwargs))


# --- inputs ------------------------------------------------------------------------------------


def tensor(
    kind: Kind, name: str, data: npt.NDArray[Any], datatype: str, binary: bool = True
) -> Any:
    t = kind.mod.InferInput(name, list(data.shape), datatype)
    if kind.grpc:
        t.set_data_from_numpy(data)
    else:
        t.set_data_from_numpy(data, binary_data=binary)
    return t


def simple_inputs(
    kind: Kind, seed: int = 0, *, length: int = 16, dtype: type = np.int32, binary: bool = True
) -> list[Any]:
    rng = np.random.default_rng(seed)
    datatype = "INT32" if dtype is np.int32 else "FP32"
    return [
        tensor(
            kind, name, rng.integers(-100, 100, size=(1, length)).astype(dtype), datatype, binary
        )
        for name in ("INPUT0", "INPUT1")
    ]


def ids_inputs(kind: Kind, n: int = 12) -> list[Any]:
    ids = np.random.default_rng(n).integers(1, 999, size=(1, n), dtype=np.int64)
    return [tensor(kind, "INPUT_IDS", ids, "INT64")]


def text_inputs(kind: Kind, prompt: str, max_tokens: int) -> list[Any]:
    return [
        tensor(kind, "text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        tensor(kind, "max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
    ]


def accumulator_input(kind: Kind, value: int) -> list[Any]:
    return [tensor(kind, "INPUT", np.array([[value]], dtype=np.int32), "INT32")]


def requested(kind: Kind, names: list[str], **kwargs: Any) -> list[Any]:
    return [kind.mod.InferRequestedOutput(n, **kwargs) for n in names]


_sequence_ids = itertools.count(random.randrange(10_000, 1_000_000) * 100)


def sequence_id(kind: str) -> int | str:
    """A fresh sequence id; fresh so that a test never continues another one's sequence."""
    return next(_sequence_ids) if kind == "int" else f"compat-{uuid.uuid4().hex[:12]}"


# --- views: results reduced to comparable values ----------------------------------------------


class Close:
    """A float tensor, equal to another within 1e-5: instances may differ in the last bit."""

    def __init__(self, values: npt.NDArray[Any]) -> None:
        self.values = values

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Close)
            and self.values.shape == other.values.shape
            and bool(np.allclose(self.values, other.values, rtol=1e-5, atol=1e-6))
        )

    def __repr__(self) -> str:
        return f"Close({self.values.tolist()!r})"


def tensor_view(array: npt.NDArray[Any] | None) -> Any:
    if array is None:
        return None
    if array.dtype.kind == "f":
        return ("float", array.shape, Close(array))
    return (str(array.dtype), array.shape, array.tolist())


def result_view(kind: Kind, result: Any, outputs: list[str]) -> dict[str, Any]:
    """The response's metadata and every output decoded (so HTTP JSON and binary alike)."""
    if kind.grpc:
        response = result.get_response(as_json=True)
        # The tensor bytes, compared decoded below (floats to 1e-5).
        response.pop("raw_output_contents", None)
    else:
        response = json.loads(json.dumps(result.get_response()))
        for out in response.get("outputs", []):
            out.pop("data", None)  # JSON tensor data: compared decoded below
    return {
        "response": response,
        "tensors": {name: tensor_view(result.as_numpy(name)) for name in outputs},
    }


def error_view(exc: InferenceServerException) -> tuple[str, str | None, str]:
    return ("error", exc.status(), exc.message())


def statistics_shape(value: Any, key: str = "") -> Any:
    """Statistics with every count, duration and timestamp zeroed: only their shape is compared.

    Counts legitimately differ: the proxy answers from whichever instance it relays to, and each
    instance has served different traffic; a second read of one server differs as well. Lists
    (``batch_stats``: one entry per batch size an instance happened to execute) are compared
    as the set of their entries' shapes.
    """
    if isinstance(value, dict):
        return {k: statistics_shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return sorted({json.dumps(statistics_shape(v), sort_keys=True) for v in value})
    if key in ("name", "version"):
        return value
    if isinstance(value, int | float) or (isinstance(value, str) and value.isdigit()):
        return 0
    return value


# --- the calls ---------------------------------------------------------------------------------

CallFn = Callable[[Ctx], Awaitable[Any]]


async def live(ctx: Ctx) -> Any:
    return await maybe(ctx.client.is_server_live())


async def ready(ctx: Ctx) -> Any:
    return await maybe(ctx.client.is_server_ready())


async def server_metadata(ctx: Ctx) -> Any:
    return await api(ctx, "get_server_metadata")


async def model_metadata(ctx: Ctx) -> Any:
    return [await api(ctx, "get_model_metadata", m) for m in ("simple", "text_generator")]


async def model_metadata_version(ctx: Ctx) -> Any:
    return await api(ctx, "get_model_metadata", "text_encoder", model_version="1")


async def model_config(ctx: Ctx) -> Any:
    return [await api(ctx, "get_model_config", m) for m in ("accumulator", "text_generator")]


async def model_ready(ctx: Ctx) -> Any:
    return [
        await maybe(ctx.client.is_model_ready(m)) for m in ("simple", "accel_sim", "no_such_model")
    ]


async def statistics(ctx: Ctx) -> Any:
    if ctx.kind.grpc:
        # Not as_json: protobuf's JSON leaves out zero counts, which would change the shape.
        message = await maybe(ctx.client.get_inference_statistics("simple"))
        stats = MessageToDict(
            message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
        )
    else:
        stats = await maybe(ctx.client.get_inference_statistics("simple"))
    return statistics_shape(stats)


async def infer(ctx: Ctx) -> Any:
    outputs = ["OUTPUT0", "OUTPUT1"]
    r = await maybe(ctx.client.infer("simple", simple_inputs(ctx.kind, 1), request_id="infer-1"))
    return result_view(ctx.kind, r, outputs)


async def infer_json_outputs(ctx: Ctx) -> Any:
    outputs = ["OUTPUT0", "OUTPUT1"]
    r = await maybe(
        ctx.client.infer(
            "simple",
            simple_inputs(ctx.kind, 2, binary=False),
            outputs=requested(ctx.kind, outputs, binary_data=False),
        )
    )
    return result_view(ctx.kind, r, outputs)


async def infer_binary_outputs(ctx: Ctx) -> Any:
    outputs = ["OUTPUT1"]  # and only that one: OUTPUT0 is not requested
    r = await maybe(
        ctx.client.infer(
            "simple",
            simple_inputs(ctx.kind, 3, binary=True),
            outputs=requested(ctx.kind, outputs, binary_data=True),
        )
    )
    return result_view(ctx.kind, r, outputs)


async def infer_float_outputs(ctx: Ctx) -> Any:
    outputs = ["EMBEDDING", "BATCH_SIZE", "PADDED_LENGTH"]
    r = await maybe(ctx.client.infer("text_encoder", ids_inputs(ctx.kind, 12)))
    return result_view(ctx.kind, r, outputs)


async def async_infer(ctx: Ctx) -> Any:
    """Several requests in flight at once: callbacks for the sync clients, tasks for aio."""
    ids = [f"async-{n}" for n in range(3)]
    kind, client = ctx.kind, ctx.client
    if kind.aio:
        results = await asyncio.gather(
            *(
                client.infer("simple", simple_inputs(kind, n), request_id=i)
                for n, i in enumerate(ids)
            )
        )
    elif kind is HTTP:
        pending = [
            client.async_infer("simple", simple_inputs(kind, n), request_id=i)
            for n, i in enumerate(ids)
        ]
        results = [p.get_result(timeout=TIMEOUT_S) for p in pending]
    else:
        done: queue.Queue[tuple[Any, Any]] = queue.Queue()
        for n, i in enumerate(ids):
            client.async_infer(
                "simple",
                simple_inputs(kind, n),
                callback=lambda result, error: done.put((result, error)),
                request_id=i,
            )
        answers = [done.get(timeout=TIMEOUT_S) for _ in ids]
        errors = [e for _, e in answers if e is not None]
        if errors:
            raise errors[0]
        results = [r for r, _ in answers]
    views = [result_view(kind, r, ["OUTPUT0", "OUTPUT1"]) for r in results]
    return sorted(views, key=lambda v: v["response"]["id"])


async def classification(ctx: Ctx) -> Any:
    outputs = ["OUTPUT0"]
    r = await maybe(
        ctx.client.infer(
            "simple",
            simple_inputs(ctx.kind, 4),
            outputs=requested(ctx.kind, outputs, class_count=3),
        )
    )
    return result_view(ctx.kind, r, outputs)


async def classification_json(ctx: Ctx) -> Any:
    outputs = ["OUTPUT1"]
    r = await maybe(
        ctx.client.infer(
            "simple",
            simple_inputs(ctx.kind, 5),
            outputs=requested(ctx.kind, outputs, class_count=2, binary_data=False),
        )
    )
    return result_view(ctx.kind, r, outputs)


async def request_parameters(ctx: Ctx) -> Any:
    """Custom parameters, priority and timeout ride along (here on a model that ignores them)."""
    r = await maybe(
        ctx.client.infer(
            "simple",
            simple_inputs(ctx.kind, 6),
            request_id="params",
            parameters={"custom_s": "abc", "custom_i": 7, "custom_b": True, "custom_f": 0.5},
            priority=1,
            timeout=10_000_000,
        )
    )
    return result_view(ctx.kind, r, ["OUTPUT0", "OUTPUT1"])


async def priority_levels(ctx: Ctx) -> Any:
    """``priority`` and ``timeout`` on a model with priority levels, where they take effect."""
    r = await maybe(
        ctx.client.infer("text_encoder", ids_inputs(ctx.kind, 9), priority=1, timeout=30_000_000)
    )
    return result_view(ctx.kind, r, ["EMBEDDING", "PADDED_LENGTH"])


SEQUENCE_VALUES = [3, 4, 5, -2, 10, 0, 7]


async def _sequence(ctx: Ctx, seq: int | str) -> Any:
    sums = []
    last = len(SEQUENCE_VALUES) - 1
    for n, v in enumerate(SEQUENCE_VALUES):
        r = await maybe(
            ctx.client.infer(
                "accumulator",
                accumulator_input(ctx.kind, v),
                sequence_id=seq,
                sequence_start=n == 0,
                sequence_end=n == last,
            )
        )
        sums.append(result_view(ctx.kind, r, ["OUTPUT"]))
    return sums


async def sequence_int(ctx: Ctx) -> Any:
    return await _sequence(ctx, sequence_id("int"))


async def sequence_string(ctx: Ctx) -> Any:
    return await _sequence(ctx, sequence_id("str"))


async def sequence_without_start(ctx: Ctx) -> Any:
    """A request continuing a sequence nobody started: Triton refuses it, and so must the proxy."""
    return await maybe(
        ctx.client.infer(
            # Never started by any test; a fixed id, since Triton's message names it.
            "accumulator",
            accumulator_input(ctx.kind, 1),
            sequence_id=987_654_321,
        )
    )


async def unknown_model(ctx: Ctx) -> Any:
    return await maybe(ctx.client.infer("no_such_model", simple_inputs(ctx.kind)))


async def unknown_model_metadata(ctx: Ctx) -> Any:
    return await api(ctx, "get_model_metadata", "no_such_model")


async def unknown_version(ctx: Ctx) -> Any:
    return await maybe(ctx.client.infer("simple", simple_inputs(ctx.kind), model_version="7"))


async def bad_shape(ctx: Ctx) -> Any:
    return await maybe(ctx.client.infer("simple", simple_inputs(ctx.kind, length=8)))


async def bad_datatype(ctx: Ctx) -> Any:
    return await maybe(ctx.client.infer("simple", simple_inputs(ctx.kind, dtype=np.float32)))


async def decoupled_over_infer(ctx: Ctx) -> Any:
    """Plain inference refuses a decoupled model (HTTP 501, gRPC UNIMPLEMENTED)."""
    return await maybe(ctx.client.infer("text_generator", text_inputs(ctx.kind, "x", 2)))


# gRPC streaming ---------------------------------------------------------------------------------


def stream_view(result: Any, error: Any) -> Any:
    if error is not None:
        return ("stream error", error.status(), error.message())
    return result.get_response(as_json=True)


async def _stream(
    ctx: Ctx, requests: list[dict[str, Any]], responses: int, *, one_at_a_time: bool = False
) -> list[Any]:
    """Responses of one ModelStreamInfer carrying ``requests``, grouped by request id.

    The sync client is asked for the empty final responses, and half-closes after the last one
    it expects, then takes whatever else came before the stream ended; the aio client cannot ask
    for them (``triton_`` parameters are reserved there), so it half-closes
    after its requests and reads until Triton ends the stream. ``one_at_a_time`` sends each
    request only after the previous one's (single) response arrived.
    """
    got: list[Any] = []
    if ctx.kind.aio:
        arrived: asyncio.Queue[None] = asyncio.Queue()

        async def gen() -> AsyncIterator[dict[str, Any]]:
            for n, request in enumerate(requests):
                if one_at_a_time and n:
                    await arrived.get()
                yield dict(request)

        async for result, error in ctx.client.stream_infer(gen(), stream_timeout=TIMEOUT_S):
            got.append(stream_view(result, error))
            arrived.put_nowait(None)
    else:
        events: queue.Queue[Any] = queue.Queue()
        ctx.client.start_stream(
            callback=lambda result, error: events.put(stream_view(result, error))
        )
        try:
            for request in requests:
                ctx.client.async_stream_infer(**request, enable_empty_final_response=True)
                if one_at_a_time:
                    got.append(events.get(timeout=TIMEOUT_S))
            got += [events.get(timeout=TIMEOUT_S) for _ in range(responses - len(got))]
        except BaseException:
            # Without cancelling, stop_stream waits for a stream the server never ends.
            ctx.client.stop_stream(cancel_requests=True)
            raise
        ctx.client.stop_stream()  # returns once the stream has ended
        while not events.empty():
            got.append(events.get())  # anything more than expected is compared too
    # Responses of different requests interleave as the model produces them: keep each
    # request's own order, not the interleaving.
    return sorted(got, key=lambda r: r.get("id", "") if isinstance(r, dict) else "")


def _final(response: Any) -> bool:
    return (
        isinstance(response, dict) and response["parameters"]["triton_final_response"]["bool_param"]
    )


async def stream_tokens(ctx: Ctx) -> Any:
    requests = [
        {"model_name": "text_generator", "inputs": text_inputs(ctx.kind, p, n), "request_id": p}
        for p, n in (("first prompt", 6), ("second", 4))
    ]
    # 10 tokens, plus one empty final response per request for the sync client.
    got = await _stream(ctx, requests, 10 if ctx.kind.aio else 12)
    return [r for r in got if not _final(r)], sum(map(_final, got))


async def stream_errors(ctx: Ctx) -> Any:
    requests = [
        {"model_name": "no_such_model", "inputs": simple_inputs(ctx.kind)},
        {"model_name": "simple", "inputs": simple_inputs(ctx.kind, length=8)},
    ]
    # One at a time, and never a decoupled model's error on the same stream: Triton 2.51 has
    # aborted twice (gRPC "ASSERTION FAILED: !byte_buffer->Valid()") on a stream that mixed
    # them (docs/triton-notes.md). The decoupled model's error has its own stream below.
    got = await _stream(ctx, requests, 2, one_at_a_time=True)
    return sorted(map(str, got))


async def stream_decoupled_error(ctx: Ctx) -> Any:
    requests = [{"model_name": "text_generator", "inputs": text_inputs(ctx.kind, "x", 0)}]
    # The sync client also gets the empty final response that follows the error.
    got = await _stream(ctx, requests, 1)
    return sorted(map(str, got))


async def stream_sequence(ctx: Ctx) -> Any:
    seq = sequence_id("int")
    last = len(SEQUENCE_VALUES) - 1
    requests = [
        {
            "model_name": "accumulator",
            "inputs": accumulator_input(ctx.kind, v),
            "request_id": f"{n:02d}",
            "sequence_id": seq,
            "sequence_start": n == 0,
            "sequence_end": n == last,
        }
        for n, v in enumerate(SEQUENCE_VALUES)
    ]
    return await _stream(ctx, requests, len(requests))


# HTTP generate extension (tritonclient has no helper: plain http.client and aiohttp) -------------


def sse_events(body: bytes) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream, in order, parsed."""
    events = []
    for block in body.split(b"\n\n"):
        for line in block.splitlines():
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    return events


async def _post(ctx: Ctx, path: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    data = json.dumps(body).encode()
    if ctx.kind.aio:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://{ctx.target.http}{path}", data=data) as reply,
        ):
            return reply.status, reply.headers.get("Content-Type", ""), await reply.read()
    host, port = ctx.target.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def _generate_call(path: str, body: dict[str, Any]) -> CallFn:
    async def call(ctx: Ctx) -> Any:
        status, content_type, data = await _post(ctx, path, body)
        if path.endswith("_stream"):
            return status, content_type, sse_events(data)
        return status, content_type, json.loads(data)

    return call


GENERATE = "/v2/models/text_generator/generate"
PROMPT = {"text_input": "Hello, proxy", "max_tokens": 6}


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    fn: CallFn
    kinds: tuple[Kind, ...] = ALL
    error: bool = False
    """The call must raise InferenceServerException, directly and through the proxy alike."""


CALLS: dict[str, Case] = {
    "live": Case(live),
    "ready": Case(ready),
    "server_metadata": Case(server_metadata),
    "model_metadata": Case(model_metadata),
    "model_metadata_version": Case(model_metadata_version),
    "model_config": Case(model_config),
    "model_ready": Case(model_ready),
    "statistics": Case(statistics),
    "infer": Case(infer),
    "infer_json_outputs": Case(infer_json_outputs, HTTP_KINDS),
    "infer_binary_outputs": Case(infer_binary_outputs, HTTP_KINDS),
    "infer_float_outputs": Case(infer_float_outputs),
    "async_infer": Case(async_infer),
    "classification": Case(classification),
    "classification_json": Case(classification_json, HTTP_KINDS),
    "request_parameters": Case(request_parameters),
    "priority_levels": Case(priority_levels),
    "sequence_int": Case(sequence_int),
    "sequence_string": Case(sequence_string),
    "sequence_without_start": Case(sequence_without_start, error=True),
    "stream_tokens": Case(stream_tokens, GRPC_KINDS),
    "stream_errors": Case(stream_errors, GRPC_KINDS),
    "stream_decoupled_error": Case(stream_decoupled_error, GRPC_KINDS),
    "stream_sequence": Case(stream_sequence, GRPC_KINDS),
    "generate": Case(_generate_call(GENERATE, {**PROMPT, "stream": False}), HTTP_KINDS),
    # Triton's quirk (the model streams several responses): 200 with an error body.
    "generate_many_responses": Case(_generate_call(GENERATE, PROMPT), HTTP_KINDS),
    "generate_error": Case(_generate_call(GENERATE, {**PROMPT, "max_tokens": 0}), HTTP_KINDS),
    "generate_unknown_model": Case(
        _generate_call("/v2/models/no_such_model/generate", PROMPT), HTTP_KINDS
    ),
    "generate_stream": Case(_generate_call(GENERATE + "_stream", PROMPT), HTTP_KINDS),
    "generate_stream_error": Case(
        _generate_call(GENERATE + "_stream", {**PROMPT, "max_tokens": 0}), HTTP_KINDS
    ),
    "unknown_model": Case(unknown_model, error=True),
    "unknown_model_metadata": Case(unknown_model_metadata, error=True),
    "unknown_version": Case(unknown_version, error=True),
    "bad_shape": Case(bad_shape, error=True),
    "bad_datatype": Case(bad_datatype, error=True),
    "decoupled_over_infer": Case(decoupled_over_infer, error=True),
}

PAIRS = [
    pytest.param(kind, name, id=f"{kind.name}-{name}")
    for name, case in CALLS.items()
    for kind in case.kinds
]


async def run_call(kind: Kind, name: str, target: Target) -> Any:
    async with open_client(kind, target) as client:
        try:
            return await CALLS[name].fn(Ctx(kind, target, client))
        except InferenceServerException as exc:
            return error_view(exc)


# --- fixtures and the test ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(triton_fleet: Any) -> Iterator[ProxyThread]:
    with running_proxy(triton_fleet.servers) as p:
        yield p


@pytest.fixture(scope="module")
def targets(triton_fleet: Any, proxy: ProxyThread) -> tuple[Target, Target]:
    server = triton_fleet.server(0)
    direct = Target(str(server.http_url).removeprefix("http://"), str(server.grpc_address))
    # Every instance serves `simple` once, so that each has statistics of the same shape.
    for s in triton_fleet.servers:
        with httpclient.InferenceServerClient(str(s.http_url).removeprefix("http://")) as c:
            c.infer("simple", simple_inputs(HTTP))
    return direct, Target(proxy.http, proxy.grpc)


@pytest.mark.parametrize(("kind", "name"), PAIRS)
async def test_same_answer_through_proxy(
    kind: Kind, name: str, targets: tuple[Target, Target]
) -> None:
    direct_target, proxy_target = targets
    direct = await run_call(kind, name, direct_target)
    proxied = await run_call(kind, name, proxy_target)
    assert proxied == direct
    raised = isinstance(direct, tuple) and direct[:1] == ("error",)
    assert raised == CALLS[name].error, f"direct answer: {direct}"
