"""proxy.h2 against real gRPC peers: grpc.aio clients on the server, a grpc.aio server behind
the client; and hostile bytes on a raw socket, which must cost the sender its connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from proxy.fleet.errors import UpstreamConnectError, UpstreamLostError
from proxy.h2 import wire
from proxy.h2.client import H2Upstreams
from proxy.h2.server import H2GrpcServer

SERVICE = "/test.Echo/"
BIG = 9 << 20  # over every default window and the frame size


@dataclass
class Seen:
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    metadata: list[tuple[str, str | bytes]] = field(default_factory=list)
    go_on: asyncio.Event = field(default_factory=asyncio.Event)
    returned: list[bytes] = field(default_factory=list)


async def _server(seen: Seen) -> tuple[H2GrpcServer, int]:
    async def echo(request: bytes, context: Any) -> bytes:
        seen.metadata = context.invocation_metadata()
        return request

    async def fail(request: bytes, context: Any) -> bytes:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "full é try later", [("retry-after", "3")]
        )
        raise AssertionError

    async def early(request: bytes, context: Any) -> bytes:
        # Answered before it returns, then waits for the test (as the dispatcher's
        # ``deliver`` answers before the proxy's accounting).
        context.answer_now(request)
        context.answer_now(b"a second answer is not written")
        await seen.go_on.wait()
        seen.returned.append(request)
        if request == b"raise":
            await context.abort(grpc.StatusCode.INTERNAL, "raised after the answer")
        return request

    async def slow(request: bytes, context: Any) -> bytes:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.cancelled.set()
            raise
        return b""

    async def chat(requests: AsyncIterator[bytes], context: Any) -> None:
        if dict(context.invocation_metadata()).get("x-stall"):
            await asyncio.sleep(30)  # reads nothing
        async for request in requests:
            await context.write(request)
            await context.write(request[::-1])

    server = H2GrpcServer(
        {
            SERVICE + "Echo": echo,
            SERVICE + "Fail": fail,
            SERVICE + "Slow": slow,
            SERVICE + "Early": early,
        },
        {SERVICE + "Chat": chat},
        max_receive_bytes=16 << 20,
    )
    return server, await server.start("127.0.0.1", 0)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Seen, grpc.aio.Channel]]:
    seen = Seen()
    server, port = await _server(seen)
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)]
    )
    try:
        yield seen, channel
    finally:
        await channel.close()
        await server.stop(1.0)


async def test_unary_calls_of_any_size_and_many_at_once(served: Any) -> None:
    seen, channel = served
    echo = channel.unary_unary(SERVICE + "Echo")
    big = bytes(range(256)) * (BIG // 256)
    assert await echo(big) == big
    smalls = [b"m%d" % i for i in range(200)]
    assert await asyncio.gather(*(echo(m) for m in smalls)) == smalls
    await echo(b"x", metadata=(("x-key", "v"), ("x-trace-bin", b"\x00\xff")))
    assert ("x-key", "v") in seen.metadata and ("x-trace-bin", b"\x00\xff") in seen.metadata


@pytest.mark.parametrize("message", [b"early", b"raise"])
async def test_an_answer_given_early_reaches_the_client_once(served: Any, message: bytes) -> None:
    seen, channel = served
    early = channel.unary_unary(SERVICE + "Early")
    async with asyncio.timeout(5):
        assert await early(message) == message  # while the handler still waits
    assert seen.returned == []
    seen.go_on.set()
    assert await early(b"again") == b"again"
    assert seen.returned == [message, b"again"]


async def test_compressed_requests_reach_the_handler_plain(served: Any) -> None:
    _, channel = served
    echo = channel.unary_unary(SERVICE + "Echo")
    assert await echo(b"abc" * 5000, compression=grpc.Compression.Gzip) == b"abc" * 5000


async def test_statuses_details_and_trailing_metadata_reach_the_client(served: Any) -> None:
    _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary(SERVICE + "Fail")(b"")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "full é try later"
    assert ("retry-after", "3") in tuple(info.value.trailing_metadata())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary(SERVICE + "Nothing")(b"")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_oversized_message_is_refused(served: Any) -> None:
    _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary(SERVICE + "Echo")(b"\0" * (17 << 20))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await channel.unary_unary(SERVICE + "Echo")(b"ok") == b"ok"


async def test_deadline_and_cancellation_stop_the_handler(served: Any) -> None:
    seen, channel = served
    slow = channel.unary_unary(SERVICE + "Slow")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await slow(b"", timeout=0.2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(seen.cancelled.wait(), 5)
    seen.cancelled.clear()
    call = slow(b"")
    await asyncio.sleep(0.2)
    call.cancel()
    await asyncio.wait_for(seen.cancelled.wait(), 5)


async def test_streams_relay_every_message_in_order(served: Any) -> None:
    _, channel = served
    chat = channel.stream_stream(SERVICE + "Chat")
    requests = [b"first", bytes(BIG), b"third"]

    async def send() -> AsyncIterator[bytes]:
        for r in requests:
            yield r

    answers = [a async for a in chat(send())]
    assert answers == [x for r in requests for x in (r, r[::-1])]


async def test_a_stream_that_is_not_read_stops_its_sender(served: Any) -> None:
    """The server reads ahead of a stream's handler a few messages and one window, not
    whatever the client sends."""
    _, channel = served
    call = channel.stream_stream(SERVICE + "Chat")(metadata=(("x-stall", "1"),))
    written = 0

    async def write() -> None:
        nonlocal written
        for _ in range(64):
            await call.write(bytes(1 << 20))
            written += 1

    task = asyncio.create_task(write())
    await asyncio.sleep(1.5)
    assert 3 <= written <= 12
    task.cancel()
    call.cancel()


# --- the client, in front of a grpc.aio server ---------------------------------------------


def _upstreams(port: int) -> tuple[H2Upstreams, Any]:
    """A client for one instance at ``port`` (the fleet reduced to what the client reads)."""
    instance = SimpleNamespace(name="t0", spec=SimpleNamespace(grpc=f"127.0.0.1:{port}"))
    fleet: Any = SimpleNamespace(instances={"t0": instance})
    ups = H2Upstreams(fleet, max_send_bytes=64 << 20, connect_timeout_s=1.0, request_timeout_s=None)
    return ups, instance


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[H2Upstreams, Any, asyncio.Event]]:
    cancelled = asyncio.Event()

    async def echo(request: bytes, context: Any) -> bytes:
        await context.send_initial_metadata((("x-initial", "1"),))
        if request == b"fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no model 'x' é sorry")
        if request == b"slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return request + b"!"

    async def chat(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request
            yield b"again " + request[:10]

    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        },
    )
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    )
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ups, instance = _upstreams(port)
    try:
        yield ups, instance, cancelled
    finally:
        await ups.close()
        await server.stop(0)


async def test_client_unary_calls_and_tritons_statuses(upstream: Any) -> None:
    ups, instance, _ = upstream
    big = bytes(range(256)) * (BIG // 256)
    assert await ups.unary(instance, SERVICE + "Echo", big, (), None) == big + b"!"
    got = await asyncio.gather(
        *(ups.unary(instance, SERVICE + "Echo", b"%d" % i, (), 10.0) for i in range(100))
    )
    assert got == [b"%d!" % i for i in range(100)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ups.unary(instance, SERVICE + "Echo", b"fail", (("x-a", "b"),), None)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no model 'x' é sorry"


async def test_client_deadline_and_cancellation_reach_the_server(upstream: Any) -> None:
    ups, instance, cancelled = upstream
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ups.unary(instance, SERVICE + "Echo", b"slow", (), 0.2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(cancelled.wait(), 5)
    cancelled.clear()
    task = asyncio.create_task(ups.unary(instance, SERVICE + "Echo", b"slow", (), None))
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_client_streams(upstream: Any) -> None:
    ups, instance, _ = upstream
    call = ups.stream(instance, SERVICE + "Chat", (), None)
    for message in (b"one", bytes(BIG)):
        await call.write(message)
    await call.done_writing()
    answers = [a async for a in call]
    assert answers == [b"one", b"again one", bytes(BIG), b"again " + bytes(10)]


async def test_client_transport_failures_are_classified() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ups, instance = _upstreams(port)
    with pytest.raises(UpstreamConnectError) as refused:
        await ups.unary(instance, SERVICE + "Echo", b"", (), None)
    assert refused.value.refused

    # A server that takes the request and drops the connection.
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", port)
    try:
        with pytest.raises(UpstreamLostError):
            await ups.unary(instance, SERVICE + "Echo", b"", (), None)
    finally:
        server.close()
        await ups.close()


async def test_answers_to_calls_the_client_gave_up_on_are_dropped() -> None:
    """Triton's answer to a call reset for its deadline was already on its way: the
    connection carries on (the answer's header block still updates the HPACK table)."""

    def answer(stream: int) -> bytes:
        block = wire.encode_block(((b":status", b"200"), (b"content-type", b"application/grpc")))
        message = wire.message_prefix(2) + b"ok"
        trailers = wire.encode_block(((b"grpc-status", b"0"),))
        return (
            wire.frame(wire.HEADERS, wire.END_HEADERS, stream, block)
            + wire.frame(wire.DATA, 0, stream, message)
            + wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, stream, trailers)
        )

    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(wire.settings_frame(()))
        seen = b""
        answered: set[int] = set()
        while chunk := await reader.read(1 << 16):
            seen += chunk
            body = seen[len(wire.PREFACE) :]
            for kind, _, stream, _ in _frames(body):
                if kind == wire.HEADERS and stream not in answered:
                    answered.add(stream)
                    delay = 0.3 if stream == 1 else 0.5
                    asyncio.get_running_loop().call_later(delay, writer.write, answer(stream))

    server = await asyncio.start_server(late, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ups, instance = _upstreams(port)
    try:
        first = ups.unary(instance, SERVICE + "Echo", b"", (), 0.1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await first
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # On the same connection, answered after the late answer came.
        got = await ups.unary(instance, SERVICE + "Echo", b"", (), 2.0)
        assert got == b"ok"
    finally:
        server.close()
        await ups.close()


# --- hostile bytes --------------------------------------------------------------------------


def _frames(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    pos = 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos : pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        stream = int.from_bytes(data[pos + 5 : pos + 9], "big")
        yield kind, flags, stream, data[pos + 9 : pos + 9 + n]
        pos += 9 + n


async def _goaway_after(port: int, payload: bytes, preface: bool = True) -> int | None:
    """What the server answers ``payload`` with: its GOAWAY code (None if it did not send
    one), having also closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        data = (wire.PREFACE + wire.settings_frame(()) if preface else b"") + payload
        with contextlib.suppress(ConnectionError):
            for i in range(0, len(data), 1 << 16):  # read meanwhile: the server may cut us off
                writer.write(data[i : i + (1 << 16)])
                await writer.drain()

    sending = asyncio.create_task(send())
    data = b""
    try:
        async with asyncio.timeout(5):
            while chunk := await reader.read(1 << 16):
                data += chunk
    except ConnectionResetError:
        pass
    await sending
    writer.close()
    codes = [struct.unpack(">I", p[4:8])[0] for k, _, _, p in _frames(data) if k == wire.GOAWAY]
    return codes[0] if codes else None


def _request_headers(stream: int, end_headers: bool = True) -> bytes:
    block = wire.encode_block(
        (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", SERVICE.encode() + b"Slow"),
            (b"content-type", b"application/grpc"),
        )
    )
    return wire.frame(wire.HEADERS, wire.END_HEADERS if end_headers else 0, stream, block)


async def test_protocol_abuse_costs_the_connection() -> None:
    server, port = await _server(Seen())
    try:
        assert await _goaway_after(port, b"GET / HTTP/1.1\r\n\r\n" + bytes(20), False) == (
            wire.PROTOCOL_ERROR
        )
        oversized = b"\x20\x00\x00" + bytes((wire.DATA, 0)) + (1).to_bytes(4, "big")
        assert await _goaway_after(port, oversized) == wire.FRAME_SIZE_ERROR  # 2 MiB
        flood = _request_headers(1, end_headers=False) + b"".join(
            wire.frame(wire.CONTINUATION, 0, 1, bytes(16_000)) for _ in range(8)
        )
        assert await _goaway_after(port, flood) == wire.ENHANCE_YOUR_CALM
        rapid = b"".join(
            _request_headers(s) + wire.rst_stream(s, wire.CANCEL) for s in range(1, 6001, 2)
        )
        assert await _goaway_after(port, rapid) == wire.ENHANCE_YOUR_CALM
        even = _request_headers(2)
        assert await _goaway_after(port, even) == wire.PROTOCOL_ERROR
        window = wire.frame(wire.WINDOW_UPDATE, 0, 0, (wire.MAX_WINDOW).to_bytes(4, "big"))
        assert await _goaway_after(port, window) == wire.FLOW_CONTROL_ERROR
        bad_hpack = wire.frame(wire.HEADERS, wire.END_HEADERS, 1, b"\xff\xff\xff\xff")
        assert await _goaway_after(port, bad_hpack) == wire.COMPRESSION_ERROR
    finally:
        await server.stop(1.0)


async def test_unfinished_messages_cannot_fill_the_servers_memory() -> None:
    """Many calls that each send part of a large message and never finish it: the server
    gives the connection's window back only as messages are handed over, so a client that
    sends past the window it was given is cut off instead of being buffered."""
    server, port = await _server(Seen())
    try:
        window = server.max_receive_bytes + (1 << 20)
        chunk = wire.frame(wire.DATA, 0, 0, bytes(16_000))[9:]
        partial = []
        for stream in range(1, 2 * 24, 2):  # 24 calls x 1 MB, each within its stream window
            data = wire.message_prefix(8 << 20) + b"".join(chunk for _ in range(62))
            partial.append(_request_headers(stream))
            partial += [
                wire.frame(wire.DATA, 0, stream, data[i : i + 16_000])
                for i in range(0, len(data), 16_000)
            ]
        assert sum(len(p) for p in partial) > window
        assert await _goaway_after(port, b"".join(partial)) == wire.FLOW_CONTROL_ERROR
    finally:
        await server.stop(1.0)


async def test_calls_over_the_stream_limit_are_refused_and_the_rest_served() -> None:
    from proxy.h2.server import MAX_STREAMS

    server, port = await _server(Seen())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        opened = range(1, 2 * (MAX_STREAMS + 10), 2)
        writer.write(wire.PREFACE + wire.settings_frame(()))
        writer.write(b"".join(_request_headers(s) for s in opened))
        await writer.drain()
        refused: set[int] = set()
        data = b""
        async with asyncio.timeout(5):
            while len(refused) < 10:
                data += await reader.read(1 << 16)
                refused = {
                    s
                    for k, _, s, p in _frames(data)
                    if k == wire.RST_STREAM and int.from_bytes(p, "big") == wire.REFUSED_STREAM
                }
        assert refused == set(list(opened)[MAX_STREAMS:])
    finally:
        writer.close()
        await server.stop(1.0)
