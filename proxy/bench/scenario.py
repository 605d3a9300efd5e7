"""Benchmark scenarios and the open-loop arrival schedule built from them.

A scenario file names the model, the traffic classes (arrival rate, request-size mix, Triton
priority, SLO, API key, sessions), the measured duration, a warm-up and a seed. The schedule is
built once, before any request is sent, so every arm of a comparison sees exactly the same
arrivals and a slow server cannot thin out the load (no coordinated omission).

Arrivals per class form a homogeneous Poisson process: the count over the horizon ``T`` is
``Poisson(rate * T)`` and, given the count, the times are independent uniforms on ``[0, T)``.
That is the textbook construction of a Poisson process and needs no loop over gaps.

Two extensions shape the work, not only the rate:

- a size bucket may have several ``rows`` (input shape ``[rows, tokens]``): a request of 4 rows
  of 512 tokens fills 4 of the model's ``max_batch_size`` rows and pads its batch to 512;
- a class may have ``bursts``: ``count`` requests dropped at once (or spread over
  ``spread_s``) ``at_s`` seconds into the measured window, optionally repeated ``every_s``, on
  top of its Poisson arrivals (an offline evaluation job filling the fleet). Bursts are part of
  the schedule built in advance, like everything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import numpy as np
import yaml
from numpy.typing import NDArray

from proxy import strict


@dataclass(frozen=True)
class SizeBucket:
    """A weighted range of request sizes; sizes inside are uniform integers in ``[lo, hi]``."""

    tokens: tuple[int, ...]
    weight: float = 1.0
    rows: int = 1
    """Rows per request (input shape ``[rows, tokens]``); each counts against the model's
    ``max_batch_size`` (16 for ``accel_sim``), which must hold it."""

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if len(self.tokens) != 2:
            raise ValueError(f"tokens must be [lo, hi], got {list(self.tokens)}")
        lo, hi = self.tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"tokens must satisfy 1 <= lo <= hi, got [{lo}, {hi}]")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")

    @property
    def lo(self) -> int:
        return self.tokens[0]

    @property
    def hi(self) -> int:
        return self.tokens[1]


@dataclass(frozen=True)
class Burst:
    """``count`` requests of the class at ``at_s`` seconds into the measured window.

    With ``spread_s`` > 0 their times are uniform on ``[at_s, at_s + spread_s)``; with
    ``every_s`` the burst repeats at ``at_s + k * every_s`` while that is inside the measured
    window. ``count`` scales with the load factor (:meth:`Scenario.scaled`).
    """

    at_s: float
    count: int
    spread_s: float = 0.0
    every_s: float | None = None

    def __post_init__(self) -> None:
        if not self.at_s >= 0:
            raise ValueError(f"at_s must be >= 0, got {self.at_s}")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")
        if not self.spread_s >= 0:
            raise ValueError(f"spread_s must be >= 0, got {self.spread_s}")
        if self.every_s is not None and not self.every_s > 0:
            raise ValueError(f"every_s must be > 0 or null, got {self.every_s}")

    def starts(self, duration_s: float) -> list[float]:
        """Start times of the burst's occurrences, seconds into the measured window."""
        if self.at_s >= duration_s:
            return []
        if self.every_s is None:
            return [self.at_s]
        n = int(np.ceil((duration_s - self.at_s) / self.every_s))
        return [
            self.at_s + k * self.every_s
            for k in range(n)
            if self.at_s + k * self.every_s < duration_s
        ]


@dataclass(frozen=True)
class ClassSpec:
    """One traffic class: how often it arrives, how big its requests are, how it is tagged."""

    rate_rps: float
    sizes: tuple[SizeBucket, ...] = (SizeBucket(tokens=(8, 64)),)
    triton_priority: int = 0
    """Sent as ``parameters.priority`` by arms that set Triton priorities (0 = model default)."""
    slo_p99_ms: float | None = None
    api_key: str | None = None
    """Sent as ``Authorization: Bearer <key>`` so the proxy can classify the request."""
    sessions: int = 0
    """Number of distinct session ids (header ``x-session-id``); 0 sends none."""
    bursts: tuple[Burst, ...] = ()
    """Requests dropped at once on top of the Poisson arrivals (see :class:`Burst`)."""
    min_share: float = 0.0
    """The class's guaranteed share of the fleet: proxy arms with classes set it as the
    class's ``min_share``. For a class without an SLO the sweep checks it in every 10 s
    window (:func:`proxy.bench.sweep.window_floor`)."""

    def __post_init__(self) -> None:
        if not self.rate_rps >= 0:
            raise ValueError(f"rate_rps must be >= 0, got {self.rate_rps}")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share must be within [0, 1], got {self.min_share}")
        if not self.sizes:
            raise ValueError("sizes must list at least one bucket")
        if self.triton_priority < 0:
            raise ValueError(f"triton_priority must be >= 0, got {self.triton_priority}")
        if self.slo_p99_ms is not None and not self.slo_p99_ms > 0:
            raise ValueError(f"slo_p99_ms must be > 0, got {self.slo_p99_ms}")
        if self.sessions < 0:
            raise ValueError(f"sessions must be >= 0, got {self.sessions}")

    @property
    def mean_tokens(self) -> float:
        total = sum(b.weight for b in self.sizes)
        return sum(b.weight * (b.lo + b.hi) / 2 for b in self.sizes) / total

    def burst_requests(self, duration_s: float) -> int:
        """Requests the bursts add over a measured window of ``duration_s``."""
        return sum(b.count * len(b.starts(duration_s)) for b in self.bursts)

    def mean_rate_rps(self, duration_s: float) -> float:
        """Poisson rate plus the bursts' requests averaged over the measured window."""
        return self.rate_rps + self.burst_requests(duration_s) / duration_s


@dataclass(frozen=True)
class ModelSpec:
    """The model every request goes to and its single token-ids input of shape ``[1, n]``."""

    name: str = "accel_sim"
    version: str = ""
    input: str = "INPUT_IDS"
    datatype: Literal["INT64", "INT32"] = "INT64"
    encoding: Literal["binary", "json"] = "binary"
    """``binary``: tensors after a JSON header (what tritonclient sends); ``json``: all JSON."""
    extra_inputs: tuple[str, ...] = ()
    """More inputs sent with the same tensor as ``input`` (``simple`` needs INPUT0 and INPUT1)."""
    parameters: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """``config.pbtxt`` string parameters overridden on the benchmark's own servers, e.g.
    ``accel_sim``'s ``base_ms`` and ``per_token_us``: the emulated device these figures rest on
    (see :func:`proxy.bench.fleet.bench_repository`)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.version,
            "input": self.input,
            "datatype": self.datatype,
            "encoding": self.encoding,
            "extra_inputs": list(self.extra_inputs),
            "parameters": dict(self.parameters),
        }


@dataclass(frozen=True)
class PhaseSpec:
    """A stretch of the measured window with its own arrival rates (load that changes)."""

    name: str
    duration_s: float
    rates: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Class -> ``rate_rps`` during the phase; a class not listed keeps its own rate."""

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        bad = {k: v for k, v in self.rates.items() if not v >= 0}
        if bad:
            raise ValueError(f"rates must be >= 0, got {bad}")


@dataclass(frozen=True)
class Scenario:
    duration_s: float
    """Measured window, after the warm-up."""
    classes: Mapping[str, ClassSpec]
    warmup_s: float = 0.0
    """Traffic sent before the measured window; its requests are not counted."""
    seed: int = 0
    repetitions: int = 1
    timeout_s: float = 60.0
    """Per-request client timeout; a request that times out counts as an error."""
    model: ModelSpec = field(default_factory=ModelSpec)
    phases: tuple[PhaseSpec, ...] = ()
    """Consecutive phases covering ``duration_s`` (their durations must add up to it); the
    warm-up runs at the first phase's rates. None: one rate per class throughout."""

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")
        if not self.classes:
            raise ValueError("classes must define at least one class")
        if self.repetitions < 1:
            raise ValueError(f"repetitions must be >= 1, got {self.repetitions}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.phases:
            total = sum(p.duration_s for p in self.phases)
            if abs(total - self.duration_s) > 1e-6:
                raise ValueError(
                    f"phases last {total:g} s in all; duration_s must be the same "
                    f"(got {self.duration_s:g})"
                )
            for p in self.phases:
                unknown = sorted(set(p.rates) - set(self.classes))
                if unknown:
                    raise ValueError(f"phase {p.name!r} names unknown classes {unknown}")

    def segments(self) -> list[tuple[str, float, float, Mapping[str, float]]]:
        """(phase name, start, end, class -> rate) from time 0 of the schedule; the warm-up is
        its own segment named ``warmup``."""
        base = {n: c.rate_rps for n, c in self.classes.items()}
        segs: list[tuple[str, float, float, Mapping[str, float]]] = []
        if not self.phases:
            if self.warmup_s:
                segs.append(("warmup", 0.0, self.warmup_s, base))
            segs.append(("all", self.warmup_s, self.horizon_s, base))
            return segs
        first = {**base, **self.phases[0].rates}
        if self.warmup_s:
            segs.append(("warmup", 0.0, self.warmup_s, first))
        t = self.warmup_s
        for p in self.phases:
            segs.append((p.name, t, t + p.duration_s, {**base, **p.rates}))
            t += p.duration_s
        return segs

    @property
    def horizon_s(self) -> float:
        return self.warmup_s + self.duration_s

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(self.classes)

    @property
    def offered_rps(self) -> float:
        """Every class's mean rate over the measured window, bursts included."""
        return sum(c.mean_rate_rps(self.duration_s) for c in self.classes.values())

    def scaled(self, factor: float) -> Scenario:
        """The same scenario with every class's rate multiplied (for load sweeps)."""
        if not factor > 0:
            raise ValueError(f"load factor must be > 0, got {factor}")
        classes = {
            name: dataclasses.replace(
                spec,
                rate_rps=spec.rate_rps * factor,
                bursts=tuple(
                    dataclasses.replace(b, count=round(b.count * factor)) for b in spec.bursts
                ),
            )
            for name, spec in self.classes.items()
        }
        return dataclasses.replace(self, classes=MappingProxyType(classes))

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON-friendly) mirroring the scenario file."""
        return {
            "model": self.model.to_dict(),
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "seed": self.seed,
            "repetitions": self.repetitions,
            "timeout_s": self.timeout_s,
            "phases": [
                {"name": p.name, "duration_s": p.duration_s, "rates": dict(p.rates)}
                for p in self.phases
            ],
            "classes": {
                name: {
                    "rate_rps": c.rate_rps,
                    "sizes": [
                        {"tokens": list(b.tokens), "weight": b.weight, "rows": b.rows}
                        for b in c.sizes
                    ],
                    "bursts": [dataclasses.asdict(b) for b in c.bursts],
                    "triton_priority": c.triton_priority,
                    "slo_p99_ms": c.slo_p99_ms,
                    "api_key": c.api_key,
                    "sessions": c.sessions,
                    "min_share": c.min_share,
                }
                for name, c in self.classes.items()
            },
        }


def parse_scenario(data: object, source: str | None = None) -> Scenario:
    """Strictly build a :class:`Scenario` from parsed YAML data."""
    return strict.load(Scenario, data, source=source)


def load_scenario(path: str | Path) -> Scenario:
    """Read and strictly validate a scenario YAML file."""
    p = Path(path)
    with p.open(encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return parse_scenario(data, source=str(p))


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the schedule, ``t`` seconds after the run starts."""

    index: int
    t: float
    cls: str
    tokens: int
    session: str | None
    warmup: bool
    rows: int = 1
    burst: bool = False
    """Part of a burst (not of the class's Poisson arrivals)."""
    bucket: int = 0
    """Which of its class's ``sizes`` it was drawn from."""


def build_schedule(scenario: Scenario, rng: np.random.Generator) -> list[Arrival]:
    """All arrivals of one run, sorted by time; pure given ``rng``."""
    horizon = scenario.horizon_s
    times: list[NDArray[np.float64]] = []
    cls_idx: list[NDArray[np.int64]] = []
    tokens: list[NDArray[np.int64]] = []
    rows: list[NDArray[np.int64]] = []
    buckets: list[NDArray[np.int64]] = []
    sessions: list[NDArray[np.int64]] = []
    burst: list[NDArray[np.bool_]] = []
    names = scenario.class_names
    for k, name in enumerate(names):
        spec = scenario.classes[name]
        if scenario.phases:
            parts = []
            for _, lo, hi, rates in scenario.segments():
                m = int(rng.poisson(rates[name] * (hi - lo)))
                parts.append(rng.uniform(lo, hi, m))
            t = np.concatenate(parts)
        else:
            n = int(rng.poisson(spec.rate_rps * horizon))
            t = rng.uniform(0.0, horizon, n)
        in_burst = np.zeros(t.size, dtype=bool)
        for b in spec.bursts:
            for start in b.starts(scenario.duration_s):
                at = scenario.warmup_s + start
                bt = (
                    at + rng.uniform(0.0, b.spread_s, b.count)
                    if b.spread_s
                    else np.full(b.count, at)
                )
                t = np.concatenate([t, np.minimum(bt, np.nextafter(horizon, 0.0))])
                in_burst = np.concatenate([in_burst, np.ones(b.count, dtype=bool)])
        m = t.size
        times.append(t)
        cls_idx.append(np.full(m, k, dtype=np.int64))
        tok, row, which = _draw_sizes(spec.sizes, m, rng)
        tokens.append(tok)
        rows.append(row)
        buckets.append(which)
        sessions.append(
            rng.integers(0, spec.sessions, m) if spec.sessions else np.full(m, -1, np.int64)
        )
        burst.append(in_burst)
    t = np.concatenate(times)
    c = np.concatenate(cls_idx)
    tk = np.concatenate(tokens)
    rw = np.concatenate(rows)
    bk = np.concatenate(buckets)
    ses = np.concatenate(sessions)
    bu = np.concatenate(burst)
    order = np.lexsort((c, t))  # time first; class order breaks ties (bursts share a time)
    return [
        Arrival(
            index=i,
            t=float(t[j]),
            cls=names[c[j]],
            tokens=int(tk[j]),
            session=f"{names[c[j]]}-{ses[j]}" if ses[j] >= 0 else None,
            warmup=bool(t[j] < scenario.warmup_s),
            rows=int(rw[j]),
            burst=bool(bu[j]),
            bucket=int(bk[j]),
        )
        for i, j in enumerate(order)
    ]


def _draw_sizes(
    buckets: tuple[SizeBucket, ...], n: int, rng: np.random.Generator
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Tokens, rows and bucket index of ``n`` requests drawn from the weighted buckets."""
    weights = np.array([b.weight for b in buckets], dtype=float)
    which: NDArray[np.int64] = rng.choice(len(buckets), size=n, p=weights / weights.sum())
    lo = np.array([b.lo for b in buckets], dtype=np.int64)[which]
    hi = np.array([b.hi for b in buckets], dtype=np.int64)[which]
    sizes: NDArray[np.int64] = rng.integers(lo, hi + 1)
    rows: NDArray[np.int64] = np.array([b.rows for b in buckets], dtype=np.int64)[which]
    return sizes, rows, which
