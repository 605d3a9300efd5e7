"""Active readiness probes: healthy instances every interval, ejected ones with backoff."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import HttpUpstreams

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, fleet: Fleet, upstreams: HttpUpstreams, *, tick_s: float = 0.1) -> None:
        self.fleet = fleet
        self.upstreams = upstreams
        self.tick_s = min(tick_s, fleet.health.interval_s)
        self._task: asyncio.Task[None] | None = None

    def check_soon(self, instance: Instance) -> None:
        """Probe ``instance`` at the next tick (it just answered 5xx, say)."""
        instance.next_probe_at = min(instance.next_probe_at, self.fleet.clock.now())

    async def probe(self, instance: Instance) -> bool:
        timeout = aiohttp.ClientTimeout(total=self.fleet.health.timeout_s)
        was_healthy = instance.healthy
        try:
            async with self.upstreams.session(instance).get(
                "/v2/health/ready", timeout=timeout
            ) as resp:
                ok = resp.status == 200
                reason = f"readiness probe answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, reason = False, f"readiness probe failed: {exc or type(exc).__name__}"
        if ok:
            self.fleet.report_success(instance)
            if not was_healthy:
                log.info("instance %s is ready again", instance.name)
        else:
            self.fleet.report_failure(instance, reason)
            if was_healthy and not instance.healthy:
                log.warning("instance %s ejected: %s", instance.name, reason)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in self.fleet.all()))

    async def _run(self) -> None:
        while True:
            due = self.fleet.due_for_probe()
            if due:
                await asyncio.gather(*(self.probe(i) for i in due))
            await asyncio.sleep(self.tick_s)

    async def start(self) -> None:
        await self.probe_all()
        self._task = asyncio.create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
