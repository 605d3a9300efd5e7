"""From raw run records to per-arm, per-class figures, and their spread over repetitions.

Only arrivals scheduled in the measured window (after the warm-up) count. Latency quantiles
are over requests that succeeded; shed and failed requests show up in the completion rate and
in SLO attainment instead, which is where a scheduler that sheds to look fast pays for it:

- ``completion_rate`` = OK / scheduled;
- ``slo_attainment`` = (OK and latency <= the class's ``slo_p99_ms``) / scheduled;
- ``throughput_rps`` = OK / measured duration;
- ``windows`` = OK completions per class in each ``window_s`` (10 s) window of the measured
  period, by completion time whatever the arrival time: a class starved for a while shows a
  window near zero even when its total looks fine;
- ``owed`` = per class and window, what a share floor may ask of that window: the requests the
  class had waiting at the window's start (arrivals, warm-up included, less OK completions
  before it) plus those arriving in it up to :data:`GRACE_S` before its end
  (:func:`window_owed`). A floor is held in a window that completes ``min(floor, owed)``, so a
  Poisson window that brings fewer requests than the floor is not a miss;
- ``sizes``: for a class with several size buckets, the same figures per bucket
  (:func:`size_label`): a class's tail is often one bucket's (issue 10: online's 512-token
  rows, a third of online's requests, set its P99);
- ``tail``: where a class's (and size bucket's) slowest requests spent their time, when the
  model reports the batch each request ran in (``accel_sim``): each repetition's slowest
  :data:`TAIL_SHARE` with the batch's rows, padded length and device time, so the report can
  split their latency into the run of their batch and the wait before it (queues, the
  proxy, the network);
- the proxy's memory (RSS) when the arm's probe reports it (:data:`PROXY_RSS`);
- the copies the proxy sent to wake Triton's batcher (``routing.wake.nudge``: each a whole
  request Triton receives, rejects or runs, and the proxy drops the answer of) when the arm's
  probe reports them (:data:`PROXY_COPIES`): the price of the nudge, per request;
- the requests the proxy sent at the top class's priority because their class was starved of
  its ``min_share`` (the floor boost, ``scheduling.starved_after_s``), when the arm's probe
  reports them (:data:`PROXY_BOOSTED`).

Ratios between arms are taken within one repetition (same schedule, same machine state) and
then summarised across repetitions; absolute times from different runs are not compared.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from proxy.bench.runner import PENDING, Outcome, RunRecords
from proxy.bench.scenario import Arrival, Scenario
from proxy.bench.trace import is_trace_key
from proxy.stats.histogram import Histogram

US = 1_000_000
WINDOW_S = 10.0
"""Width of the completion-count windows (offline completions per 10 s window)."""
GRACE_S = 1.0
"""Arrivals in a window's last second are owed to the next one: serving takes time."""
TAIL_SHARE = 0.01
"""The slowest share of a run's requests whose batches :attr:`ClassStats.tail` keeps."""
PROXY_RSS = "proxy rss MiB"
"""Probe sample key holding the proxy process's resident memory (proxy arms only)."""
PROXY_COPIES = "proxy copies"
"""Probe sample key holding the proxy's ``triton_proxy_quiet_nudges_total`` (a counter)."""
PROXY_BOOSTED = "proxy boosted"
"""Probe sample key holding the proxy's ``triton_proxy_boosted_total`` (a counter)."""
NOT_LOAD = frozenset({PROXY_RSS, PROXY_COPIES, PROXY_BOOSTED})
"""Probe sample keys that are not an instance's load."""


@dataclass
class ClassStats:
    scheduled: int = 0
    ok: int = 0
    shed: int = 0
    error: int = 0
    unfinished: int = 0
    within_slo: int = 0
    slo_p99_ms: float | None = None
    duration_s: float = 0.0
    latency_us: Histogram = field(default_factory=Histogram)
    """Latency of successful requests, from their scheduled send time, microseconds."""
    tail: list[tuple[float, int, int, int]] = field(default_factory=list)
    """``(latency ms, batch rows, padded length, batch cost us)`` of each repetition's slowest
    :data:`TAIL_SHARE` of the requests that reported their batch (module doc)."""

    def quantile_ms(self, q: float) -> float | None:
        v = self.latency_us.quantile(q)
        return v / 1000.0 if v is not None else None

    @property
    def p50_ms(self) -> float | None:
        return self.quantile_ms(0.50)

    @property
    def p95_ms(self) -> float | None:
        return self.quantile_ms(0.95)

    @property
    def p99_ms(self) -> float | None:
        return self.quantile_ms(0.99)

    @property
    def p999_ms(self) -> float | None:
        return self.quantile_ms(0.999)

    @property
    def throughput_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def completion_rate(self) -> float | None:
        return self.ok / self.scheduled if self.scheduled else None

    @property
    def slo_attainment(self) -> float | None:
        if self.slo_p99_ms is None or not self.scheduled:
            return None
        return self.within_slo / self.scheduled

    @property
    def slo_met(self) -> bool | None:
        """The class's P99 is within its SLO (None without an SLO or samples)."""
        p99 = self.p99_ms
        if self.slo_p99_ms is None or p99 is None:
            return None
        return p99 <= self.slo_p99_ms

    def merge(self, other: ClassStats) -> None:
        self.scheduled += other.scheduled
        self.ok += other.ok
        self.shed += other.shed
        self.error += other.error
        self.unfinished += other.unfinished
        self.within_slo += other.within_slo
        self.duration_s += other.duration_s
        self.slo_p99_ms = self.slo_p99_ms if self.slo_p99_ms is not None else other.slo_p99_ms
        self.latency_us.merge(other.latency_us)
        self.tail.extend(other.tail)

    def figures(self) -> dict[str, float | int | bool | None]:
        return {
            "scheduled": self.scheduled,
            "ok": self.ok,
            "shed": self.shed,
            "error": self.error,
            "unfinished": self.unfinished,
            "p50_ms": self.p50_ms,
            "p95_ms": self.p95_ms,
            "p99_ms": self.p99_ms,
            "p999_ms": self.p999_ms,
            "throughput_rps": self.throughput_rps,
            "completion_rate": self.completion_rate,
            "slo_p99_ms": self.slo_p99_ms,
            "slo_attainment": self.slo_attainment,
            "slo_met": self.slo_met,
        }

    def to_dict(self) -> dict[str, object]:
        return {
            **self.figures(),
            "duration_s": self.duration_s,
            "latency_us": self.latency_us.to_dict(),
            "tail": [list(t) for t in self.tail],
        }


@dataclass
class LoadSeries:
    """Per-instance load over time: ``values[name][k]`` at ``t[k]`` seconds into the run."""

    source: str
    t: list[float] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=dict)
    """None where a probe got no answer."""

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "t": self.t, "values": self.values}


@dataclass
class ArmResult:
    name: str
    classes: dict[str, ClassStats] = field(default_factory=dict)
    failed: str | None = None
    """Why the arm produced no figures (it could not start), else None."""
    errors: Counter[str] = field(default_factory=Counter)
    dispatch_lag_p99_ms: float | None = None
    """How late the generator itself sent requests; large values mean it was overloaded."""
    dispatch_lag_max_ms: float | None = None
    loads: list[LoadSeries] = field(default_factory=list)
    window_s: float = WINDOW_S
    windows: dict[str, list[int]] = field(default_factory=dict)
    """Per class: OK completions in each window of the measured period (see module doc)."""
    owed: dict[str, list[int]] = field(default_factory=dict)
    """Per class: the most a share floor may ask of each window (module doc)."""
    sizes: dict[str, ClassStats] = field(default_factory=dict)
    """Per size bucket of a class with several (:func:`size_label`)."""
    sheds: Counter[str] = field(default_factory=Counter)
    """``"<class> <reason>"`` -> requests shed."""
    proxy_rss_mib: dict[str, float] | None = None
    """``first`` / ``max`` / ``last`` probed RSS of the proxy process, MiB (proxy arms)."""
    proxy_copies: float | None = None
    """Copies the proxy sent to wake Triton's batcher after the warm-up (proxy arms that
    report them: none sent at all reads as None), :func:`counted`."""
    proxy_boosted: float | None = None
    """Requests the floor boost sent after the warm-up (None as for ``proxy_copies``)."""

    def min_window(self, cls: str) -> int | None:
        w = self.windows.get(cls)
        return min(w) if w else None

    def holds(self, cls: str, floor: float) -> bool | None:
        """Whether each window completed ``min(floor, owed)`` of ``cls`` (the floor itself
        where owed is unknown); None without windows."""
        w = self.windows.get(cls)
        if not w:
            return None
        owed: Sequence[float] = self.owed.get(cls) or [floor] * len(w)
        return all(done >= min(floor, due) for done, due in zip(w, owed, strict=True))

    def total(self) -> ClassStats:
        out = ClassStats()
        durations = [c.duration_s for c in self.classes.values()]
        for c in self.classes.values():
            out.merge(c)
        out.duration_s = max(durations, default=0.0)
        out.slo_p99_ms = None
        return out

    def least_served(self) -> tuple[str, float] | None:
        """The class with the lowest completion rate, and that rate."""
        rates = [(n, c.completion_rate) for n, c in self.classes.items()]
        known = [(n, r) for n, r in rates if r is not None]
        return min(known, key=lambda nr: nr[1]) if known else None

    def to_dict(self) -> dict[str, object]:
        total = self.total()
        least = self.least_served()
        return {
            "name": self.name,
            "failed": self.failed,
            "classes": {n: c.to_dict() for n, c in self.classes.items()},
            "total": {
                "scheduled": total.scheduled,
                "ok": total.ok,
                "shed": total.shed,
                "error": total.error,
                "throughput_rps": total.throughput_rps,
            },
            "least_served": {"class": least[0], "completion_rate": least[1]} if least else None,
            "errors": dict(self.errors),
            "dispatch_lag_p99_ms": self.dispatch_lag_p99_ms,
            "dispatch_lag_max_ms": self.dispatch_lag_max_ms,
            "loads": [s.to_dict() for s in self.loads],
            "window_s": self.window_s,
            "windows": self.windows,
            "owed": self.owed,
            "sizes": {n: c.to_dict() for n, c in self.sizes.items()},
            "sheds": dict(self.sheds),
            "proxy_rss_mib": self.proxy_rss_mib,
            "proxy_copies": self.proxy_copies,
            "proxy_boosted": self.proxy_boosted,
        }


def window_edges(
    start: float, duration_s: float, window_s: float = WINDOW_S
) -> NDArray[np.float64]:
    """The edges of :func:`window_counts`' windows: ``floor(duration_s / window_s)`` whole
    windows from ``start``, or one of ``duration_s`` when the period is shorter than one."""
    n = int(duration_s // window_s)
    width = window_s if n >= 1 else duration_s
    edges: NDArray[np.float64] = start + width * np.arange(max(n, 1) + 1)
    return edges


def window_counts(
    finished: NDArray[np.float64], start: float, duration_s: float, window_s: float = WINDOW_S
) -> list[int]:
    """Completions (finish times, same clock as ``start``) in each window of the period.

    The period ``[start, start + duration_s)`` is cut into ``floor(duration_s / window_s)``
    whole windows (a tail shorter than a window is left out); a period shorter than one window
    is one window of its own length. NaN (never finished) counts nowhere.
    """
    edges = window_edges(start, duration_s, window_s)
    done = finished[~np.isnan(finished)]
    done = done[done < edges[-1]]  # half-open windows (histogram closes the last one)
    counts, _ = np.histogram(done, bins=edges)
    return [int(x) for x in counts]


def window_owed(
    scheduled: NDArray[np.float64],
    finished: NDArray[np.float64],
    start: float,
    duration_s: float,
    window_s: float = WINDOW_S,
    grace_s: float = GRACE_S,
) -> list[int]:
    """Per window of :func:`window_counts`: arrivals scheduled before its end less
    ``grace_s`` (at least its start), less completions (``finished``: the OK ones, NaN for
    none) before its start."""
    edges = window_edges(start, duration_s, window_s)
    starts = edges[:-1]
    cutoffs = np.maximum(edges[1:] - grace_s, starts)
    arrived = np.searchsorted(np.sort(scheduled), cutoffs, side="left")
    done = np.sort(finished[~np.isnan(finished)])
    served = np.searchsorted(done, starts, side="left")
    return [int(x) for x in arrived - served]


def size_label(scenario: Scenario, cls: str, bucket: int) -> str:
    """``"<class> <lo>-<hi>"``, with ``x<rows>`` when a request has several rows."""
    b = scenario.classes[cls].sizes[bucket]
    rows = f"x{b.rows}" if b.rows > 1 else ""
    return f"{cls} {b.lo}-{b.hi}{rows}"


def slowest_batches(
    latency_s: NDArray[np.float64], batch: NDArray[np.int32], share: float = TAIL_SHARE
) -> list[tuple[float, int, int, int]]:
    """The slowest ``share`` (at least one) of the requests that reported their batch:
    ``(latency ms, rows, padded length, cost us)``, slowest first."""
    known = batch[:, 0] >= 0
    if not known.any():
        return []
    lat, seen = latency_s[known], batch[known]
    k = max(1, int(len(lat) * share))
    order = np.argsort(lat)[::-1][:k]
    return [
        (round(float(lat[i]) * 1000.0, 3), int(seen[i, 0]), int(seen[i, 1]), int(seen[i, 2]))
        for i in order
    ]


def rss_summary(rec: RunRecords) -> dict[str, float] | None:
    """First, max and last probed proxy RSS (MiB), or None when no probe reported it."""
    values = [s[PROXY_RSS] for _, s in rec.load_samples if PROXY_RSS in s]
    if not values:
        return None
    return {"first": values[0], "max": max(values), "last": values[-1]}


def counted(rec: RunRecords, key: str, warmup_s: float) -> float | None:
    """A proxy counter the probe reads under ``key`` (:data:`PROXY_COPIES`,
    :data:`PROXY_BOOSTED`) from the end of the warm-up (the last probe by then) to the run's
    last probe that read it, or None when none did (a labelled counter has no sample until
    its first count: until then it reads 0)."""
    seen = [(t, s[key]) for t, s in rec.load_samples if key in s]
    if not seen:
        return None
    before = [value for t, value in seen if t <= warmup_s]
    return seen[-1][1] - (before[-1] if before else 0.0)


def copies_per_request(arms: Sequence[ArmResult]) -> float | None:
    """The wake copies of the runs that reported them, per request they scheduled in the
    measured period (a copy sent while the last requests drain counts too)."""
    seen = [a for a in arms if a.proxy_copies is not None]
    requests = sum(a.total().scheduled for a in seen)
    return sum(a.proxy_copies or 0.0 for a in seen) / requests if requests else None


def summarize_run(
    name: str,
    scenario: Scenario,
    schedule: Sequence[Arrival],
    rec: RunRecords,
    load_grid_s: float = 0.5,
    window_s: float = WINDOW_S,
) -> ArmResult:
    n = len(schedule)
    measured = np.fromiter((not a.warmup for a in schedule), dtype=bool, count=n)
    cls_of = np.fromiter(
        (scenario.class_names.index(a.cls) for a in schedule), dtype=np.int64, count=n
    )
    lat = rec.latency
    result = ArmResult(
        name=name,
        errors=Counter(rec.errors),
        window_s=window_s,
        sheds=Counter(rec.sheds),
        proxy_rss_mib=rss_summary(rec),
        proxy_copies=counted(rec, PROXY_COPIES, scenario.warmup_s),
        proxy_boosted=counted(rec, PROXY_BOOSTED, scenario.warmup_s),
    )
    bucket = np.fromiter((a.bucket for a in schedule), dtype=np.int64, count=n)

    def stats_of(sel: NDArray[np.bool_], slo_p99_ms: float | None) -> ClassStats:
        out = rec.outcome[sel]
        ok = out == Outcome.OK
        lat_ok = lat[sel][ok]
        stats = ClassStats(
            scheduled=int(sel.sum()),
            ok=int(ok.sum()),
            shed=int((out == Outcome.SHED).sum()),
            error=int((out == Outcome.ERROR).sum()),
            unfinished=int((out == PENDING).sum()),
            slo_p99_ms=slo_p99_ms,
            duration_s=scenario.duration_s,
        )
        if slo_p99_ms is not None:
            stats.within_slo = int((lat_ok * 1000.0 <= slo_p99_ms).sum())
        stats.latency_us.record_many(np.round(np.maximum(lat_ok, 0.0) * US).astype(np.int64))
        stats.tail = slowest_batches(lat[sel][ok], rec.batch[sel][ok])
        return stats

    for k, cname in enumerate(scenario.class_names):
        spec = scenario.classes[cname]
        sel = measured & (cls_of == k)
        result.classes[cname] = stats_of(sel, spec.slo_p99_ms)
        if len(spec.sizes) > 1:
            for b in range(len(spec.sizes)):
                label = size_label(scenario, cname, b)
                result.sizes[label] = stats_of(sel & (bucket == b), spec.slo_p99_ms)
        done = (cls_of == k) & (rec.outcome == Outcome.OK)
        start = rec.t0 + scenario.warmup_s
        result.windows[cname] = window_counts(
            rec.finished[done], start, scenario.duration_s, window_s
        )
        result.owed[cname] = window_owed(
            rec.scheduled[cls_of == k], rec.finished[done], start, scenario.duration_s, window_s
        )
    lag = (rec.started - rec.scheduled)[~np.isnan(rec.started)]
    if lag.size:
        result.dispatch_lag_p99_ms = float(np.percentile(lag, 99) * 1000.0)
        result.dispatch_lag_max_ms = float(lag.max() * 1000.0)
    result.loads.append(client_in_flight(rec, load_grid_s))
    if rec.load_samples:
        result.loads.append(probed_load(rec))
    return result


def client_in_flight(rec: RunRecords, grid_s: float) -> LoadSeries:
    """Mean requests in flight per instance over each ``[t, t + grid_s)``, client view.

    Exact time averages (the integral of the in-flight count over the bin), so a short spike
    is neither lost nor blown up by sampling. "(all)" counts every request, which is all a
    client sees of an arm that does not say which instance served it.
    """
    done = ~np.isnan(rec.finished) & ~np.isnan(rec.started)
    end = float(np.nanmax(rec.finished[done]) - rec.t0) if done.any() else 0.0
    edges = np.arange(0.0, end + grid_s, grid_s)
    series = LoadSeries(source="client_in_flight", t=[round(float(x), 6) for x in edges[:-1]])
    starts = rec.started - rec.t0
    ends = rec.finished - rec.t0

    def busy_time(times: NDArray[np.float64]) -> NDArray[np.float64]:
        # sum_i max(0, x - times_i) at every edge x, from sorted times and prefix sums
        s = np.sort(times)
        prefix = np.concatenate([[0.0], np.cumsum(s)])
        k = np.searchsorted(s, edges, side="right")
        area: NDArray[np.float64] = k * edges - prefix[k]
        return area

    def mean_in_flight(mask: NDArray[np.bool_]) -> list[float | None]:
        area = busy_time(starts[mask]) - busy_time(ends[mask])
        return [round(float(x), 4) for x in np.diff(area) / grid_s]

    series.values["(all)"] = mean_in_flight(done)
    for i, inst in enumerate(rec.instances):
        series.values[inst] = mean_in_flight(done & (rec.instance == i))
    return series


def probed_load(rec: RunRecords) -> LoadSeries:
    keys = {k for _, sample in rec.load_samples for k in sample} - NOT_LOAD
    names = sorted(k for k in keys if not is_trace_key(k))
    series = LoadSeries(source="probe", t=[round(t, 6) for t, _ in rec.load_samples])
    for name in names:
        series.values[name] = [sample.get(name) for _, sample in rec.load_samples]
    return series


# -- repetitions and comparisons -----------------------------------------------------------


@dataclass
class Repetition:
    index: int
    seed: int
    order: list[str]
    """Arms in the order they ran (rotated each repetition to spread drift)."""
    arms: dict[str, ArmResult] = field(default_factory=dict)
    requests: int = 0


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def spread(values: Sequence[float | None]) -> Spread | None:
    xs = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not xs:
        return None
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs))


Metric = Callable[[ClassStats], float | None]

METRICS: dict[str, Metric] = {
    "p50_ms": lambda c: c.p50_ms,
    "p95_ms": lambda c: c.p95_ms,
    "p99_ms": lambda c: c.p99_ms,
    "p999_ms": lambda c: c.p999_ms,
    "throughput_rps": lambda c: c.throughput_rps,
    "completion_rate": lambda c: c.completion_rate,
    "slo_attainment": lambda c: c.slo_attainment,
    "shed": lambda c: float(c.shed),
}
RATIO_METRICS = ("p50_ms", "p99_ms", "p999_ms", "throughput_rps")


@dataclass
class Report:
    scenario: Scenario
    arms: list[str]
    baseline: str | None
    repetitions: list[Repetition] = field(default_factory=list)
    note: str = ""
    """Shown with the figures, e.g. that the model simulates an accelerator's cost curve."""

    def merged(self, arm: str, cls: str, sizes: bool = False) -> ClassStats | None:
        """One class's stats pooled over every repetition (``sizes``: ``cls`` is one size
        bucket's label, :func:`size_label`)."""
        groups = [
            r.arms[arm].sizes if sizes else r.arms[arm].classes
            for r in self.repetitions
            if arm in r.arms
        ]
        parts = [g[cls] for g in groups if cls in g]
        if not parts:
            return None
        out = ClassStats()
        for p in parts:
            out.merge(p)
        return out

    def per_rep(self, arm: str, cls: str, metric: str) -> list[float | None]:
        fn = METRICS[metric]
        return [
            fn(r.arms[arm].classes[cls])
            for r in self.repetitions
            if arm in r.arms and cls in r.arms[arm].classes
        ]

    def spread(self, arm: str, cls: str, metric: str) -> Spread | None:
        return spread(self.per_rep(arm, cls, metric))

    def ratio(self, arm: str, cls: str, metric: str) -> Spread | None:
        """``metric(arm) / metric(baseline)`` within each repetition, then summarised."""
        if self.baseline is None:
            return None
        fn = METRICS[metric]
        ratios: list[float | None] = []
        for r in self.repetitions:
            a, b = r.arms.get(arm), r.arms.get(self.baseline)
            if a is None or b is None or cls not in a.classes or cls not in b.classes:
                continue
            x, y = fn(a.classes[cls]), fn(b.classes[cls])
            ratios.append(x / y if x is not None and y else None)
        return spread(ratios)

    def least_served(self, arm: str) -> Spread | None:
        return spread(
            [
                ls[1]
                for r in self.repetitions
                if arm in r.arms and (ls := r.arms[arm].least_served()) is not None
            ]
        )

    def to_dict(self) -> dict[str, object]:
        classes = self.scenario.class_names
        summary: dict[str, object] = {}
        for arm in self.arms:
            per_class: dict[str, object] = {}
            for cls in classes:
                pooled = self.merged(arm, cls)
                per_class[cls] = {
                    "pooled": pooled.figures() if pooled else None,
                    "spread": {
                        m: (s.to_dict() if (s := self.spread(arm, cls, m)) else None)
                        for m in METRICS
                    },
                    "ratio_vs_baseline": {
                        m: (s.to_dict() if (s := self.ratio(arm, cls, m)) else None)
                        for m in RATIO_METRICS
                    },
                }
            least = self.least_served(arm)
            summary[arm] = {
                "classes": per_class,
                "least_served_completion_rate": least.to_dict() if least else None,
            }
        return {
            "note": self.note,
            "scenario": self.scenario.to_dict(),
            "arms": self.arms,
            "baseline": self.baseline,
            "summary": summary,
            "repetitions": [
                {
                    "index": r.index,
                    "seed": r.seed,
                    "order": r.order,
                    "requests": r.requests,
                    "arms": {n: a.to_dict() for n, a in r.arms.items()},
                }
                for r in self.repetitions
            ],
        }
