"""Polls every instance's Triton ``/metrics`` and keeps a windowed snapshot of each.

A failed scrape (connection error, timeout, HTTP error, unparsable text) keeps the previous
snapshot; its ``taken_at`` then ages and the router treats it as stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from types import TracebackType

import aiohttp

from proxy.clock import Clock
from proxy.fleet.metrics import LoadTracker, parse
from proxy.fleet.snapshot import InstanceSnapshot

log = logging.getLogger(__name__)


def _ignore(name: str) -> None:
    return None


class Scraper:
    """Scrapes ``targets`` (instance name -> metrics URL) every ``interval_s`` seconds.

    Use as ``async with Scraper(...) as s:`` or call :meth:`start` / :meth:`stop`. Without an
    injected ``session`` the scraper opens its own and closes it on stop. All targets are
    scraped concurrently each round; each request is bounded by ``timeout_s``.
    """

    def __init__(
        self,
        clock: Clock,
        targets: Mapping[str, str] | None = None,
        *,
        interval_s: float = 1.0,
        window_s: float = 10.0,
        timeout_s: float | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if window_s < interval_s:
            raise ValueError("window_s must be >= interval_s")
        self._clock = clock
        self.interval_s = interval_s
        self.window_s = window_s
        self.timeout_s = timeout_s if timeout_s is not None else interval_s
        self._session = session
        self._owns_session = session is None
        self._targets: dict[str, str] = {}
        self._trackers: dict[str, LoadTracker] = {}
        self._snapshots: dict[str, InstanceSnapshot] = {}
        self._errors: dict[str, str] = {}
        self.failures: dict[str, int] = {}
        """Scrape failures per instance since it became a target."""
        self._task: asyncio.Task[None] | None = None
        self.on_change: Callable[[str], None] = _ignore
        """Called with an instance's name when its snapshot is replaced or dropped (the
        runtime passes ``Fleet.touch``, so routing views refresh that instance)."""
        self.set_targets(targets or {})

    def set_targets(self, targets: Mapping[str, str]) -> None:
        """Replace the set of instances to scrape; a removed instance's state is dropped."""
        for name in set(self._targets) - set(targets):
            self._trackers.pop(name, None)
            if self._snapshots.pop(name, None) is not None:
                self.on_change(name)
            self._errors.pop(name, None)
            self.failures.pop(name, None)
        for name, url in targets.items():
            if self._targets.get(name) not in (None, url):
                # A new address is a different server: its counters are not comparable.
                self._trackers.pop(name, None)
                if self._snapshots.pop(name, None) is not None:
                    self.on_change(name)
            self.failures.setdefault(name, 0)
        self._targets = dict(targets)

    def snapshot(self, instance: str) -> InstanceSnapshot | None:
        """The newest snapshot of ``instance``, or None if never scraped successfully."""
        return self._snapshots.get(instance)

    def snapshots(self) -> Mapping[str, InstanceSnapshot]:
        return dict(self._snapshots)

    def last_error(self, instance: str) -> str | None:
        """Why the last scrape of ``instance`` failed; None after a success."""
        return self._errors.get(instance)

    async def scrape_once(self) -> None:
        """Scrape every target once, concurrently."""
        targets = dict(self._targets)
        await asyncio.gather(*(self._scrape(name, url) for name, url in targets.items()))

    async def _scrape(self, name: str, url: str) -> None:
        session = self._get_session()
        try:
            async with session.get(
                url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                resp.raise_for_status()
                text = await resp.text()
            scrape = parse(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if self._targets.get(name) == url:
                self._errors[name] = f"{type(exc).__name__}: {exc}"
                self.failures[name] = self.failures.get(name, 0) + 1
            return
        if self._targets.get(name) != url:
            return  # removed or re-addressed while we waited
        tracker = self._trackers.get(name)
        if tracker is None:
            tracker = self._trackers[name] = LoadTracker(self.window_s)
        self._snapshots[name] = tracker.observe(scrape, self._clock.now())
        self.on_change(name)
        self._errors.pop(name, None)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self.scrape_once()
            except Exception:
                # A bug in one round must not stop scraping for good: snapshots would all go
                # stale silently. Expected failures are handled per target in _scrape.
                log.exception("metrics scrape round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - began)))

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("scraper already started")
        self._task = asyncio.create_task(self._run(), name="triton-metrics-scraper")

    async def stop(self) -> None:
        """Cancel the polling task and wait for it; close the session if we opened it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Scraper:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
