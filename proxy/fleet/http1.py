"""A small HTTP/1.1 client for the proxy's non-streaming upstream requests.

Why not aiohttp's client here: per forwarded request it builds a ``ClientRequest`` and a
``ClientResponse``, a timer context, trace hooks, a cookie filter and a header multidict, and
parses the URL; under closed-loop load that was 30-36 % of the proxy's CPU samples (py-spy,
docs/benchmarks.md "Speed"). A proxy that forwards bytes needs none of it: it writes one request
(head and body in one ``writelines``) on a kept-alive connection and reads one response (status,
headers, a ``Content-Length`` or chunked body). Streaming answers (``generate_stream``) still go
through aiohttp, which relays chunks as they come.

Failure semantics match :func:`proxy.fleet.upstream.http_failure` on the aiohttp path: no
connection (refused, flagged ``refused``; or a connect timeout) is :class:`UpstreamConnectError`
(safe to retry elsewhere); a connection that breaks after the request was written, or an idle
kept-alive connection the server had closed, is :class:`UpstreamLostError` with
``before_response`` telling whether any byte of the answer had arrived; a malformed answer is
lost after the response began. The caller's timeout surfaces as ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.fleet.errors import UpstreamConnectError, UpstreamLostError

FAILURES: tuple[type[Exception], ...] = (UpstreamConnectError, UpstreamLostError, OSError)
"""What a :meth:`Http1Pool.request` raises when the exchange failed (a timeout aside)."""

MAX_HEAD_BYTES = 64 * 1024
"""A response head larger than this is malformed (Triton's are a few hundred bytes)."""


# Not frozen, though nothing changes it once built: a frozen dataclass's ``__init__`` sets each
# field through ``object.__setattr__``, and one is built per request (with nine fields, 4.5
# against 1.3 µs to build, ``timeit``, session 17).
@dataclass(slots=True)
class Http1Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class _Connection(asyncio.Protocol):
    """One kept-alive connection; reads exactly one response per :meth:`exchange`."""

    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._expired = False
        """The current exchange ran past its timeout."""
        self._deadline: float | None = None
        """Loop time when the exchange in progress times out (None: none in progress, or
        no timeout)."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._buf = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._lost: BaseException | None = None
        self._answered = False
        """Some byte of the current exchange's answer has arrived."""

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they write all the same.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._answered = True
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._lost = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _arm(self, timeout_s: float) -> None:
        """Time out the exchange beginning now after ``timeout_s``.

        The connection's timer is kept from one exchange to the next and re-armed only when it
        fires before the deadline in force (:meth:`_on_timer`) or would fire after it: with the
        same timeout for every request, a busy connection arms one timer per ``timeout_s``
        instead of one per exchange (``call_later`` and ``cancel``: 1.8-2.0 µs, session 17)."""
        deadline = self._loop.time() + timeout_s
        self._deadline = deadline
        if self._timer is not None and self._timer_at <= deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(deadline, self._on_timer)
        self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return  # no exchange in progress with a timeout: the timer lapses
        if self._loop.time() < deadline:  # armed for an earlier exchange
            self._timer = self._loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
            return
        self._expired = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError())

    async def _more(self) -> None:
        """Wait for more bytes; raises when the connection ended instead, and
        ``TimeoutError`` once the exchange ran past its timeout."""
        if self._expired:
            raise TimeoutError
        if self.closed:
            raise UpstreamLostError(
                f"connection closed by the server{f' ({self._lost})' if self._lost else ''}",
                before_response=not self._answered,
            )
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()

    # -- one exchange ------------------------------------------------------------------
    async def exchange(
        self, head: bytes, body: bytes, no_body: bool, timeout_s: float | None = None
    ) -> Http1Response:
        """One request and its answer; ``TimeoutError`` when the answer is not complete within
        ``timeout_s``.

        The timeout is the connection's timer (:meth:`_arm`), whose callback fails the wait for
        bytes in progress, not ``asyncio.timeout``: that builds a context manager object,
        reschedules and cancels the task and counts its cancellations (enter and exit
        4.7-5.1 µs, ``timeit``, session 17); every wait of an exchange is one of this
        connection's."""
        assert self.transport is not None
        self._buf.clear()
        self._answered = False
        self._expired = False
        if timeout_s is not None:
            self._arm(timeout_s)
        try:
            self.transport.writelines((head, body) if body else (head,))
            while True:
                end = self._buf.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise UpstreamLostError("response head too large", before_response=False)
                await self._more()
            status, reason, headers, length, chunked, close = _parse_head(bytes(self._buf[:end]))
            del self._buf[: end + 4]
            if no_body or status in (204, 304) or 100 <= status < 200:
                data = b""
            elif chunked:
                data = await self._chunked()
            elif length is not None:
                while len(self._buf) < length:
                    await self._more()
                data = bytes(self._buf[:length])
                del self._buf[:length]
            else:  # no length: the body runs until the server closes the connection
                while not self.closed:
                    await self._more_or_eof()
                data, close = bytes(self._buf), True
        finally:
            self._deadline = None
        if close or self._buf:
            self.close()
        return Http1Response(status, reason, headers, data)

    async def _more_or_eof(self) -> None:
        if self._expired:
            raise TimeoutError
        with_eof = self.closed
        if not with_eof:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            while (line_end := self._buf.find(b"\r\n")) < 0:
                await self._more()
            size_text = bytes(self._buf[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise UpstreamLostError(
                    f"bad chunk size {size_text[:20]!r}", before_response=False
                ) from None
            del self._buf[: line_end + 2]
            if size == 0:
                # Trailers (usually none) end with an empty line.
                while (trailer_end := self._buf.find(b"\r\n")) != 0:
                    if trailer_end > 0:
                        del self._buf[: trailer_end + 2]
                        continue
                    await self._more()
                del self._buf[:2]
                return bytes(out)
            while len(self._buf) < size + 2:
                await self._more()
            out += self._buf[:size]
            del self._buf[: size + 2]


def _parse_head(
    head: bytes,
) -> tuple[int, str, list[tuple[str, str]], int | None, bool, bool]:
    """(status, reason, headers, content length, chunked, close after) of a response head."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise UpstreamLostError(f"malformed response line {lines[0][:80]!r}", before_response=False)
    headers: list[tuple[str, str]] = []
    length: int | None = None
    chunked = False
    close = version == "HTTP/1.0"
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise UpstreamLostError(
                f"malformed response header {line[:80]!r}", before_response=False
            )
        name, value = name.strip(), value.strip()
        low = name.lower()
        if low == "content-length":
            if not value.isdigit():
                raise UpstreamLostError(f"bad Content-Length {value[:20]!r}", before_response=False)
            length = int(value)
        elif low == "transfer-encoding":
            chunked = value.lower().endswith("chunked")
        elif low == "connection":
            tokens = {t.strip().lower() for t in value.split(",")}
            close = "close" in tokens or (close and "keep-alive" not in tokens)
        headers.append((name, value))
    return int(code), reason, headers, length, chunked, close


class Http1Pool:
    """Kept-alive connections to one instance, at most ``limit`` open at once."""

    def __init__(
        self,
        base_url: str,
        limit: int,
        connect_timeout_s: float,
        on_busy: Callable[[], None] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Pool serves plain http:// URLs, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open = 0
        self.in_use = 0
        """Connections carrying a request right now (``open_connections`` for routing)."""
        self.on_busy = on_busy
        """Called after ``in_use`` changed (routing views refresh the instance)."""
        # Requests may hold at most ``limit`` connections; past that they wait in order. A
        # count and a queue of futures rather than ``asyncio.Semaphore``, whose ``async with``
        # took 0.65-0.74 µs even with a slot free, against about 0.1 µs (session 17).
        self._free_slots = limit
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False

    async def _wait_for_slot(self) -> None:
        """Wait until a finished request hands this one its slot (first come, first served)."""
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed a slot as it was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it already
                    self._slot_waiters.remove(waiter)
            raise

    def _release_slot(self) -> None:
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free_slots += 1

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        where = f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connect timeout ({where})") from exc
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to {where}: {exc}",
                refused=isinstance(exc, ConnectionRefusedError),
            ) from exc
        return conn

    async def request(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        timeout_s: float | None = None,
    ) -> Http1Response:
        """One request; the caller's headers must not hold Host, Content-Length or hop-by-hop
        ones (they are set here)."""
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}")
        # aiohttp's server decodes header bytes as UTF-8 with surrogateescape: this gives the
        # client's bytes back unchanged, whatever they were.
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        if self._free_slots > 0 and not self._slot_waiters:
            self._free_slots -= 1
        else:
            await self._wait_for_slot()
        try:
            conn = None
            while self._idle:
                candidate = self._idle.pop()  # the most recently used: least likely timed out
                if not candidate.closed:
                    conn = candidate
                    break
                self._open -= 1
            if conn is None:
                conn = await self._connect()
                self._open += 1
            self.in_use += 1
            if self.on_busy is not None:
                self.on_busy()
            done = False
            try:
                response = await conn.exchange(head, body, method == "HEAD", timeout_s)
                done = True
                return response
            finally:
                self.in_use -= 1
                if self.on_busy is not None:
                    self.on_busy()
                if done and not conn.closed and not self.closed:
                    self._idle.append(conn)
                else:
                    # Broken, cancelled mid-exchange or timed out: its state is unknown.
                    conn.close()
                    self._open -= 1
        finally:
            self._release_slot()

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().close()
            self._open -= 1
