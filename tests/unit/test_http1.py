"""The lean HTTP/1.1 upstream client (proxy.fleet.http1) against servers whose bytes we choose."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from proxy.fleet.errors import UpstreamConnectError, UpstreamLostError
from proxy.fleet.http1 import Http1Pool

Answer = Callable[[bytes], bytes | None]
"""Request head -> raw response bytes to write (None: close the connection instead)."""


class RawServer:
    def __init__(self, answer: Answer, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                out = self.answer(head)
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def raw_server(answer: Answer, **kw: bool) -> AsyncIterator[tuple[RawServer, str]]:
    server = RawServer(answer, **kw)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        await srv.wait_closed()


def fixed(response: bytes) -> Answer:
    return lambda head: response


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def test_keeps_connections_alive_and_forwards_bytes():
    async with raw_server(fixed(OK)) as (server, url):
        pool = Http1Pool(url, limit=4, connect_timeout_s=1.0)
        for _ in range(3):
            answer = await pool.request("POST", "/v2/models/m/infer", [("X-A", "1")], b"body")
            assert (answer.status, answer.body) == (200, b"{}")
            assert ("Content-Type", "application/json") in answer.headers
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v2/models/m/infer HTTP/1.1\r\n")
        assert b"\r\nX-A: 1\r\n" in first and b"\r\nContent-Length: 4\r\n" in first
        assert first.endswith(b"\r\n\r\nbody")
        assert pool.in_use == 0
        pool.close()


async def test_chunked_body_with_extensions_and_trailers():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;ext=1\r\nabc\r\n4\r\ndefg\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    async with raw_server(fixed(chunked)) as (server, url):
        pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
        assert (await pool.request("GET", "/x", [], b"")).body == b"abcdefg"
        assert (await pool.request("GET", "/x", [], b"")).body == b"abcdefg"
        assert server.connections == 1  # the connection was left clean for the next one
        pool.close()


async def test_connection_close_and_body_until_eof():
    no_length = b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\nboom"
    async with raw_server(fixed(no_length), close_after=True) as (server, url):
        pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
        for _ in range(2):
            answer = await pool.request("GET", "/x", [], b"")
            assert (answer.status, answer.reason, answer.body) == (
                500,
                "Internal Server Error",
                b"boom",
            )
        assert server.connections == 2  # not reused after Connection: close
        pool.close()


async def test_no_body_for_head_and_204():
    answers = iter(
        [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n", OK]
    )
    async with raw_server(lambda head: next(answers)) as (server, url):
        pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
        assert (await pool.request("HEAD", "/x", [], b"")).body == b""
        assert (await pool.request("GET", "/x", [], b"")).status == 204
        assert (await pool.request("GET", "/x", [], b"")).body == b"{}"
        assert server.connections == 1
        pool.close()


async def test_refused_connection_is_a_connect_error():
    async with raw_server(fixed(OK)) as (_, url):
        pass  # closed: nothing listens there any more
    pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
    with pytest.raises(UpstreamConnectError) as caught:
        await pool.request("GET", "/x", [], b"")
    assert caught.value.refused  # nothing listens: the instance can be ejected at once
    assert pool.in_use == 0


@pytest.mark.parametrize(
    ("response", "before_response"),
    [
        (None, True),  # closed before answering: a stateless request may go elsewhere
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", False),  # closed mid-body
        (b"garbage\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", False),
    ],
)
async def test_broken_answers_are_lost_requests(response, before_response):
    answer = fixed(response) if response else (lambda head: None)
    async with raw_server(answer, close_after=True) as (_, url):
        pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
        with pytest.raises(UpstreamLostError) as caught:
            await pool.request("POST", "/x", [], b"b")
        assert caught.value.before_response is before_response
        assert pool.in_use == 0
        pool.close()


async def test_cancelled_exchange_drops_its_connection():
    never: asyncio.Event = asyncio.Event()

    def slow(head: bytes) -> bytes | None:
        return b"" if not never.is_set() else OK

    async with raw_server(slow) as (_server, url):
        pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
        task = asyncio.create_task(pool.request("GET", "/x", [], b""))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.in_use == 0 and not pool._idle  # its state was unknown: not reused
        with pytest.raises(TimeoutError):
            await pool.request("GET", "/x", [], b"", timeout_s=0.05)
        assert not pool._idle
        pool.close()


async def test_at_most_limit_connections():
    gate = asyncio.Event()

    async def answer_later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await gate.wait()
        writer.write(OK)
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(answer_later, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = Http1Pool(url, limit=2, connect_timeout_s=1.0)
    tasks = [asyncio.create_task(pool.request("GET", "/x", [], b"")) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert pool.in_use == 2
    gate.set()
    assert [r.status for r in await asyncio.gather(*tasks)] == [200] * 5
    pool.close()
    srv.close()
    await srv.wait_closed()


async def test_header_bytes_travel_unchanged():
    async with raw_server(fixed(OK)) as (server, url):
        pool = Http1Pool(url, limit=1, connect_timeout_s=1.0)
        # What aiohttp's server hands over for the raw bytes b"caf\xc3\xa9" and b"\xff".
        value = b"caf\xc3\xa9 \xff".decode("utf-8", "surrogateescape")
        await pool.request("GET", "/x", [("X-Name", value)], b"")
        assert b"\r\nX-Name: caf\xc3\xa9 \xff\r\n" in server.requests[0]
        pool.close()


async def test_a_request_cancelled_while_waiting_for_a_slot_gives_no_slot_away():
    gate = asyncio.Event()

    async def answer_later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await gate.wait()
                writer.write(OK)
                await writer.drain()
        writer.close()

    srv = await asyncio.start_server(answer_later, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = Http1Pool(url, limit=1, connect_timeout_s=1.0)
    first = asyncio.create_task(pool.request("GET", "/x", [], b""))
    waiting = asyncio.create_task(pool.request("GET", "/x", [], b""))
    behind = asyncio.create_task(pool.request("GET", "/x", [], b""))
    await asyncio.sleep(0.05)
    waiting.cancel()  # left the queue: the slot goes to the one behind it, once
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.in_use == 1
    gate.set()
    assert [(await t).status for t in (first, behind)] == [200, 200]
    assert pool.in_use == 0
    # All slots back: a burst still holds at most ``limit`` connections.
    gate.clear()
    burst = [asyncio.create_task(pool.request("GET", "/x", [], b"")) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert pool.in_use == 1
    gate.set()
    assert [r.status for r in await asyncio.gather(*burst)] == [200] * 3
    pool.close()
    srv.close()
    await srv.wait_closed()


async def test_a_slot_handed_to_a_request_cancelled_at_that_moment_passes_on():
    pool = Http1Pool("http://127.0.0.1:9", limit=1, connect_timeout_s=1.0)
    pool._free_slots = 0  # the one slot is held
    waiter = asyncio.create_task(pool._wait_for_slot())
    await asyncio.sleep(0)
    pool._release_slot()  # handed to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool._free_slots == 1 and not pool._slot_waiters


async def test_the_connection_timer_follows_each_exchange_deadline():
    delays = [0.0, 0.2, 0.0, 5.0]  # seconds before each answer on the one connection

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while delays:
                await reader.readuntil(b"\r\n\r\n")
                await asyncio.sleep(delays.pop(0))
                writer.write(OK)
                await writer.drain()
        writer.close()

    srv = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = Http1Pool(url, limit=1, connect_timeout_s=1.0)
    async with asyncio.timeout(3):
        # The timer armed for a short deadline fires during a later, longer exchange: it
        # re-arms instead of failing it.
        assert (await pool.request("GET", "/x", [], b"", timeout_s=0.05)).status == 200
        assert (await pool.request("GET", "/x", [], b"", timeout_s=1.0)).status == 200
        # A timer armed far out is brought forward for a shorter deadline.
        assert (await pool.request("GET", "/x", [], b"", timeout_s=60.0)).status == 200
        with pytest.raises(TimeoutError):
            await pool.request("GET", "/x", [], b"", timeout_s=0.1)
    pool.close()
    srv.close()
    await srv.wait_closed()
