"""Instance feedback: an instance whose queue wait stays high gets a lower selection weight."""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from proxy.clock import Clock
from proxy.fleet.snapshot import InstanceSnapshot


@dataclass(frozen=True)
class FeedbackParams:
    enabled: bool = True
    queue_p95_threshold_us: float = 100_000.0
    """A window is bad when the model's queue-wait P95 on the instance is above this (µs), and
    above its peers' (``peer_ratio``)."""
    peer_ratio: float | None = 2.0
    """Moving load away from an instance helps only when its peers have room. So a bad
    window also needs the median of the latest P95s of the model's other instances to be at
    most the threshold, and this instance's P95 to be above ``peer_ratio`` times that median.
    When the whole fleet is slow, cutting the weight of whichever instance crossed the
    threshold first only moves its queue to its peers, and load swings between them
    (measured: docs/benchmarks.md, issue 10, eleventh round: at FIFO capacity, 3 of 3
    repetitions lost online's tail with the absolute rule alone, 1 of 8 with this one).
    None: the absolute threshold alone; it is also alone while no peer has been evaluated."""
    windows: int = 3
    """Consecutive bad (good) windows before the weight steps down (up)."""
    factor: float = 0.5
    """Weight multiplier per step down; recovery divides by it, up to 1.0."""
    floor: float = 0.1
    """The weight never drops below this: a penalised instance still gets some traffic, so
    its recovery can be observed."""
    window_s: float = 5.0
    """Minimum clock time between two evaluations of one (instance, model)."""

    def __post_init__(self) -> None:
        if self.queue_p95_threshold_us <= 0:
            raise ValueError("queue_p95_threshold_us must be > 0")
        if self.peer_ratio is not None and self.peer_ratio < 1.0:
            raise ValueError("peer_ratio must be >= 1 (or null: no peer rule)")
        if self.windows < 1:
            raise ValueError("windows must be >= 1")
        if not 0.0 < self.factor < 1.0:
            raise ValueError("factor must be in (0, 1)")
        if not 0.0 < self.floor <= 1.0:
            raise ValueError("floor must be in (0, 1]")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")


@dataclass
class _State:
    weight: float = 1.0
    bad: int = 0
    good: int = 0
    evaluated_at: float | None = None
    seen_taken_at: float | None = None


class _Peers:
    """The latest queue-wait P95 (µs) of each instance of one model, also kept sorted: the
    median of all but one instance is two lookups."""

    def __init__(self) -> None:
        self.latest: dict[str, float] = {}
        self._sorted: list[float] = []

    def set(self, instance: str, p95: float) -> None:
        self.drop(instance)
        self.latest[instance] = p95
        insort(self._sorted, p95)

    def drop(self, instance: str) -> None:
        old = self.latest.pop(instance, None)
        if old is not None:
            del self._sorted[bisect_left(self._sorted, old)]

    def median_without(self, p95: float) -> float | None:
        """The median of the others, when one instance's latest value is ``p95`` (any equal
        entry stands for it); None without others."""
        values = self._sorted
        n = len(values) - 1
        if n < 1:
            return None
        own = bisect_left(values, p95)

        def at(k: int) -> float:
            return values[k if k < own else k + 1]

        mid = n // 2
        return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


class InstanceFeedback:
    """Per (instance, model) selection weight from the snapshot's queue-wait P95.

    A window is one evaluation: at least ``window_s`` of clock time after the previous one,
    and on a snapshot not seen before (a stale snapshot is no new evidence, so streaks do not
    move). A window is bad when ``queue_us_p95 > queue_p95_threshold_us`` and, with
    ``peer_ratio``, ``median(peers) <= queue_p95_threshold_us`` and
    ``queue_us_p95 > peer_ratio * median(peers)``, where the peers are the model's other
    instances, each at the P95 of its own latest window (at most ``window_s`` plus a scrape
    old; an instance without traffic counts as 0, one removed from the fleet not at all). A
    window without traffic (P95 unknown) is good. After ``windows`` consecutive bad windows
    the weight becomes ``max(floor, weight * factor)``; after ``windows`` consecutive good ones
    it becomes ``min(1, weight / factor)``; each step starts a new streak. Pure apart from
    the injected clock; the router multiplies the result into ``Candidate.weight``.

    Source: Envoy outlier detection ejects a host after N consecutive errors; here the same
    streak rule lowers a weight instead of ejecting, since a slow instance still serves.
    """

    def __init__(self, params: FeedbackParams, clock: Clock) -> None:
        self.params = params
        self._clock = clock
        self._states: dict[tuple[str, str], _State] = {}
        self._peers: dict[str, _Peers] = {}

    def weight(
        self,
        instance: str,
        model: str,
        snapshot: InstanceSnapshot | None,
        now: float | None = None,
    ) -> float:
        """Evaluate a new window if one is due, and return the current weight.

        ``now`` is the clock's time when the caller has just read it (one read per decision
        instead of one per candidate).
        """
        st = self._states.get((instance, model))
        if st is None:
            st = self._states[(instance, model)] = _State()
        if now is None:
            now = self._clock.now()
        if st.evaluated_at is not None and now - st.evaluated_at < self.params.window_s:
            return st.weight
        if snapshot is None or snapshot.taken_at == st.seen_taken_at:
            return st.weight
        st.evaluated_at = now
        st.seen_taken_at = snapshot.taken_at
        p95 = snapshot.model(model).queue_us_p95
        p = self.params
        if p.peer_ratio is not None:
            peers = self._peers.get(model)
            if peers is None:
                peers = self._peers[model] = _Peers()
            peers.set(instance, p95 or 0.0)
        if p95 is not None and p95 > p.queue_p95_threshold_us and self._above_peers(model, p95):
            st.bad, st.good = st.bad + 1, 0
            if st.bad >= p.windows:
                st.weight = max(p.floor, st.weight * p.factor)
                st.bad = 0
        else:
            st.good, st.bad = st.good + 1, 0
            if st.good >= p.windows:
                st.weight = min(1.0, st.weight / p.factor)
                st.good = 0
        return st.weight

    def _above_peers(self, model: str, p95: float) -> bool:
        ratio = self.params.peer_ratio
        if ratio is None:
            return True
        median = self._peers[model].median_without(p95)
        if median is None:
            return True
        return median <= self.params.queue_p95_threshold_us and p95 > ratio * median

    def due_at(self, instance: str, model: str, snapshot: InstanceSnapshot | None) -> float | None:
        """Clock time from which :meth:`weight` would evaluate a window on ``snapshot``; None
        when only a newer snapshot can start one (routing views re-ask when it arrives)."""
        st = self._states.get((instance, model))
        if snapshot is None or (st is not None and snapshot.taken_at == st.seen_taken_at):
            return None
        if st is None or st.evaluated_at is None:
            return float("-inf")
        return st.evaluated_at + self.params.window_s

    def current(self, instance: str, model: str) -> float:
        """The weight without evaluating anything (1.0 if never seen)."""
        st = self._states.get((instance, model))
        return st.weight if st is not None else 1.0

    def forget(self, instance: str) -> None:
        """Drop all state of ``instance`` (removed from the fleet)."""
        for key in [k for k in self._states if k[0] == instance]:
            del self._states[key]
        for peers in self._peers.values():
            peers.drop(instance)
