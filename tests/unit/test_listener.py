"""proxy.listener on real loopback sockets, under asyncio's loop and under uvloop (the proxy's).

The property that matters: connections waiting in the kernel's queue are all taken in the same
turn of the loop, whatever the loop. uvloop's own ``create_server`` takes one per turn, which
``test_create_server_under_uvloop_takes_one_connection_per_turn`` records so that the reason
for this module stays checked.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from proxy.listener import listen

WAITING = 200


def run(loop_kind: str, coro: Coroutine[Any, Any, None]) -> None:
    if loop_kind == "uvloop":
        uvloop.run(coro)
    else:
        asyncio.run(coro)


class Counted(asyncio.Protocol):
    made = 0

    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Counted.made += 1
        self.transport = transport


async def turns_until_all_served(
    start: Callable[[], Awaitable[tuple[int, Callable[[], None]]]],
) -> int:
    """Queue ``WAITING`` connections in the kernel before the loop runs again, then count the
    turns of the loop until every one reached ``connection_made``."""
    Counted.made = 0
    port, close = await start()
    # Blocking connects: the kernel completes each handshake and queues the connection.
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(WAITING)]
    try:
        turns = 0
        while Counted.made < WAITING and turns < 10 * WAITING:
            await asyncio.sleep(0)  # one turn: the loop polls its sockets before resuming us
            turns += 1
        assert Counted.made == WAITING
        return turns
    finally:
        for c in clients:
            c.close()
        close()


async def start_listener() -> tuple[int, Callable[[], None]]:
    listener = await listen(Counted, "127.0.0.1", 0, backlog=1024)
    return listener.sockets[0].getsockname()[1], listener.close


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_every_waiting_connection_is_taken_in_one_turn(loop_kind: str) -> None:
    async def main() -> None:
        turns = await turns_until_all_served(start_listener)
        # One turn accepts them all; handing each to its protocol takes a turn or two more.
        assert turns <= 5

    run(loop_kind, main())


def test_create_server_under_uvloop_takes_one_connection_per_turn() -> None:
    async def start() -> tuple[int, Callable[[], None]]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Counted, "127.0.0.1", 0, backlog=1024)
        return server.sockets[0].getsockname()[1], server.close

    async def main() -> None:
        turns = await turns_until_all_served(start)
        assert turns >= WAITING // 2

    uvloop.run(main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_close_refuses_new_connections_and_keeps_served_ones(loop_kind: str) -> None:
    async def main() -> None:
        served: list[Counted] = []

        def factory() -> Counted:
            served.append(Counted())
            return served[-1]

        listener = await listen(factory, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if served and served[0].transport is not None:
                break
            await asyncio.sleep(0.01)
        listener.close()
        await listener.wait_closed()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        transport = served[0].transport
        assert transport is not None and not transport.is_closing()
        writer.close()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_reuse_port_lets_listeners_share_a_port_and_only_them(loop_kind: str) -> None:
    async def main() -> None:
        first = await listen(Counted, "127.0.0.1", 0, reuse_port=True)
        port = first.sockets[0].getsockname()[1]
        second = await listen(Counted, "127.0.0.1", port, reuse_port=True)
        try:
            assert second.sockets[0].getsockname()[1] == port
            with pytest.raises(OSError):
                await listen(Counted, "127.0.0.1", port)
        finally:
            first.close()
            second.close()

    run(loop_kind, main())
