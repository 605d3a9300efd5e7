"""Every metric the proxy exports, on an injected registry (no global one).

Counters and histograms are updated on the request path (per request through
:class:`RequestTelemetry`, a subscriber of the runtime's request observer); fleet state
(health, in-flight, scraped load, class queues, control loops) is read at scrape time by a
collector, so it never goes stale in between. Every family is defined in this module.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from proxy.exposition import MAX_SERIES, Registry, render_families
from proxy.observer import RequestRecord
from proxy.scheduling.queues import FLOOR_AIM

if TYPE_CHECKING:
    from proxy.control.loops import ControlLoops
    from proxy.runtime import Runtime

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LOOP_LAG_INTERVAL_S = 0.1
DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)

M = TypeVar("M", Counter, Histogram)


class Children(Generic[M]):
    """A metric's labelled children, cached by label values.

    ``metric.labels(...)`` validates and joins the values and takes a lock on every call (about
    2 µs each, measured with ``timeit`` on this machine; the request path made five of them).
    The cache is bounded: label values come from model names clients send and from config, so
    past ``max_entries`` distinct combinations it stops caching new ones and calls
    ``labels()`` directly (still correct, just not faster).
    """

    __slots__ = ("_cache", "_max", "metric")
    metric: M

    def __init__(self, metric: M, max_entries: int = MAX_SERIES) -> None:
        self.metric = metric
        self._max = max_entries
        self._cache: dict[tuple[str, ...], M] = {}

    def get(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self.metric.labels(*values)
            if len(self._cache) < self._max:
                self._cache[values] = child
        return child


class Telemetry:
    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()
        r = self.registry
        self.requests = Counter(
            "triton_proxy_requests",
            "Requests answered, by model, class, instance, outcome and canary arm",
            ["model", "class", "instance", "outcome", "arm"],
            registry=r,
        )
        self.latency = Histogram(
            "triton_proxy_request_duration_seconds",
            "Time from arrival at the proxy to the last response byte, by model, class and arm",
            ["model", "class", "arm"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            "triton_proxy_slo_requests",
            "Requests of classes with a latency SLO, by whether they met it (result: met, or "
            "missed when slower than slo_p99_ms or shed); the SLO attainment and burn rates",
            ["model", "class", "result", "arm"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "triton_proxy_queue_wait_seconds",
            "Time a request waited in its class queue in the proxy before dispatch",
            ["class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            "triton_proxy_shed",
            "Requests refused by admission (429 / RESOURCE_EXHAUSTED), by class and reason",
            ["class", "reason"],
            registry=r,
        )
        self.boosted = Counter(
            "triton_proxy_boosted",
            "Requests of a starved class sent at the top class's Triton priority (the floor "
            "boost, scheduling.starved_after_s), by class",
            ["class"],
            registry=r,
        )
        self.decisions = Counter(
            "triton_proxy_routing_decisions",
            "Routing decisions, by model, policy, chosen instance and arm (a request routing.wake "
            "sends to a quiet instance instead is counted here at the policy's choice, and in "
            "triton_proxy_quiet_wakes_total at the instance it went to)",
            ["model", "policy", "instance", "arm"],
            registry=r,
        )
        self.decision_time = Histogram(
            "triton_proxy_routing_decision_seconds",
            "Time spent choosing an instance, by policy",
            ["policy"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "triton_proxy_retries", "Requests re-sent to another instance", registry=r
        )
        self.upstream_streams = Counter(
            "triton_proxy_upstream_streams",
            "ModelStreamInfer calls opened to Triton, by the kind of model they carry "
            "(decoupled, other): a client stream that uses both kinds is relayed as one call "
            "of each, since Triton can abort on a stream mixing their errors",
            ["kind"],
            registry=r,
        )
        self.wakes = Counter(
            "triton_proxy_quiet_wakes",
            "Requests sent to a quiet instance instead of the policy's choice, to wake Triton's "
            "batcher for the requests it left queued there (proxy.routing.wake), by instance",
            ["instance"],
            registry=r,
        )
        self.nudges = Counter(
            "triton_proxy_quiet_nudges",
            "Copies of a short request sent to a quiet instance to wake Triton's batcher, their "
            "answers dropped (routing.wake.nudge), by instance",
            ["instance"],
            registry=r,
        )
        self.ejections = Counter(
            "triton_proxy_ejections",
            "Instances taken out of rotation (failed probe or connection), by instance",
            ["instance"],
            registry=r,
        )
        self.model_control_calls = Counter(
            "triton_proxy_model_control_calls",
            "Model-control calls (load, unload, settings) by protocol and how this process "
            "handled them: fanned_out to the fleet, or relayed_to_leader (with --workers, only "
            "the leader worker fans out)",
            ["protocol", "handled"],
            registry=r,
        )
        self.reloads = Counter(
            "triton_proxy_policy_reloads",
            "Policy file reloads, by result",
            ["result"],
            registry=r,
        )
        self.control = Counter(
            "triton_proxy_control_decisions",
            "Changes made by the SLO control loops, by loop, model, direction and reason",
            ["loop", "model", "direction", "reason"],
            registry=r,
        )
        self.control_dry_run_decisions = Counter(
            "triton_proxy_control_dry_run_decisions",
            "Changes the SLO control loops would have made (control.dry_run), by loop, model, "
            "direction and reason",
            ["loop", "model", "direction", "reason"],
            registry=r,
        )
        self.control_apply_failures = Counter(
            "triton_proxy_control_apply_failures",
            "Changes that could not be applied on every instance (drain timeout, load error)",
            ["loop", "model"],
            registry=r,
        )
        self.control_off = Counter(
            "triton_proxy_control_off",
            "A loop gave up on a model (reason: refused = Triton is not in explicit model "
            "control mode; no_dynamic_batching)",
            ["loop", "model", "reason"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "triton_proxy_event_loop_lag_seconds",
            "How late the proxy's event loop ran a timer (sampled every "
            f"{LOOP_LAG_INTERVAL_S:g} s): time every request waits before its next step runs. "
            "High values mean the proxy process itself is short of CPU",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "triton_proxy_gc_pause_seconds",
            "How long each run of Python's cyclic garbage collector stopped the process, by "
            "generation (2 = a full collection): every request in flight waits that long",
            ["generation"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self._gc_by = [self.gc_pause.labels(str(g)) for g in range(3)]
        self._fleet_collector: _FleetCollector | None = None
        # Children used on every request, looked up once per label combination.
        self.requests_by = Children(self.requests)
        self.latency_by = Children(self.latency)
        self.slo_by = Children(self.slo)
        self.queue_wait_by = Children(self.queue_wait)
        self.decisions_by = Children(self.decisions)
        self.decision_time_by = Children(self.decision_time)

    def watch(self, runtime: Callable[[], Runtime]) -> None:
        """Export the live state of whatever runtime is current at scrape time."""
        if self._fleet_collector is None:
            self._fleet_collector = _FleetCollector(runtime)
            self.registry.register(self._fleet_collector)

    def exposition(self) -> bytes:
        return self.registry.exposition()

    def watch_gc(self) -> Callable[[], None]:
        """Time every run of the cyclic collector into ``gc_pause`` until the returned function
        is called (the hook is process-wide: call it when the server stops)."""
        started = 0.0

        def on_gc(phase: str, info: dict[str, int]) -> None:
            nonlocal started
            if phase == "start":
                started = time.perf_counter()
            else:
                self._gc_by[info["generation"]].observe(time.perf_counter() - started)

        gc.callbacks.append(on_gc)
        return lambda: gc.callbacks.remove(on_gc)

    async def watch_loop_lag(self, on_lag: Callable[[float], None] = lambda _: None) -> None:
        """Sample the event loop's lag until cancelled: sleep ``LOOP_LAG_INTERVAL_S`` and
        record how much later than asked the loop woke up (the real loop's clock: this measures
        the process, not the proxy's logic); ``on_lag`` gets each sample too."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + LOOP_LAG_INTERVAL_S
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            lag = max(0.0, loop.time() - asked)
            self.loop_lag.observe(lag)
            on_lag(lag)


class RequestTelemetry:
    """Counts and times every finished request (a :class:`proxy.observer.RequestObserver`)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.t = telemetry

    def on_request(self, record: RequestRecord) -> None:
        t = self.t
        r = record
        t.requests_by.get(r.model, r.class_name, r.instance, r.outcome, r.arm).inc()
        t.latency_by.get(r.model, r.class_name, r.arm).observe(r.latency_s)
        if r.slo_s is not None:
            met = r.latency_s <= r.slo_s and not r.outcome.startswith("shed_")
            t.slo_by.get(r.model, r.class_name, "met" if met else "missed", r.arm).inc()


class _FleetCollector(Collector):
    def __init__(self, runtime: Callable[[], Runtime]) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        rt = self._runtime()
        healthy = GaugeMetricFamily(
            "triton_proxy_instance_healthy",
            "1 when the instance is in rotation",
            labels=["instance"],
        )
        in_flight = GaugeMetricFamily(
            "triton_proxy_instance_in_flight",
            "Requests the proxy has in flight on the instance",
            labels=["instance"],
        )
        model_in_flight = GaugeMetricFamily(
            "triton_proxy_model_in_flight",
            "Requests the proxy has in flight, by instance and model",
            labels=["instance", "model"],
        )
        draining = GaugeMetricFamily(
            "triton_proxy_instance_draining",
            "1 while this process keeps the model's new requests off the instance (a drained "
            "batching-window reload; with workers, the leader's mark as each worker applies it)",
            labels=["instance", "model"],
        )
        for inst in rt.fleet.all():
            healthy.add_metric([inst.name], 1.0 if inst.healthy else 0.0)
            in_flight.add_metric([inst.name], inst.in_flight)
            for model, n in inst.model_in_flight.items():
                model_in_flight.add_metric([inst.name, model], n)
            for model in sorted(inst.draining):
                draining.add_metric([inst.name, model], 1.0)
        occupancy = GaugeMetricFamily(
            "triton_proxy_model_occupancy",
            "Smoothed share of the model's instances with the proxy's requests of it in flight "
            "(proxy.routing.occupancy; expected_start's pack_above reads it)",
            labels=["model"],
        )
        for model, value in sorted(rt.fleet.occupancy.values.items()):
            occupancy.add_metric([model], value)
        fill = GaugeMetricFamily(
            "triton_proxy_model_fill",
            "With routing.occupancy_depth (the main arm's): the model's smoothed mean requests "
            "in flight per instance over that share of max_batch_size, at most 1 (pack_above "
            "reads it for the long work of classes without max_per_instance)",
            labels=["model"],
        )
        main_fill = rt.fleet.fills.get(rt.dispatcher.fill.depth)  # the main arm's depth
        for model, value in sorted(main_fill.values.items() if main_fill else ()):
            fill.add_metric([model], value)
        long_load = GaugeMetricFamily(
            "triton_proxy_model_long_load",
            "With routing.occupancy_depth and routing.fill_from_load: the model's smoothed "
            "device time per second of the long requests of classes without max_per_instance "
            "in full batches, in instances' worth (the fill decides their packing from "
            "fill_from_load on)",
            labels=["model"],
        )
        load = rt.fleet.long_load
        for model, value in sorted(load.rates.values.items() if load else ()):
            long_load.add_metric([model], value)
        yield healthy
        yield in_flight
        yield model_in_flight
        yield draining
        yield occupancy
        yield long_load
        yield fill
        yield from _scraped(rt)
        yield _buffered(rt)
        yield from _feedback(rt)
        yield from _classes(rt)
        yield from _overload(rt)
        yield from control_metrics(rt.control)


def _scraped(rt: Runtime) -> Iterator[Metric]:
    pending = GaugeMetricFamily(
        "triton_proxy_scraped_pending_requests",
        "nv_inference_pending_request_count as last scraped, by instance and model",
        labels=["instance", "model"],
    )
    queue_us = GaugeMetricFamily(
        "triton_proxy_scraped_queue_seconds",
        "Mean Triton queue time per request over the scrape window",
        labels=["instance", "model"],
    )
    compute_us = GaugeMetricFamily(
        "triton_proxy_scraped_compute_seconds",
        "Mean Triton compute time per request over the scrape window",
        labels=["instance", "model"],
    )
    age = GaugeMetricFamily(
        "triton_proxy_scrape_age_seconds",
        "Age of the instance's last metrics snapshot",
        labels=["instance"],
    )
    now = rt.clock.now()
    for name, snap in rt.scraper.snapshots().items():
        age.add_metric([name], now - snap.taken_at)
        for model, load in snap.models.items():
            pending.add_metric([name, model], load.pending)
            if load.queue_us is not None:
                queue_us.add_metric([name, model], load.queue_us / 1e6)
            if load.compute_us is not None:
                compute_us.add_metric([name, model], load.compute_us / 1e6)
    yield from (pending, queue_us, compute_us, age)


def _overload(rt: Runtime) -> Iterator[Metric]:
    guard = rt.dispatcher.overload
    if guard is None:
        return
    pressure = GaugeMetricFamily(
        "triton_proxy_overload_pressure",
        "How many of the least important classes this process refuses at arrival because its "
        "event loop lags (scheduling.overload; 1.5 = the lowest wholly, the next half)",
    )
    pressure.add_metric([], guard.pressure)
    yield pressure


def _buffered(rt: Runtime) -> Metric:
    buffered = GaugeMetricFamily(
        "triton_proxy_buffered_bytes",
        "Request bodies held by the proxy (queued and in flight), of limits.max_buffered_bytes",
    )
    buffered.add_metric([], rt.budget.in_use)
    return buffered


def _feedback(rt: Runtime) -> Iterator[Metric]:
    if rt.router.feedback is None:
        return
    weight = GaugeMetricFamily(
        "triton_proxy_instance_feedback_weight",
        "Selection weight from instance feedback (1 = no penalty)",
        labels=["instance", "model"],
    )
    for inst in rt.fleet.all():
        for model in rt.catalog.known():
            weight.add_metric([inst.name, model], rt.router.feedback.current(inst.name, model))
    yield weight


def _classes(rt: Runtime) -> Iterator[Metric]:
    if rt.gates is None:
        return
    queued = GaugeMetricFamily(
        "triton_proxy_class_queued",
        "Requests waiting in the proxy's class queue, by model and class",
        labels=["model", "class"],
    )
    running = GaugeMetricFamily(
        "triton_proxy_class_in_flight",
        "Requests of the class dispatched and not yet finished, by model",
        labels=["model", "class"],
    )
    capacity = GaugeMetricFamily(
        "triton_proxy_model_capacity",
        "Dispatch slots of the model's gate (healthy instances x concurrency)",
        labels=["model"],
    )
    scale = GaugeMetricFamily(
        "triton_proxy_class_share_scale",
        "The factor this process's gate applies to the class's max_share (class-limit loop; "
        "with workers, the leader's factor as each worker applies it; 1 = not limited)",
        labels=["model", "class"],
    )
    debt = GaugeMetricFamily(
        "triton_proxy_class_floor_debt_seconds",
        "Device-seconds of its min_share the floor boost counts the class as owed, by model "
        f"(scheduling.starved_after_s; it boosts from starved_after_s x {FLOOR_AIM:g} x "
        "min_share x instances, divided by the workers with serve --workers)",
        labels=["model", "class"],
    )
    for model, gate in rt.gates.gates.items():
        info = rt.catalog.cached(model)
        if info is not None:
            capacity.add_metric([model], rt.gates.capacity(info, model))
        for klass in gate.config.classes:
            queued.add_metric([model, klass], gate.queued(klass))
            running.add_metric([model, klass], gate.in_flight(klass))
            scale.add_metric([model, klass], gate.share_scale(klass))
            owed = gate.floor_debt(klass)
            if owed is not None:
                debt.add_metric([model, klass], owed)
    adaptive = GaugeMetricFamily(
        "triton_proxy_adaptive_concurrency",
        "Requests of the model the instance may hold, as adaptive concurrency set it",
        labels=["model", "instance"],
    )
    if rt.gates.adaptive is not None:
        for (instance, model), limit in rt.gates.adaptive.current().items():
            adaptive.add_metric([model, instance], limit)
    slo = GaugeMetricFamily(
        "triton_proxy_class_slo_seconds",
        "The class's latency objective (slo_p99_ms) from the policy, in seconds",
        labels=["class"],
    )
    classes = rt.config.scheduling.classes if rt.config.scheduling else {}
    for klass, spec in classes.items():
        if spec.slo_p99_ms is not None:
            slo.add_metric([klass], spec.slo_p99_ms / 1000.0)
    yield from (queued, running, capacity, scale, debt, adaptive, slo)


def control_metrics(loops: ControlLoops) -> Iterator[Metric]:
    """The control loops' state: windows, targets, class limits, dry run, leadership."""
    window = GaugeMetricFamily(
        "triton_proxy_batching_window_seconds",
        "Triton's max_queue_delay_microseconds (as seconds) each instance runs for the model, "
        "as the batching-window loop last read or set it",
        labels=["model", "instance"],
    )
    target = GaugeMetricFamily(
        "triton_proxy_batching_window_target_seconds",
        "The window the batching-window loop wants for the model (in dry run: would set)",
        labels=["model"],
    )
    limit = GaugeMetricFamily(
        "triton_proxy_class_limit",
        "Share of the model's slots a class below the top one may hold (max_share x the "
        "class-limit loop's factor; in dry run: what it would set)",
        labels=["model", "class"],
    )
    dry = GaugeMetricFamily(
        "triton_proxy_control_dry_run", "1 when the control loops only report (control.dry_run)"
    )
    leader = GaugeMetricFamily(
        "triton_proxy_control_leader", "1 when this process runs the control loops"
    )
    deferred = GaugeMetricFamily(
        "triton_proxy_control_deferred_seconds",
        "How long the model's batching-window change has waited for headroom (the other "
        "instances could not carry its load without the one to drain); absent when none waits",
        labels=["loop", "model"],
    )
    now = loops.clock.now()
    for model, since in sorted(loops.deferred.items()):
        deferred.add_metric(["batching", model], max(0.0, now - since))
    for (instance, model), us in sorted(loops.windows.items()):
        window.add_metric([model, instance], us / 1e6)
    for model, us in sorted(loops.window_target.items()):
        target.add_metric([model], us / 1e6)
    for model, klass, share in loops.class_limits():
        limit.add_metric([model, klass], share)
    dry.add_metric([], 1.0 if loops.config.dry_run else 0.0)
    leader.add_metric([], 1.0 if loops.is_leader() else 0.0)
    yield from (window, target, limit, deferred, dry, leader)


def merge_workers(expositions: Sequence[tuple[str, str]]) -> bytes:
    """One exposition from several workers' ``(worker, text)``: each series gets ``worker``."""
    families: dict[str, Metric] = {}
    for worker, text in expositions:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples += [
                Sample(s.name, {**s.labels, "worker": worker}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
    return render_families(families.values())
