"""The lean HTTP/1.1 server (proxy.frontends.http_server) on real sockets, in the test's loop.

A small application echoes what it received; its body holds count what they hold, so every test
can check that each hold is released once, whatever way its request ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from proxy.errors import Code, ProxyError
from proxy.frontends import http_server
from proxy.frontends.http_server import HttpServer, Request, Response, Stream

LIMIT = 10_000


class Hold:
    def __init__(self, app: EchoApp, nbytes: int) -> None:
        self.app = app
        self.nbytes = 0
        self.released = False
        app.holds.append(self)
        self.grow(nbytes)

    def grow(self, nbytes: int) -> None:
        if self.nbytes + nbytes > LIMIT:
            raise ProxyError(Code.PAYLOAD_TOO_LARGE, f"over {LIMIT} bytes")
        self.nbytes += nbytes

    def release(self) -> None:
        assert not self.released, "released twice"
        self.released = True


@dataclass
class EchoApp:
    holds: list[Hold] = field(default_factory=list)
    cancelled: int = 0
    finished: list[Request] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    go_on: asyncio.Event = field(default_factory=asyncio.Event)

    def open_body(self, request: Request) -> Hold:
        if request.content_length is not None and request.content_length > LIMIT:
            raise ProxyError(Code.PAYLOAD_TOO_LARGE, f"over {LIMIT} bytes")
        return Hold(self, request.content_length or 0)

    async def handle(self, request: Request) -> Response | Stream:
        if request.target.startswith("/wait"):
            request.hold_on_leave = request.target == "/wait-held"
            self.started.set()
            try:
                await self.go_on.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            self.finished.append(request)
        if request.target == "/refuse":
            raise ProxyError(Code.UNAVAILABLE, "not now", retry_after_s=2.0)
        if request.target.startswith("/early"):
            # Answered before the handler returns, which then waits for the test.
            early = Response(200, b"early", [("Content-Type", "text/plain")])
            request.answer_now(early)
            request.answer_now(Response(500, b"a second answer is not written"))
            self.started.set()
            await self.go_on.wait()
            self.finished.append(request)
            if request.target == "/early-raises":
                raise ProxyError(Code.INTERNAL, "raised after the answer: not written")
            return early
        if request.target == "/stream":
            stream = request.start_stream(200, [("Content-Type", "text/event-stream")])
            await stream.write(b"data: 1\n\n")
            self.started.set()
            await self.go_on.wait()
            await stream.write(b"data: 2\n\n")
            await stream.end()
            return stream
        doc = {
            "method": request.method,
            "target": request.target,
            "body": request.body.decode(errors="replace"),
            "x": request.headers.get("x-test", ""),
        }
        return Response(200, json.dumps(doc).encode(), [("Content-Type", "application/json")])

    def all_released(self) -> bool:
        return all(h.released for h in self.holds)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict[str, str]:
        doc: dict[str, str] = json.loads(self.body)
        return doc


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        body = b"".join(parts)
    else:
        body = await reader.read()
    return Answer(status, headers, body)


async def closed(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF or reset) within a second."""
    try:
        async with asyncio.timeout(1.0):
            return await reader.read(1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def request(method: str, target: str, body: bytes = b"", headers: tuple[str, ...] = ()) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: t", *headers]
    if body and not any(h.lower().startswith("transfer-encoding") for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[HttpServer, EchoApp]]:
    app = EchoApp()
    server = HttpServer(app)
    await server.start("127.0.0.1", 0)
    try:
        yield server, app
    finally:
        app.go_on.set()
        await server.close(timeout_s=1.0)


@contextlib.asynccontextmanager
async def connection(
    server: HttpServer,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        for i in range(3):
            writer.write(request("POST", f"/echo/{i}", b"body %d" % i, ("X-Test: yes",)))
            answer = await read_answer(reader)
            assert answer.status == 200
            assert answer.json() == {
                "method": "POST",
                "target": f"/echo/{i}",
                "body": f"body {i}",
                "x": "yes",
            }
            assert "connection" not in answer.headers
        assert not await closed(reader)
        assert len(app.holds) == 3 and app.all_released()


async def test_http10_closes_unless_it_asked_for_keep_alive() -> None:
    async with serving() as (server, _):
        async with connection(server) as (reader, writer):
            writer.write(b"GET /a HTTP/1.0\r\n\r\n")
            answer = await read_answer(reader)
            assert answer.status == 200 and answer.headers["connection"] == "close"
            assert await closed(reader)
        async with connection(server) as (reader, writer):
            writer.write(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            answer = await read_answer(reader)
            assert answer.headers["connection"] == "keep-alive"
            writer.write(b"GET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            assert (await read_answer(reader)).json()["target"] == "/b"


async def test_connection_close_is_honoured_and_later_requests_are_not_answered() -> None:
    async with serving() as (server, _), connection(server) as (reader, writer):
        writer.write(request("GET", "/first", headers=("Connection: close",)))
        writer.write(request("GET", "/never"))
        answer = await read_answer(reader)
        assert answer.json()["target"] == "/first"
        assert answer.headers["connection"] == "close"
        assert await closed(reader)


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(
            request("GET", "/wait/1") + request("POST", "/2", b"two") + request("GET", "/3")
        )
        await app.started.wait()
        await asyncio.sleep(0.05)  # the later requests are parsed and wait their turn
        app.go_on.set()
        targets = [(await read_answer(reader)).json()["target"] for _ in range(3)]
        assert targets == ["/wait/1", "/2", "/3"]
        assert app.all_released()


@pytest.mark.parametrize("target", ["/early", "/early-raises"])
async def test_an_answer_given_early_is_written_once_before_the_handler_returns(
    target: str,
) -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(request("GET", target) + request("GET", "/after"))
        async with asyncio.timeout(5):
            answer = await read_answer(reader)  # while the handler still waits
        assert (answer.status, answer.body) == (200, b"early")
        assert app.finished == []
        app.go_on.set()
        # Nothing else of the first request follows: the next answer is the next request's.
        after = await read_answer(reader)
        assert after.status == 200 and after.json()["target"] == "/after"
        assert [r.target for r in app.finished] == [target]
        assert not await closed(reader)
        assert app.all_released()


async def test_chunked_request_body_is_assembled() -> None:
    body = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(request("POST", "/c", body, ("Transfer-Encoding: chunked",)))
        answer = await read_answer(reader)
        assert answer.json()["body"] == "hello, world"
        assert app.holds[0].nbytes == 12 and app.all_released()


@pytest.mark.parametrize(
    "encoding, data",
    [
        ("gzip", gzip.compress(b"x" * 5000)),
        ("deflate", zlib.compress(b"x" * 5000)),
        ("deflate", zlib.compress(b"x" * 5000)[2:-4]),  # raw deflate, no zlib header
    ],
)
async def test_compressed_bodies_are_decoded(encoding: str, data: bytes) -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(request("POST", "/z", data, (f"Content-Encoding: {encoding}",)))
        answer = await read_answer(reader)
        assert answer.json()["body"] == "x" * 5000
        assert app.holds[0].nbytes == 5000 and app.all_released()


async def test_expect_100_continue_is_answered_only_for_an_acceptable_body() -> None:
    async with serving() as (server, app):
        async with connection(server) as (reader, writer):
            writer.write(
                request("POST", "/e", headers=("Content-Length: 4", "Expect: 100-continue"))
            )
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"body")
            assert (await read_answer(reader)).json()["body"] == "body"
        async with connection(server) as (reader, writer):
            head = request("POST", "/e", headers=(f"Content-Length: {LIMIT + 1}",))
            writer.write(head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
            answer = await read_answer(reader)  # the final answer, no interim 100 before it
            assert answer.status == 413
            assert answer.json() == {"error": f"over {LIMIT} bytes"}
            assert await closed(reader)
        assert app.all_released()


async def test_body_over_the_limit_by_length_is_refused_before_it_is_read() -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: 10000001\r\n\r\n")
        answer = await read_answer(reader)  # no byte of the body was sent
        assert answer.status == 413 and answer.headers["connection"] == "close"
        assert answer.headers["content-type"] == "application/json"
        assert await closed(reader)
        assert app.holds == []


async def test_zip_bomb_is_refused_by_its_decompressed_size() -> None:
    bomb = gzip.compress(b"\0" * (50 * LIMIT))
    assert len(bomb) < LIMIT
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(request("POST", "/bomb", bomb, ("Content-Encoding: gzip",)))
        answer = await read_answer(reader)
        assert answer.status == 413 and "error" in answer.json()
        assert max(h.nbytes for h in app.holds) <= LIMIT
        assert app.all_released()


async def test_chunked_body_over_the_limit_is_refused_as_it_arrives() -> None:
    chunk = b"%x\r\n%s\r\n" % (4000, b"y" * 4000)
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(request("POST", "/c", chunk * 3, ("Transfer-Encoding: chunked",)))
        answer = await read_answer(reader)
        assert answer.status == 413
        assert app.all_released()


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /x HTTP/1.1\r\nBad Header\r\n\r\n",
        b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
        b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET /x HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /x HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
        # Fields each within the limit, 480 kB of head in all.
        b"GET /x HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 8000) for i in range(60)),
        b"POST /x HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nnotgz",
        b"POST /x HTTP/1.1\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n\r\n"
        + gzip.compress(b"x" * 100)[:10],
    ],
)
async def test_malformed_requests_get_400_in_tritons_format_and_the_connection_closes(
    data: bytes,
) -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(data)
        answer = await read_answer(reader)
        assert answer.status == 400, answer
        assert set(answer.json()) == {"error"}
        assert answer.headers["connection"] == "close"
        assert await closed(reader)
        assert app.all_released()


async def test_an_error_raised_by_the_handler_is_answered_in_tritons_format() -> None:
    async with serving() as (server, _), connection(server) as (reader, writer):
        writer.write(request("GET", "/refuse") + request("GET", "/after"))
        answer = await read_answer(reader)
        assert (answer.status, answer.json()) == (503, {"error": "not now"})
        assert answer.headers["retry-after"] == "2"
        assert (await read_answer(reader)).status == 200  # the connection is kept


async def test_client_disconnect_cancels_the_handler_and_releases_the_body() -> None:
    async with serving() as (server, app):
        async with connection(server) as (_, writer):
            writer.write(request("POST", "/wait", b"payload"))
            await app.started.wait()
        for _ in range(100):
            if app.cancelled:
                break
            await asyncio.sleep(0.01)
        assert app.cancelled == 1
        assert app.all_released()


async def test_a_held_handler_runs_to_its_end_when_the_client_leaves() -> None:
    async with serving() as (server, app):
        async with connection(server) as (_, writer):
            writer.write(request("POST", "/wait-held", b"payload"))
            await app.started.wait()
        await asyncio.sleep(0.1)  # the server has seen the connection close
        assert app.cancelled == 0
        assert not app.all_released()  # the handler still holds its body
        app.go_on.set()
        for _ in range(100):
            if app.finished:
                break
            await asyncio.sleep(0.01)
        assert [r.client_left for r in app.finished] == [True]
        for _ in range(100):
            if app.all_released():
                break
            await asyncio.sleep(0.01)
        assert app.all_released()


async def test_streamed_answer_is_sent_chunk_by_chunk() -> None:
    async with serving() as (server, app), connection(server) as (reader, writer):
        writer.write(request("POST", "/stream", b"{}"))
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head and b"Content-Length" not in head
        # The first event arrives while the handler still waits to send the second.
        assert await reader.readexactly(14) == b"9\r\ndata: 1\n\n\r\n"
        assert app.started.is_set() and not app.go_on.is_set()
        app.go_on.set()
        assert await reader.readuntil(b"0\r\n\r\n") == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"
        writer.write(request("GET", "/next"))
        assert (await read_answer(reader)).json()["target"] == "/next"


async def test_stop_listening_closes_idle_connections_and_lets_busy_ones_answer() -> None:
    async with serving() as (server, app):
        assert server.port is not None
        async with connection(server) as (idle_reader, idle_writer):
            idle_writer.write(request("GET", "/warm"))
            await read_answer(idle_reader)
            async with connection(server) as (busy_reader, busy_writer):
                busy_writer.write(request("GET", "/wait"))
                await app.started.wait()
                server.stop_listening()
                assert await closed(idle_reader)
                with pytest.raises(OSError):
                    await asyncio.open_connection("127.0.0.1", server.port)
                app.go_on.set()
                answer = await read_answer(busy_reader)
                assert answer.status == 200 and answer.headers["connection"] == "close"
                assert await closed(busy_reader)


async def test_close_cuts_what_is_still_running() -> None:
    app = EchoApp()
    server = HttpServer(app)
    await server.start("127.0.0.1", 0)
    async with connection(server) as (reader, writer):
        writer.write(request("GET", "/wait"))
        await app.started.wait()
        await server.close(timeout_s=0.1)
        assert await closed(reader)
    assert app.cancelled == 1


async def test_ipv6_listener() -> None:
    app = EchoApp()
    server = HttpServer(app)
    try:
        port = await server.start("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        reader, writer = await asyncio.open_connection("::1", port)
        writer.write(request("GET", "/six"))
        assert (await read_answer(reader)).json()["target"] == "/six"
        writer.close()
    finally:
        await server.close()


async def test_idle_connections_close_after_the_keep_alive_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_server, "KEEPALIVE_TIMEOUT_S", 0.3)
    async with serving() as (server, app), connection(server) as (busy_reader, busy_writer):
        async with connection(server) as (idle_reader, idle_writer):
            idle_writer.write(request("GET", "/once"))
            await read_answer(idle_reader)
            busy_writer.write(request("GET", "/wait"))
            await app.started.wait()
            await asyncio.sleep(0.7)
            assert await closed(idle_reader)
        app.go_on.set()  # a request in progress is not idle: it is answered
        assert (await read_answer(busy_reader)).status == 200
