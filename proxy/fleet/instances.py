"""The fleet: which Triton instances exist, which are healthy, and what the proxy has in flight.

In-flight accounting uses release-once tokens (``with fleet.track(instance, model):``) so every
exit path (success, error, cancellation) decrements exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from proxy.clock import Clock
from proxy.routing.occupancy import NO_FILL, FillRule, LongLoad, Occupancy


class ChangeJournal:
    """Names of instances whose routing inputs changed, in order, for readers that keep
    derived state (routing views, ``proxy.routing.view``) up to date without rescanning the
    fleet: each reader remembers how far it has read and refreshes only what changed since.

    Appended to on every change placement reads: a request starting or finishing, a stream,
    a busy connection, health, a model going out or back, draining, a new scraped snapshot.
    The log keeps at most ``limit`` entries; a reader that fell further behind (or read before
    a :meth:`reset`, e.g. a reload of the instance list) rebuilds from scratch.
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.epoch = 0
        """Bumped by :meth:`reset`: every reader must rebuild."""
        self._base = 0
        self._log: list[str] = []

    @property
    def end(self) -> int:
        """Offset just past the newest entry (what a reader stores after reading)."""
        return self._base + len(self._log)

    def append(self, name: str) -> None:
        log = self._log
        log.append(name)
        if len(log) > self.limit:
            half = len(log) // 2
            del log[:half]
            self._base += half

    def reset(self) -> None:
        """Everything may have changed (instance list, slot limits, shares)."""
        self.epoch += 1
        self._base += len(self._log)
        self._log.clear()

    def since(self, epoch: int, offset: int) -> list[str] | None:
        """Names appended after ``offset`` in ``epoch``; None: the reader must rebuild."""
        if epoch != self.epoch or offset < self._base:
            return None
        return self._log[offset - self._base :]


class WatchedSet(set[str]):
    """A set that calls ``on_change`` after every mutation (``Instance.draining``: other
    modules add and discard models, and routing views must hear of it)."""

    on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def add(self, item: str) -> None:
        super().add(item)
        self._changed()

    def discard(self, item: object) -> None:
        super().discard(item)
        self._changed()

    def remove(self, item: str) -> None:
        super().remove(item)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def update(self, *others: Iterable[str]) -> None:
        super().update(*others)
        self._changed()


@dataclass(frozen=True)
class InstanceSpec:
    """One Triton server as the policy file names it."""

    name: str
    http: str
    """Base URL of Triton's HTTP/REST endpoint, e.g. ``http://10.0.0.5:8000``."""
    grpc: str | None = None
    """``host:port`` of Triton's gRPC endpoint."""
    metrics: str | None = None
    """Full URL of Triton's Prometheus endpoint, e.g. ``http://10.0.0.5:8002/metrics``."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("instance name must not be empty")
        if not self.http.startswith(("http://", "https://")):
            raise ValueError(f"http must be a URL starting with http:// ({self.http!r})")
        object.__setattr__(self, "http", self.http.rstrip("/"))


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 1.0
    """Readiness probe period for healthy instances."""
    timeout_s: float = 2.0
    backoff_initial_s: float = 0.5
    """First re-probe delay after an instance is ejected; doubles up to ``backoff_max_s``."""
    backoff_max_s: float = 10.0
    eject_after_failures: int = 3
    """Consecutive failures (probe timeouts, broken connections, connect timeouts) to eject.

    A refused connection or a probe that the server answers "not ready" ejects at once: the
    server itself says it cannot serve. One answered request resets the count.
    """

    def __post_init__(self) -> None:
        if min(self.interval_s, self.timeout_s, self.backoff_initial_s) <= 0:
            raise ValueError("health intervals and timeouts must be > 0")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        if self.eject_after_failures < 1:
            raise ValueError("eject_after_failures must be >= 1")


@dataclass(frozen=True, slots=True)
class Work:
    """What an in-flight request is, for placement: its class, Triton priority level, and
    whether it is long (a throughput class capped per instance, or a cost well above the
    model's usual requests)."""

    class_name: str = "default"
    level: int = 0
    long: bool = False
    cost: float = 0.0
    """The request's estimated cost (rows x longest dimension, proxy.scheduling.cost)."""
    rows: int = 1
    """Its rows (the batch dimension of its costliest input): ``cost / rows`` is the length
    a batch it joins is padded to."""


NO_WORK = Work()


class Resend(NamedTuple):
    """A way to send one request in flight to its instance again (``routing.wake.nudge``)."""

    send: Callable[[], Awaitable[object]]
    expired: bool
    """The copy carries an expired Triton ``timeout``: Triton rejects it unrun, so it costs
    no device time and may stand in for long work (``routing.wake.expired_copy``)."""


@dataclass
class ModelOut:
    """A model one instance does not serve right now (unloaded there, or not ready)."""

    reason: str
    next_probe_at: float
    backoff_s: float


@dataclass
class Instance:
    """Mutable run-time state of one instance; owned by :class:`Fleet`."""

    spec: InstanceSpec
    healthy: bool = True
    failures: int = 0
    backoff_s: float = 0.0
    next_probe_at: float = 0.0
    ejected_reason: str = ""
    in_flight: int = 0
    streams: int = 0
    last_answer_at: float = float("-inf")
    """Clock time of the instance's last answer to a forwarded request."""
    failed_at: float = float("-inf")
    """Clock time of the last failure this process saw (probe, connection, 5xx)."""
    verdict_at: float = float("-inf")
    """Clock time of the last health verdict (a success or a failure report)."""
    model_in_flight: Counter[str] = field(default_factory=Counter)
    long_in_flight: Counter[str] = field(default_factory=Counter)
    """Requests in flight flagged long (see :class:`Work`), by model."""
    cost_in_flight: dict[str, float] = field(default_factory=dict)
    """Estimated cost of the requests in flight, by model (:attr:`Work.cost`)."""
    class_in_flight: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Requests in flight by (model, class)."""
    level_in_flight: Counter[tuple[str, int]] = field(default_factory=Counter)
    """Requests in flight by (model, Triton priority level); level 0 = the model's default."""
    last_sent: dict[str, float] = field(default_factory=dict)
    """Clock time this proxy last sent a request of each model here (proxy.routing.wake)."""
    woken_at: float = float("-inf")
    """Clock time routing.wake last sent a request here instead of the policy's choice."""
    resend: dict[str, Resend] = field(default_factory=dict)
    """model -> a way to send again one stateless request of it in flight here
    (``routing.wake.nudge``)."""
    flights: dict[str, dict[int, tuple[float, Work]]] = field(default_factory=dict)
    """model -> the requests in flight here, ``(sent at, work)`` by token: what the replay
    of Triton's batcher reads (``proxy.routing.batcher``). A model's dict, once made, stays:
    routing candidates hold it."""
    answered_at: dict[str, float] = field(default_factory=dict)
    """model -> clock time a request of it last finished here."""

    def ahead_of(self, model: str, level: int | None) -> tuple[int, int]:
        """Requests of ``model`` in flight here that Triton serves no later than one at
        ``level`` (same or more important level; all of them when ``level`` is None or 0),
        and how many of those are at a more important level than ``level`` (0 then)."""
        if level is None or level <= 0:
            return self.model_in_flight.get(model, 0), 0
        ahead = above = 0
        for (m, lv), n in self.level_in_flight.items():
            if m == model and 0 < lv <= level:
                ahead += n
                if lv < level:
                    above += n
        return ahead, above

    models_out: dict[str, ModelOut] = field(default_factory=dict)
    """Models taken out of rotation on this instance alone, re-probed with backoff."""

    def serves(self, model: str) -> bool:
        return self.healthy and model not in self.models_out

    draining: WatchedSet = field(default_factory=WatchedSet)
    """Models whose new requests placement keeps off this instance (a drained reload is under
    way); requests already in flight finish here."""

    name: str = field(init=False, repr=False)
    """``spec.name``, copied: a property read it five to eight times per request."""

    def __post_init__(self) -> None:
        self.name = self.spec.name


class Tracked:
    """The release-once in-flight token of :meth:`Fleet.track`: counted on entering the
    ``with`` block, released once on leaving it, whatever way it is left.

    A class, not a ``@contextmanager`` generator: the generator and contextlib's wrapper were
    five Python calls per request more (cProfile, session 17). The counters are changed with
    ``get`` and ``pop``, which are dict's own: ``Counter``'s ``__missing__`` and
    ``__delitem__`` are Python functions, six calls per request."""

    __slots__ = ("_counters", "_fleet", "_instance", "_model", "_stream", "_work")

    def __init__(
        self, fleet: Fleet, instance: Instance, model: str, stream: bool, work: Work
    ) -> None:
        self._fleet = fleet
        self._instance = instance
        self._model = model
        self._stream = stream
        self._work = work
        counters: tuple[tuple[Counter[Any], Any], ...] = (
            (instance.model_in_flight, model),
            (instance.class_in_flight, (model, work.class_name)),
            (instance.level_in_flight, (model, work.level)),
        )
        if work.long:
            counters += ((instance.long_in_flight, model),)
        self._counters = counters

    def __enter__(self) -> None:
        instance, model, work = self._instance, self._model, self._work
        fleet = self._fleet
        instance.in_flight += 1
        for counter, key in self._counters:
            counter[key] = counter.get(key, 0) + 1
        costs = instance.cost_in_flight
        costs[model] = costs.get(model, 0.0) + work.cost
        now = instance.last_sent[model] = fleet.clock.now()
        if self._stream:
            instance.streams += 1
        else:  # a stream is not one batch of Triton's: the replay leaves it out
            flights = instance.flights.get(model)
            if flights is None:
                flights = instance.flights[model] = {}
            flights[id(self)] = (now, work)
        quiet = fleet.quiet.get(model)
        if quiet:
            quiet.discard(instance.name)
        fleet.journal.append(instance.name)

    def __exit__(self, *exc: object) -> None:
        instance, model, work = self._instance, self._model, self._work
        instance.in_flight -= 1
        for counter, key in self._counters:
            n = counter[key] - 1
            if n:
                counter[key] = n
            else:
                counter.pop(key)
        costs = instance.cost_in_flight
        if model in instance.model_in_flight:
            costs[model] -= work.cost
        else:  # the last one: no float residue left behind
            del costs[model]
        if self._stream:
            instance.streams -= 1
        else:
            del instance.flights[model][id(self)]
            instance.answered_at[model] = self._fleet.clock.now()
            # An answer shows the model's batcher running there: not quiet any more (a
            # stale mark sent the next request there instead of where the policy chose).
            quiet = self._fleet.quiet.get(model)
            if quiet:
                quiet.discard(instance.name)
        self._fleet.journal.append(instance.name)


class Fleet:
    """Instances in policy order, their health and the proxy's own in-flight counts."""

    def __init__(self, specs: tuple[InstanceSpec, ...], health: HealthConfig, clock: Clock) -> None:
        self.health = health
        self.clock = clock
        self.instances: dict[str, Instance] = {s.name: Instance(s) for s in specs}
        self.listeners: list[Callable[[Instance], None]] = []
        """Called when an instance leaves or rejoins rotation."""
        self.journal = ChangeJournal()
        """Every change placement reads, by instance name (see :class:`ChangeJournal`)."""
        self.quiet: dict[str, set[str]] = {}
        """model -> instances quiet for it (``proxy.routing.wake``; found by a periodic scan,
        left by the next send there or answer from there)."""
        self.occupancy = Occupancy()
        """The smoothed share of each model's instances with work in flight
        (``proxy.routing.occupancy``; sampled by the runtime's periodic scan, read by
        placement and the metrics)."""
        self.fills: dict[float, Occupancy] = {}
        """``routing.occupancy_depth`` (of an arm, above 0) -> each model's smoothed mean in
        flight per instance over that share of its ``max_batch_size``, at most 1: its *fill*,
        which decides the packing of long work of a class without ``max_per_instance``
        (:meth:`occupancy_for`). Sampled by the runtime's scan for the depths its arms use."""
        self.long_load: LongLoad | None = None
        """With an arm's ``routing.fill_from_load``: each model's long load
        (``proxy.routing.occupancy.LongLoad``), added to by dispatch, sampled by the
        runtime's scan."""
        self.long_free: dict[str, frozenset[str]] = {}
        """model -> the instances serving it without its long work in flight, for models with
        long work in flight (``proxy.routing.occupancy.long_free``; sampled with the
        occupancy)."""
        self.positions: dict[str, int] = {}
        """Instance name -> its place in policy order (ties between instances go by it)."""
        self._adopted()

    def occupancy_for(self, model: str, capped: bool, rule: FillRule = NO_FILL) -> float:
        """The occupancy placement reads for a request of ``model`` in an arm with fill
        ``rule``: a class with ``max_per_instance`` (``capped``), or any class of an arm
        without ``routing.occupancy_depth``, reads the busy share; the long work of an
        uncapped class, the fill at the arm's depth, and with ``routing.fill_from_load`` only
        while the model's long load is at least that (``proxy.routing.occupancy``). Until
        the runtime has sampled what the rule needs, the busy share."""
        if capped or not rule.depth:
            return self.occupancy.get(model)
        fill = self.fills.get(rule.depth)
        if fill is None:
            return self.occupancy.get(model)
        if rule.from_load:
            load = self.long_load
            if load is None or load.get(model) < rule.from_load:
                return self.occupancy.get(model)
        return fill.get(model)

    def _adopted(self) -> None:
        """After the instance list changed: positions, draining hooks, readers rebuild."""
        self.positions = {name: i for i, name in enumerate(self.instances)}
        self.journal.limit = max(4096, 4 * len(self.instances))
        for inst in self.instances.values():
            inst.draining.on_change = lambda name=inst.name: self.journal.append(name)
        self.journal.reset()

    def touch(self, name: str) -> None:
        """Something placement reads about ``name`` changed outside this class (a new scraped
        snapshot, a busy connection): routing views refresh it before their next decision."""
        self.journal.append(name)

    def set_specs(self, specs: tuple[InstanceSpec, ...], health: HealthConfig) -> None:
        """Adopt a reloaded instance list: unchanged instances keep their state and counts."""
        self.health = health
        old = self.instances
        self.instances = {
            s.name: old[s.name] if s.name in old and old[s.name].spec == s else Instance(s)
            for s in specs
        }
        self._adopted()

    def get(self, name: str) -> Instance:
        return self.instances[name]

    def all(self) -> list[Instance]:
        return list(self.instances.values())

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.healthy]

    def healthy_count(self) -> int:
        return sum(1 for i in self.instances.values() if i.healthy)

    def serving(self, model: str) -> list[Instance]:
        """Healthy instances that have not said ``model`` is missing or not ready there."""
        return [i for i in self.instances.values() if i.serves(model)]

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances.values())

    def track(
        self, instance: Instance, model: str, *, stream: bool = False, work: Work = NO_WORK
    ) -> Tracked:
        """Count one request (or stream) in flight on ``instance`` until the block exits."""
        return Tracked(self, instance, model, stream, work)

    def total_in_flight(self) -> int:
        return sum(i.in_flight for i in self.instances.values())

    # --- health -------------------------------------------------------------------------
    def report_success(self, instance: Instance) -> None:
        now = self.clock.now()
        instance.failures = 0
        instance.verdict_at = now
        instance.next_probe_at = now + self.health.interval_s
        if not instance.healthy:
            instance.healthy = True
            instance.ejected_reason = ""
            instance.backoff_s = 0.0
            self._changed(instance)

    def probe_soon(self, instance: Instance) -> None:
        """Probe ``instance`` at the health checker's next tick (it answered 5xx, say)."""
        instance.next_probe_at = min(instance.next_probe_at, self.clock.now())

    def report_answer(self, instance: Instance) -> None:
        """The instance answered a forwarded request: its failures are no longer consecutive."""
        instance.last_answer_at = self.clock.now()
        if instance.healthy:
            instance.failures = 0

    def report_failure(self, instance: Instance, reason: str, *, immediate: bool = False) -> None:
        """A probe failed or a connection failed or broke; ``immediate`` ejects at once (the
        server refused the connection, or said it is not ready)."""
        instance.failures += 1
        now = self.clock.now()
        instance.failed_at = instance.verdict_at = now
        threshold = 1 if immediate else self.health.eject_after_failures
        if instance.healthy and instance.failures >= threshold:
            self.eject(instance, reason)
        elif not instance.healthy:
            instance.backoff_s = min(
                max(instance.backoff_s * 2, self.health.backoff_initial_s),
                self.health.backoff_max_s,
            )
            instance.next_probe_at = now + instance.backoff_s

    def eject(self, instance: Instance, reason: str) -> None:
        """Take ``instance`` out of rotation now (probed back with backoff)."""
        if not instance.healthy:
            return
        instance.healthy = False
        instance.ejected_reason = reason
        instance.backoff_s = self.health.backoff_initial_s
        instance.next_probe_at = self.clock.now() + instance.backoff_s
        self._changed(instance)

    # --- per-model availability --------------------------------------------------------
    def exclude_model(self, instance: Instance, model: str, reason: str) -> None:
        """``instance`` answered that ``model`` is not there (or not ready): route the model
        elsewhere until a readiness probe of the model on that instance succeeds."""
        if model in instance.models_out:
            return
        backoff = self.health.backoff_initial_s
        instance.models_out[model] = ModelOut(reason, self.clock.now() + backoff, backoff)
        self._changed(instance)

    def include_model(self, instance: Instance, model: str) -> None:
        if instance.models_out.pop(model, None) is not None:
            self._changed(instance)

    def model_probe_failed(self, instance: Instance, model: str) -> None:
        out = instance.models_out.get(model)
        if out is not None:
            out.backoff_s = min(out.backoff_s * 2, self.health.backoff_max_s)
            out.next_probe_at = self.clock.now() + out.backoff_s

    def due_model_probes(self) -> list[tuple[Instance, str]]:
        now = self.clock.now()
        return [
            (i, model)
            for i in self.instances.values()
            if i.healthy
            for model, out in i.models_out.items()
            if out.next_probe_at <= now
        ]

    def _changed(self, instance: Instance) -> None:
        self.journal.append(instance.name)
        for listener in self.listeners:
            listener(instance)

    def due_for_probe(self) -> list[Instance]:
        now = self.clock.now()
        return [i for i in self.instances.values() if i.next_probe_at <= now]
