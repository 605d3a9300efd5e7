"""Runs the SLO loops: feeds them, asks them each tick, applies (or, in dry run, only reports).

:class:`ControlLoops` subscribes to the runtime's :class:`~proxy.observer.RequestObservers` for
the class latencies, reads the gates (queued requests) and the scraper (Triton's queue time and
pending requests) once per ``tick_s``, and hands each decision to the gate (class limits) or to
the :class:`~proxy.control.apply.WindowApplier` (batching window, in a background task, one
model at a time). Every decision is counted, exported and logged with its reason.

A window change waits for headroom (:mod:`proxy.control.headroom`): while the other instances
could not carry the model's load without the one to drain, the change is deferred (counted once
per episode as ``reason="no_headroom"``, logged once, exported as
``triton_proxy_control_deferred_seconds``) and tried again at every tick; the dwell starts only
when a change goes ahead. An episode ends when the change goes ahead, or when the loop has not
wanted it for ``window_s`` (so a condition that flickers from tick to tick is one episode). A
change that stopped part way (deferred between two instances, or failed) is resumed at a later
tick (at once when headroom returns; after ``dwell_s`` after a failure).

Only the leader runs the loops (``is_leader``, injected; every process but one sees False).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proxy.aio import cancel_and_wait
from proxy.clock import Clock
from proxy.control.apply import WindowApplier
from proxy.control.batching import BatchingController, BatchingSample, ClassP99
from proxy.control.class_limits import ClassLimitController
from proxy.control.config import ControlConfig
from proxy.control.decision import Decision
from proxy.control.headroom import Headroom, InstanceLoad, busy_share, check_all
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.model_control import ModelControlError
from proxy.fleet.snapshot import InstanceSnapshot
from proxy.observer import RequestRecord
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.models import ModelGates
from proxy.stats.window import WindowedQuantiles
from proxy.telemetry import Telemetry

log = logging.getLogger("proxy.control")

MISS_FACTOR = 10.0
"""A shed or failed request of an SLO class is recorded as this many times its SLO."""
OFF_REASONS = ("refused", "no_dynamic_batching")
"""Why the batching-window loop gives up on a model (``triton_proxy_control_off_total``)."""


@dataclass(frozen=True)
class ClassRoles:
    """Which class the loops protect and which they may limit."""

    top: str
    """The most important class with ``slo_p99_ms``."""
    slo_s: Mapping[str, float]
    """Every class with an SLO, in seconds."""
    lower: tuple[str, ...]
    """Classes ranked below ``top``, most important first."""
    throughput: tuple[str, ...]
    """Classes without an SLO."""

    @staticmethod
    def of(scheduling: SchedulingConfig | None) -> ClassRoles | None:
        if scheduling is None:
            return None
        classes = scheduling.classes
        slo = {n: c.slo_p99_ms / 1e3 for n, c in classes.items() if c.slo_p99_ms is not None}
        if not slo:
            return None
        top = min(slo, key=lambda n: (classes[n].rank, n))
        rank = classes[top].rank
        lower = tuple(
            sorted((n for n, c in classes.items() if c.rank > rank), key=lambda n: classes[n].rank)
        )
        throughput = tuple(n for n in classes if n not in slo)
        return ClassRoles(top, slo, lower, throughput)


class ControlLoops:
    def __init__(
        self,
        config: ControlConfig,
        scheduling: SchedulingConfig | None,
        *,
        fleet: Fleet,
        gates: Callable[[], ModelGates | None],
        snapshots: Callable[[], Mapping[str, InstanceSnapshot]],
        applier: WindowApplier,
        clock: Clock,
        telemetry: Telemetry,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self.fleet = fleet
        self.gates = gates
        self.snapshots = snapshots
        self.applier = applier
        self.clock = clock
        self.telemetry = telemetry
        self.is_leader = is_leader
        self.config = config
        self.scheduling = scheduling
        self.roles = ClassRoles.of(scheduling)
        self._latency: dict[tuple[str, str], WindowedQuantiles] = {}
        self._backlog: dict[str, deque[tuple[float, float]]] = {}
        self._load: dict[str, deque[tuple[float, float]]] = {}
        """Per model: (time, requests in flight on its instances + queued in the proxy)."""
        self._deferred: dict[str, float] = {}
        """Models whose window change waits for headroom -> since when (clock seconds)."""
        self._unwanted: dict[str, float] = {}
        """Deferred models whose change the loop stopped wanting -> since when; the episode
        ends after ``window_s`` of that, so a flickering condition is one episode."""
        self._retry_at: dict[str, float] = {}
        """Models whose last change stopped part way -> earliest time to resume it."""
        self._limits: dict[str, ClassLimitController] = {}
        self._batching: dict[str, BatchingController] = {}
        self.window_target: dict[str, int] = {}
        """Each model's window as the loop sees it (in dry run, the one it would have set)."""
        self.windows: dict[tuple[str, str], int] = {}
        """(instance, model) -> the window Triton runs there, as last read or set."""
        self._off: set[str] = set()
        """Models the batching loop gave up on (no dynamic batcher, or model control refused)."""
        self._applying: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._warned_no_slo = False
        applier.on_window = self._learn_window

    # --- inputs ---------------------------------------------------------------------------
    def on_request(self, record: RequestRecord) -> None:
        """An answered request of an SLO class adds its latency; one that was shed or failed
        on the service's side adds ``MISS_FACTOR x`` its SLO (a miss, whatever its latency), so
        a class whose requests do not come back does not look healthy."""
        if self.roles is None or not self.config.any_enabled:
            return
        slo = self.roles.slo_s.get(record.class_name)
        if slo is None:
            return
        if record.succeeded:
            latency = record.latency_s
        elif record.missed_service:
            latency = max(record.latency_s, MISS_FACTOR * slo)
        else:
            return  # the client's own mistake (bad input, unknown model)
        key = (record.model, record.class_name)
        w = self._latency.get(key)
        if w is None:
            w = self._latency[key] = WindowedQuantiles(self.config.window_s)
        w.record(latency, record.at)

    def p99(self, model: str, class_name: str, now: float) -> float | None:
        w = self._latency.get((model, class_name))
        if w is None:
            return None
        merged = w.merged(now)
        if merged.count < self.config.min_samples:
            return None
        value = merged.quantile(0.99)
        return None if value is None else value / 1e6

    def _learn_window(self, instance: str, model: str, window_us: int | None) -> None:
        if window_us is None:
            self.windows.pop((instance, model), None)
        else:
            self.windows[(instance, model)] = window_us

    # --- reload ---------------------------------------------------------------------------
    def reconfigure(self, config: ControlConfig, scheduling: SchedulingConfig | None) -> None:
        was = self.config
        self.config = config
        self.scheduling = scheduling
        self.roles = ClassRoles.of(scheduling)
        if config.window_s != was.window_s:
            self._latency.clear()
        for c in self._limits.values():
            c.reconfigure(config.class_limits)
        for b in self._batching.values():
            b.reconfigure(config.batching)
        if not config.class_limits.enabled or config.dry_run:
            self._reset_limits()
        if not config.class_limits.enabled:
            self._limits.clear()
        if not config.batching.enabled:
            self._batching.clear()
            self.window_target.clear()
            self._deferred.clear()
            self._unwanted.clear()
            self._retry_at.clear()
        self._off.clear()  # a new policy may name other models; give each one a new try

    def _reset_limits(self) -> None:
        gates = self.gates()
        for model, ctl in self._limits.items():
            for name in ctl.factors:
                if gates is not None and model in gates.gates:
                    gates.gates[model].set_share_scale(name, 1.0)

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="control-loops")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *self._applying.values())
        self._task = None
        self._applying.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            if self.config.any_enabled and self.is_leader():
                await self.tick()

    # --- one tick -------------------------------------------------------------------------
    async def tick(self) -> None:
        now = self.clock.now()
        roles = self.roles
        if roles is None:
            if not self._warned_no_slo:
                self._warned_no_slo = True
                log.warning(
                    "control loops are on but no scheduling class has slo_p99_ms: nothing to do"
                )
            return
        gates = self.gates()
        models = set(gates.gates) if gates is not None else set()
        models.update(m for m, _ in self._latency)
        snaps = self.snapshots()
        for model in sorted(models):
            self._sample_backlog(model, roles, gates, snaps, now)
            if self.config.class_limits.enabled:
                self._tick_limits(model, roles, gates, now)
            if self.config.batching.enabled:
                await self._tick_batching(model, roles, snaps, now)

    def _sample_backlog(
        self,
        model: str,
        roles: ClassRoles,
        gates: ModelGates | None,
        snaps: Mapping[str, InstanceSnapshot],
        now: float,
    ) -> None:
        queued = 0
        gate = gates.gates.get(model) if gates is not None else None
        if gate is not None:
            queued = sum(gate.queued(c) for c in roles.throughput)
        pending = sum(s.model(model).pending for s in snaps.values())
        self._append(self._backlog, model, now, queued + pending)
        self._append(self._load, model, now, self._load_now(model, gates))

    def _append(
        self, series: dict[str, deque[tuple[float, float]]], model: str, now: float, v: float
    ) -> None:
        d = series.setdefault(model, deque())
        d.append((now, v))
        while d and d[0][0] <= now - self.config.window_s:
            d.popleft()

    def backlog(self, model: str) -> float:
        d = self._backlog.get(model)
        return sum(v for _, v in d) / len(d) if d else 0.0

    def _load_now(self, model: str, gates: ModelGates | None) -> int:
        """``L_now``: the model's requests in flight on its instances + queued in the proxy."""
        gate = gates.gates.get(model) if gates is not None else None
        queued = gate.queued() if gate is not None else 0
        return queued + sum(i.model_in_flight.get(model, 0) for i in self.fleet.all())

    def headroom(self, model: str, drains: Sequence[str]) -> Headroom:
        """The headroom rule (:func:`proxy.control.headroom.check_all`) for draining each of
        ``drains`` in turn, on the proxy's view of the model's instances now."""
        gates = self.gates()
        info = gates.info(model) if gates is not None else None
        snaps = self.snapshots()
        loads = []
        for inst in self.fleet.serving(model):
            if model in inst.draining:
                continue
            busy = None
            snap = snaps.get(inst.name)
            if snap is not None and info is not None:
                m = snap.model(model)
                busy = busy_share(m.exec_rate, m.compute_us, info.model_instances)
            loads.append(
                InstanceLoad(
                    inst.name,
                    inst.model_in_flight.get(model, 0),
                    gates.slot_limit(inst.name, model) if gates is not None else None,
                    busy,
                )
            )
        d = self._load.get(model)
        mean = sum(v for _, v in d) / len(d) if d else 0.0
        load = max(float(self._load_now(model, gates)), mean)
        return check_all(drains, loads, load, self.config.batching.headroom_ratio)

    def _to_drain(self, model: str, window_us: int) -> list[str]:
        """Instances serving ``model`` whose window is not ``window_us`` (or not known)."""
        return [
            i.name
            for i in self.fleet.serving(model)
            if self.windows.get((i.name, model)) != window_us
        ]

    def _behind(self, model: str, window_us: int) -> bool:
        """Some instance is known to run another window than the model's target."""
        return any(
            self.windows.get((i.name, model), window_us) != window_us
            for i in self.fleet.serving(model)
        )

    @property
    def deferred(self) -> Mapping[str, float]:
        """Models whose window change waits for headroom -> since when."""
        return dict(self._deferred)

    def _defer(self, model: str, direction: str, change: str, verdict: Headroom) -> None:
        """A window change waits for headroom: counted and logged once per episode."""
        self._unwanted.pop(model, None)
        if model in self._deferred:
            return
        self._deferred[model] = self.clock.now()
        dry = self.config.dry_run
        counter = self.telemetry.control_dry_run_decisions if dry else self.telemetry.control
        counter.labels("batching", model, direction, "no_headroom").inc()
        log.info(
            "%sbatching %s * %s deferred: no_headroom (%s: %s)",
            "dry run: " if dry else "",
            model,
            change,
            verdict.reason,
            verdict.detail,
        )

    def _end_deferral(self, model: str, why: str) -> None:
        self._unwanted.pop(model, None)
        since = self._deferred.pop(model, None)
        if since is not None:
            log.info(
                "batching %s: %s after %.0f s without headroom",
                model,
                why,
                self.clock.now() - since,
            )

    def _tick_limits(
        self, model: str, roles: ClassRoles, gates: ModelGates | None, now: float
    ) -> None:
        ctl = self._limits.get(model)
        if ctl is None:
            ctl = self._limits[model] = ClassLimitController(model, self.config.class_limits)
        d = ctl.observe(
            roles.top, self.p99(model, roles.top, now), roles.slo_s[roles.top], roles.lower, now
        )
        if d is None:
            return
        if not self.config.dry_run and gates is not None and model in gates.gates:
            gates.gates[model].set_share_scale(d.target, d.new)
        self._report(d, f"{d.old:.2f} -> {d.new:.2f}")

    async def _tick_batching(
        self,
        model: str,
        roles: ClassRoles,
        snaps: Mapping[str, InstanceSnapshot],
        now: float,
    ) -> None:
        if model in self._off or model in self._applying:
            return
        cfg = self.config.batching
        if cfg.models and model not in cfg.models:
            return
        current = self.window_target.get(model)
        if current is None:
            self._export_zero_failures(model)
            current = await self._read_window(model)
            if current is None:
                return
            self.window_target[model] = current
        ctl = self._batching.get(model)
        if ctl is None:
            ctl = self._batching[model] = BatchingController(cfg)
        queue = [s.model(model).queue_us for s in snaps.values()]
        known = [q for q in queue if q is not None]
        sample = BatchingSample(
            model=model,
            window_us=current,
            top=roles.top,
            slo_classes={
                n: ClassP99(self.p99(model, n, now), slo) for n, slo in roles.slo_s.items()
            },
            triton_queue_us=sum(known) / len(known) if known else None,
            backlog=self.backlog(model),
            backlog_now=self._backlog[model][-1][1] if self._backlog.get(model) else None,
        )
        d = ctl.observe(sample, now)
        if d is None:
            if self.config.dry_run or not self._behind(model, current):
                if model in self._deferred:
                    since = self._unwanted.setdefault(model, now)
                    if now - since >= self.config.window_s:
                        self._end_deferral(model, f"change not wanted for {now - since:.0f} s")
                return
            # An earlier change stopped part way: finish it, when headroom allows.
            if now < self._retry_at.get(model, now):
                return
            if cfg.headroom:
                verdict = self.headroom(model, self._to_drain(model, current))
                if not verdict.ok:
                    self._defer(model, self._direction(model, current), "rollout", verdict)
                    return
            self._end_deferral(model, "rollout resumed")
            log.info("batching %s: resuming the change to %g ms", model, current / 1e3)
            self._start_apply(model, current)
            return
        new = int(d.new)
        change = f"{d.old / 1e3:g} ms -> {d.new / 1e3:g} ms"
        if cfg.headroom:
            verdict = self.headroom(model, self._to_drain(model, new))
            if not verdict.ok:
                self._defer(model, d.direction, change, verdict)
                return
        self._end_deferral(model, "headroom back")
        ctl.changed(now)
        self.window_target[model] = new
        self._report(d, change)
        if not self.config.dry_run:
            self._start_apply(model, new)

    def _start_apply(self, model: str, window_us: int) -> None:
        self._retry_at.pop(model, None)
        self._applying[model] = asyncio.create_task(
            self.apply_window(model, window_us), name=f"control-window-{model}"
        )

    def _direction(self, model: str, window_us: int) -> str:
        olds = [w for (_, m), w in self.windows.items() if m == model and w != window_us]
        return "up" if olds and window_us > olds[0] else "down"

    async def _read_window(self, model: str) -> int | None:
        for instance in self.fleet.healthy():
            try:
                window = await self.applier.read(instance, model)
            except ModelControlError as exc:
                log.debug("cannot read %s's config on %s: %s", model, instance.name, exc)
                continue
            if window is None:
                self._turn_off(model, "no_dynamic_batching", "the model has no dynamic batcher")
            return window
        return None

    @property
    def off_models(self) -> frozenset[str]:
        """Models the batching loop gave up on."""
        return frozenset(self._off)

    def applying(self, model: str) -> bool:
        """A window change of ``model`` is under way."""
        return model in self._applying

    async def apply_window(self, model: str, window_us: int) -> None:
        """Roll ``window_us`` out to every instance (drained, one at a time); never raises for
        a server's refusal or failure, which it reports instead."""
        if model in self._off:
            return
        cfg = self.config.batching

        def can_drain(instance: Instance, m: str) -> Headroom:
            return self.headroom(m, [instance.name])

        try:
            result = await self.applier.apply(
                model,
                window_us,
                drain_timeout_s=cfg.drain_timeout_s,
                ready_timeout_s=cfg.ready_timeout_s,
                can_drain=can_drain if cfg.headroom else None,
            )
            if result.deferred is not None:
                # Resumed by a later tick once the others have headroom again.
                self._defer(model, self._direction(model, window_us), "rollout", result.deferred)
                log.info(
                    "batching window of %s is %g ms on %s so far; the rest waits for headroom",
                    model,
                    window_us / 1e3,
                    ", ".join(result.changed) or "none",
                )
            elif result.refused:
                self._turn_off(
                    model,
                    "refused",
                    f"Triton refused to reload it ({result.failed}); start the servers with "
                    "--model-control-mode=explicit to let the proxy tune the batching window",
                )
                self.window_target.pop(model, None)
            elif result.failed is not None:
                # The next tick re-reads the window Triton runs; a resume waits for the dwell.
                self.window_target.pop(model, None)
                self._retry_at[model] = self.clock.now() + cfg.dwell_s
                self.telemetry.control_apply_failures.labels("batching", model).inc()
                log.warning(
                    "batching window of %s not applied everywhere (%s); changed on: %s",
                    model,
                    result.failed,
                    ", ".join(result.changed) or "none",
                )
            else:
                log.info(
                    "batching window of %s is %g ms on %s",
                    model,
                    window_us / 1e3,
                    ", ".join(result.changed) or "every instance already",
                )
        except (ModelControlError, OSError, ValueError) as exc:
            # A background change must not die unseen; the next tick re-reads the window.
            self.window_target.pop(model, None)
            self._retry_at[model] = self.clock.now() + cfg.dwell_s
            self.telemetry.control_apply_failures.labels("batching", model).inc()
            log.error("batching window change of %s failed: %s", model, exc)
        finally:
            self._applying.pop(model, None)

    def _export_zero_failures(self, model: str) -> None:
        """Failure counters of a model the loop looks after exist from the start, at 0, as
        Prometheus advises for labels known in advance: a panel or alert on them then shows 0
        rather than no data, and ``increase()`` sees their first failure."""
        self.telemetry.control_apply_failures.labels("batching", model)
        for reason in OFF_REASONS:
            self.telemetry.control_off.labels("batching", model, reason)

    def _turn_off(self, model: str, reason: str, why: str) -> None:
        if model in self._off:
            return
        self._off.add(model)
        self.telemetry.control_off.labels("batching", model, reason).inc()
        log.warning("batching-window loop off for model %s: %s", model, why)

    def _report(self, d: Decision, change: str) -> None:
        dry = self.config.dry_run
        counter = self.telemetry.control_dry_run_decisions if dry else self.telemetry.control
        counter.labels(d.loop, d.model, d.direction, d.reason).inc()
        log.info(
            "%s%s %s %s %s: %s (%s)",
            "dry run: would change " if dry else "",
            d.loop,
            d.model,
            d.target,
            change,
            d.reason,
            d.detail,
        )

    # --- export ---------------------------------------------------------------------------
    def applied_scales(self) -> dict[str, dict[str, float]]:
        """Model -> class -> the factor this process's loop applied to its gate (none in dry
        run): what the leader worker hands to the other workers (:mod:`proxy.workers`)."""
        if self.config.dry_run or not self.config.class_limits.enabled:
            return {}
        return {m: dict(c.factors) for m, c in self._limits.items() if c.factors}

    def class_limits(self) -> list[tuple[str, str, float]]:
        """(model, class, share of the slots the class may hold) for every class below the top
        one: its ``max_share`` times the loop's factor (in dry run: the factor it would set)."""
        roles, scheduling = self.roles, self.scheduling
        if roles is None or scheduling is None:
            return []
        out = []
        for model, ctl in self._limits.items():
            for name in roles.lower:
                cls = scheduling.classes.get(name)
                if cls is not None:
                    out.append((model, name, cls.max_share * ctl.factor(name)))
        return out
