"""A lean HTTP/1.1 server for the proxy's public HTTP port.

Why not aiohttp's server: per request it builds a ``BaseRequest``, a URL object, a match info,
a middleware chain and a ``StreamResponse`` whose ``prepare``/``write_eof`` go through its
payload writer; py-spy put that machinery at about a quarter of the proxy's CPU per HTTP
request (docs/benchmarks.md, "Speed"). A proxy that forwards bytes needs much less. One
:class:`asyncio.Protocol` per connection feeds ``httptools``' request parser (llhttp, in C) and
hands the application a :class:`Request` whose body is already read in full; the application
answers with a :class:`Response` (written with one ``writelines``, ``Content-Length`` set) or
a :class:`Stream` (chunked transfer encoding, for server-sent events).

What it supports:

- HTTP/1.1 keep-alive and HTTP/1.0 (closed after the answer unless it asked for keep-alive);
  ``Connection: close``; pipelined requests, answered in order; an idle connection (no request
  in progress) is closed after :data:`KEEPALIVE_TIMEOUT_S`;
- request bodies by ``Content-Length`` or chunked; ``Content-Encoding: gzip``/``deflate``
  decoded as they arrive (other encodings are handed over as sent); the decoded size is bounded
  by the application's :class:`BodyHold` (the proxy's byte budget and ``max_body_bytes``), so a
  zip bomb is refused once its decompressed bytes pass the limit;
- ``Expect: 100-continue``: the interim 100 is sent only once the application admitted the
  body (:meth:`Application.open_body`); a refused body is answered without it;
- a client that disconnects cancels the handler of its request in progress;
- graceful shutdown: :meth:`HttpServer.stop_listening` closes the listeners and the idle
  connections, busy ones close after their answer; :meth:`HttpServer.close` cuts the rest.

What it refuses, answered 400 in Triton's error format (``{"error": "..."}``) and followed by
closing the connection: anything llhttp cannot parse (bad request line or header, bad chunking,
``Content-Length`` with ``Transfer-Encoding``...), a request target or header field over
:data:`MAX_FIELD_BYTES`, more than :data:`MAX_HEADERS` headers, a head over
:data:`MAX_HEAD_BYTES`, a body that ends early or does not decode. Upgrades (``CONNECT``,
``Upgrade:``) are not supported: the request is answered as any other (the route table refuses
non-origin-form targets), then the connection closes. Not supported either: TLS, HTTP/2,
trailers (ignored), request bodies handed over before they are complete.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http
import logging
import zlib
from collections.abc import Iterable
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import Code, ProxyError
from proxy.listener import Listener, listen

log = logging.getLogger(__name__)

KEEPALIVE_TIMEOUT_S = 75.0
"""An idle connection (no request in progress, nothing received) is closed after this."""
MAX_FIELD_BYTES = 8190
"""Longest request target, header name or header value (aiohttp's limits, as before)."""
MAX_HEADERS = 128
MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line and headers)."""
MAX_PIPELINED = 16
"""Complete requests waiting behind the one being answered before reading pauses."""
LINGER_S = 2.0
"""After an answer that ends the connection early (a refused or malformed request), input is
read and dropped this long before the socket closes, so that the client, still sending, reads
the answer instead of a reset."""

_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
_JSON = (("Content-Type", "application/json"),)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INFLATE_STEP = 1 << 20


class BodyHold(Protocol):
    """Bytes of one request body held against the application's limits."""

    @property
    def nbytes(self) -> int: ...

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` more (decoded bytes as they arrive); raise :class:`ProxyError` to
        refuse the body."""

    def release(self) -> None:
        """Called once, whatever way the request ends."""


class Application(Protocol):
    def open_body(self, request: Request) -> BodyHold:
        """Admit the body of ``request`` (its head is complete; ``content_length`` is None
        for a chunked body), or raise :class:`ProxyError` to refuse it before it is read."""

    async def handle(self, request: Request) -> Response | Stream:
        """The answer to a complete request; a :class:`ProxyError` raised is answered in
        Triton's format."""


class Response:
    """A complete answer; ``Content-Length`` is set from ``body``."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self, status: int = 200, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        self.status = status
        self.body = body
        self.headers = headers


def error_response(exc: ProxyError) -> Response:
    """``exc`` in Triton's error format, with ``Retry-After`` when it says when to retry."""
    headers: Iterable[tuple[str, str]] = _JSON
    if exc.retry_after_s is not None:
        headers = (*_JSON, ("Retry-After", str(max(1, round(exc.retry_after_s)))))
    return Response(exc.code.http_status, exc.body(), headers)


def _bad_request(message: str) -> ProxyError:
    return ProxyError(Code.INVALID_ARG, message)


def _encode_head(text: str) -> bytes:
    # Header values relayed from upstream are latin-1 (proxy.fleet.http1) or UTF-8 with
    # surrogate escapes (aiohttp's client): both give back the bytes they were read from.
    try:
        return text.encode("latin-1", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape")


def _head(
    status: int, headers: Iterable[tuple[str, str]], framing: str, keep_alive: bool, v10: bool
) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers]
    lines.append(framing)
    if not keep_alive:
        lines.append("Connection: close\r\n")
    elif v10:
        lines.append("Connection: keep-alive\r\n")
    lines.append("\r\n")
    return _encode_head("".join(lines))


class Request:
    """One request, its body read in full (decoded when it came gzip/deflate-encoded)."""

    __slots__ = (
        "_conn",
        "_hold",
        "answered",
        "body",
        "client_left",
        "content_length",
        "headers",
        "hold_on_leave",
        "keep_alive",
        "method",
        "stream",
        "target",
        "version",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        target: str,
        version: str,
        headers: CIMultiDictProxy[str],
        keep_alive: bool,
        content_length: int | None,
    ) -> None:
        self._conn = conn
        self.method = method
        self.target = target
        """The raw request target, as sent (UTF-8, undecodable bytes surrogate-escaped)."""
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.body = b""
        self._hold: BodyHold | None = None
        self.stream: Stream | None = None
        self.hold_on_leave = False
        """Set by the handler once its work cannot be called back (an inference request sent
        to Triton, which does not notice a closed connection, server issue #7077): when the
        client leaves, the handler is no longer cancelled but runs to its end, and its answer
        goes nowhere. Before that, a client that leaves cancels the handler at once."""
        self.client_left = False
        """The client closed the connection while this request was being answered."""
        self.answered = False
        """Its answer was written by :meth:`answer_now`: whatever the handler returns or raises
        afterwards is not written."""

    def start_stream(self, status: int, headers: Iterable[tuple[str, str]]) -> Stream:
        """Send the head of a streamed answer; the handler writes it, ends it and returns it."""
        self.stream = Stream(self._conn, self, status, headers)
        return self.stream

    def answer_now(self, answer: Response | Stream) -> None:
        """Write ``answer`` before the handler returns (it must return the same answer): work
        the handler does after it runs off the client's clock. Does nothing for a streamed
        answer (it is written as it goes), a request answered already, or a connection gone."""
        conn = self._conn
        if not isinstance(answer, Response) or self.answered or conn._answering is not self:
            return
        self.answered = True
        with contextlib.suppress(ConnectionError):
            conn._write_response(self, answer)

    def _release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()


class Stream:
    """A streamed answer: each :meth:`write` is sent at once (one chunk), with backpressure."""

    __slots__ = ("_chunked", "_conn", "ended", "status")

    def __init__(
        self,
        conn: _Connection,
        request: Request,
        status: int,
        headers: Iterable[tuple[str, str]],
    ) -> None:
        self._conn = conn
        self.status = status
        self.ended = False
        # HTTP/1.0 has no chunked encoding: the answer ends when the connection closes.
        self._chunked = request.version != "1.0"
        if not self._chunked:
            request.keep_alive = False
        framing = "Transfer-Encoding: chunked\r\n" if self._chunked else ""
        conn.write(_head(status, headers, framing, request.keep_alive, request.version == "1.0"))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self._chunked:
            self._conn.write_parts((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            self._conn.write(data)
        await self._conn.drain()

    async def end(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.ended = True
        await self._conn.drain()


class _Stop(Exception):
    """Stops the parser from a callback; the reason is in the connection's state."""


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._app = server.app
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: collections.deque[tuple[Request, Response | None]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._answering: Request | None = None
        self._busy = False
        """A request is being answered (``_task`` runs it)."""
        self._closing = False
        """No more requests are read: close once the queue is answered."""
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        self._last_seen = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._continue_when_idle = False
        # The message being parsed.
        self._url: list[bytes] = []
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._in_head = False
        self._head_began = False
        self._head_bytes = 0
        self._request: Request | None = None
        self._chunks: list[bytes] = []
        self._received = 0
        self._decoder: zlib._Decompress | None = None
        self._encoding = ""
        self._inflating = False
        self._refusal: ProxyError | None = None
        self._linger_after = False
        """The connection ends with a refusal: linger (:meth:`_linger`) instead of closing."""

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they work all the same.
        self._transport = transport  # type: ignore[assignment]
        self._server.connections.add(self)
        self._last_seen = self._loop.time()
        self._idle_timer = self._loop.call_at(
            self._last_seen + KEEPALIVE_TIMEOUT_S, self._check_idle
        )

    def connection_lost(self, exc: BaseException | None) -> None:
        self._server.connections.discard(self)
        self._closing = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        # The client left: its handler stops (docs/cancellation.md), unless it holds on.
        answering = self._answering
        if answering is not None:
            answering.client_left = True
        held = answering is not None and answering.hold_on_leave
        if self._task is not None and not self._task.done() and not held:
            self._task.cancel()
        self._drop_queue()
        if self._request is not None:
            self._request._release()
            self._request = None
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("connection lost"))
            self._drain_waiter.exception()  # retrieved: nobody else may wait on it

    def eof_received(self) -> bool:
        # A client that closed its side has left, as far as can be told: a socket closed
        # entirely shows only this end of input until something is written to it. Its handler
        # is cancelled (the transport closes, then connection_lost), as with aiohttp's server.
        return False

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._last_seen = self._loop.time()
        if self._closing:
            return  # lingering, or done reading: dropped
        self._head_began = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The request (CONNECT, or one with Upgrade) was queued: it is answered, then
            # the connection closes; nothing after it is read.
            self._stop_reading()
            if not self._busy:
                self._next()
        except httptools.HttpParserError as exc:
            refusal, self._refusal = self._refusal, None
            if refusal is None:
                refusal = _bad_request(f"malformed HTTP request: {exc}")
            self._refuse(refusal)
            return
        if self._in_head and not self._head_began:
            # All of this read belongs to the head still incomplete (one that began within
            # this read is counted from the next: at most one read more than the limit).
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(_bad_request(f"request head over {MAX_HEAD_BYTES} bytes"))
                return
        if len(self._queue) > MAX_PIPELINED and not self._read_paused:
            self._read_paused = True
            assert self._transport is not None
            self._transport.pause_reading()

    # -- httptools callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_began = True
        self._head_bytes = 0
        self._url.clear()
        self._headers = CIMultiDict()
        self._chunks = []
        self._received = 0
        self._decoder = None
        self._inflating = False

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        if sum(map(len, self._url)) > MAX_FIELD_BYTES:
            self._stop(_bad_request(f"request target over {MAX_FIELD_BYTES} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_FIELD_BYTES or len(value) > MAX_FIELD_BYTES:
            self._stop(_bad_request(f"header field over {MAX_FIELD_BYTES} bytes"))
        if len(self._headers) >= MAX_HEADERS:
            self._stop(_bad_request(f"more than {MAX_HEADERS} headers"))
        self._headers.add(
            name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
        )

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        headers = self._headers
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        length_text = headers.get("Content-Length")
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        length = None
        if length_text is not None and not chunked:
            # llhttp refused lengths that are not digits, or beside Transfer-Encoding.
            try:
                length = int(length_text)
            except ValueError:
                self._stop(_bad_request(f"bad Content-Length {length_text[:32]!r}"))
        version = parser.get_http_version()
        request = Request(
            self,
            parser.get_method().decode("ascii", "replace"),
            url.decode("utf-8", "surrogateescape"),
            version,
            CIMultiDictProxy(headers),
            parser.should_keep_alive() and not self._closing,
            length,
        )
        self._request = request
        if not (chunked or length):
            return
        try:
            request._hold = self._app.open_body(request)
        except ProxyError as exc:
            # Answered without reading the body; the connection then closes.
            self._request = None
            self._stop(exc)
        self._received = 0
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._encoding = encoding
            self._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS if "gzip" in encoding else 0)
        expect = headers.get("Expect")
        if expect is not None and expect.lower() == "100-continue" and version != "1.0":
            if self._busy or self._queue:
                self._continue_when_idle = True  # after the answers before it
            else:
                self.write(_CONTINUE)

    def on_body(self, data: bytes) -> None:
        decoder = self._decoder
        if decoder is None:
            self._take(data)
            return
        if not self._inflating and self._encoding == "deflate" and data and data[0] & 0x0F != 8:
            # A raw deflate stream without the zlib header (aiohttp accepted it too).
            decoder = self._decoder = zlib.decompressobj(-zlib.MAX_WBITS)
        self._inflating = True
        try:
            while data:
                # In steps of at most _INFLATE_STEP bytes, each held before the next: a zip
                # bomb is refused once it passes the limit, not after it was inflated.
                piece = decoder.decompress(data, _INFLATE_STEP)
                data = decoder.unconsumed_tail
                self._take(piece)
        except zlib.error as exc:
            self._stop(_bad_request(f"could not read the request body: {exc}"))

    def _take(self, data: bytes) -> None:
        request = self._request
        assert request is not None and request._hold is not None
        self._received += len(data)
        hold = request._hold
        if self._received > hold.nbytes:
            try:
                hold.grow(self._received - hold.nbytes)
            except ProxyError as exc:
                self._stop(exc)
        if data:
            self._chunks.append(data)

    def on_message_complete(self) -> None:
        request = self._request
        self._request = None
        if request is None:
            return
        if self._decoder is not None and not self._decoder.eof:
            request._release()
            self._stop(
                _bad_request(
                    "could not read the request body: it ends before its "
                    f"{self._encoding} stream does"
                )
            )
        chunks = self._chunks
        request.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._enqueue(request, None)

    def _stop(self, refusal: ProxyError) -> None:
        self._refusal = refusal
        raise _Stop

    # -- answering ---------------------------------------------------------------------
    def _refuse(self, refusal: ProxyError) -> None:
        """Answer ``refusal`` after what is queued, then close: nothing more is read."""
        request = self._request
        self._request = None
        if request is None:
            request = Request(self, "GET", "", "1.1", CIMultiDictProxy(CIMultiDict()), False, 0)
        else:
            request._release()
        request.keep_alive = False
        self._stop_reading()
        self._linger_after = True
        self._enqueue(request, error_response(refusal))

    def _stop_reading(self) -> None:
        self._closing = True

    def _enqueue(self, request: Request, ready: Response | None) -> None:
        self._queue.append((request, ready))
        if not self._busy:
            self._next()

    def _next(self) -> None:
        """Start answering the first queued request, or close or go idle."""
        if self._queue:
            self._busy = True
            request, ready = self._queue.popleft()
            self._answering = request
            self._task = self._loop.create_task(self._answer(request, ready))
            if self._read_paused and len(self._queue) <= MAX_PIPELINED // 2:
                self._read_paused = False
                assert self._transport is not None
                self._transport.resume_reading()
            return
        self._busy = False
        self._task = None
        self._answering = None
        self._last_seen = self._loop.time()  # idle from now on
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._closing:
            if self._linger_after:
                self._linger()
            else:
                transport.close()
        elif self._continue_when_idle:
            self._continue_when_idle = False
            self.write(_CONTINUE)

    async def _answer(self, request: Request, ready: Response | None) -> None:
        answer: Response | Stream
        try:
            if ready is not None:
                answer = ready
            else:
                try:
                    answer = await self._app.handle(request)
                except ProxyError as exc:
                    answer = error_response(exc)
                finally:
                    request._release()
            if isinstance(answer, Response):
                if not request.answered:
                    self._write_response(request, answer)
            elif not answer.ended:
                # Headers are sent, so no error can follow: the client sees the answer cut
                # short, as it would from the server itself.
                request.keep_alive = False
        except (asyncio.CancelledError, ConnectionError):
            return  # the connection is gone: connection_lost cleans up
        except Exception:
            log.exception("unexpected error answering %s %s", request.method, request.target[:200])
            if request.stream is None and not request.answered:
                self._write_response(
                    request, error_response(ProxyError(Code.INTERNAL, "internal proxy error"))
                )
            request.keep_alive = False
        if not request.keep_alive:
            # Connection: close, HTTP/1.0, a stream cut short: nothing after it is answered.
            self._stop_reading()
            self._drop_queue()
        self._next()

    def _drop_queue(self) -> None:
        while self._queue:
            self._queue.popleft()[0]._release()

    def _write_response(self, request: Request, response: Response) -> None:
        body = response.body
        status = response.status
        if request.method == "HEAD" or status in (204, 304):
            framing = f"Content-Length: {len(body)}\r\n" if status != 204 else ""
            body = b""
        else:
            framing = f"Content-Length: {len(body)}\r\n"
        if self._closing and not self._queue:
            request.keep_alive = False  # the last answer on this connection
        head = _head(
            status, response.headers, framing, request.keep_alive, request.version == "1.0"
        )
        self.write_parts((head, body) if body else (head,))

    # -- writing -----------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("connection closed")
        transport.write(data)

    def write_parts(self, parts: tuple[bytes, ...]) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("connection closed")
        transport.writelines(parts)

    async def drain(self) -> None:
        if not self._write_paused:
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("connection closed")
        self._drain_waiter = self._loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    # -- closing -----------------------------------------------------------------------
    def _linger(self) -> None:
        """Half-close after an answer that ends the connection early; drop what still comes."""
        transport = self._transport
        assert transport is not None
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(LINGER_S, transport.close)

    def _check_idle(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        now = self._loop.time()
        due = self._last_seen + KEEPALIVE_TIMEOUT_S
        if not self._busy and not self._queue and now >= due:
            transport.close()
            return
        if self._busy or self._queue:
            due = now + KEEPALIVE_TIMEOUT_S
        self._idle_timer = self._loop.call_at(due, self._check_idle)

    def shutdown(self) -> None:
        """Read no more requests; close now if idle, else after the answer in progress."""
        self._stop_reading()
        self._continue_when_idle = False
        self._drop_queue()
        if not self._busy:
            if self._request is not None:
                self._request._release()
                self._request = None
            assert self._transport is not None
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task


class HttpServer:
    """Listens on one port and serves :class:`Application` over HTTP/1.1."""

    def __init__(self, app: Application) -> None:
        self.app = app
        self.connections: set[_Connection] = set()
        self._servers: list[Listener] = []
        self.port: int | None = None

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 128
    ) -> int:
        """Listen on ``host``:``port`` (0: any free port); returns the bound port."""
        server = await listen(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_port=reuse_port
        )
        self._servers.append(server)
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    def stop_listening(self) -> None:
        """No new connection; idle ones close now, busy ones after their answer."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()

    async def close(self, timeout_s: float = 1.0) -> None:
        """Stop listening, wait up to ``timeout_s`` for answers in progress, cut the rest."""
        self.stop_listening()
        tasks = [t for c in self.connections if (t := c.task) is not None and not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for conn in list(self.connections):
            conn.abort()
        for server in self._servers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await server.wait_closed()
        self._servers.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
