"""gRPC calls to Triton on :mod:`proxy.h2`: one multiplexed connection per instance.

:class:`H2Upstreams` has :class:`proxy.fleet.grpc_upstream.GrpcUpstreams`' interface and
raises what it raises: Triton's statuses as ``grpc.aio.AioRpcError`` (details and trailing
metadata as Triton sent them), transport failures classified by
:func:`proxy.fleet.grpc_upstream.upstream_error` (their details are worded as gRPC's core
words them, which that function reads). So the frontend handles both the same way.

Messages pass as bytes: the request's message is framed and written with its headers in one
write when the windows allow; the answer's message is cut from the DATA frames.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import grpc

from proxy.fleet.grpc_upstream import Metadata, classified, effective_timeout, grpc_target
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import RETIRE_MAX_S
from proxy.h2 import wire
from proxy.h2.connection import Connection, Inbox, Stream

log = logging.getLogger(__name__)

STREAM_WINDOW = 4 << 20
MAX_STREAM_ID = (1 << 31) - 1
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
# How a reset stream reads to the caller, as gRPC's core reports RST_STREAM codes.
_RESET_STATUS = {
    wire.CANCEL: grpc.StatusCode.CANCELLED,
    wire.REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
}


def rpc_error(code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class UpstreamCall:
    """One call on an instance's connection: the stream's owner, and the caller's handle.

    For a unary call, :meth:`result` waits for the answer; a stream call is written with
    :meth:`write` / :meth:`done_writing`, read by iterating, ended early with :meth:`cancel`.
    """

    def __init__(self, conn: ClientConnection, unary: bool) -> None:
        self.conn = conn
        self.unary = unary
        self.stream: Stream = conn.open(conn.take_stream_id(), self)
        self.inbox = Inbox(conn, self.stream, MAX_STREAM_ID, unary=unary)
        self.initial: list[wire.Header] | None = None
        self.trailers: list[wire.Header] | None = None
        self.error: grpc.aio.AioRpcError | None = None

    # --- the stream's owner ---------------------------------------------------------------
    def on_headers(self, headers: list[wire.Header], end_stream: bool) -> None:
        if self.initial is None and not end_stream:
            self.initial = headers
            status = wire.find(headers, b":status")
            if status != b"200":
                self._end(rpc_error(grpc.StatusCode.UNKNOWN, f"HTTP status {status!r}"))
                self.conn.reset(self.stream, wire.CANCEL)
            return
        self.trailers = headers
        self._end(None)
        if not self.stream.ended:
            self.conn.reset(self.stream, wire.CANCEL)  # Triton is done: stop sending

    def on_data(self, data: wire.View, end_stream: bool) -> None:
        try:
            self.inbox.feed(data)
        except ValueError as exc:
            self._end(rpc_error(grpc.StatusCode.INTERNAL, f"bad message from Triton: {exc}"))
            self.conn.reset(self.stream, wire.PROTOCOL_ERROR)
            return
        if end_stream and self.trailers is None:
            self._end(rpc_error(grpc.StatusCode.INTERNAL, "Triton ended the call without a status"))

    def on_reset(self, code: int) -> None:
        status = _RESET_STATUS.get(code, grpc.StatusCode.INTERNAL)
        self._end(rpc_error(status, f"Stream removed: RST_STREAM with error code {code}"))

    def on_lost(self, reason: str, unprocessed: bool) -> None:
        if unprocessed:
            # Never seen by Triton: the same as a call that could not connect.
            reason = f"failed to connect to all addresses; last error: {reason}"
        self._end(rpc_error(grpc.StatusCode.UNAVAILABLE, reason))

    def _end(self, error: grpc.aio.AioRpcError | None) -> None:
        if self.trailers is None and error is None:
            return
        if error is not None and self.error is None and self.trailers is None:
            self.error = error
        if self.trailers is not None and self.error is None:
            code = int(wire.find(self.trailers, b"grpc-status") or b"2")
            if code != 0:
                message = wire.decode_message_text(wire.find(self.trailers, b"grpc-message") or b"")
                trailing = [
                    (k.decode("latin-1"), wire.metadata_value(k, v))
                    for k, v in self.trailers
                    if not k.startswith(b":")
                    and k not in (b"grpc-status", b"grpc-message", b"content-type")
                ]
                self.error = rpc_error(
                    _STATUS.get(code, grpc.StatusCode.UNKNOWN), message, trailing
                )
        self.inbox.wake()

    @property
    def done(self) -> bool:
        return self.trailers is not None or self.error is not None

    # --- the caller's side ----------------------------------------------------------------
    async def result(self) -> bytes:
        while not self.done:
            await self.inbox.wait()
        if self.error is not None:
            raise self.error
        if len(self.inbox.messages) != 1:
            raise rpc_error(
                grpc.StatusCode.INTERNAL, "Triton answered a unary call without one message"
            )
        return self.inbox.take()

    async def write(self, message: bytes) -> None:
        if self.done:
            raise asyncio.InvalidStateError("the call has ended")
        await self.conn.send_message(self.stream, message, False)

    async def done_writing(self) -> None:
        if self.done or self.stream.ended:
            return
        self.conn.write(self.conn.data_frame(self.stream, b"", True))

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._answers()

    async def _answers(self) -> AsyncIterator[bytes]:
        while True:
            while self.inbox.messages:
                yield self.inbox.take()
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self.inbox.wait()

    def expire(self) -> None:
        """The call's deadline passed: Triton is told to stop, the caller gets
        DEADLINE_EXCEEDED."""
        if not self.done:
            self.conn.reset(self.stream, wire.CANCEL)
            self._end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> None:
        if not self.done:
            self.error = rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled")
            self.conn.reset(self.stream, wire.CANCEL)
            self.inbox.wake()


class ClientConnection(Connection):
    is_client = True

    def __init__(self, authority: str) -> None:
        super().__init__(stream_window=STREAM_WINDOW, max_streams=0)
        self.authority = authority.encode()
        self.next_id = 1
        self._static: dict[str, bytes] = {}

    @property
    def usable(self) -> bool:
        return not self.closed and self.goaway_from_peer is None and self.next_id < MAX_STREAM_ID

    def take_stream_id(self) -> int:
        sid = self.next_id
        self.next_id += 2
        return sid

    def unknown_stream(self, stream_id: int) -> None:
        pass  # answers to calls this end reset: dropped

    def unknown_headers(self, stream_id: int, headers: list[wire.Header], end_stream: bool) -> None:
        if stream_id % 2 == 0 or stream_id >= self.next_id:
            super().unknown_headers(stream_id, headers, end_stream)
        # Else the answer to a call this end reset: dropped.

    def headers_block(self, path: str, metadata: Metadata, timeout: float | None) -> bytes:
        static = self._static.get(path)
        if static is None:
            static = self._static[path] = wire.encode_block(
                (
                    (b":method", b"POST"),
                    (b":scheme", b"http"),
                    (b":path", path.encode()),
                    (b":authority", self.authority),
                    (b"content-type", b"application/grpc"),
                    (b"te", b"trailers"),
                    # The proxy's own, as a gRPC channel sends its own (the client's is dropped).
                    (b"user-agent", b"triton-proxy-h2"),
                )
            )
        parts = [static]
        if timeout is not None:
            parts.append(wire.encode_field(b"grpc-timeout", wire.format_timeout(timeout)))
        for key, value in metadata:
            parts.append(wire.encode_field(*wire.metadata_field(key, value)))
        return b"".join(parts)

    def call(
        self, path: str, metadata: Metadata, timeout: float | None, message: bytes | None
    ) -> UpstreamCall:
        """Open a call; with ``message``, a unary one whose request is written at once."""
        call = UpstreamCall(self, unary=message is not None)
        block = self.header_frames(call.stream, self.headers_block(path, metadata, timeout), False)
        if message is None:
            self.write(block)
            return call
        if self.message_fits(call.stream, message):
            frame, body = self.message_frame(call.stream, message, True)
            self.write_all([block + frame, body])
        else:
            # The headers now: a stream's HEADERS must go out in the order of its id.
            self.write(block)
            sending = self.send_message(call.stream, message, True)
            task = asyncio.get_running_loop().create_task(sending)
            task.add_done_callback(_ignore_failure)
        return call


def _ignore_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # the call itself reports the broken connection


class H2Upstreams:
    """One HTTP/2 connection per instance, opened on first use and again after it broke."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        max_send_bytes: int,
        connect_timeout_s: float,
        request_timeout_s: float | None,
    ) -> None:
        self.fleet = fleet
        self.max_send_bytes = max_send_bytes
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._connections: dict[str, tuple[str, ClientConnection]] = {}
        self._connecting: dict[str, asyncio.Future[ClientConnection]] = {}
        self._retiring: set[ClientConnection] = set()

    def _open_connection(self, instance: Instance) -> ClientConnection | None:
        entry = self._connections.get(instance.name)
        if entry is not None and entry[1].usable and entry[0] == instance.spec.grpc:
            return entry[1]
        return None

    async def connection(self, instance: Instance) -> ClientConnection:
        target = grpc_target(instance)
        entry = self._connections.get(instance.name)
        if entry is not None and entry[0] == target and entry[1].usable:
            return entry[1]
        if entry is not None:
            self._retire(entry[1])
            del self._connections[instance.name]
        pending = self._connecting.get(instance.name)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._connecting[instance.name] = pending
            try:
                conn = await self._connect(target)
            except Exception as exc:
                pending.set_exception(exc)
                pending.exception()  # read: the waiters below get it too
                raise
            except BaseException:
                pending.cancel()
                raise
            finally:
                self._connecting.pop(instance.name, None)
            self._connections[instance.name] = (target, conn)
            pending.set_result(conn)
            return conn
        return await asyncio.shield(pending)

    async def _connect(self, target: str) -> ClientConnection:
        host, _, port = target.rpartition(":")
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: ClientConnection(target), host, int(port)
                )
        except (OSError, TimeoutError, ValueError) as exc:
            reason = (
                "Connection refused"
                if isinstance(exc, ConnectionRefusedError)
                else str(exc) or type(exc).__name__
            )
            raise rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                f"failed to connect to all addresses; last error: {target}: {reason}",
            ) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _retire(self, conn: ClientConnection) -> None:
        if conn.closed:
            return
        if not conn.streams:
            conn.close()
            return
        self._retiring.add(conn)

        async def close_when_idle() -> None:
            try:
                async with asyncio.timeout(RETIRE_MAX_S):
                    while conn.streams and not conn.closed:
                        await asyncio.sleep(0.05)
            except TimeoutError:
                pass
            conn.close()
            self._retiring.discard(conn)

        asyncio.get_running_loop().create_task(close_when_idle())

    async def unary(
        self,
        instance: Instance,
        method: str,
        request: bytes,
        metadata: Metadata,
        client_remaining: float | None,
    ) -> bytes:
        """One unary call; raises Upstream{Connect,Lost,Timeout}Error or Triton's
        ``AioRpcError`` (as :meth:`GrpcUpstreams.unary`)."""
        timeout = effective_timeout(client_remaining, self.request_timeout_s)
        ours = timeout is not None and timeout != client_remaining
        try:
            if len(request) > self.max_send_bytes:
                raise rpc_error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Sent message larger than max ({len(request)} vs. {self.max_send_bytes})",
                )
            conn = self._open_connection(instance) or await self.connection(instance)
            call = conn.call(method, metadata, timeout, request)
            # A timer, not asyncio.timeout: no task cancellation to undo on every call.
            timer = None
            if timeout is not None:
                timer = asyncio.get_running_loop().call_later(timeout, call.expire)
            try:
                return await call.result()
            except asyncio.CancelledError:
                call.cancel()  # the client went away: Triton should stop working on it too
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        except grpc.aio.AioRpcError as exc:
            failure = classified(exc, ours)
            if failure is exc:
                raise
            raise failure from exc

    def stream(
        self,
        instance: Instance,
        method: str,
        metadata: Metadata,
        client_remaining: float | None,
    ) -> _PendingStream:
        """Open a bidirectional call (connected on its first write); only the client's
        deadline applies, as in :meth:`GrpcUpstreams.stream`."""
        return _PendingStream(
            self, instance, method, metadata, effective_timeout(client_remaining, None)
        )

    async def retire(self, keep: set[str]) -> None:
        for name, (target, conn) in list(self._connections.items()):
            inst = self.fleet.instances.get(name)
            if name not in keep or inst is None or target != inst.spec.grpc:
                del self._connections[name]
                self._retire(conn)

    def retiring(self) -> int:
        return len(self._retiring)

    async def close(self) -> None:
        for _, conn in self._connections.values():
            conn.close()
        for conn in self._retiring:
            conn.close()
        self._connections.clear()
        self._retiring.clear()


class _PendingStream:
    """A stream call whose connection is made at its first write (``stream`` is not async)."""

    def __init__(
        self,
        upstreams: H2Upstreams,
        instance: Instance,
        method: str,
        metadata: Metadata,
        timeout: float | None,
    ) -> None:
        self._open = (upstreams, instance, method, metadata, timeout)
        self._call: UpstreamCall | None = None
        self._ready = asyncio.Event()
        self._cancelled = False
        self._timer: asyncio.TimerHandle | None = None

    async def _get(self) -> UpstreamCall:
        if self._call is None:
            if self._cancelled:
                raise asyncio.InvalidStateError("the call was cancelled")
            upstreams, instance, method, metadata, timeout = self._open
            conn = await upstreams.connection(instance)
            self._call = conn.call(method, metadata, timeout, None)
            if timeout is not None:
                self._timer = asyncio.get_running_loop().call_later(timeout, self._call.expire)
            self._ready.set()
        return self._call

    async def write(self, message: bytes) -> None:
        await (await self._get()).write(message)

    async def done_writing(self) -> None:
        if self._call is not None:
            await self._call.done_writing()
        self._ready.set()  # never written: nothing was sent, nothing will answer

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._answers()

    async def _answers(self) -> AsyncIterator[bytes]:
        await self._ready.wait()
        if self._call is None:
            return
        async for message in self._call:
            yield message

    def cancel(self) -> None:
        self._cancelled = True
        self._ready.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._call is not None:
            self._call.cancel()
