"""One pooled HTTP client per Triton instance; bodies pass through untouched.

Failures are sorted into what the dispatcher needs to know: the request never reached the
instance (retry elsewhere), the connection broke (before or after the first byte of the
answer), or the instance did not answer in time. A pool that leaves the fleet (a reload
removed its instance, or a broken connection makes its idle keep-alive connections suspect)
is retired: it takes no new request and closes once the requests using it have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp

from proxy.fleet.errors import UpstreamConnectError, UpstreamLostError, UpstreamTimeoutError
from proxy.fleet.http1 import Http1Pool
from proxy.fleet.instances import Fleet, Instance

__all__ = [
    "HttpUpstreams",
    "UpstreamConnectError",
    "UpstreamLostError",
    "UpstreamTimeoutError",
    "http_failure",
]

log = logging.getLogger(__name__)

RETIRE_MAX_S = 3600.0
"""A retired pool closes when its last request ends, or after this long at the latest."""


def http_failure(
    exc: aiohttp.ClientError | TimeoutError, *, before_response: bool
) -> UpstreamConnectError | UpstreamLostError | UpstreamTimeoutError:
    """What an aiohttp client error means for the request that met it."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(text, refused=isinstance(exc.os_error, ConnectionRefusedError))
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectError(f"connect timeout ({text})")
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return UpstreamTimeoutError(text)
    if isinstance(exc, aiohttp.ClientPayloadError):
        before_response = False
    return UpstreamLostError(text, before_response=before_response)


@dataclass
class _Pool:
    url: str
    session: aiohttp.ClientSession
    http1: Http1Pool | None = None
    """Non-streaming requests to an ``http://`` instance (proxy.fleet.http1)."""
    users: int = 0

    def busy(self) -> bool:
        connector = self.session.connector
        # Acquired sockets carry a request right now; users covers a request between
        # taking the pool and acquiring a socket.
        if self.http1 is not None and self.http1.in_use:
            return True
        return self.users > 0 or bool(connector and getattr(connector, "_acquired", ()))

    async def close(self) -> None:
        if self.http1 is not None:
            self.http1.close()
        await self.session.close()


class HttpUpstreams:
    """Keeps one ``aiohttp.ClientSession`` (its own connection pool) per instance."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        connections_per_instance: int,
        connect_timeout_s: float,
        request_timeout_s: float | None,
    ) -> None:
        self.fleet = fleet
        self._connections = connections_per_instance
        self._connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        # A read timeout, not a total one: a server-sent event stream may run for long, as
        # long as the instance keeps sending; a unary answer must come within the limit.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=request_timeout_s
        )
        self._pools: dict[str, _Pool] = {}
        """instance name -> its pool"""
        self._retiring: set[asyncio.Task[None]] = set()

    def _pool(self, instance: Instance) -> _Pool:
        pool = self._pools.get(instance.name)
        if pool is not None and pool.url == instance.spec.http and not pool.session.closed:
            return pool
        if pool is not None:
            self._retire(pool)
        s = aiohttp.ClientSession(
            base_url=instance.spec.http,
            connector=aiohttp.TCPConnector(
                limit=self._connections, enable_cleanup_closed=True, force_close=False
            ),
            timeout=self._timeout,
            # Bytes travel as the server sent them: the client decompresses, not us.
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            # One pool serves every client: a cookie one response set must never ride on
            # another client's request (and no jar is consulted on the hot path).
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        http1 = None
        if instance.spec.http.startswith("http://"):
            http1 = Http1Pool(
                instance.spec.http,
                self._connections,
                self._connect_timeout_s,
                on_busy=functools.partial(self.fleet.touch, instance.name),
            )
        pool = self._pools[instance.name] = _Pool(instance.spec.http, s, http1)
        return pool

    def http1(self, instance: Instance) -> Http1Pool | None:
        """The lean pool for non-streaming requests (proxy.fleet.http1); None for https://
        instances, which keep aiohttp's client for everything."""
        return self._pool(instance).http1

    def session(self, instance: Instance) -> aiohttp.ClientSession:
        """The instance's pool, for short calls that may fail if it retires under them."""
        return self._pool(instance).session

    @contextlib.contextmanager
    def using(self, instance: Instance) -> Iterator[aiohttp.ClientSession]:
        """The instance's pool, kept open (even if retired) until the block exits."""
        pool = self._pool(instance)
        pool.users += 1
        try:
            yield pool.session
        finally:
            pool.users -= 1

    def open_connections(self, instance: Instance) -> int:
        """Connections carrying a request to ``instance`` right now (both clients)."""
        pool = self._pools.get(instance.name)
        if pool is None or pool.session.closed:
            return 0
        busy = pool.http1.in_use if pool.http1 is not None else 0
        if pool.session.connector is None:
            return busy
        return busy + len(getattr(pool.session.connector, "_acquired", ()))

    def reset(self, instance: Instance) -> None:
        """A connection to ``instance`` broke: its idle keep-alive connections are suspect
        (a dead server leaves them open on our side), so new requests get a fresh pool."""
        pool = self._pools.get(instance.name)
        if pool is not None and pool.url == instance.spec.http:
            del self._pools[instance.name]
            self._retire(pool)
            self.fleet.touch(instance.name)  # its busy connections no longer count

    async def retire(self, keep: set[str]) -> None:
        """Retire the pools of instances no longer in the fleet (or whose address changed)."""
        for name, pool in list(self._pools.items()):
            inst = self.fleet.instances.get(name)
            if name not in keep or inst is None or pool.url != inst.spec.http:
                del self._pools[name]
                self._retire(pool)

    def retiring(self) -> int:
        """Retired pools still waiting for their requests to finish."""
        return len(self._retiring)

    def _retire(self, pool: _Pool) -> None:
        task = asyncio.get_running_loop().create_task(
            self._close_when_idle(pool), name="upstream-pool-retire"
        )
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close_when_idle(self, pool: _Pool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETIRE_MAX_S
        try:
            while pool.busy() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            # Also when cancelled by close(): the shutdown drain is over.
            await pool.close()

    async def close(self) -> None:
        """Close every pool now (shutdown, after the drain)."""
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            await pool.close()
