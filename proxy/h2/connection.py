"""One HTTP/2 connection over an asyncio transport: frames in, streams, flow control.

Both ends of the gRPC relay use it: :mod:`proxy.h2.server` for clients' connections and
:mod:`proxy.h2.client` for the connection to each Triton instance. What it owns: the
preface and SETTINGS exchange, PING answers, header blocks (HEADERS + CONTINUATION, decoded
by :class:`~proxy.h2.wire.BlockDecoder`), both directions' flow-control windows, RST_STREAM,
GOAWAY and the transport's write pressure. What a stream carries is its owner's business
(:class:`StreamOwner`).

A peer is not trusted: every length, window, stream id and count is checked, and a peer that
breaks the protocol loses the connection with GOAWAY (RFC 9113 §5.4.1). Bounds: a header
block (``MAX_HEADER_BLOCK``), queued control answers to a peer that does not read
(``MAX_CONTROL_BACKLOG``) and resets per second (``RESETS_PER_S``, the "rapid reset" attack).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

from proxy.h2 import wire
from proxy.h2.wire import H2Error

log = logging.getLogger(__name__)

MAX_HEADER_BLOCK = 64 * 1024
"""Largest header block accepted (HEADERS and its CONTINUATIONs), and header list size."""
MAX_CONTROL_BACKLOG = 1 << 20
"""Bytes of control answers (PING and SETTINGS acks, WINDOW_UPDATE) written to a peer that
does not read (while the transport is paused), before it is cut off. DATA this end chose to
send within the peer's window does not count: the peer granted that window."""
RESETS_PER_S = 200.0
RESET_BURST = 1000.0
MAX_FRAME_SIZE = 1 << 20
"""Largest frame this end accepts (SETTINGS_MAX_FRAME_SIZE): a large message in a few frames
instead of 16 KiB ones (each frame is a turn of Python); a partial frame is buffered, so this
also bounds what one connection buffers of it."""
LARGE_WRITE = 64 * 1024
"""From this size on, a message is written as it is rather than joined to its frames."""
CONNECTION_WINDOW = 16 << 20
"""The receive window this end grants a whole connection, at least."""


class StreamOwner(Protocol):
    def on_headers(self, headers: list[wire.Header], end_stream: bool) -> None: ...
    def on_data(self, data: wire.View, end_stream: bool) -> None: ...
    def on_reset(self, code: int) -> None: ...
    def on_lost(self, reason: str, unprocessed: bool) -> None:
        """The connection is gone (or GOAWAY said this stream was never processed)."""


class Stream:
    __slots__ = (
        "ended",
        "held",
        "id",
        "owner",
        "recv_unacked",
        "recv_window",
        "remote_ended",
        "send_window",
    )

    def __init__(self, stream_id: int, owner: StreamOwner, send_window: int, recv_window: int):
        self.id = stream_id
        self.owner = owner
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_unacked = 0
        self.held = 0
        """Bytes received on this stream whose connection window is not given back yet."""
        self.ended = False
        """Whether this end has sent END_STREAM (or RST_STREAM)."""
        self.remote_ended = False
        """Whether the peer has sent END_STREAM."""


class Inbox:
    """The gRPC messages a stream brings in, for one reader, and the window given back.

    DATA is cut into messages as it arrives. A unary call's bytes are granted back at once
    (its one message is bounded by the reader's size limit); a stream's only while fewer than
    ``READ_AHEAD`` messages wait to be read, so a peer whose messages are not read stops
    sending after a window's worth."""

    READ_AHEAD = 4

    def __init__(
        self,
        conn: Connection,
        stream: Stream,
        max_bytes: int,
        encoding: bytes | None = None,
        *,
        unary: bool,
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.unary = unary
        self.reader = wire.MessageReader(max_bytes, encoding)
        self.messages: deque[bytes] = deque()
        self._held = 0
        self._fed = 0
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: wire.View) -> None:
        """Take one DATA frame's bytes; raises ``wire.MessageTooLarge`` or ``ValueError``."""
        self._fed += len(data)
        if self.unary or len(self.messages) < self.READ_AHEAD:
            self.conn.grant(self.stream, len(data))
        else:
            self._held += len(data)
        self.messages.extend(self.reader.feed(data))
        self.wake()

    def take(self) -> bytes:
        message = self.messages.popleft()
        self.conn.consumed(self.stream, self._fed)
        self._fed = 0
        if self._held and len(self.messages) < self.READ_AHEAD:
            self.conn.grant(self.stream, self._held)
            self._held = 0
        return message

    def wake(self) -> None:
        """Let the reader look again (a message came, or the call ended)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class Connection(asyncio.Protocol):
    """The frame layer shared by both roles; subclasses decide what a new stream is."""

    is_client = False

    def __init__(
        self,
        *,
        stream_window: int,
        max_streams: int,
        connection_window: int = CONNECTION_WINDOW,
        hold_window: bool = False,
    ) -> None:
        self.stream_window = stream_window
        """The receive window this end grants each stream (SETTINGS_INITIAL_WINDOW_SIZE)."""
        self.connection_window = connection_window
        self.hold_window = hold_window
        """Give the connection's window back only as the streams' owners consume what came
        (``Inbox.take``) or the streams end: what one connection holds unread is bounded by
        ``connection_window``. Off: given back as it arrives (a trusted peer's answers)."""
        self.recv_window = connection_window
        self.max_streams = max_streams
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.decoder = wire.BlockDecoder(MAX_HEADER_BLOCK)
        self.peer_stream_window = wire.DEFAULT_WINDOW
        self.peer_frame_size = wire.DEFAULT_FRAME_SIZE
        self.send_window = wire.DEFAULT_WINDOW
        self.recv_unacked = 0
        self.closed = False
        self.goaway_from_peer: int | None = None
        """Last stream id the peer said it would process, once it sent GOAWAY."""
        self.last_peer_stream = 0
        self._parts: list[bytes] = []
        self._have = 0
        self._need = 9
        self._awaiting_preface = not self.is_client
        self._header_block: tuple[int, bool, list[bytes], int] | None = None
        self._window_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        self._control_backlog = 0
        """Bytes of control answers written since the transport last paused."""
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._reset_tokens = RESET_BURST
        self._reset_clock = 0.0

    # --- lifecycle ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = [
            (wire.ENABLE_PUSH, 0),
            (wire.MAX_CONCURRENT_STREAMS, self.max_streams),
            (wire.INITIAL_WINDOW_SIZE, self.stream_window),
            (wire.MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK),
            (wire.MAX_FRAME_SIZE, MAX_FRAME_SIZE),
        ]
        opening = wire.PREFACE if self.is_client else b""
        opening += wire.settings_frame(settings)
        opening += wire.window_update(0, self.connection_window - wire.DEFAULT_WINDOW)
        transport.write(opening)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reason = str(exc) if exc is not None else "Socket closed"
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.owner.on_lost(f"Connection lost: {reason}", False)
        self._wake(self._window_waiters)
        self._wake(self._drain_waiters)

    def fail(self, code: int, message: str) -> None:
        """End the connection for a protocol error of the peer's (GOAWAY, then close)."""
        if self.closed or self.transport is None:
            return
        log.info("HTTP/2 connection error %d: %s", code, message)
        self.transport.write(wire.goaway(self.last_peer_stream, code, message.encode()[:256]))
        self.transport.close()
        self.connection_lost(ConnectionError(message))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(wire.goaway(self.last_peer_stream, wire.NO_ERROR))
            self.transport.close()

    def pause_writing(self) -> None:
        self._paused = True
        self._control_backlog = 0

    def resume_writing(self) -> None:
        self._paused = False
        self._wake(self._drain_waiters)

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        waiters.clear()

    async def _wait(self, waiters: list[asyncio.Future[None]]) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        await waiter
        if self.closed:
            raise ConnectionError("connection closed")

    # --- reading --------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        # Reads are kept as they come and joined once a frame is whole (a 1 MiB frame comes
        # in many reads; joining at every read copied it over and over).
        self._parts.append(data)
        self._have += len(data)
        if self._have < self._need:
            return
        buf = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        view = memoryview(buf)
        pos, end = 0, len(buf)
        need = 9
        if self._awaiting_preface:
            if buf[: len(wire.PREFACE)] != wire.PREFACE[:end]:
                self.fail(wire.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if end < len(wire.PREFACE):
                self._parts, self._have, self._need = [buf], end, len(wire.PREFACE)
                return
            self._awaiting_preface = False
            pos = len(wire.PREFACE)
        try:
            while end - pos >= 9 and not self.closed:
                n = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if n > MAX_FRAME_SIZE:
                    raise H2Error(wire.FRAME_SIZE_ERROR, f"frame of {n} bytes")
                need = 9 + n
                if end - pos < need:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                # A large payload as a view (copied once, into its message), a small one
                # as bytes (cheaper to slice than to view: measured).
                payload = (
                    view[pos + 9 : pos + need] if n >= LARGE_WRITE else buf[pos + 9 : pos + need]
                )
                pos += need
                need = 9
                self._frame(kind, flags, stream, payload)
        except H2Error as exc:
            self.fail(exc.code, str(exc))
            return
        rest = buf[pos:] if pos else buf
        self._parts = [rest] if rest else []
        self._have = len(rest)
        self._need = need

    def _frame(self, kind: int, flags: int, stream_id: int, payload: wire.View) -> None:
        if self._header_block is not None and kind != wire.CONTINUATION:
            raise H2Error(wire.PROTOCOL_ERROR, "header block interrupted")
        if kind == wire.DATA:
            self._data(flags, stream_id, payload)
        elif kind == wire.HEADERS:
            if stream_id == 0:
                raise H2Error(wire.PROTOCOL_ERROR, "HEADERS on stream 0")
            fragment = bytes(wire.unpad(flags, payload))
            if flags & wire.PRIORITY_FLAG:
                fragment = fragment[5:]
            self._header_block = (stream_id, bool(flags & wire.END_STREAM), [], 0)
            self._fragment(flags, fragment)
        elif kind == wire.CONTINUATION:
            if self._header_block is None or self._header_block[0] != stream_id:
                raise H2Error(wire.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._fragment(flags, bytes(payload))
        elif kind == wire.SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == wire.WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == wire.PING:
            if stream_id != 0 or len(payload) != 8:
                raise H2Error(wire.PROTOCOL_ERROR, "malformed PING")
            if not flags & wire.ACK:
                self._control(wire.frame(wire.PING, wire.ACK, 0, bytes(payload)))
        elif kind == wire.RST_STREAM:
            if stream_id == 0 or len(payload) != 4:
                raise H2Error(wire.PROTOCOL_ERROR, "malformed RST_STREAM")
            self._rst_stream(stream_id, int.from_bytes(payload, "big"))
        elif kind == wire.GOAWAY:
            if stream_id != 0 or len(payload) < 8:
                raise H2Error(wire.PROTOCOL_ERROR, "malformed GOAWAY")
            self._goaway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF)
        elif kind == wire.PUSH_PROMISE:
            raise H2Error(wire.PROTOCOL_ERROR, "PUSH_PROMISE, though push is disabled")
        elif kind == wire.PRIORITY and len(payload) != 5:
            raise H2Error(wire.FRAME_SIZE_ERROR, "malformed PRIORITY")
        # Unknown frame types are ignored (RFC 9113 §4.1).

    def _fragment(self, flags: int, fragment: bytes) -> None:
        assert self._header_block is not None
        sid, end_stream, parts, size = self._header_block
        parts.append(fragment)
        size += len(fragment)
        if size > MAX_HEADER_BLOCK:
            raise H2Error(wire.ENHANCE_YOUR_CALM, f"header block over {MAX_HEADER_BLOCK} bytes")
        if not flags & wire.END_HEADERS:
            self._header_block = (sid, end_stream, parts, size)
            return
        self._header_block = None
        headers = self.decoder.decode(parts[0] if len(parts) == 1 else b"".join(parts))
        stream = self.streams.get(sid)
        if stream is None:
            self.unknown_headers(sid, headers, end_stream)
        else:
            stream.owner.on_headers(headers, end_stream)
            self._maybe_forget(stream, end_stream)

    def _data(self, flags: int, stream_id: int, payload: wire.View) -> None:
        if stream_id == 0:
            raise H2Error(wire.PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        self.recv_window -= n
        if self.recv_window < 0:
            raise H2Error(wire.FLOW_CONTROL_ERROR, "connection window exceeded")
        stream = self.streams.get(stream_id)
        if stream is None:
            self._give_back(n)
            self.unknown_stream(stream_id)
            return
        if self.hold_window:
            stream.held += n
        else:
            self._give_back(n)
        stream.recv_window -= n
        if stream.recv_window < 0:
            self._abandon(stream, wire.FLOW_CONTROL_ERROR)
            return
        end_stream = bool(flags & wire.END_STREAM)
        stream.owner.on_data(wire.unpad(flags, payload), end_stream)
        self._maybe_forget(stream, end_stream)

    def _give_back(self, n: int) -> None:
        self.recv_unacked += n
        if self.recv_unacked >= self.connection_window // 2:
            self._control(wire.window_update(0, self.recv_unacked))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0

    def consumed(self, stream: Stream, n: int) -> None:
        """The owner of ``stream`` has taken ``n`` bytes of it: the connection may bring more."""
        n = min(n, stream.held)
        if n > 0:
            stream.held -= n
            self._give_back(n)

    def forget(self, stream: Stream) -> None:
        """The stream is over on both sides (or reset): what it held goes back to the window."""
        if self.streams.pop(stream.id, None) is not None and stream.held:
            self._give_back(stream.held)
            stream.held = 0

    def grant(self, stream: Stream, n: int) -> None:
        """The owner consumed ``n`` bytes of ``stream``: let the peer send that much more."""
        stream.recv_unacked += n
        if stream.recv_unacked >= self.stream_window // 2 and stream.id in self.streams:
            stream.recv_window += stream.recv_unacked
            self._control(wire.window_update(stream.id, stream.recv_unacked))
            stream.recv_unacked = 0

    def _settings(self, flags: int, stream_id: int, payload: wire.View) -> None:
        if stream_id != 0:
            raise H2Error(wire.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & wire.ACK:
            if payload:
                raise H2Error(wire.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        for key, value in wire.parse_settings(payload):
            if key == wire.INITIAL_WINDOW_SIZE:
                if value > wire.MAX_WINDOW:
                    raise H2Error(wire.FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta = value - self.peer_stream_window
                self.peer_stream_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == wire.MAX_FRAME_SIZE:
                if not wire.DEFAULT_FRAME_SIZE <= value < 1 << 24:
                    raise H2Error(wire.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.peer_frame_size = value
            elif key == wire.ENABLE_PUSH and value > 1:
                raise H2Error(wire.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
        self._control(wire.frame(wire.SETTINGS, wire.ACK, 0))
        self._wake(self._window_waiters)

    def _window_update(self, stream_id: int, payload: wire.View) -> None:
        if len(payload) != 4:
            raise H2Error(wire.FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise H2Error(wire.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > wire.MAX_WINDOW:
                raise H2Error(wire.FLOW_CONTROL_ERROR, "connection window over 2^31-1")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                return
            stream.send_window += increment
            if increment == 0 or stream.send_window > wire.MAX_WINDOW:
                self._abandon(stream, wire.FLOW_CONTROL_ERROR)
                return
        self._wake(self._window_waiters)

    def _rst_stream(self, stream_id: int, code: int) -> None:
        now = asyncio.get_running_loop().time()
        self._reset_tokens = min(
            RESET_BURST, self._reset_tokens + (now - self._reset_clock) * RESETS_PER_S
        )
        self._reset_clock = now
        self._reset_tokens -= 1
        if self._reset_tokens < 0:
            raise H2Error(wire.ENHANCE_YOUR_CALM, "too many stream resets")
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.forget(stream)
            stream.ended = True
            stream.owner.on_reset(code)
            self._wake(self._window_waiters)

    def _goaway(self, last_stream: int) -> None:
        self.goaway_from_peer = last_stream
        for sid, stream in list(self.streams.items()):
            if self.is_client and sid > last_stream:
                self.forget(stream)
                stream.owner.on_lost("GOAWAY received", True)

    def _control(self, data: bytes) -> None:
        """Write a control answer; a peer that makes them pile up unread is cut off.

        Counted are the control answers written while the transport is paused, not the
        transport's whole buffer: a stream's large answer, sent within the window the peer
        granted, fills the buffer of a peer that reads slowly, and counting it cut such a
        peer off at the next WINDOW_UPDATE (a 9 MiB streamed answer, on a loaded machine:
        tests/middle/test_h2.py, session 32)."""
        assert self.transport is not None
        if self._paused:
            self._control_backlog += len(data)
            if self._control_backlog > MAX_CONTROL_BACKLOG:
                raise H2Error(wire.ENHANCE_YOUR_CALM, "control frames piling up unread")
        self.transport.write(data)

    def _maybe_forget(self, stream: Stream, end_stream: bool) -> None:
        if end_stream:
            stream.remote_ended = True
            if stream.ended:
                self.forget(stream)

    # --- for subclasses -------------------------------------------------------------------
    def unknown_headers(self, stream_id: int, headers: list[wire.Header], end_stream: bool) -> None:
        """HEADERS on a stream not open here: a new one (server), or one this end already
        forgot (it reset it; the peer's frames were on their way)."""
        raise H2Error(wire.PROTOCOL_ERROR, f"unexpected HEADERS on stream {stream_id}")

    def unknown_stream(self, stream_id: int) -> None:
        """DATA for a stream this end has forgotten (reset, or ended both ways)."""
        if stream_id > self.last_peer_stream and not self.is_client:
            raise H2Error(wire.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")

    # --- writing --------------------------------------------------------------------------
    def open(self, stream_id: int, owner: StreamOwner) -> Stream:
        stream = Stream(stream_id, owner, self.peer_stream_window, self.stream_window)
        self.streams[stream_id] = stream
        return stream

    def header_frames(self, stream: Stream, block: bytes, end_stream: bool) -> bytes:
        """HEADERS (+ CONTINUATION) frames carrying ``block``."""
        if end_stream:
            self.end(stream)
        size = self.peer_frame_size
        flags = wire.END_STREAM if end_stream else 0
        if len(block) <= size:
            return wire.frame(wire.HEADERS, flags | wire.END_HEADERS, stream.id, block)
        chunks = [block[i : i + size] for i in range(0, len(block), size)]
        out = [wire.frame(wire.HEADERS, flags, stream.id, chunks[0])]
        for chunk in chunks[1:-1]:
            out.append(wire.frame(wire.CONTINUATION, 0, stream.id, chunk))
        out.append(wire.frame(wire.CONTINUATION, wire.END_HEADERS, stream.id, chunks[-1]))
        return b"".join(out)

    def data_fits(self, stream: Stream, n: int) -> bool:
        """Whether ``n`` bytes of DATA can go now in one frame, windows and writes allowing."""
        return (
            not self._paused
            and n <= self.peer_frame_size
            and n <= stream.send_window
            and n <= self.send_window
        )

    def _spend(self, stream: Stream, n: int, end_stream: bool) -> int:
        """Take ``n`` bytes of DATA off both send windows; the frame's flags."""
        stream.send_window -= n
        self.send_window -= n
        if end_stream:
            self.end(stream)
            return wire.END_STREAM
        return 0

    def data_frame(self, stream: Stream, data: bytes, end_stream: bool) -> bytes:
        """One DATA frame that ``data_fits``."""
        return wire.frame(wire.DATA, self._spend(stream, len(data), end_stream), stream.id, data)

    def message_fits(self, stream: Stream, message: bytes) -> bool:
        """Whether one gRPC message can go now in one DATA frame."""
        return self.data_fits(stream, len(message) + 5)

    def message_frame(self, stream: Stream, message: bytes, end_stream: bool) -> list[bytes]:
        """One DATA frame carrying one gRPC message that ``message_fits``, as buffers for
        :meth:`write_all`: the message itself is not copied (a 1 MiB tensor was copied three
        times over on its way out when frames were built by concatenation)."""
        n = len(message) + 5
        flags = self._spend(stream, n, end_stream)
        head = wire.frame_header(wire.DATA, flags, stream.id, n) + wire.message_prefix(len(message))
        return [head, message]

    async def send_message(
        self, stream: Stream, message: bytes, end_stream: bool, head: bytes = b""
    ) -> None:
        """Write one gRPC message (after ``head``, frames already built): in one write when
        it fits, else as the windows allow."""
        if self.message_fits(stream, message):
            frame, body = self.message_frame(stream, message, end_stream)
            self.write_all([head + frame, body])
            return
        if head:
            self.write(head)
        await self.send_data(stream, wire.message_prefix(len(message)) + message, end_stream)

    def write_all(self, buffers: list[bytes]) -> None:
        """Write ``buffers`` in order: joined when small (one write is cheaper than a gather),
        as they are when large (no copy)."""
        if self.transport is None or self.closed:
            return
        if sum(map(len, buffers)) < LARGE_WRITE:
            self.transport.write(b"".join(buffers))
        else:
            self.transport.writelines(buffers)

    def end(self, stream: Stream) -> None:
        """This end sent END_STREAM; the stream is forgotten once the peer's side ended too."""
        stream.ended = True
        if stream.remote_ended:
            self.forget(stream)

    async def send_data(self, stream: Stream, data: bytes, end_stream: bool) -> None:
        """Write ``data`` as DATA frames as the peer's windows and our transport allow."""
        view = memoryview(data)
        while True:
            if self.closed:
                raise ConnectionError("connection closed")
            if stream.id not in self.streams:
                raise ConnectionResetError("stream reset")
            if self._paused:
                await self._wait(self._drain_waiters)
                continue
            n = min(len(view), self.peer_frame_size, stream.send_window, self.send_window)
            if n <= 0 and len(view):
                await self._wait(self._window_waiters)
                continue
            last = n == len(view)
            assert self.transport is not None
            self.transport.write(self.data_frame(stream, bytes(view[:n]), end_stream and last))
            view = view[n:]
            if last:
                return

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _abandon(self, stream: Stream, code: int) -> None:
        """The peer broke ``stream``'s rules: reset it, and tell its owner."""
        self.reset(stream, code)
        stream.owner.on_reset(code)

    def reset(self, stream: Stream, code: int) -> None:
        """RST_STREAM: this end abandons ``stream``."""
        if stream.id in self.streams:
            self.forget(stream)
            stream.ended = True
            self.write(wire.rst_stream(stream.id, code))
            self._wake(self._window_waiters)
