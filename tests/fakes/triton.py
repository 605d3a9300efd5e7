"""A small fake Triton server: enough KServe v2 HTTP and gRPC to put the real proxy in front.

Every request it receives is *recorded* (protocol, method, raw path, headers or metadata, the
parsed request parameters, the body) before anything else happens, including requests for
routes it does not serve, so a test asserts what the far side received rather than what the
proxy says it did.

It answers like Triton: ``{"error": "..."}`` bodies, 400 for a body it cannot read, 404 for an
unknown model, never a 5xx unless a test tells it to (:class:`Fault`). That makes every 5xx a
client sees through the proxy, while no fault is set, a 5xx of the proxy's own making.

Failure modes a test can set:

- :class:`Fault` on inference calls (HTTP and gRPC): answer a status, close the connection
  before answering, delay, hang until released, or stall until the next request for the model
  arrives (as Triton's dynamic batcher can: docs/triton-notes.md);
- ``ready`` / ``model_ready``: the server's or one model's readiness;
- :meth:`FakeTriton.freeze` / :meth:`FakeTriton.thaw`: every call hangs (health included), as
  under SIGSTOP; :meth:`FakeTriton.kill` / :meth:`FakeTriton.restart`: listeners and all open
  connections go away at once, as under SIGKILL, and come back on the same ports.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import numpy as np
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

SERVICE = "inference.GRPCInferenceService"
HEADER_LENGTH = "Inference-Header-Content-Length"
STORED_BODY_BYTES = 64 * 1024
MAX_INFLATED_BYTES = 16 << 20


def simple_config(name: str = "simple", priority_levels: int = 3) -> dict[str, Any]:
    """Like model_repository/simple: dynamic batching with priority levels."""
    batching: dict[str, Any] = {"max_queue_delay_microseconds": 100}
    if priority_levels:
        batching.update(priority_levels=priority_levels, default_priority_level=priority_levels)
    return {
        "name": name,
        "platform": "",
        "backend": "python",
        "max_batch_size": 8,
        "input": [
            {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
        "dynamic_batching": batching,
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }


def sequence_config(name: str = "seq") -> dict[str, Any]:
    """Like model_repository/accumulator: a sequence batcher with a numeric CORRID."""
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": 8,
        "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "OUTPUT", "data_type": "TYPE_INT32", "dims": [1]}],
        "sequence_batching": {
            "direct": {},
            "control_input": [
                {
                    "name": "CORRID",
                    "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}],
                }
            ],
        },
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }


def decoupled_config(name: str = "gen") -> dict[str, Any]:
    """Like model_repository/text_generator: decoupled, served by generate/generate_stream."""
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]}],
        "model_transaction_policy": {"decoupled": True},
        "dynamic_batching": {"priority_levels": 3, "default_priority_level": 3},
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }


def default_models() -> dict[str, dict[str, Any]]:
    return {
        "simple": simple_config(),
        "plain": simple_config("plain", priority_levels=0),
        "seq": sequence_config(),
        "gen": decoupled_config(),
    }


@dataclass(frozen=True)
class Received:
    """One request as the fake received it."""

    instance: str
    protocol: Literal["http", "grpc"]
    method: str
    """HTTP method, or ``"POST"`` for a gRPC call."""
    raw_path: str
    """The request target exactly as it arrived (gRPC: ``/service/Method``)."""
    headers: tuple[tuple[str, str], ...]
    """HTTP headers or gRPC metadata (names lower-case), in arrival order."""
    model: str | None = None
    parameters: Mapping[str, Any] | None = None
    """Request parameters of an inference call, when the fake could read them."""
    body: bytes = b""
    """The body (HTTP; the first 64 KiB) or serialized message (gRPC)."""
    at: float = 0.0

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((v for k, v in self.headers if k == lowered), None)

    @property
    def path(self) -> str:
        return self.raw_path.split("?", 1)[0]


@dataclass
class Fault:
    """How the fake misbehaves on inference calls (HTTP infer/generate and gRPC infer/stream).

    ``kind``: ``status`` answers ``status`` with ``message`` (gRPC: the matching code);
    ``close`` drops the connection before answering (gRPC: the call is aborted UNAVAILABLE
    with a transport-like message); ``delay`` waits ``delay_s`` then answers normally;
    ``hang`` waits until :meth:`FakeTriton.release` (or kill); ``stall`` waits until the next
    inference call for the same model reaches this fake. ``models`` limits it to those
    models; ``count`` to that many calls (None: every call).
    """

    kind: Literal["status", "close", "delay", "hang", "stall"]
    status: int = 503
    message: str = "fake fault"
    delay_s: float = 0.0
    models: frozenset[str] | None = None
    count: int | None = None

    def matches(self, model: str | None) -> bool:
        if self.count is not None and self.count <= 0:
            return False
        return self.models is None or model in self.models


_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_NUMPY_TYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


_DOC = web.RequestKey("doc", dict)
_TAIL = web.RequestKey("tail", bytes)


class BadRequest(Exception):
    """The fake cannot read the request: it answers 400, as Triton does."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _decode_body(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    try:
        if encoding in ("gzip", "deflate"):
            inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
            plain = inflater.decompress(body, MAX_INFLATED_BYTES)
            if inflater.unconsumed_tail:
                raise BadRequest(f"request body inflates past {MAX_INFLATED_BYTES} bytes")
            if not inflater.eof:
                raise BadRequest("truncated compressed request body")
            return plain
    except zlib.error as exc:
        raise BadRequest(f"failed to decompress the request body: {exc}") from exc
    raise BadRequest(f"unsupported Content-Encoding '{encoding}'")


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose duplicate keys keep their first value, as Triton's RapidJSON
    lookups do (``FindMember`` returns the first match); Python's json keeps the last."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


def _split_infer_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON header and the binary tail of a KServe v2 infer body (400 when unreadable)."""
    n = len(body)
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError as exc:
            raise BadRequest(f"invalid {HEADER_LENGTH} '{header_length}'") from exc
        if not 0 < n <= len(body):
            raise BadRequest(f"{HEADER_LENGTH} {n} does not fit a body of {len(body)} bytes")
    try:
        doc = json.loads(body[:n], object_pairs_hook=_first_wins)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"failed to parse the request JSON buffer: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadRequest("the request JSON must be an object")
    return doc, body[n:]


def _outputs(doc: dict[str, Any], tail: bytes) -> list[dict[str, Any]]:
    """Echo each input as an output (``INPUTn`` -> ``OUTPUTn``), JSON data only."""
    outputs = []
    offset = 0
    for item in doc.get("inputs") or []:
        if not isinstance(item, dict):
            raise BadRequest("each input must be an object")
        name = str(item.get("name", ""))
        dtype = str(item.get("datatype", ""))
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise BadRequest(f"input '{name}': shape must be a list of integers")
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(tail):
                raise BadRequest(f"input '{name}': binary_data_size {size} exceeds the body")
            raw = tail[offset : offset + size]
            offset += size
            np_type = _NUMPY_TYPES.get(dtype)
            if np_type is None:
                data: Any = []
            else:
                if size % np.dtype(np_type).itemsize:
                    raise BadRequest(f"input '{name}': {size} bytes is not a whole {dtype} tensor")
                data = np.frombuffer(raw, dtype=np_type).tolist()
        else:
            data = item.get("data", [])
        outputs.append(
            {
                "name": name.replace("INPUT", "OUTPUT"),
                "datatype": dtype,
                "shape": shape,
                "data": data,
            }
        )
    if offset != len(tail):
        raise BadRequest(f"{len(tail) - offset} unexpected bytes after the binary inputs")
    return outputs


def _grpc_parameters(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = None if choice is None else getattr(value, choice)
    return out


class FakeTriton:
    """One fake server (HTTP + gRPC) on its own free loopback ports; runs on a given loop."""

    def __init__(
        self, name: str, loop: asyncio.AbstractEventLoop, models: dict[str, Any] | None = None
    ) -> None:
        self.name = name
        self.loop = loop
        self.models: dict[str, dict[str, Any]] = models if models is not None else default_models()
        self.ready = True
        self.model_ready: dict[str, bool] = {}
        """Per-model readiness override (absent: ready when the model exists)."""
        self.faults: list[Fault] = []
        self.received: list[Received] = []
        self.http_port = 0
        self.grpc_port = 0
        self._lock = threading.Lock()
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._released = asyncio.Event()
        self._arrivals: dict[str, asyncio.Event] = {}

    # --- the proxy's view ---------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> None:
        return None

    # --- what it saw --------------------------------------------------------------------
    def _record(self, item: Received) -> None:
        with self._lock:
            self.received.append(item)

    def seen(self, predicate: Callable[[Received], bool] = lambda r: True) -> list[Received]:
        with self._lock:
            return [r for r in self.received if predicate(r)]

    def inferences(self) -> list[Received]:
        """Inference calls only (not health probes, config fetches...)."""
        return self.seen(lambda r: r.parameters is not None)

    def clear(self) -> None:
        with self._lock:
            self.received.clear()

    # --- misbehaviour (callable from any thread) ----------------------------------------
    def freeze(self) -> None:
        self.loop.call_soon_threadsafe(self._thawed.clear)

    def thaw(self) -> None:
        self.loop.call_soon_threadsafe(self._thawed.set)

    def release(self) -> None:
        """Let every call hanging on a ``hang`` fault go on."""
        self.loop.call_soon_threadsafe(self._released.set)

    def _arrived(self, model: str) -> asyncio.Event:
        """An inference call for ``model`` arrived: calls stalled on it go on; the event the
        next arrival sets."""
        earlier = self._arrivals.get(model)
        if earlier is not None:
            earlier.set()
        event = self._arrivals[model] = asyncio.Event()
        return event

    def _take_fault(self, model: str | None) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(model):
                    if fault.count is not None:
                        fault.count -= 1
                    return fault
        return None

    # --- lifecycle (coroutines: run them on the fake's loop) ----------------------------
    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._record_http])
        r = app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.health_ready)
        r.add_get("/v2/models/stats", self.stats)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(base, self.model_metadata)
            r.add_get(base + "/ready", self.model_ready_handler)
            r.add_get(base + "/config", self.model_config)
            r.add_get(base + "/stats", self.stats)
            r.add_post(base + "/infer", self.infer)
            r.add_post(base + "/generate", self.generate)
            r.add_post(base + "/generate_stream", self.generate_stream)
        for settings in ("/v2/logging", "/v2/trace/setting", "/v2/models/{model}/trace/setting"):
            r.add_get(settings, self.settings)
            r.add_post(settings, self.settings)
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_post("/v2/repository/models/{model}/{action:load|unload}", self.repository_action)
        r.add_route("*", "/{tail:.*}", self.not_found)
        # Bodies are recorded as sent; the fake decodes Content-Encoding itself, as Triton does.
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, auto_decompress=False
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.http_port, reuse_address=True)
        await site.start()
        self.http_port = self._runner.addresses[0][1]
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers([self._grpc_handler()])
        self.grpc_port = server.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        await server.start()
        self._grpc = server

    async def kill(self) -> None:
        """Listeners and every open connection go away at once (as a SIGKILLed server's)."""
        runner, self._runner = self._runner, None
        server, self._grpc = self._grpc, None
        self._released.set()
        if server is not None:
            await server.stop(0)
        if runner is not None:
            web_server = runner.server
            for site in list(runner.sites):
                await site.stop()
            if web_server is not None:
                for transport in list(web_server._connections.values()):
                    transport.abort()
            await runner.cleanup()
        self._released = asyncio.Event()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    # --- HTTP ---------------------------------------------------------------------------
    @web.middleware
    async def _record_http(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        await self._thawed.wait()
        body = await request.read()
        model = request.match_info.get("model")
        params: dict[str, Any] | None = None
        error: str | None = None
        infer = request.method == "POST" and request.path.endswith(
            ("/infer", "/generate", "/generate_stream")
        )
        doc: dict[str, Any] = {}
        tail = b""
        if infer:
            try:
                plain = _decode_body(body, request.headers.get("Content-Encoding"))
                doc, tail = _split_infer_body(plain, request.headers.get(HEADER_LENGTH))
                raw = doc.get("parameters")
                params = dict(raw) if isinstance(raw, dict) else {}
                if request.path.endswith(("/generate", "/generate_stream")):
                    # generate bodies carry parameters at the top level (Triton's schema).
                    params = {k: v for k, v in doc.items() if not isinstance(v, dict | list)}
                    params.update(raw if isinstance(raw, dict) else {})
            except BadRequest as exc:
                error = str(exc)
                params = {}
        self._record(
            Received(
                instance=self.name,
                protocol="http",
                method=request.method,
                raw_path=request.raw_path,
                headers=tuple((k.lower(), v) for k, v in request.headers.items()),
                model=model,
                parameters=params,
                body=body[:STORED_BODY_BYTES],
                at=time.monotonic(),
            )
        )
        if error is not None:
            return _error(400, error)
        request[_DOC], request[_TAIL] = doc, tail
        return await handler(request)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "triton", "version": "2.51.0", "extensions": []})

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 400)

    def _known(self, model: str) -> dict[str, Any]:
        config = self.models.get(model)
        if config is None:
            raise web.HTTPNotFound(
                text=json.dumps({"error": f"Request for unknown model: '{model}' is not found"}),
                content_type="application/json",
            )
        return config

    async def model_metadata(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        config = self._known(model)
        return web.json_response(
            {
                "name": model,
                "versions": ["1"],
                "platform": config.get("backend", ""),
                "inputs": [],
                "outputs": [],
            }
        )

    async def model_ready_handler(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        ok = model in self.models and self.model_ready.get(model, True)
        return web.Response(status=200 if ok else 400)

    async def model_config(self, request: web.Request) -> web.Response:
        return web.json_response(self._known(request.match_info["model"]))

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"model_stats": []})

    async def settings(self, request: web.Request) -> web.Response:
        return web.json_response({"log_verbose_level": 0, "trace_level": ["OFF"]})

    async def repository_index(self, request: web.Request) -> web.Response:
        return web.json_response(
            [{"name": m, "version": "1", "state": "READY"} for m in self.models]
        )

    async def repository_action(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def not_found(self, request: web.Request) -> web.Response:
        return _error(404, "Not Found")

    async def _apply_fault(self, request: web.Request, model: str) -> web.StreamResponse | None:
        next_arrival = self._arrived(model)
        fault = self._take_fault(model)
        if fault is None:
            return None
        if fault.kind == "stall":
            await next_arrival.wait()
            return None
        if fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
            return None
        if fault.kind == "hang":
            await self._released.wait()
            return None
        if fault.kind == "close":
            # The request was read; the connection drops before any byte of an answer.
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=200)
        return _error(fault.status, fault.message)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        self._known(model)
        failed = await self._apply_fault(request, model)
        if failed is not None:
            return failed
        doc = request[_DOC]
        try:
            outputs = _outputs(doc, request[_TAIL])
        except BadRequest as exc:
            return _error(400, str(exc))
        return web.json_response(
            {
                "model_name": model,
                "model_version": "1",
                "id": str(doc.get("id", "")),
                "parameters": {"echo": json.dumps(doc.get("parameters") or {})},
                "outputs": outputs,
            }
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        self._known(model)
        failed = await self._apply_fault(request, model)
        if failed is not None:
            return failed
        doc = request[_DOC]
        return web.json_response(
            {"model_name": model, "model_version": "1", "text_output": str(doc.get("text_input"))}
        )

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        self._known(model)
        failed = await self._apply_fault(request, model)
        if failed is not None:
            return failed
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            event = {"model_name": model, "model_version": "1", "text_output": f"token{i}"}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write_eof()
        return response

    # --- gRPC ---------------------------------------------------------------------------
    def _grpc_handler(self) -> grpc.GenericRpcHandler:
        unary: dict[str, Callable[[bytes, Any], Awaitable[bytes]]] = {
            "ServerLive": self._grpc_live,
            "ServerReady": self._grpc_ready,
            "ModelReady": self._grpc_model_ready,
            "ModelMetadata": self._grpc_model_metadata,
            "ModelConfig": self._grpc_model_config,
            "ModelInfer": self._grpc_infer,
            "ModelStatistics": self._grpc_empty(pb.ModelStatisticsResponse),
            "RepositoryIndex": self._grpc_empty(pb.RepositoryIndexResponse),
            "RepositoryModelLoad": self._grpc_empty(pb.RepositoryModelLoadResponse),
            "RepositoryModelUnload": self._grpc_empty(pb.RepositoryModelUnloadResponse),
            "LogSettings": self._grpc_empty(pb.LogSettingsResponse),
            "TraceSetting": self._grpc_empty(pb.TraceSettingResponse),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(self._grpc_recorded(name, fn))
            for name, fn in unary.items()
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self._grpc_stream)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _record_grpc(
        self, method: str, context: Any, message: bytes, request: pb.ModelInferRequest | None
    ) -> None:
        metadata = tuple(
            (k.lower(), v if isinstance(v, str) else v.decode("latin-1"))
            for k, v in context.invocation_metadata() or ()
        )
        self._record(
            Received(
                instance=self.name,
                protocol="grpc",
                method="POST",
                raw_path=f"/{SERVICE}/{method}",
                headers=metadata,
                model=request.model_name if request is not None else None,
                parameters=_grpc_parameters(request.parameters) if request is not None else None,
                body=message[:STORED_BODY_BYTES],
                at=time.monotonic(),
            )
        )

    def _grpc_recorded(
        self, method: str, fn: Callable[[bytes, Any], Awaitable[bytes]]
    ) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handler(message: bytes, context: Any) -> bytes:
            await self._thawed.wait()
            if method != "ModelInfer":
                self._record_grpc(method, context, message, None)
            return await fn(message, context)

        return handler

    def _grpc_empty(self, reply_type: Any) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handler(message: bytes, context: Any) -> bytes:
            return bytes(reply_type().SerializeToString())

        return handler

    async def _grpc_live(self, message: bytes, context: Any) -> bytes:
        return bytes(pb.ServerLiveResponse(live=True).SerializeToString())

    async def _grpc_ready(self, message: bytes, context: Any) -> bytes:
        return bytes(pb.ServerReadyResponse(ready=self.ready).SerializeToString())

    async def _grpc_parse(self, message_type: Any, message: bytes, context: Any) -> Any:
        try:
            return message_type.FromString(message)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse request: {exc}")

    async def _grpc_model(self, model: str, context: Any) -> dict[str, Any]:
        config = self.models.get(model)
        if config is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{model}' is not found"
            )
        assert config is not None
        return config

    async def _grpc_model_ready(self, message: bytes, context: Any) -> bytes:
        request = await self._grpc_parse(pb.ModelReadyRequest, message, context)
        ok = request.name in self.models and self.model_ready.get(request.name, True)
        return bytes(pb.ModelReadyResponse(ready=ok).SerializeToString())

    async def _grpc_model_metadata(self, message: bytes, context: Any) -> bytes:
        request = await self._grpc_parse(pb.ModelMetadataRequest, message, context)
        await self._grpc_model(request.name, context)
        reply = pb.ModelMetadataResponse(name=request.name, versions=["1"], platform="python")
        return bytes(reply.SerializeToString())

    async def _grpc_model_config(self, message: bytes, context: Any) -> bytes:
        request = await self._grpc_parse(pb.ModelConfigRequest, message, context)
        config = await self._grpc_model(request.name, context)
        parsed = json_format.ParseDict(config, mc.ModelConfig(), ignore_unknown_fields=True)
        return bytes(pb.ModelConfigResponse(config=parsed).SerializeToString())

    def _infer_response(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        reply = pb.ModelInferResponse(model_name=request.model_name, model_version="1")
        reply.id = request.id
        for tensor in request.inputs:
            out = reply.outputs.add()
            out.name = tensor.name.replace("INPUT", "OUTPUT")
            out.datatype = tensor.datatype
            out.shape.extend(tensor.shape)
        reply.raw_output_contents.extend(request.raw_input_contents)
        for key, value in request.parameters.items():
            reply.parameters[key].CopyFrom(value)
        return reply

    async def _grpc_fault(self, model: str, context: Any) -> None:
        next_arrival = self._arrived(model)
        fault = self._take_fault(model)
        if fault is None:
            return
        if fault.kind == "stall":
            await next_arrival.wait()
        elif fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
        elif fault.kind == "hang":
            await self._released.wait()
        elif fault.kind == "close":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        else:
            code = _GRPC_CODES.get(fault.status, grpc.StatusCode.UNKNOWN)
            await context.abort(code, fault.message)

    async def _grpc_infer(self, message: bytes, context: Any) -> bytes:
        request: pb.ModelInferRequest | None
        try:
            request = pb.ModelInferRequest.FromString(message)
        except DecodeError:
            request = None
        self._record_grpc("ModelInfer", context, message, request)
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cannot parse ModelInferRequest")
        assert request is not None
        await self._grpc_model(request.model_name, context)
        await self._grpc_fault(request.model_name, context)
        return bytes(self._infer_response(request).SerializeToString())

    async def _grpc_stream(
        self, messages: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        await self._thawed.wait()
        async for message in messages:
            try:
                request = pb.ModelInferRequest.FromString(message)
            except DecodeError:
                self._record_grpc("ModelStreamInfer", context, message, None)
                reply = pb.ModelStreamInferResponse(error_message="cannot parse ModelInferRequest")
                yield bytes(reply.SerializeToString())
                continue
            self._record_grpc("ModelStreamInfer", context, message, request)
            if request.model_name not in self.models:
                reply = pb.ModelStreamInferResponse(
                    error_message=f"Request for unknown model: '{request.model_name}' is not found"
                )
            else:
                await self._grpc_fault(request.model_name, context)
                reply = pb.ModelStreamInferResponse(infer_response=self._infer_response(request))
            yield bytes(reply.SerializeToString())


@dataclass
class FakeFleet:
    """N fake servers sharing one event loop on a background thread."""

    size: int = 3
    models: Callable[[], dict[str, dict[str, Any]]] = default_models
    servers: list[FakeTriton] = field(default_factory=list)
    bystanders: list[FakeTriton] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fakes")

    def call(self, coro: Awaitable[Any], timeout: float = 30) -> Any:
        async def run() -> Any:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def start(self) -> FakeFleet:
        self._thread.start()
        for i in range(self.size):
            self.add(f"fake-{i}")
        return self

    def add(self, name: str, *, instance: bool = True) -> FakeTriton:
        """Start one more fake; ``instance=False`` keeps it out of :attr:`servers` (the
        proxy's instances), as a bystander such as an SSRF canary."""
        fake = FakeTriton(name, self.loop, self.models())
        self.call(fake.start())
        (self.servers if instance else self.bystanders).append(fake)
        return fake

    def stop(self) -> None:
        for fake in [*self.servers, *self.bystanders]:
            self.call(fake.kill())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def kill(self, index: int) -> None:
        self.call(self.servers[index].kill())

    def restart(self, index: int) -> None:
        self.call(self.servers[index].restart())

    def received(self, predicate: Callable[[Received], bool] = lambda r: True) -> list[Received]:
        return [r for fake in self.servers for r in fake.seen(predicate)]

    def inferences(self) -> list[Received]:
        return [r for fake in self.servers for r in fake.inferences()]

    def clear(self) -> None:
        for fake in self.servers:
            fake.clear()

    def __enter__(self) -> FakeFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
