"""Everything built from one policy file, wired together; the frontends hold a reference."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric

from proxy.clock import Clock
from proxy.config import ProxyConfig
from proxy.dispatch import Dispatcher, RetryGate
from proxy.fleet.affinity import SequenceAffinity
from proxy.fleet.health import HealthChecker
from proxy.fleet.instances import Fleet
from proxy.fleet.upstream import HttpUpstreams
from proxy.placement import Chooser, FleetPlacement


class Runtime:
    def __init__(
        self,
        config: ProxyConfig,
        clock: Clock,
        rng: random.Random,
        chooser: Chooser,
        retries: RetryGate,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng
        self.fleet = Fleet(config.instances, config.health, clock)
        self.upstreams = HttpUpstreams(
            self.fleet,
            connections_per_instance=config.limits.connections_per_instance,
            connect_timeout_s=config.limits.connect_timeout_s,
            request_timeout_s=config.limits.request_timeout_s,
        )
        self.health = HealthChecker(self.fleet, self.upstreams)
        self.affinity = SequenceAffinity(
            clock,
            max_entries=config.sequences.max_entries,
            idle_timeout_s=config.sequences.idle_timeout_s,
        )
        self.placement = FleetPlacement(self.fleet, self.upstreams, chooser)
        self.dispatcher = Dispatcher(self.fleet, self.placement, self.affinity, retries)

    def session_key(self, headers: Mapping[str, str]) -> str | None:
        return headers.get(self.config.session_header) or None

    def extra_metrics(self) -> Iterator[Metric]:
        """Gauges of subsystems that export state at scrape time."""
        return iter(())

    async def start(self) -> None:
        await self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await self.upstreams.close()
