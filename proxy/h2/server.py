"""gRPC server on :mod:`proxy.h2`: the proxy's ``inference.GRPCInferenceService`` endpoint.

Handlers are the frontend's own (:class:`proxy.frontends.grpc.GrpcFrontend`), called as
``grpc.aio`` calls them: a unary handler ``(request bytes, context) -> response bytes``, a
stream handler ``(request iterator, context) -> None`` that writes answers with
``context.write``. :class:`ServerCall` is that context (``invocation_metadata``,
``time_remaining``, ``abort``, ``write``), so the frontend does not know which server runs it.

Why not ``grpc.aio``: a bare ``grpc.aio`` relay costs 0.43 ms of CPU per call at
concurrency 16, this one about a fifth of that (docs/benchmarks.md, session 19).

Each call runs as one task, started when its request has arrived whole (unary) or at its
headers (stream). A client's RST_STREAM or a lost connection cancels the task (and with it
the upstream call); its deadline (``grpc-timeout``) ends it with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, NoReturn, cast

import grpc

from proxy.h2 import wire
from proxy.h2.connection import CONNECTION_WINDOW, Connection, Inbox, Stream
from proxy.h2.wire import H2Error
from proxy.listener import Listener, listen

log = logging.getLogger(__name__)

UnaryHandler = Callable[[bytes, Any], Awaitable[bytes]]
StreamHandler = Callable[[AsyncIterator[bytes], Any], Awaitable[None]]
Metadata = Iterable[tuple[str, str | bytes]]

MAX_STREAMS = 256
"""Concurrent calls per client connection (SETTINGS_MAX_CONCURRENT_STREAMS)."""
STREAM_WINDOW = 1 << 20

_RESPONSE_HEADERS = wire.encode_block(
    ((b":status", b"200"), (b"content-type", b"application/grpc"))
)
_OK = wire.encode_block(((b"grpc-status", b"0"),))


class Abort(Exception):
    """Raised by :meth:`ServerCall.abort`: the call ends with this status."""

    def __init__(self, code: int, details: str, trailing: Metadata = ()) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = list(trailing)


def status_block(code: int, details: str, trailing: Metadata, *, trailers_only: bool) -> bytes:
    fields: list[wire.Header] = []
    if trailers_only:
        fields += [(b":status", b"200"), (b"content-type", b"application/grpc")]
    fields.append((b"grpc-status", str(code).encode()))
    if details:
        fields.append((b"grpc-message", wire.encode_message_text(details)))
    fields += [wire.metadata_field(k, v) for k, v in trailing]
    return wire.encode_block(fields)


class ServerCall:
    """One client call: the stream's owner, and the handler's ``context``."""

    def __init__(
        self,
        conn: ServerConnection,
        stream_id: int,
        headers: list[wire.Header],
        deadline: float | None,
        unary: bool,
        encoding: bytes | None,
    ) -> None:
        self.conn = conn
        self.stream: Stream = conn.open(stream_id, self)
        self.headers = headers
        self.deadline = deadline
        self.unary = unary
        self.inbox = Inbox(conn, self.stream, conn.server.max_receive_bytes, encoding, unary=unary)
        self.client_done = False
        self.headers_sent = False
        self.done = False
        self.task: asyncio.Task[None] | None = None
        self.handler: UnaryHandler | StreamHandler | None = None
        self.expired = False
        self._failure: Abort | None = None
        self._timer: asyncio.TimerHandle | None = None

    # --- the handler's context ------------------------------------------------------------
    def invocation_metadata(self) -> list[tuple[str, str | bytes]]:
        return [
            (k.decode("latin-1"), wire.metadata_value(k, v))
            for k, v in self.headers
            if not k.startswith(b":")
        ]

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()
    ) -> NoReturn:
        raise Abort(code.value[0], details, trailing_metadata)

    async def write(self, message: bytes) -> None:
        if self.done:
            raise asyncio.InvalidStateError("the call has ended")
        head = b""
        if not self.headers_sent:
            self.headers_sent = True
            head = self.conn.header_frames(self.stream, _RESPONSE_HEADERS, False)
        await self.conn.send_message(self.stream, message, False, head)

    # --- the request's messages, for a stream handler ---------------------------------------
    def __aiter__(self) -> ServerCall:
        return self

    async def __anext__(self) -> bytes:
        while not self.inbox.messages:
            if self._failure is not None:
                raise self._failure
            if self.client_done or self.done:
                raise StopAsyncIteration
            await self.inbox.wait()
        return self.inbox.take()

    # --- the stream's owner (frames from the client) ----------------------------------------
    def on_headers(self, headers: list[wire.Header], end_stream: bool) -> None:
        if end_stream:  # the client's trailers: gRPC has no use for them
            self._client_ended()

    def on_data(self, data: wire.View, end_stream: bool) -> None:
        try:
            self.inbox.feed(data)
        except wire.MessageTooLarge as exc:
            self._fail(Abort(wire.RESOURCE_EXHAUSTED, str(exc)))
            return
        except ValueError as exc:
            self._fail(Abort(wire.INTERNAL, str(exc)))
            return
        if self.unary and len(self.inbox.messages) > 1:
            self._fail(Abort(wire.UNIMPLEMENTED, "more than one request on a unary call"))
            return
        if end_stream:
            self._client_ended()

    def _client_ended(self) -> None:
        self.client_done = True
        if self.unary and self.task is None and not self.done:
            if len(self.inbox.messages) != 1 or self.inbox.reader.partial:
                self._fail(Abort(wire.UNIMPLEMENTED, "a unary call needs exactly one request"))
                return
            self.start()
        self.inbox.wake()

    def on_reset(self, code: int) -> None:
        self._cancel()

    def on_lost(self, reason: str, unprocessed: bool) -> None:
        self._cancel()

    def _cancel(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        if self.task is not None:
            self.task.cancel()
        self.inbox.wake()

    def _fail(self, failure: Abort) -> None:
        """A bad request: end the call with ``failure`` (the handler, if running, stops)."""
        if self.task is None:
            self.finish_with(failure)
            return
        self._failure = failure
        self.inbox.wake()
        if self.unary:
            self.task.cancel()

    # --- running the handler ----------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.conn.calls.add(self.task)
        self.task.add_done_callback(self.conn.calls.discard)
        if self.deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(self.deadline, self._expire)

    def _expire(self) -> None:
        if self.task is not None and not self.task.done():
            self.expired = True
            self.task.cancel()

    async def _run(self) -> None:
        try:
            if self.unary:
                unary = cast(UnaryHandler, self.handler)
                response: bytes | None = await unary(self.inbox.take(), self)
            else:
                await cast(StreamHandler, self.handler)(self, self)
                response = None
        except Abort as failure:
            self.finish_with(failure)
        except asyncio.CancelledError:
            if self.expired:
                self.finish_with(Abort(wire.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            elif self._failure is not None:
                self.finish_with(self._failure)
            # Else the client reset the call or left: nobody to answer.
        except Exception:
            log.exception("gRPC handler failed")
            self.finish_with(Abort(wire.UNKNOWN, "Unexpected error in the proxy"))
        else:
            if self._failure is not None:
                self.finish_with(self._failure)
            elif response is None:
                self.finish_with(Abort(wire.OK, ""))
            else:
                await self._respond(response)
        finally:
            if self._timer is not None:
                self._timer.cancel()

    def answer_now(self, message: bytes) -> None:
        """A unary call's answer written before its handler returns (it must return the same
        answer), when it fits the flow-control windows: what the handler does afterwards runs
        off the client's clock (the dispatcher's ``deliver``)."""
        if self.unary:
            self._answer_at_once(message)

    def _answer_at_once(self, message: bytes) -> bool:
        """Headers, the message and OK in one write, if the call is open and they fit."""
        conn, stream = self.conn, self.stream
        if (
            self.done
            or self.headers_sent
            or stream.id not in conn.streams
            or not conn.message_fits(stream, message)
        ):
            return False
        self.headers_sent = True
        head = conn.header_frames(stream, _RESPONSE_HEADERS, False)
        frame, body = conn.message_frame(stream, message, False)
        conn.write_all([head + frame, body, conn.header_frames(stream, _OK, True)])
        self._ended()
        return True

    async def _respond(self, message: bytes) -> None:
        """A unary call's answer: headers, the message and OK, in one write when they fit."""
        if self._answer_at_once(message) or self.done or self.stream.id not in self.conn.streams:
            return
        try:
            await self.write(message)
        except (ConnectionError, asyncio.InvalidStateError):
            return
        self.finish_with(Abort(wire.OK, ""))

    def finish_with(self, status: Abort) -> None:
        """End the call with ``status`` (trailers; headers and trailers at once if no
        message was sent)."""
        conn, stream = self.conn, self.stream
        if self.done or stream.id not in conn.streams:
            self.done = True
            return
        block = status_block(
            status.code, status.details, status.trailing, trailers_only=not self.headers_sent
        )
        self.headers_sent = True
        conn.write(conn.header_frames(stream, block, True))
        self._ended()

    def _ended(self) -> None:
        self.done = True
        if not self.stream.remote_ended:
            # Answered before the client finished sending: it need send nothing more.
            self.conn.reset(self.stream, wire.NO_ERROR)


class ServerConnection(Connection):
    def __init__(self, server: H2GrpcServer) -> None:
        super().__init__(
            stream_window=STREAM_WINDOW,
            max_streams=MAX_STREAMS,
            # Room for one whole message of the largest size, and no more, held unread.
            connection_window=max(CONNECTION_WINDOW, server.max_receive_bytes + (1 << 20)),
            hold_window=True,
        )
        self.server = server
        self.calls: set[asyncio.Task[None]] = set()
        self.refusing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)

    def unknown_headers(self, stream_id: int, headers: list[wire.Header], end_stream: bool) -> None:
        if stream_id <= self.last_peer_stream:
            return  # trailers of a call this end has answered and reset: dropped
        if stream_id % 2 == 0:
            raise H2Error(wire.PROTOCOL_ERROR, f"bad new stream id {stream_id}")
        self.last_peer_stream = stream_id
        if self.refusing or len(self.streams) >= MAX_STREAMS:
            self.write(wire.rst_stream(stream_id, wire.REFUSED_STREAM))
            return
        fields = dict(headers)
        method, path = fields.get(b":method"), fields.get(b":path")
        content_type = fields.get(b"content-type", b"")
        if method is None or path is None or b":scheme" not in fields:
            self.write(wire.rst_stream(stream_id, wire.PROTOCOL_ERROR))
            return
        if method != b"POST" or not content_type.startswith(b"application/grpc"):
            status = b"405" if method != b"POST" else b"415"
            stream = self.open(stream_id, _Refused())
            if end_stream:
                stream.remote_ended = True
            self.write(self.header_frames(stream, wire.encode_block([(b":status", status)]), True))
            if not stream.remote_ended:
                self.reset(stream, wire.NO_ERROR)
            return
        timeout = fields.get(b"grpc-timeout")
        deadline = None
        if timeout is not None:
            seconds = wire.parse_timeout(timeout)
            if seconds is not None:
                deadline = asyncio.get_running_loop().time() + seconds
        encoding = fields.get(b"grpc-encoding")
        if encoding == b"identity":
            encoding = None
        route = self.server.routes.get(path)
        unary = route is None or route[0]
        call = ServerCall(self, stream_id, headers, deadline, unary, encoding)
        if route is None:
            call.finish_with(
                Abort(wire.UNIMPLEMENTED, f"Method not found: {path.decode(errors='replace')}")
            )
            return
        if encoding not in (None, b"gzip", b"deflate"):
            assert encoding is not None
            call.finish_with(
                Abort(
                    wire.UNIMPLEMENTED,
                    f"Compression algorithm '{encoding.decode(errors='replace')}' not supported",
                )
            )
            return
        call.handler = route[1]
        if not unary:
            call.start()
        if end_stream:
            call.stream.remote_ended = True
            call._client_ended()


class _Refused:
    """Owner of a stream answered at its headers (not gRPC): whatever follows is dropped."""

    def on_headers(self, headers: list[wire.Header], end_stream: bool) -> None:
        pass

    def on_data(self, data: wire.View, end_stream: bool) -> None:
        pass

    def on_reset(self, code: int) -> None:
        pass

    def on_lost(self, reason: str, unprocessed: bool) -> None:
        pass


class H2GrpcServer:
    """Listens for gRPC clients; ``unary`` and ``streams`` map a method's path to its handler."""

    def __init__(
        self,
        unary: Mapping[str, UnaryHandler],
        streams: Mapping[str, StreamHandler],
        *,
        max_receive_bytes: int,
    ) -> None:
        self.routes: dict[bytes, tuple[bool, UnaryHandler | StreamHandler]] = {
            **{k.encode(): (True, v) for k, v in unary.items()},
            **{k.encode(): (False, v) for k, v in streams.items()},
        }
        """A method's path -> (whether it is unary, its handler)."""
        self.max_receive_bytes = max_receive_bytes
        self.connections: set[ServerConnection] = set()
        self._servers: list[Listener] = []

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096
    ) -> int:
        server = await listen(
            lambda: ServerConnection(self), host, port, backlog=backlog, reuse_port=reuse_port
        )
        self._servers.append(server)
        bound: int = server.sockets[0].getsockname()[1]
        return bound

    async def stop(self, grace: float) -> None:
        """Stop listening, tell every client (GOAWAY), give calls ``grace`` seconds, then
        cancel what is left and close."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.refusing = True
            conn.write(wire.goaway(conn.last_peer_stream, wire.NO_ERROR))
        calls = [t for conn in self.connections for t in conn.calls]
        if calls:
            await asyncio.wait(calls, timeout=grace)
        for conn in list(self.connections):
            for task in list(conn.calls):
                task.cancel()
        await asyncio.sleep(0)
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers = []
