"""``triton-proxy canary``: the two arms' per-class tails side by side, with how sure the
difference is.

From Prometheus it reads, over ``--window``, each arm's and class's latency histogram
(``increase(triton_proxy_request_duration_seconds_bucket[window])``) and outcomes. Quantiles
are estimated the way ``histogram_quantile`` does (linear within a bucket). The uncertainty is
a bootstrap: each arm's bucket counts are resampled (multinomial, same total) ``--bootstrap``
times, independently per arm, and the quantile difference ``canary - main`` recomputed each
time. The report gives its 95% interval and the share of resamples in which the canary's
quantile is lower ("P(canary lower)"; 0.5 means no evidence either way). It accounts for
sampling noise only, at the resolution of the histogram's buckets: two arms whose tails fall in
the same bucket cannot be told apart, and the interval then straddles 0. Shed requests
(429s) are fast and count in the histogram, so the shed share is shown beside the tails.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proxy.canary import ARMS, CANARY, MAIN
from proxy.ops.render import Prometheus

QUANTILES = (0.5, 0.95, 0.99)
MIN_SAMPLES = 100
"""Below this many requests in an arm and class, its P99 is reported but flagged."""

Histogram = tuple[tuple[float, ...], tuple[float, ...]]
"""(upper bounds ascending, ending with inf; counts per bucket, not cumulative)."""


def quantile(bounds: Sequence[float], counts: npt.ArrayLike, q: float) -> npt.NDArray[np.float64]:
    """``histogram_quantile(q)`` of per-bucket ``counts`` (one histogram, or one per row).

    As Prometheus: the bucket holding rank ``q * total`` is found and the value interpolated
    linearly between its bounds (the first bucket starts at 0); a rank in the ``+Inf`` bucket
    gives the highest finite bound; an empty histogram gives NaN."""
    c = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    upper = np.asarray(bounds, dtype=np.float64)
    lower = np.concatenate(([0.0], upper[:-1]))
    cum = np.cumsum(c, axis=1)
    total = cum[:, -1]
    rank = q * total
    idx = np.argmax(cum >= rank[:, None], axis=1)
    rows = np.arange(c.shape[0])
    before = np.where(idx > 0, cum[rows, np.maximum(idx - 1, 0)], 0.0)
    inside = c[rows, idx]
    frac = np.divide(rank - before, inside, out=np.ones_like(rank), where=inside > 0)
    hi, lo = upper[idx], lower[idx]
    finite_top = upper[np.isfinite(upper)].max(initial=0.0)
    value = np.where(np.isinf(hi), finite_top, lo + (hi - lo) * frac)
    return np.where(total > 0, value, np.nan)


@dataclass(frozen=True)
class Difference:
    q: float
    main: float
    canary: float
    low: float
    high: float
    """95% bootstrap interval of ``canary - main``."""
    p_canary_lower: float


def compare(
    bounds: Sequence[float],
    main: Sequence[float],
    canary: Sequence[float],
    q: float,
    rng: np.random.Generator,
    resamples: int = 2000,
) -> Difference:
    """The two arms' ``q`` quantiles and how sure their difference is (bootstrap)."""
    diffs = []
    for counts in (main, canary):
        n = round(sum(counts))
        p = np.asarray(counts, dtype=np.float64) / max(sum(counts), 1e-12)
        diffs.append(quantile(bounds, rng.multinomial(n, p, size=resamples), q))
    d = diffs[1] - diffs[0]
    lower = float(np.mean(d < 0) + 0.5 * np.mean(d == 0))
    return Difference(
        q,
        float(quantile(bounds, main, q)[0]),
        float(quantile(bounds, canary, q)[0]),
        float(np.percentile(d, 2.5)),
        float(np.percentile(d, 97.5)),
        lower,
    )


@dataclass(frozen=True)
class ClassReport:
    klass: str
    requests: dict[str, float]
    shed: dict[str, float]
    histograms: dict[str, tuple[float, ...]]
    bounds: tuple[float, ...]
    differences: tuple[Difference, ...]


def histograms(results: Sequence[Mapping[str, object]]) -> dict[tuple[str, str], Histogram]:
    """Instant-query results of ``sum by (class, arm, le) (increase(..._bucket[w]))`` as
    per-bucket counts per (class, arm)."""
    cumulative: dict[tuple[str, str], dict[float, float]] = defaultdict(dict)
    for r in results:
        metric = r["metric"]
        value = r["value"]
        assert isinstance(metric, Mapping) and isinstance(value, Sequence)
        le = float("inf") if metric["le"] == "+Inf" else float(metric["le"])
        cumulative[(metric["class"], metric["arm"])][le] = float(value[1])
    out: dict[tuple[str, str], Histogram] = {}
    for key, by_le in cumulative.items():
        bounds = tuple(sorted(by_le))
        cum = [by_le[b] for b in bounds]
        counts = [max(0.0, c - p) for c, p in zip(cum, [0.0, *cum[:-1]], strict=True)]
        out[key] = (bounds, tuple(counts))
    return out


def report(
    prom: Prometheus,
    window: str,
    model: str = ".*",
    resamples: int = 2000,
    seed: int = 0,
) -> list[ClassReport]:
    sel = f'model=~"{model}"'
    buckets = prom.query(
        "sum by (class, arm, le) (increase("
        f"triton_proxy_request_duration_seconds_bucket{{{sel}}}[{window}]))"
    )
    outcomes = prom.query(
        f"sum by (class, arm, outcome) (increase(triton_proxy_requests_total{{{sel}}}[{window}]))"
    )
    hist = histograms(buckets)
    requests: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(ARMS, 0.0))
    shed: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(ARMS, 0.0))
    for r in outcomes:
        m, v = r["metric"], float(r["value"][1])
        if m.get("arm") not in ARMS:
            continue
        requests[m["class"]][m["arm"]] += v
        if str(m.get("outcome", "")).startswith("shed_"):
            shed[m["class"]][m["arm"]] += v
    rng = np.random.default_rng(seed)
    out = []
    for klass in sorted({k for k, _ in hist}):
        if (klass, MAIN) not in hist or (klass, CANARY) not in hist:
            continue
        (bounds, main), (bounds_c, canary) = hist[(klass, MAIN)], hist[(klass, CANARY)]
        if bounds != bounds_c or sum(main) == 0 or sum(canary) == 0:
            continue
        diffs = tuple(compare(bounds, main, canary, q, rng, resamples) for q in QUANTILES)
        out.append(
            ClassReport(
                klass, requests[klass], shed[klass], {MAIN: main, CANARY: canary}, bounds, diffs
            )
        )
    return out


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def format_report(reports: Sequence[ClassReport], window: str) -> str:
    if not reports:
        return (
            f"no class has requests in both arms over the last {window} "
            "(is a canary: section active, and Prometheus scraping the proxy?)"
        )
    lines = [
        f"canary vs main over the last {window} (latency in ms; Δ = canary - main, 95% "
        "bootstrap interval; P(lower) = how sure the canary's quantile is the lower one)",
        "",
        f"{'class':<12}{'arm':<8}{'requests':>10}{'shed':>8}{'P50':>9}{'P95':>9}{'P99':>9}",
    ]
    for r in reports:
        for arm in ARMS:
            n = r.requests.get(arm, 0.0) or sum(r.histograms[arm])
            shed = r.shed.get(arm, 0.0) / n if n else 0.0
            qs = [d.main if arm == MAIN else d.canary for d in r.differences]
            lines.append(
                f"{r.klass:<12}{arm:<8}{n:>10.0f}{shed:>8.1%}" + "".join(f"{_ms(v):>9}" for v in qs)
            )
        for d in r.differences:
            lines.append(
                f"{'':<12}Δ P{round(d.q * 100)}: {(d.canary - d.main) * 1000:+.1f} ms "
                f"[{d.low * 1000:+.1f}, {d.high * 1000:+.1f}], P(canary lower) = "
                f"{d.p_canary_lower:.2f}"
            )
        few = [arm for arm in ARMS if sum(r.histograms[arm]) < MIN_SAMPLES]
        if few:
            lines.append(
                f"{'':<12}(fewer than {MIN_SAMPLES} requests in {', '.join(few)}: tails are rough)"
            )
        lines.append("")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "canary", help="compare the canary arm's per-class tails with the main arm's"
    )
    c.add_argument("--prometheus", default="http://localhost:9090")
    c.add_argument("--window", default="30m", help="PromQL range, e.g. 15m, 1h")
    c.add_argument("--model", default=".*", help="regex of model names")
    c.add_argument("--bootstrap", type=int, default=2000, help="resamples per quantile")
    c.set_defaults(func=cmd_canary)


def cmd_canary(args: argparse.Namespace) -> int:
    reports = report(Prometheus(args.prometheus), args.window, args.model, args.bootstrap)
    print(format_report(reports, args.window))
    return 0 if reports else 1
