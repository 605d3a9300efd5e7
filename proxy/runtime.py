"""Everything built from one policy file, wired together; the frontends hold a reference.

A policy reload builds a new :class:`Runtime` on the side from the new file, adopting the
running one's fleet state where instances are unchanged, then swaps one reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping

from proxy.aio import cancel_and_wait
from proxy.budget import ByteBudget
from proxy.canary import CANARY, MAIN, Splitter
from proxy.clock import Clock
from proxy.config import ProxyConfig
from proxy.control.apply import WindowApplier
from proxy.control.loops import ControlLoops
from proxy.dispatch import Arm, Dispatcher
from proxy.fleet.affinity import SequenceAffinity
from proxy.fleet.catalog import ModelCatalog
from proxy.fleet.grpc_upstream import GrpcUpstreams
from proxy.fleet.health import HealthChecker
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.model_control import ModelControl
from proxy.fleet.scraper import Scraper
from proxy.fleet.upstream import HttpUpstreams
from proxy.frontends.admin_relay import LeaderClient
from proxy.frontends.common import private_headers
from proxy.h2.client import H2Upstreams
from proxy.leadership import build_leadership
from proxy.observer import RequestObservers
from proxy.placement import FleetPlacement
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.config import RoutingConfig
from proxy.routing.engine import Router
from proxy.routing.occupancy import SAMPLE_S as OCCUPANCY_SAMPLE_S
from proxy.routing.occupancy import FillRule, LongLoad, Occupancy, busy_shares, long_free
from proxy.routing.wake import nudge_targets, quiet_instances, scraped_batch_s
from proxy.scheduling import Classifier, GateObserver, ShedReason
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.cost import CostOverride
from proxy.scheduling.models import FanOutObserver, ModelGates
from proxy.scheduling.overload import OverloadGuard
from proxy.telemetry import RequestTelemetry, Telemetry
from proxy.workers import (
    STATE_FILE,
    FollowerReports,
    SharedFleetState,
    SharedSnapshots,
    WorkerRole,
    leader_state,
    per_worker_scheduling,
    write_state,
)

log = logging.getLogger(__name__)


class _GateTelemetry(GateObserver):
    def __init__(self, telemetry: Telemetry) -> None:
        self.t = telemetry

    def on_dispatch(self, class_name: str, waited_s: float, order: int) -> None:
        self.t.queue_wait_by.get(class_name).observe(waited_s)

    def on_shed(self, class_name: str, reason: ShedReason) -> None:
        self.t.shed.labels(class_name, reason.value).inc()

    def on_boost(self, class_name: str) -> None:
        self.t.boosted.labels(class_name).inc()


def fill_rule(routing: RoutingConfig) -> FillRule:
    """An arm's fill rule from its routing section."""
    return FillRule(routing.occupancy_depth, routing.fill_from_load)


class Runtime:
    def __init__(
        self,
        config: ProxyConfig,
        clock: Clock,
        rng: random.Random,
        telemetry: Telemetry,
        *,
        gate_observer: GateObserver | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        role: WorkerRole | None = None,
    ) -> None:
        self.config = config
        self.role = role
        """One of several worker processes (``serve --workers``), or None."""
        self.workers = role.count if role is not None else 1
        self.private_headers = private_headers(config)
        """Names of headers the proxy consumes and never forwards (credentials, class)."""
        self.clock = clock
        self.rng = rng
        self.telemetry = telemetry
        self.fleet = Fleet(config.instances, config.health, clock)
        self.fleet.listeners.append(self._on_health_change)
        self.upstreams = HttpUpstreams(
            self.fleet,
            connections_per_instance=config.limits.connections_per_instance,
            connect_timeout_s=config.limits.connect_timeout_s,
            request_timeout_s=config.limits.request_timeout_s,
        )
        engine = H2Upstreams if config.listen.grpc_engine == "h2" else GrpcUpstreams
        self.grpc_upstreams: GrpcUpstreams | H2Upstreams = engine(
            self.fleet,
            max_send_bytes=config.limits.max_body_bytes,
            connect_timeout_s=config.limits.connect_timeout_s,
            request_timeout_s=config.limits.request_timeout_s,
        )
        self.health = HealthChecker(self.fleet)
        self.budget = ByteBudget(config.limits.max_buffered_bytes)
        self.draining = False
        """Shutdown began: readiness answers "not ready" (see ``ProxyServer.stop``)."""
        self.admin_leader: LeaderClient | None = None
        """A follower worker's way to the leader, which alone fans model control out
        (:mod:`proxy.frontends.admin_relay`; set by ``ProxyServer``)."""
        self.affinity = SequenceAffinity(
            clock,
            max_entries=config.sequences.max_entries,
            idle_timeout_s=config.sequences.idle_timeout_s,
        )
        self.catalog = ModelCatalog(self.fleet, self.upstreams, clock)
        scrape = config.scrape
        self.scraper: Scraper | SharedSnapshots
        if role is None or role.leader:
            self.scraper = Scraper(
                clock,
                {i.name: i.metrics for i in config.instances if i.metrics},
                interval_s=scrape.interval_s,
                window_s=scrape.window_s,
                timeout_s=scrape.timeout_s,
            )
        else:
            # A follower worker reads the leader's snapshots and health verdicts.
            self.scraper = SharedSnapshots(
                role.state_dir / STATE_FILE,
                self.fleet,
                scrape.interval_s,
                report_path=role.report_file(),
                on_state=self._adopt_control,
            )
        self.scraper.on_change = self.fleet.touch
        self._publisher: asyncio.Task[None] | None = None
        self._waker: asyncio.Task[None] | None = None
        self._nudging: set[asyncio.Task[None]] = set()
        self._meter: asyncio.Task[None] | None = None
        # The leader worker shares its drain marks and class factors (proxy.workers).
        self._followers: FollowerReports | None = None
        if role is not None and role.leader and role.count > 1:
            self._followers = FollowerReports(role)
        self._drain_epoch = 0
        self._mark_epoch: dict[tuple[str, str], int] = {}
        """(instance, model) drained -> the drain epoch that published its mark."""
        self.leadership = build_leadership(
            config.leadership, clock, eligible=role is None or role.leader
        )
        self.router = Router(config.routing, clock, rng, observer=self._decided)
        self.placement = FleetPlacement(
            self.fleet,
            self.upstreams,
            self._place,
            self.scraper.snapshot,
            self._slot_limit,
            self._slots_by_level,
            self._woke,
            self._keeps_sessions,
        )
        observers: list[GateObserver] = [_GateTelemetry(telemetry)]
        if gate_observer is not None:
            observers.append(gate_observer)
        self._gate_observer = FanOutObserver(observers)
        self.gates: ModelGates | None = None
        classifier = None
        if config.scheduling is not None:
            self.gates = ModelGates(
                self._scheduling(config),
                self.fleet,
                clock,
                self._gate_observer,
                workers=self.workers,
                packs_long=self._packs_long,
            )
            classifier = Classifier(config.scheduling)
            self._export_boostable(config.scheduling)
        self.observers = RequestObservers([RequestTelemetry(telemetry)])
        """Every finished request fans out from here (telemetry, control loops)."""
        self.model_control = ModelControl(self.upstreams)
        self.control = ControlLoops(
            config.control,
            config.scheduling,
            fleet=self.fleet,
            gates=lambda: self.gates,
            snapshots=self.scraper.snapshots,
            applier=WindowApplier(
                self.fleet,
                self.model_control,
                on_drain=self._drain_changed,
                remote_in_flight=self._remote_in_flight,
            ),
            clock=clock,
            telemetry=telemetry,
            # The control loops act only in the leader worker of the leader replica.
            is_leader=lambda: self.leadership.is_leader() and is_leader(),
        )
        self.observers.add(self.control)
        self.dispatcher = Dispatcher(
            self.fleet,
            self.placement,
            self.affinity,
            self.router.retry_budget,
            self.catalog,
            telemetry,
            admission=self.gates,
            classifier=classifier,
            max_retries=config.routing.retry.max_retries,
            request_timeout_s=config.limits.request_timeout_s,
            on_lost=self.upstreams.reset,
            observer=self.observers,
            cancel_upstream=config.limits.cancel_upstream,
        )
        self.dispatcher.costs.set_overrides(cost_overrides(config))
        self.dispatcher.fill = fill_rule(config.routing)
        self.dispatcher.overload = self._overload_guard(config)
        self.canary_router: Router | None = None
        self.canary_gates: ModelGates | None = None
        self.canary_placement = FleetPlacement(
            self.fleet,
            self.upstreams,
            self._place_canary,
            self.scraper.snapshot,
            self._canary_slot_limit,
            self._canary_slots_by_level,
            self._woke,
            self._canary_keeps_sessions,
        )
        self._set_canary(config)

    # --- wiring -------------------------------------------------------------------------
    def _overload_guard(self, config: ProxyConfig) -> OverloadGuard | None:
        scheduling = config.scheduling
        if scheduling is None or scheduling.overload is None:
            return None
        return OverloadGuard(
            scheduling.overload,
            scheduling.classes,
            self.clock,
            self.rng,
            retry_after_s=scheduling.retry_after_s,
        )

    def observe_lag(self, lag_s: float) -> None:
        """One sample of the event loop's lag (:meth:`Telemetry.watch_loop_lag`)."""
        guard = self.dispatcher.overload
        if guard is None:
            return
        before = guard.pressure
        if guard.observe_lag(lag_s):
            log.info(
                "overload: the event loop lagged %.1f ms on average over %g s (limit %g ms): "
                "pressure %.2f -> %.2f of %g",
                guard.last_lag_ms,
                guard.config.step_s,
                guard.config.lag_ms,
                before,
                guard.pressure,
                guard.ceiling,
            )

    def _export_boostable(self, scheduling: SchedulingConfig) -> None:
        """``triton_proxy_boosted_total`` at 0 for every class the floor boost may lift, so
        a dashboard's rate reads 0 rather than no data until the first boost."""
        for klass in scheduling.boosted_classes():
            self.telemetry.boosted.labels(klass)

    def _scheduling(self, config: ProxyConfig) -> SchedulingConfig:
        """This process's part of the scheduling section (all of it without workers)."""
        assert config.scheduling is not None
        return per_worker_scheduling(config.scheduling, self.workers)

    def _place(
        self, request: RouteRequest, source: FleetPlacement, exclude: frozenset[str]
    ) -> Candidate | None:
        # self.router, read per call: a reload swaps it.
        return self.router.place(request, source, exclude)

    def _place_canary(
        self, request: RouteRequest, source: FleetPlacement, exclude: frozenset[str]
    ) -> Candidate | None:
        # A request that entered the canary arm just before a reload removed it is placed by
        # the main router.
        router = self.canary_router
        return (router or self.router).place(request, source, exclude)

    def _keeps_sessions(self, model: str) -> bool:
        return self.router.keeps_sessions(model)  # self.router, read per call: a reload swaps it

    def _canary_keeps_sessions(self, model: str) -> bool:
        return (self.canary_router or self.router).keeps_sessions(model)  # as _place_canary

    def _packs_long(self, model: str) -> bool:
        return self.router.packs_long(model)  # the router in place: a reload swaps it first

    def _canary_packs_long(self, model: str) -> bool:
        return (self.canary_router or self.router).packs_long(model)

    def _busy_depth(self, share: float, model: str) -> int:
        """Requests of ``model`` in flight per instance that make its fill 1 at
        ``routing.occupancy_depth`` ``share``: that share of its ``max_batch_size``, this
        worker's share of it with ``serve --workers`` (each sees its own requests only), at
        least 1."""
        info = self.catalog.cached(model)
        batch = info.max_batch_size if info is not None else 1
        return max(1, round(share * batch / self.workers))

    def _woke(self, instance: str) -> None:
        self.telemetry.wakes.labels(instance).inc()

    def _quiet_after(self, model: str) -> float | None:
        """How long ``model`` may go without a send to an instance running it before that
        instance is quiet (proxy.routing.wake); None: not judged (batch time unknown)."""
        info = self.catalog.cached(model)
        batch = info.max_batch_size if info is not None else 1
        batch_s = self.dispatcher.costs.batch_seconds(model, batch)
        if batch_s is None:
            snapshots = self.scraper.snapshots().values()
            batch_s = scraped_batch_s(
                snap.models[model].compute_us for snap in snapshots if model in snap.models
            )
        return self.config.routing.wake.quiet_after_s(batch_s)

    def _quiet_after_work(self, model: str, cost: float) -> float | None:
        """The same for an instance with ``cost`` of ``model`` in flight (``by_work``): a
        margin over one batch of it on the learned cost curve (None: curve unknown)."""
        return self.config.routing.wake.quiet_after_s(self.dispatcher.costs.seconds(model, cost))

    async def _find_quiet(self) -> None:
        """Every ``routing.wake.scan_ms``: which instances are quiet (proxy.routing.wake)."""
        while True:
            wake = self.config.routing.wake  # read per tick: a reload may change it
            await asyncio.sleep(wake.scan_ms / 1e3)
            self.dispatcher.nudge = wake.enabled and wake.nudge
            self.dispatcher.expired_copy = wake.enabled and wake.nudge and wake.expired_copy
            self.dispatcher.real_copy = wake.real_copy
            if wake.enabled:
                self.fleet.quiet = quiet_instances(
                    self.fleet.instances.values(),
                    self.clock.now(),
                    self._quiet_after,
                    self._quiet_after_work if wake.by_work else None,
                    wake.ring_after_s(),
                )
                if wake.nudge:
                    self._nudge()
            elif self.fleet.quiet:
                self.fleet.quiet = {}

    def _nudge(self) -> None:
        """Send each quiet instance holding a short request a copy of it (routing.wake.nudge)."""
        now = self.clock.now()
        for inst, _model, resend in nudge_targets(self.fleet.quiet, self.fleet.instances):
            inst.woken_at = now  # judged again only once it has answered
            for names in self.fleet.quiet.values():
                names.discard(inst.name)  # woken: nothing to redirect there
            self.telemetry.nudges.labels(inst.name).inc()
            task = asyncio.get_running_loop().create_task(_dropped(resend()))
            self._nudging.add(task)
            task.add_done_callback(self._nudging.discard)

    async def _measure_occupancy(self) -> None:
        """Every ``SAMPLE_S``: the fleet's busy share per model, its fill at each arm's
        ``routing.occupancy_depth`` (its long load where an arm has ``routing.fill_from_load``
        as well), and its instances free of long work (proxy.routing.occupancy)."""
        while True:
            await asyncio.sleep(OCCUPANCY_SAMPLE_S)
            fleet, gates = self.fleet, self.gates
            now, saturated = self.clock.now(), gates.saturated() if gates is not None else ()
            fleet.occupancy.sample(busy_shares(fleet.instances.values()), now, saturated)
            d = self.dispatcher  # read per tick: a reload may change the rules
            rules = {d.fill} if d.canary is None else {d.fill, d.canary.fill}
            depths = {rule.depth for rule in rules if rule.depth}
            for depth in fleet.fills.keys() - depths:
                del fleet.fills[depth]
            for depth in depths:
                fill = fleet.fills.setdefault(depth, Occupancy())
                at = functools.partial(self._busy_depth, depth)
                fill.sample(busy_shares(fleet.instances.values(), at), now, saturated)
            if not any(rule.from_load for rule in rules if rule.depth):
                fleet.long_load = None
            else:
                if fleet.long_load is None:
                    fleet.long_load = LongLoad()
                fleet.long_load.sample(now, self.workers)
            fleet.long_free = long_free(fleet.instances.values())

    def _decided(self, model: str, policy: str, instance: str, seconds: float) -> None:
        self._decided_in(MAIN, model, policy, instance, seconds)

    def _decided_canary(self, model: str, policy: str, instance: str, seconds: float) -> None:
        self._decided_in(CANARY, model, policy, instance, seconds)

    def _decided_in(self, arm: str, model: str, policy: str, instance: str, seconds: float) -> None:
        self.telemetry.decisions_by.get(model, policy, instance, arm).inc()
        self.telemetry.decision_time_by.get(policy).observe(seconds)

    def is_leader(self) -> bool:
        """Whether this process may change the fleet's configuration (batching windows):
        the leader worker of the leader replica (proxy.leadership, proxy.workers)."""
        return self.leadership.is_leader()

    def _set_canary(self, config: ProxyConfig) -> None:
        """Builds (or removes) the canary arm of ``config`` beside the main arm, which must be
        in place already. Gates of a removed arm are dropped, not closed: what waits in them
        still drains as their slots free up."""
        canary = config.canary
        d = self.dispatcher
        if canary is None:
            d.canary = d.splitter = None
            self.canary_router = None
            self.canary_gates = None
            self._set_gate_shares(1.0, None)
            return
        stats = self.canary_router.stats if self.canary_router is not None else None
        router = Router(
            canary.routing or config.routing,
            self.clock,
            self.rng,
            stats,
            observer=self._decided_canary,
        )
        self.canary_router = router  # before its gates: they read its policies (packs_long)
        if canary.scheduling is None:
            self.canary_gates = None
            admission, classifier = self.gates, d.classifier
            self._set_gate_shares(1.0, None)
        else:
            scheduling = per_worker_scheduling(canary.scheduling, self.workers)
            if self.canary_gates is None:
                self.canary_gates = ModelGates(
                    scheduling,
                    self.fleet,
                    self.clock,
                    self._gate_observer,
                    workers=self.workers,
                    packs_long=self._canary_packs_long,
                )
            else:
                self.canary_gates.reconfigure(scheduling)
            admission, classifier = self.canary_gates, Classifier(canary.scheduling)
            self._set_gate_shares(1.0 - canary.share, canary.share)
        fill = fill_rule(canary.routing or config.routing)
        d.canary = Arm(CANARY, self.canary_placement, admission, classifier, fill)
        d.splitter = Splitter(canary.share, canary.split, self.rng)

    def _set_gate_shares(self, main: float, canary: float | None) -> None:
        for gates, share in ((self.gates, main), (self.canary_gates, canary)):
            if gates is not None and share is not None:
                gates.share = share
                gates.poke()
        self.fleet.journal.reset()  # every instance's slots may have changed

    def _poke_gates(self) -> None:
        if self.gates is not None:
            self.gates.poke()

    def _drain_changed(self) -> None:
        """A drain mark was set or cleared here: the gates' capacity changed; the leader
        worker tells the others at once (a new drain epoch)."""
        self._poke_gates()
        if self._followers is None:
            return
        self._drain_epoch += 1
        marks = {(i.name, m) for i in self.fleet.all() for m in i.draining}
        self._mark_epoch = {k: self._mark_epoch.get(k, self._drain_epoch) for k in sorted(marks)}
        self._publish_once()

    def _remote_in_flight(self, instance: str, model: str) -> int | None:
        if self._followers is None:
            return 0
        return self._followers.in_flight(
            instance, model, self._mark_epoch.get((instance, model), self._drain_epoch)
        )

    def _adopt_control(self, state: SharedFleetState, drains_changed: bool) -> None:
        """Follower: the leader's class factors on this worker's gates; its drain marks (already
        on the fleet) change the gates' capacity."""
        gates = self.gates
        if gates is not None:
            for model, gate in gates.gates.items():
                scales = state.class_scales.get(model, {})
                for klass in gate.config.classes:
                    factor = scales.get(klass, 1.0)
                    if gate.share_scale(klass) != factor:
                        gate.set_share_scale(klass, factor)
        if drains_changed:
            self._poke_gates()

    def _on_health_change(self, instance: Instance) -> None:
        if not instance.healthy:
            self.telemetry.ejections.labels(instance.name).inc()
            self.affinity.forget_instance(instance.name, f"was ejected ({instance.ejected_reason})")

    def ready(self) -> bool:
        """What the proxy's own readiness endpoints answer."""
        return not self.draining and self.fleet.any_healthy()

    def _slot_limit(self, instance: str, model: str) -> int | None:
        return self.gates.slot_limit(instance, model) if self.gates is not None else None

    def _canary_slot_limit(self, instance: str, model: str) -> int | None:
        gates = self.canary_gates or self.gates
        return gates.slot_limit(instance, model) if gates is not None else None

    def _slots_by_level(self, model: str) -> bool:
        return self.gates is not None and self.gates.slots_by_level(model)

    def _canary_slots_by_level(self, model: str) -> bool:
        gates = self.canary_gates or self.gates
        return gates is not None and gates.slots_by_level(model)

    def session_key(self, headers: Mapping[str, str]) -> str | None:
        return headers.get(self.config.routing.session_header.lower()) or None

    # --- reload -------------------------------------------------------------------------
    async def apply(self, config: ProxyConfig) -> list[str]:
        """Adopt a reloaded policy in place, keeping fleet state, counts and queues.

        Everything that can fail is built first; then each part is swapped by one reference,
        so a request sees either the old policy or the new one. Returns the sections that only
        take effect on restart (listening ports, limits, sequence table).
        """
        router = Router(
            config.routing, self.clock, self.rng, self.router.stats, observer=self._decided
        )
        classifier = Classifier(config.scheduling) if config.scheduling is not None else None
        restart_only = [
            name
            for name in ("listen", "limits", "sequences", "scrape", "leadership")
            if getattr(config, name) != getattr(self.config, name)
        ]
        new_specs = {i.name: i for i in config.instances}
        for inst in self.fleet.all():
            if new_specs.get(inst.name) != inst.spec:
                # Its open sequences cannot follow it (their state lives on that server).
                self.affinity.forget_instance(inst.name, "was removed by a policy reload")
        self.fleet.set_specs(config.instances, config.health)
        self.scraper.set_targets({i.name: i.metrics for i in config.instances if i.metrics})
        await self.upstreams.retire({i.name for i in config.instances})
        await self.grpc_upstreams.retire({i.name for i in config.instances})
        self.router = router
        if config.scheduling is None:
            # Requests already queued drain through the old gates as slots free up.
            self.gates = None
        elif self.gates is None:
            self.gates = ModelGates(
                self._scheduling(config),
                self.fleet,
                self.clock,
                self._gate_observer,
                workers=self.workers,
                packs_long=self._packs_long,
            )
        else:
            self.gates.reconfigure(self._scheduling(config))
        if config.scheduling is not None:
            self._export_boostable(config.scheduling)
        self.dispatcher.reconfigure(
            admission=self.gates,
            classifier=classifier,
            retries=router.retry_budget,
            max_retries=config.routing.retry.max_retries,
        )
        self.dispatcher.costs.set_overrides(cost_overrides(config))
        self.dispatcher.fill = fill_rule(config.routing)
        if config.scheduling != self.config.scheduling:
            self.dispatcher.overload = self._overload_guard(config)
        self.control.reconfigure(config.control, config.scheduling)
        self._set_canary(config)
        self.config = config
        # Slot limits and shares may have changed without any instance changing: routing
        # views refresh every instance before their next decision.
        self.fleet.journal.reset()
        self.private_headers = private_headers(config)
        return restart_only

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self.role is None or self.role.leader:
            await self.health.start()
        else:
            # Followers probe once, to start from the truth; then the leader probes.
            await self.health.probe_all()
        await self.scraper.start()
        if self.role is not None and self.role.leader:
            self._publisher = asyncio.create_task(self._publish(), name="fleet-state-publisher")
        self._waker = asyncio.create_task(self._find_quiet(), name="quiet-instances")
        self._meter = asyncio.create_task(self._measure_occupancy(), name="occupancy")
        await self.leadership.start()
        await self.control.start()

    async def _publish(self) -> None:
        """Leader: share snapshots and health verdicts with the followers (proxy.workers)."""
        assert self.role is not None
        while True:
            self._publish_once()
            await asyncio.sleep(self.config.scrape.interval_s / 2)

    def _publish_once(self) -> None:
        assert self.role is not None
        try:
            state = leader_state(
                self.fleet,
                self.scraper.snapshots(),
                self.clock.now(),
                drain_epoch=self._drain_epoch,
                class_scales=self.control.applied_scales(),
            )
            write_state(self.role.state_dir / STATE_FILE, state)
        except OSError as exc:
            log.warning("could not publish the fleet state to the other workers: %s", exc)

    async def stop(self) -> None:
        await self.control.stop()
        await self.leadership.stop()
        await cancel_and_wait(self._publisher, self._waker, self._meter, *self._nudging)
        self._publisher = self._waker = self._meter = None
        for gates in (self.gates, self.canary_gates):
            if gates is not None:
                gates.close()
        await self.catalog.close()
        await self.scraper.stop()
        await self.health.stop()
        await self.upstreams.close()
        await self.grpc_upstreams.close()


async def _dropped(send: Awaitable[object]) -> None:
    """A nudge's answer, or its failure, is nobody's."""
    with contextlib.suppress(Exception):
        await send


def cost_overrides(config: ProxyConfig) -> Mapping[str, CostOverride]:
    """The policy file's cost curves per model (``scheduling.cost.models``)."""
    return config.scheduling.cost.models if config.scheduling is not None else {}
