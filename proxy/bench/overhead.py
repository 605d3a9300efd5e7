"""What a proxy costs: latency added on an idle fleet, and the request rate it sustains.

Two measurements, each with every arm next to direct access to the servers:

1. **Idle overhead.** Small requests at a low open-loop rate (the fleet never queues), all
   arms on the same schedule, repeated. Added latency is the arm's quantile minus direct's
   quantile, taken within each repetition and summarised across them.
2. **Sustained rate.** Open-loop steps of rising rate, a few seconds each, for one arm at a
   time (started once for all its steps). A step is sustained when nearly every request
   completes and the P99, timed from the schedule, stays under a bound (an arm that cannot
   keep up queues, and its P99 grows without limit).
   The direct arm's own ceiling is measured the same way: an arm that reaches the same rate
   as direct is limited by the fleet or by this generator, not by itself, and is reported as
   "at least" that rate. A generator that falls behind its schedule is flagged too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
from numpy.typing import NDArray

from proxy.bench.compare import ArmSpec, run_comparison
from proxy.bench.report import LAG_WARN_MS
from proxy.bench.results import ClassStats, Report, Spread, spread, summarize_run
from proxy.bench.runner import HttpTarget, Progress, ProgressLine, Sleep, run_schedule
from proxy.bench.scenario import ClassSpec, ModelSpec, Scenario, SizeBucket, build_schedule
from proxy.clock import Clock, MonotonicClock

PROBE_CLASS = "small"


def small_request_scenario(
    model: ModelSpec,
    rate_rps: float,
    duration_s: float,
    *,
    tokens: int = 8,
    warmup_s: float = 1.0,
    seed: int = 0,
    repetitions: int = 1,
    api_key: str | None = None,
) -> Scenario:
    """One class of fixed-size small requests at ``rate_rps``."""
    cls = ClassSpec(
        rate_rps=rate_rps, sizes=(SizeBucket(tokens=(tokens, tokens)),), api_key=api_key
    )
    return Scenario(
        duration_s=duration_s,
        warmup_s=warmup_s,
        seed=seed,
        repetitions=repetitions,
        classes=MappingProxyType({PROBE_CLASS: cls}),
        model=model,
    )


@dataclass(frozen=True)
class RatePoint:
    offered_rps: float
    achieved_rps: float
    completion_rate: float
    p50_ms: float | None
    p99_ms: float | None
    lag_p99_ms: float | None
    sustained: bool

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass
class OverheadReport:
    direct: str
    idle: Report
    added_ms: dict[str, dict[str, Spread | None]] = field(default_factory=dict)
    """arm -> {"p50": spread, "p99": spread} of (arm - direct) per repetition, ms."""
    rates: dict[str, list[RatePoint]] = field(default_factory=dict)
    highest_tried: float = 0.0
    """The highest rate of the search; an arm that sustains it may well go further."""

    def sustained(self, arm: str) -> float | None:
        ok = [p.offered_rps for p in self.rates.get(arm, []) if p.sustained]
        return max(ok) if ok else None

    def bound(self, arm: str) -> str:
        """Why the arm's sustained rate stops where it does."""
        points = self.rates.get(arm, [])
        if not points:
            return "not measured"
        top, direct_top = self.sustained(arm), self.sustained(self.direct)
        if any(p.lag_p99_ms is not None and p.lag_p99_ms > LAG_WARN_MS for p in points):
            generator = "generator fell behind at some step"
        else:
            generator = ""
        highest = max(p.offered_rps for p in points)
        if top == highest and top >= self.highest_tried:
            why = "every step sustained: at least the highest rate tried"
        elif arm == self.direct:
            why = "ceiling of the fleet and this generator"
        elif top is not None and top == direct_top:
            why = "same as direct: limited by the fleet or the generator, not by the arm"
        else:
            why = "limit of the arm"
        return "; ".join(x for x in (why, generator) if x)

    def render(self) -> str:
        w = max([22, *(len(a) for a in self.idle.arms)])
        lines = [
            f"Proxy overhead vs {self.direct}: {PROBE_CLASS} requests on an idle fleet "
            "(latency added = arm quantile - direct quantile per repetition; median [min-max])",
            f"{'arm':<{w}} {'P50 ms':>8} {'+P50 ms':>20} {'P99 ms':>8} {'+P99 ms':>20} "
            f"{'sustained req/s':>16}  bound",
        ]
        for arm in self.idle.arms:
            c = self.idle.merged(arm, PROBE_CLASS)
            added = self.added_ms.get(arm, {})
            top = self.sustained(arm)
            lines.append(
                f"{arm:<{w}} {_f(c.p50_ms if c else None):>8} {_s(added.get('p50')):>20} "
                f"{_f(c.p99_ms if c else None):>8} {_s(added.get('p99')):>20} "
                f"{(f'{top:g}' if top is not None else '-'):>16}  {self.bound(arm)}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {
            "direct": self.direct,
            "idle": self.idle.to_dict(),
            "added_ms": {
                arm: {k: (s.to_dict() if s else None) for k, s in v.items()}
                for arm, v in self.added_ms.items()
            },
            "rates": {arm: [p.to_dict() for p in pts] for arm, pts in self.rates.items()},
            "sustained_rps": {arm: self.sustained(arm) for arm in self.rates},
            "bound": {arm: self.bound(arm) for arm in self.rates},
        }


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _s(s: Spread | None) -> str:
    if s is None:
        return "-"
    if s.n < 2:
        return f"{s.median:+.2f}"
    return f"{s.median:+.2f} [{s.lo:+.2f}..{s.hi:+.2f}]"


async def measure_overhead(
    model: ModelSpec,
    direct: ArmSpec,
    arms: Sequence[ArmSpec],
    *,
    idle_rate_rps: float = 20.0,
    idle_duration_s: float = 30.0,
    repetitions: int = 3,
    tokens: int = 8,
    rates: Sequence[float] = (250, 500, 1000, 2000, 4000),
    step_s: float = 5.0,
    p99_limit_ms: float = 50.0,
    min_completion: float = 0.999,
    seed: int = 0,
    api_key: str | None = None,
    settle_s: float = 1.0,
    retries: int = 1,
    show_progress: bool = True,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
) -> OverheadReport:
    """Idle added latency of every arm vs ``direct``, then each arm's sustained rate."""
    everyone = [direct, *arms]
    idle_sc = small_request_scenario(
        model,
        idle_rate_rps,
        idle_duration_s,
        tokens=tokens,
        seed=seed,
        repetitions=repetitions,
        api_key=api_key,
    )
    idle = await run_comparison(
        idle_sc,
        everyone,
        baseline=direct.name,
        settle_s=settle_s,
        show_progress=show_progress,
        clock=clock,
        sleep=sleep,
        note="small requests on an idle fleet",
    )
    out = OverheadReport(direct=direct.name, idle=idle, highest_tried=max(rates, default=0.0))
    for arm_name in idle.arms:
        out.added_ms[arm_name] = {
            key: spread(_added(idle, arm_name, direct.name, q))
            for key, q in (("p50", 0.5), ("p99", 0.99))
        }
    bar = ProgressLine() if show_progress else None
    for arm in everyone:
        out.rates[arm.name] = await sustained_rate(
            arm,
            model,
            rates,
            step_s=step_s,
            tokens=tokens,
            p99_limit_ms=p99_limit_ms,
            min_completion=min_completion,
            seed=seed,
            api_key=api_key,
            settle_s=settle_s,
            retries=retries,
            progress=bar,
            clock=clock,
            sleep=sleep,
        )
    return out


def _added(report: Report, arm: str, direct: str, q: float) -> list[float | None]:
    out: list[float | None] = []
    for rep in report.repetitions:
        a, d = rep.arms.get(arm), rep.arms.get(direct)
        if a is None or d is None or PROBE_CLASS not in a.classes or PROBE_CLASS not in d.classes:
            continue
        x, y = a.classes[PROBE_CLASS].quantile_ms(q), d.classes[PROBE_CLASS].quantile_ms(q)
        out.append(x - y if x is not None and y is not None else None)
    return out


async def sustained_rate(
    arm: ArmSpec,
    model: ModelSpec,
    rates: Sequence[float],
    *,
    step_s: float = 5.0,
    tokens: int = 8,
    p99_limit_ms: float = 50.0,
    min_completion: float = 0.999,
    seed: int = 0,
    api_key: str | None = None,
    settle_s: float = 1.0,
    retries: int = 1,
    progress: Progress | None = None,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
) -> list[RatePoint]:
    """Rising open-loop steps until one is not sustained (after ``retries`` more tries).

    The arm is started once for all steps. Every attempt is returned, failed ones included.
    """
    clk = clock if clock is not None else MonotonicClock()
    points: list[RatePoint] = []
    async with contextlib.AsyncExitStack() as stack:
        spec = await stack.enter_async_context(arm.open())
        target: HttpTarget | None = None
        attempt = 0
        for rate in sorted(rates):
            sustained = False
            for _ in range(1 + retries):  # a noisy machine gets one more try per step
                sc = small_request_scenario(
                    model,
                    rate,
                    step_s,
                    tokens=tokens,
                    warmup_s=min(1.0, step_s / 5),
                    seed=seed,
                    api_key=api_key,
                )
                if target is None:
                    target = HttpTarget(arm.name, spec, sc)
                    stack.push_async_callback(target.aclose)
                target.name = f"{arm.name} @{rate:g}/s"
                if attempt:
                    await sleep(settle_s)
                schedule = build_schedule(sc, np.random.default_rng(seed + attempt))
                attempt += 1
                rec = await run_schedule(
                    schedule,
                    target,
                    horizon_s=sc.horizon_s,
                    clock=clk,
                    sleep=sleep,
                    progress=progress,
                )
                stats = summarize_run(arm.name, sc, schedule, rec).classes[PROBE_CLASS]
                lag = (rec.started - rec.scheduled)[~np.isnan(rec.started)]
                point = _rate_point(rate, stats, lag, p99_limit_ms, min_completion)
                points.append(point)
                if point.sustained:
                    sustained = True
                    break
            if not sustained:
                break
    return points


def _rate_point(
    rate: float,
    stats: ClassStats,
    lag_s: NDArray[np.float64],
    p99_limit_ms: float,
    min_completion: float,
) -> RatePoint:
    # Latency counts from the scheduled time, so an arm that cannot keep up shows it as a
    # growing P99 (its queue) or as failures; no separate "keeps up" test is needed.
    completion = stats.completion_rate or 0.0
    p99 = stats.p99_ms
    return RatePoint(
        offered_rps=rate,
        achieved_rps=stats.throughput_rps,
        completion_rate=completion,
        p50_ms=stats.p50_ms,
        p99_ms=p99,
        lag_p99_ms=float(np.percentile(lag_s, 99) * 1000.0) if lag_s.size else None,
        sustained=completion >= min_completion and p99 is not None and p99 <= p99_limit_ms,
    )
