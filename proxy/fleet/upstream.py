"""One pooled HTTP client per Triton instance; bodies pass through untouched."""

from __future__ import annotations

import aiohttp

from proxy.fleet.errors import UpstreamConnectError, UpstreamLostError
from proxy.fleet.http1 import Http1Pool
from proxy.fleet.instances import Fleet, Instance

__all__ = ["HttpUpstreams", "UpstreamConnectError", "UpstreamLostError"]


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
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout_s, sock_connect=connect_timeout_s
        )
        self._sessions: dict[str, tuple[str, aiohttp.ClientSession]] = {}
        """instance name -> (base URL, its pool)"""
        self._pools: dict[str, tuple[str, Http1Pool]] = {}
        """instance name -> (base URL, its HTTP/1.1 pool for non-streaming requests)"""

    def pool(self, instance: Instance) -> Http1Pool | None:
        """The lean pool for non-streaming requests (proxy.fleet.http1); None for https://
        instances, which keep aiohttp's client."""
        entry = self._pools.get(instance.name)
        if entry is not None and entry[0] == instance.spec.http and not entry[1].closed:
            return entry[1]
        if not instance.spec.http.startswith("http://"):
            return None
        if entry is not None:
            entry[1].close()
        pool = Http1Pool(instance.spec.http, self._connections, self._connect_timeout_s)
        self._pools[instance.name] = (instance.spec.http, pool)
        return pool

    def session(self, instance: Instance) -> aiohttp.ClientSession:
        entry = self._sessions.get(instance.name)
        if entry is not None and entry[0] == instance.spec.http and not entry[1].closed:
            return entry[1]
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
        self._sessions[instance.name] = (instance.spec.http, s)
        return s

    def open_connections(self, instance: Instance) -> int:
        """Connections carrying a request to ``instance`` right now (both clients)."""
        pooled = self._pools.get(instance.name)
        busy = pooled[1].in_use if pooled is not None else 0
        entry = self._sessions.get(instance.name)
        if entry is None or entry[1].closed or entry[1].connector is None:
            return busy
        # Acquired sockets are the ones carrying a request right now.
        return busy + len(getattr(entry[1].connector, "_acquired", ()))

    async def retire(self, keep: set[str]) -> None:
        """Close the pools of instances no longer in the fleet (or whose address changed)."""
        for name, (url, session) in list(self._sessions.items()):
            inst = self.fleet.instances.get(name)
            if name not in keep or inst is None or url != inst.spec.http:
                del self._sessions[name]
                await session.close()
        for name, (url, pool) in list(self._pools.items()):
            inst = self.fleet.instances.get(name)
            if name not in keep or inst is None or url != inst.spec.http:
                del self._pools[name]
                pool.close()

    async def close(self) -> None:
        for _, s in self._sessions.values():
            await s.close()
        self._sessions.clear()
        for _, pool in self._pools.values():
            pool.close()
        self._pools.clear()
