"""Listening sockets that take every waiting connection each time they are ready.

The proxy's HTTP and gRPC ports listen here rather than through ``loop.create_server``, for
one reason: uvloop (the proxy's event loop, :func:`proxy.cli._run`) accepts **one** connection
per turn of the loop. Its libuv (1.4x) calls ``accept()`` once each time the listening socket is
readable (``uv__server_io``) and waits for the next turn for the next one; asyncio's own loop
takes up to ``backlog`` at a time. Under load a turn of the proxy's loop runs every request's
callbacks that are ready and lasts tens of milliseconds, so the proxy took a few dozen new
connections a second. Clients that open a connection when none of theirs is free (the
benchmark's generator, and most HTTP client pools) then opened them faster than that: measured
on ``benchmarks/issue10/case.yaml`` with six servers at x2 (docs/benchmarks.md, session 49),
the HTTP port's listen queue grew by about 200 connections a second to its 4,096, ``strace``
counted exactly one ``accept4`` per ``epoll_wait``, and the requests written on connections
still in that queue waited there (the kernel had completed their handshake) until the load
stopped: a quarter of all requests answered after 10-20 s with Triton's queues empty.

:func:`listen` binds like ``create_server`` (every address ``host`` resolves to, the same
options) and, each time a socket is readable, accepts until the queue is empty, at most
``backlog`` at once so a flood cannot hold the loop; each connection gets ``TCP_NODELAY`` and is
handed to the loop with ``connect_accepted_socket`` (asyncio's and uvloop's API for sockets
accepted outside them).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

ACCEPT_RETRY_S = 1.0
"""Pause after the process ran out of file descriptors or memory (asyncio's own rule)."""
_OUT_OF_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


class Listener:
    """Listening sockets serving ``factory``'s protocols; :meth:`close` stops them."""

    def __init__(
        self,
        sockets: list[socket.socket],
        factory: Callable[[], asyncio.Protocol],
        backlog: int,
    ) -> None:
        self.sockets = sockets
        self._factory = factory
        self._backlog = backlog
        self._loop = asyncio.get_running_loop()
        self._handing: set[asyncio.Task[object]] = set()
        """Accepted connections being handed to the loop (until their ``connection_made``)."""
        self._closed = False
        for sock in sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(self._backlog):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                log.error(
                    "cannot accept connections on %s (%s): paused for %g s",
                    sock.getsockname(),
                    exc,
                    ACCEPT_RETRY_S,
                )
                self._loop.remove_reader(sock.fileno())
                self._loop.call_later(ACCEPT_RETRY_S, self._resume, sock)
                return
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                # Answers are written whole: Nagle would only hold their last segment back.
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._hand_over(conn))
            self._handing.add(task)
            task.add_done_callback(self._handing.discard)

    async def _hand_over(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # the client left before its connection was set up
            log.debug("accepted connection lost before it was served: %s", exc)
            conn.close()
        except asyncio.CancelledError:  # closed before it was served
            conn.close()

    def _resume(self, sock: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        """Stop accepting and close the listening sockets. Connections already served stay;
        one accepted but not yet handed to its protocol is dropped, as ``Server.close``
        drops those still in the kernel's queue."""
        if self._closed:
            return
        self._closed = True
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()
        for task in self._handing:
            task.cancel()

    async def wait_closed(self) -> None:
        """Wait until the connections dropped by :meth:`close` are closed."""
        if self._handing:
            await asyncio.wait(list(self._handing))


async def listen(
    factory: Callable[[], asyncio.Protocol],
    host: str | None,
    port: int,
    *,
    backlog: int = 4096,
    reuse_port: bool = False,
) -> Listener:
    """Listen on every address ``host`` resolves to (None or "": all interfaces), as
    ``loop.create_server`` binds them; port 0 picks a free port."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                # As create_server: the IPv6 socket does not also take IPv4 (its own socket does).
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return Listener(sockets, factory, backlog)
