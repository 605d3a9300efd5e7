"""Active readiness probes: healthy instances every interval, ejected ones with backoff, and
models taken out of rotation on one instance (``/v2/models/NAME/ready``) with backoff."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

import aiohttp

from proxy.aio import cancel_and_wait
from proxy.fleet.instances import Fleet, Instance

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, fleet: Fleet, *, tick_s: float = 0.1) -> None:
        self.fleet = fleet
        self.tick_s = min(tick_s, fleet.health.interval_s)
        self._task: asyncio.Task[None] | None = None
        self._probe_session: aiohttp.ClientSession | None = None

    def check_soon(self, instance: Instance) -> None:
        """Probe ``instance`` at the next tick (it just answered 5xx, say)."""
        self.fleet.probe_soon(instance)

    def _session(self) -> aiohttp.ClientSession:
        # Probes get their own small pool: queued behind the request pool's connections, a
        # probe would time out on the proxy's own backlog rather than on the server.
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit_per_host=2)
            )
        return self._probe_session

    async def probe(self, instance: Instance) -> bool:
        health = self.fleet.health
        timeout = aiohttp.ClientTimeout(total=health.timeout_s)
        was_healthy = instance.healthy
        busy = False
        # The server's own "not ready", or nothing listening: no point in asking again.
        immediate = False
        try:
            async with self._session().get(
                instance.spec.http + "/v2/health/ready", timeout=timeout
            ) as resp:
                ok = resp.status == 200
                reason = f"readiness probe answered {resp.status}"
                immediate = True
        except TimeoutError:
            ok, reason = False, f"readiness probe timed out after {health.timeout_s:g} s"
            # An overloaded server answers its requests but not its probe in time: it is
            # busy, not dead, and ejecting it would only pile its load on the others.
            busy = self.fleet.clock.now() - instance.last_answer_at <= 2 * health.timeout_s
        except aiohttp.ClientError as exc:
            ok, reason = False, f"readiness probe failed: {exc or type(exc).__name__}"
            immediate = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
                exc.os_error, ConnectionRefusedError
            )
        if busy:
            log.debug("instance %s is slow to answer probes but serving requests", instance.name)
            instance.next_probe_at = self.fleet.clock.now() + health.interval_s
            return True
        if ok:
            self.fleet.report_success(instance)
            if not was_healthy:
                log.info("instance %s is ready again", instance.name)
        else:
            self.fleet.report_failure(instance, reason, immediate=immediate)
            if was_healthy and not instance.healthy:
                log.warning("instance %s ejected: %s", instance.name, reason)
        return ok

    async def probe_model(self, instance: Instance, model: str) -> bool:
        """Is ``model``, out of rotation on ``instance``, ready there again?"""
        timeout = aiohttp.ClientTimeout(total=self.fleet.health.timeout_s)
        url = f"{instance.spec.http}/v2/models/{quote(model, safe='')}/ready"
        try:
            async with self._session().get(url, timeout=timeout) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            self.fleet.include_model(instance, model)
            log.info("model %s is ready again on instance %s", model, instance.name)
        else:
            self.fleet.model_probe_failed(instance, model)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in self.fleet.all()))

    async def _run(self) -> None:
        while True:
            due = self.fleet.due_for_probe()
            models = self.fleet.due_model_probes()
            if due or models:
                await asyncio.gather(
                    *(self.probe(i) for i in due), *(self.probe_model(i, m) for i, m in models)
                )
            await asyncio.sleep(self.tick_s)

    async def start(self) -> None:
        await self.probe_all()
        self._task = asyncio.create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._probe_session is not None:
            await self._probe_session.close()
            self._probe_session = None
