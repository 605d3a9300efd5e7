"""Triton's gRPC protocol (``inference.GRPCInferenceService``), served by the proxy.

Every method is served by a generic handler with identity serializers: messages stay bytes.
Inference requests are read only as far as routing needs (model name and a few parameters, see
:mod:`proxy.frontends.kserve_grpc`) and forwarded as the client's bytes through the instance's
pooled channel; answers and Triton's error statuses come back unchanged. Metadata, the client's
deadline and its cancellation travel upstream with each call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2 as pb

from proxy.aio import cancel_and_wait
from proxy.dispatch import ModelAbsentError, says_model_absent
from proxy.errors import Code, ProxyError
from proxy.fleet.grpc_upstream import Metadata, upstream_error
from proxy.fleet.instances import Instance
from proxy.fleet.model_control import InstanceFailure, to_every_instance
from proxy.fleet.upstream import UpstreamConnectError, UpstreamLostError, UpstreamTimeoutError
from proxy.frontends.common import (
    SharedMemoryAction,
    SharedMemoryKind,
    check_admin,
    shared_memory_call,
)
from proxy.frontends.http import HOP_BY_HOP
from proxy.frontends.kserve_grpc import input_shapes, read_infer, read_request, with_parameters
from proxy.frontends.routes import check_model_name
from proxy.h2.server import H2GrpcServer
from proxy.request import NO_FORWARD, Call, Forward
from proxy.runtime import Runtime
from proxy.scheduling import deadline
from proxy.scheduling.cost import check_shapes, cost_of, rows_of

log = logging.getLogger(__name__)

# Codes of Triton's "model not servable here" answers (proxy.dispatch.says_model_absent):
# NOT_FOUND / UNAVAILABLE for an unknown or unloaded model, INTERNAL for a dead Python stub.
_MAYBE_ABSENT = frozenset(
    (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
)

SERVICE = "inference.GRPCInferenceService"
# Besides HTTP's hop-by-hop headers: gRPC's own, which each channel sets for itself.
_NOT_FORWARDED = HOP_BY_HOP | {"content-type", "user-agent"}
# Statuses that say something about the instance itself (HTTP 5xx): probe it soon.
_SERVER_TROUBLE = frozenset(
    (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)
)
# The label of an upstream stream call by the kind of model it carries (_StreamLegs).
_KIND = {True: "decoupled", False: "other"}
_LIVE: bytes = pb.ServerLiveResponse(live=True).SerializeToString()
_READY: bytes = pb.ServerReadyResponse(ready=True).SerializeToString()
_NOT_READY: bytes = pb.ServerReadyResponse(ready=False).SerializeToString()

UnaryHandler = Callable[[bytes, Any], Awaitable[bytes]]


def method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


def forward_metadata(
    metadata: Iterable[tuple[str, str | bytes]], drop: Collection[str] = ()
) -> Metadata:
    """Metadata to send upstream: all but pseudo-headers, gRPC's own and hop-by-hop keys."""
    return [
        (k, v)
        for k, v in metadata
        if not k.startswith((":", "grpc-")) and k not in _NOT_FORWARDED and k not in drop
    ]


def _metadata(context: Any) -> list[tuple[str, str | bytes]]:
    return [(k.lower(), v) for k, v in context.invocation_metadata() or ()]


async def _abort(
    context: Any, code: grpc.StatusCode, details: str, trailing: Metadata = ()
) -> NoReturn:
    await context.abort(code, details, trailing_metadata=tuple(trailing))
    raise AssertionError("ServicerContext.abort returns only by raising")


async def abort_with(context: Any, exc: ProxyError | grpc.aio.AioRpcError) -> NoReturn:
    """End the client's call with the proxy's error, or with Triton's status unchanged."""
    if isinstance(exc, ProxyError):
        trailing: Metadata = ()
        if exc.retry_after_s is not None:
            trailing = [("retry-after", str(max(1, round(exc.retry_after_s))))]
        await _abort(context, grpc.StatusCode[exc.code.grpc_name], exc.message, trailing)
    await _abort(
        context, exc.code(), exc.details() or "", forward_metadata(exc.trailing_metadata() or ())
    )


def _guard(handler: UnaryHandler) -> UnaryHandler:
    async def guarded(request: bytes, context: Any) -> bytes:
        try:
            return await handler(request, context)
        except (ProxyError, grpc.aio.AioRpcError) as exc:
            await abort_with(context, exc)

    return guarded


def _parse(message_type: type[Message], data: bytes) -> Any:
    """A small control message, or None if it does not parse (Triton will say why)."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None


class GrpcFrontend:
    """Builds the ``grpc.aio`` server serving Triton's gRPC protocol for one :class:`Runtime`."""

    def __init__(self, runtime_ref: Callable[[], Runtime]) -> None:
        # A callable, not a Runtime: the server outlives any one runtime object (tests and
        # reloads may hand it another).
        self._rt = runtime_ref

    def server(self, max_receive_bytes: int, *, reuse_port: bool = False) -> grpc.aio.Server:
        """``reuse_port``: share the port with the proxy's other workers (``--workers``)."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_receive_bytes),
                # Responses are bounded by Triton, not by the proxy (as over HTTP).
                ("grpc.max_send_message_length", -1),
                # Linux gRPC servers share a port with any other by default: fail instead,
                # unless the sharing is ours (workers).
                ("grpc.so_reuseport", 1 if reuse_port else 0),
            ]
        )
        server.add_generic_rpc_handlers([self.handler()])
        return server

    def unary_methods(self) -> dict[str, UnaryHandler]:
        methods: dict[str, UnaryHandler] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelInfer": self.model_infer,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.to_every_instance("RepositoryModelLoad"),
            "RepositoryModelUnload": self.to_every_instance("RepositoryModelUnload"),
            "TraceSetting": self.settings("TraceSetting", pb.TraceSettingRequest),
            "LogSettings": self.settings("LogSettings", pb.LogSettingsRequest),
        }
        for name in (
            "ServerMetadata",
            "ModelReady",
            "ModelMetadata",
            "ModelConfig",
            "ModelStatistics",
        ):
            methods[name] = self.relayed(name)
        kinds: tuple[tuple[SharedMemoryKind, str], ...] = (
            ("system", "SystemSharedMemory"),
            ("cuda", "CudaSharedMemory"),
        )
        actions: tuple[tuple[SharedMemoryAction, str], ...] = (
            ("status", "Status"),
            ("register", "Register"),
            ("unregister", "Unregister"),
        )
        for kind, prefix in kinds:
            for action, suffix in actions:
                request_type = getattr(pb, f"{prefix}{suffix}Request")
                methods[prefix + suffix] = self.shared_memory(kind, action, request_type)
        return methods

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(_guard(fn))
            for name, fn in self.unary_methods().items()
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer
        )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def h2_server(self, max_receive_bytes: int) -> H2GrpcServer:
        """The same handlers on the proxy's own HTTP/2 server (``listen.grpc_engine: h2``)."""
        unary = {method_path(name): _guard(fn) for name, fn in self.unary_methods().items()}
        streams = {method_path("ModelStreamInfer"): self.model_stream_infer}
        return H2GrpcServer(unary, streams, max_receive_bytes=max_receive_bytes)

    # --- health ---------------------------------------------------------------------------
    async def server_live(self, request: bytes, context: Any) -> bytes:
        return _LIVE

    async def server_ready(self, request: bytes, context: Any) -> bytes:
        return _READY if self._rt().ready() else _NOT_READY

    # --- inference ------------------------------------------------------------------------
    def _call(
        self,
        rt: Runtime,
        request: bytes,
        metadata: list[tuple[str, str | bytes]],
        time_remaining: float | None,
    ) -> Call:
        model, params, shapes = read_request(request)
        if not model:
            raise ProxyError(
                Code.INVALID_ARG,
                "triton-proxy could not parse the ModelInferRequest, or it names no model",
            )
        check_model_name(model)
        check_shapes(shapes, len(request))
        headers = {k: v for k, v in metadata if isinstance(v, str)}
        return Call(
            model=model,
            headers=headers,
            params=params,
            session_key=rt.session_key(headers),
            cost=cost_of(shapes),
            rows=rows_of(shapes),
            deadline=deadline.client_deadline(
                rt.clock.now(), grpc_remaining_s=time_remaining, timeout_us=params.timeout_us
            ),
        )

    async def _unary(
        self,
        rt: Runtime,
        instance: Instance,
        method: str,
        request: bytes,
        metadata: Metadata,
        context: Any,
        *,
        client_deadline: bool = True,
    ) -> bytes:
        """One call upstream; it carries the client's deadline unless ``client_deadline`` is
        false (``limits.cancel_upstream: false``: abandoned work runs to its end)."""
        remaining = context.time_remaining() if client_deadline else None
        try:
            return await rt.grpc_upstreams.unary(
                instance, method_path(method), request, metadata, remaining
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _SERVER_TROUBLE:
                rt.health.check_soon(instance)
            raise

    async def model_infer(self, request: bytes, context: Any) -> bytes:
        rt = self._rt()
        metadata = _metadata(context)
        forward = forward_metadata(metadata, rt.private_headers)

        async def send(instance: Instance, parameters: Forward) -> bytes:
            data = _with_forward(request, parameters)
            try:
                return await self._unary(
                    rt,
                    instance,
                    "ModelInfer",
                    data,
                    forward,
                    context,
                    client_deadline=rt.dispatcher.cancel_upstream,
                )
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                absent = exc.code() in _MAYBE_ABSENT
                if absent and says_model_absent(details):
                    raise ModelAbsentError(details, exc) from exc
                raise

        with rt.budget.hold(len(request)):
            call = self._call(rt, request, metadata, context.time_remaining())
            # proxy.h2's calls can answer before the handler returns; grpc.aio's cannot.
            deliver = getattr(context, "answer_now", None)
            return await rt.dispatcher.run(call, send, deliver=deliver)

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context: Any) -> None:
        """The whole stream stays on the instance chosen for its first request; each message
        passes its model's class gate on its own, so an idle stream holds no slot."""
        try:
            incoming = aiter(requests)
            first = await anext(incoming, None)
            if first is None:
                return
            rt = self._rt()
            metadata = _metadata(context)
            forward = forward_metadata(metadata, rt.private_headers)
            call = self._call(rt, first, metadata, context.time_remaining())
            klass = rt.dispatcher.classify(call)

            async def send(instance: Instance, _: Forward) -> None:
                await self._relay_stream(rt, instance, klass, first, incoming, forward, context)

            await rt.dispatcher.run(call, send, stream=True, admit=False)
        except (ProxyError, grpc.aio.AioRpcError) as exc:
            await abort_with(context, exc)

    async def _relay_stream(
        self,
        rt: Runtime,
        instance: Instance,
        klass: str,
        first: bytes,
        incoming: AsyncIterator[bytes],
        metadata: Metadata,
        context: Any,
    ) -> None:
        legs = _StreamLegs(rt, instance, klass, metadata, context)
        try:
            try:
                await legs.send(first)
            except grpc.aio.AioRpcError as exc:
                # Only here can a stream be retried elsewhere: nothing else was taken from
                # the client yet.
                transport = upstream_error(exc)
                raise (transport or exc) from exc

            def on_request(request: bytes) -> None:
                # Sequences started or ended later in the stream stay placed on its instance.
                model, params = read_infer(request)
                rt.dispatcher.note_sequence(model, params, instance)

            try:
                await legs.relay(incoming, on_request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _SERVER_TROUBLE:
                    rt.health.check_soon(instance)
                if upstream_error(exc) is not None:
                    raise UpstreamLostError(exc.details() or "") from exc
                raise
        finally:
            await legs.close()

    # --- everything else ------------------------------------------------------------------
    async def _relay(self, method: str, request: bytes, context: Any) -> bytes:
        """Metadata, config, statistics...: any ready instance answers as Triton would."""
        rt = self._rt()
        forward = forward_metadata(_metadata(context), rt.private_headers)
        return await rt.dispatcher.any_ready(
            lambda instance: self._unary(rt, instance, method, request, forward, context)
        )

    def relayed(self, method: str) -> UnaryHandler:
        async def handler(request: bytes, context: Any) -> bytes:
            return await self._relay(method, request, context)

        return handler

    def _check_admin(self, context: Any) -> None:
        given = next((v for k, v in _metadata(context) if k == "authorization"), None)
        check_admin(self._rt().config.admin, given if isinstance(given, str) else None)

    async def repository_index(self, request: bytes, context: Any) -> bytes:
        self._check_admin(context)
        return await self._relay("RepositoryIndex", request, context)

    def to_every_instance(self, method: str) -> UnaryHandler:
        """Load/unload/settings go to every instance; the first failure is returned. With
        several workers, only the leader fans out (:mod:`proxy.frontends.admin_relay`)."""

        async def handler(request: bytes, context: Any) -> bytes:
            self._check_admin(context)
            rt = self._rt()
            forward = forward_metadata(_metadata(context), rt.private_headers)
            try:
                if rt.admin_leader is not None:
                    rt.telemetry.model_control_calls.labels("grpc", "relayed_to_leader").inc()
                    return await rt.admin_leader.grpc(method, request, forward)
                return await self.fan_out(method, request, forward, context)
            except InstanceFailure as failed:
                await _abort(context, failed.code, failed.message)

        return handler

    async def fan_out(
        self, method: str, request: bytes, forward: Metadata, context: Any = None
    ) -> bytes:
        """Send one model-control call to every instance: the first instance's answer, or
        ``InstanceFailure`` with the first failure, its message naming the instance. The calls
        carry the deadline of the client's call ``context`` (none for a relayed call)."""
        rt = self._rt()
        rt.telemetry.model_control_calls.labels("grpc", "fanned_out").inc()

        async def one(instance: Instance) -> bytes:
            try:
                return await self._unary(
                    rt,
                    instance,
                    method,
                    request,
                    forward,
                    context,
                    client_deadline=context is not None,
                )
            except grpc.aio.AioRpcError as exc:
                raise InstanceFailure(exc.code(), exc.details() or "") from exc
            except (
                UpstreamConnectError,
                UpstreamLostError,
                UpstreamTimeoutError,
                ProxyError,
            ) as exc:
                raise InstanceFailure(
                    grpc.StatusCode.UNAVAILABLE, f"{instance.name}: {exc}"
                ) from exc

        fan = await to_every_instance(rt.fleet.all(), one)
        failed = fan.failure()
        if failed is None:
            return fan.answers[0][1]
        first, message = failed
        raise InstanceFailure(first.code, message)

    def settings(self, method: str, request_type: type[Message]) -> UnaryHandler:
        """Reading trace/log settings is open (as HTTP GET is); changing them is admin."""
        change = self.to_every_instance(method)

        async def handler(request: bytes, context: Any) -> bytes:
            parsed = _parse(request_type, request)
            if parsed is not None and not parsed.settings:
                return await self._relay(method, request, context)
            return await change(request, context)

        return handler

    def shared_memory(
        self, kind: SharedMemoryKind, action: SharedMemoryAction, request_type: type[Message]
    ) -> UnaryHandler:
        async def handler(request: bytes, context: Any) -> bytes:
            parsed = _parse(request_type, request)
            shared_memory_call(kind, action, parsed.name if parsed is not None else "")
            # Status with no regions and unregister answer an empty message.
            return b""

        return handler


def _with_forward(request: bytes, parameters: Forward) -> bytes:
    """The request with the parameters the proxy sets (class priority, deadline's timeout)."""
    if parameters == NO_FORWARD:
        return request
    return with_parameters(request, parameters.parameters())


class _StreamLeg:
    """One upstream call of a client's stream, and the class-gate slots of the messages sent
    on it: each message waits for its own slot (and its bytes are held against the byte
    budget until written upstream); an answer releases the oldest slot. A decoupled model's
    answers release it at the final one, when the client asked Triton to flag it
    (``triton_final_response``), else at the first."""

    def __init__(
        self,
        rt: Runtime,
        klass: str,
        call: Any,
        reply: Callable[[bytes], Awaitable[None]],
        decoupled: bool,
    ) -> None:
        self.rt = rt
        self.klass = klass
        self.call = call
        self.reply = reply
        self.decoupled = decoupled
        """Whether the call carries a decoupled model's requests (all of them, or none)."""
        self.pending: deque[contextlib.AsyncExitStack] = deque()

    async def send(self, request: bytes, model: str) -> None:
        """Admit one message and write it upstream; a refused one is answered in the stream,
        as Triton answers a failed request of a stream."""
        stack = contextlib.AsyncExitStack()
        try:
            check_shapes(input_shapes(request), len(request))
            with self.rt.budget.hold(len(request)):
                priority = await stack.enter_async_context(
                    self.rt.dispatcher.admitted(model, self.klass)
                )
                # Queued before the write: its answer may come before the write returns.
                self.pending.append(stack)
                await self.call.write(_with_forward(request, Forward(priority)))
        except BaseException as exc:
            if stack in self.pending:
                self.pending.remove(stack)
            await stack.aclose()
            if not isinstance(exc, ProxyError):
                raise
            await self.reply(_stream_error(request, model, exc.message))

    async def relay_answers(self) -> None:
        """Relay this call's answers to the client until Triton ends the call."""
        async for response in self.call:
            if self.pending and (not self.decoupled or _final_response(response)):
                await self.pending.popleft().aclose()
            await self.reply(response)

    async def close(self) -> None:
        self.call.cancel()
        while self.pending:
            await self.pending.popleft().aclose()


class _StreamLegs:
    """A client's stream, relayed to its instance as one upstream call per kind of model.

    Triton 2.51 can abort (gRPC's ``!byte_buffer->Valid()`` assertion, docs/triton-notes.md)
    on a stream that carries errors of decoupled and non-decoupled models, so the two kinds
    never share an upstream call: a client stream that uses both is relayed as two calls to
    the same instance, their answers merged as they come. A stream of one kind (the usual
    case) is one call, as before. Triton orders a stream's answers only among its
    non-decoupled requests (a decoupled model answers whenever it produces), and those stay
    on one call, in the client's order. A model the catalog cannot describe counts as
    non-decoupled, as Triton counts it.

    The stream ends when the client has half-closed and Triton has ended every call, or at
    the first failure of any of them (the others are then cancelled).
    """

    def __init__(
        self, rt: Runtime, instance: Instance, klass: str, metadata: Metadata, context: Any
    ) -> None:
        self.rt = rt
        self.instance = instance
        self.klass = klass
        self.metadata = metadata
        self.context = context
        self.legs: dict[bool, _StreamLeg] = {}
        self._write = asyncio.Lock()
        # (leg or None for the client's side, its failure or None): one per ended task.
        self._ended: asyncio.Queue[tuple[_StreamLeg | None, BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def send(self, request: bytes) -> None:
        model, _ = read_infer(request)
        decoupled = await self._decoupled(model)
        leg = self.legs.get(decoupled)
        if leg is None:
            call = self.rt.grpc_upstreams.stream(
                self.instance,
                method_path("ModelStreamInfer"),
                self.metadata,
                self.context.time_remaining(),
            )
            leg = _StreamLeg(self.rt, self.klass, call, self._reply, decoupled)
            self.legs[decoupled] = leg
            self.rt.telemetry.upstream_streams.labels(_KIND[decoupled]).inc()
            self._watch(leg.relay_answers(), leg)
        await leg.send(request, model)

    async def relay(
        self, incoming: AsyncIterator[bytes], on_request: Callable[[bytes], None]
    ) -> None:
        """Relay the rest of the client's requests and every call's answers; returns when
        the stream is over, raises the first failure."""
        self._watch(self._send_rest(incoming, on_request), None)
        client_done = False
        ended = 0
        while not (client_done and ended == len(self.legs)):
            leg, failure = await self._ended.get()
            if failure is not None:
                raise failure
            if leg is None:
                client_done = True
            else:
                ended += 1

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        for leg in self.legs.values():
            await leg.close()

    async def _send_rest(
        self, incoming: AsyncIterator[bytes], on_request: Callable[[bytes], None]
    ) -> None:
        """Relay the client's requests as they arrive, then half-close every call (also
        when one of them has ended: its side reports how, and the others must end too)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async for request in incoming:
                on_request(request)
                await self.send(request)
        for leg in self.legs.values():
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await leg.call.done_writing()

    def _watch(self, work: Awaitable[None], leg: _StreamLeg | None) -> None:
        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # by close(): nobody waits for the news
                self._ended.put_nowait((leg, exc))  # the call itself was cancelled
            except Exception as exc:
                self._ended.put_nowait((leg, exc))
            else:
                self._ended.put_nowait((leg, None))

        self._tasks.append(asyncio.create_task(run()))

    async def _decoupled(self, model: str) -> bool:
        try:
            info = await self.rt.catalog.info(model)
        except ProxyError:
            return False  # not describable now: Triton answers it, as for an unknown model
        return info is not None and info.decoupled

    async def _reply(self, response: bytes) -> None:
        async with self._write:
            await self.context.write(response)


def _stream_error(request: bytes, model: str, message: str) -> bytes:
    try:
        request_id = pb.ModelInferRequest.FromString(request).id
    except DecodeError:
        request_id = ""
    answer = pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(model_name=model, id=request_id),
    )
    data: bytes = answer.SerializeToString()
    return data


def _final_response(response: bytes) -> bool:
    try:
        parsed = pb.ModelStreamInferResponse.FromString(response)
    except DecodeError:
        return True
    flag = parsed.infer_response.parameters.get("triton_final_response")
    return bool(parsed.error_message) or flag is None or flag.bool_param
