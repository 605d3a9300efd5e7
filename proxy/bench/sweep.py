"""A load sweep's summary: per load point, arm and class; goodput; the best baseline.

Definitions (what ``sweep.txt`` / ``sweep.json`` report):

- **SLO class**: a class with ``slo_p99_ms``. It *meets its SLO* at a load point when at least
  99% of its scheduled requests (pooled over repetitions) completed OK within the SLO
  (``slo_attainment >= 0.99``): a shed or failed request counts as a miss, so shedding cannot
  buy a good P99.
- **Goodput** of an arm: the highest load of the sweep such that every SLO class meets its SLO
  there *and at every lower load of the sweep* (a lucky pass above a failure does not count),
  given as the load factor and as offered req/s. ``None`` when it fails already at the lowest
  load (below the sweep).
- **Best baseline** at a load point: among the arms that are not the proxy, the one with the
  lowest pooled P99 of the top class (rank 0: the tightest SLO). Ratios ``vs best`` are taken
  within each repetition against it, then the median over repetitions.
- **Queueing matters** at a load point when the best baseline's top-class P99 is more than 2x
  the best baseline's top-class P99 at the sweep's lowest load (the idle reference: run the
  sweep from a light load, e.g. ``--scale 0.25``).
- **Throughput classes** (no SLO): completions per 10 s window (:data:`WINDOW_S`) of the
  measured period, the minimum over windows and repetitions, next to what the class offered
  per window on average. A throughput class with a ``min_share`` is *guaranteed* that share of
  the fleet: its floor per window is ``min_share`` x what the fleet completes of that class
  alone (:func:`proxy.bench.capacity.class_capacity`) x the window. It *holds its share* at a
  load point when every window of every repetition completes the floor, or all the class
  owed that window where that was less (``ArmResult.holds``: a Poisson window may bring fewer
  requests than the floor). Where it offers less than the floor per window on average it is
  not backlogged, and the point is not judged (:func:`window_floor`).
- **The proxy's own cost** at a load point, when the sweep has both arms of
  :data:`COST_ARMS`: per SLO class, the pooled P50 and P99 of ``proxy_rr_priority`` (the proxy
  making ``rr_priority``'s decisions) minus ``rr_priority``'s. Issue 10 judges the proxy at
  light loads against "the best baseline plus the proxy's own overhead"; this is that
  overhead measured in the scenario itself (same fleet, same CPU contention), not on an idle
  fleet at concurrency 1. It means that only where queueing does not matter: near capacity
  a small delay changes what Triton batches, and the difference is no longer the proxy's
  time. A P99 difference is noisy: read it with its repetitions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.capacity import class_capacity
from proxy.bench.results import ArmResult, Report, copies_per_request
from proxy.bench.scenario import Scenario

SLO_ATTAINMENT = 0.99
"""Fraction of a class's requests that must complete within its SLO to meet it."""
QUEUEING_FACTOR = 2.0
COST_ARMS = ("proxy_rr_priority", "rr_priority")
"""(with the proxy, without): the same routing decisions, the difference is the proxy's cost."""


def top_class(report: Report) -> str:
    """The class with the tightest SLO (ties: file order); the first class if none has one."""
    sc = report.scenario
    with_slo = [n for n in sc.class_names if sc.classes[n].slo_p99_ms is not None]
    if not with_slo:
        return sc.class_names[0]
    return min(with_slo, key=lambda n: (sc.classes[n].slo_p99_ms, sc.class_names.index(n)))


def slo_classes(report: Report) -> list[str]:
    sc = report.scenario
    return [n for n in sc.class_names if sc.classes[n].slo_p99_ms is not None]


def best_baseline(report: Report, baselines: Sequence[str]) -> str | None:
    """The baseline arm with the lowest pooled top-class P99 (None without baselines)."""
    top = top_class(report)
    scored: list[tuple[float, int, str]] = []
    for k, arm in enumerate(baselines):
        c = report.merged(arm, top)
        if c is None or c.p99_ms is None:
            continue
        scored.append((c.p99_ms, k, arm))
    return min(scored)[2] if scored else None


def sweep_summary(
    reports: Sequence[tuple[float, Report]], baselines: Sequence[str] = (), servers: int = 3
) -> dict[str, Any]:
    """Per scale, arm and class: pooled figures, ratios vs the best baseline, windows, memory.

    ``reports`` are the sweep's load points (load factor, report); ``baselines`` names the arms
    that count as baselines (see the module doc); ``servers``: the fleet's size (for the
    throughput classes' ``min_share`` floors).
    """
    out: dict[str, Any] = {
        "scales": [s for s, _ in reports],
        "slo_attainment_required": SLO_ATTAINMENT,
        "points": [],
        "loads": [],
    }
    for scale, report in reports:
        best = best_baseline(report, [b for b in baselines if b in report.arms])
        top = top_class(report)
        sc = report.scenario
        out["loads"].append(
            {
                "scale": scale,
                "offered_rps": sc.offered_rps,
                "best_baseline": best,
                "top_class": top,
                "best_baseline_top_p99_ms": _p99(report, best, top),
                "proxy_cost_ms": proxy_cost(report),
            }
        )
        floors: dict[tuple[str, float], float | None] = {}  # the same for every arm
        for arm in report.arms:
            reps = [r.arms[arm] for r in report.repetitions if arm in r.arms]
            rss = [a.proxy_rss_mib for a in reps if a.proxy_rss_mib]
            sheds: dict[str, int] = {}
            for a in reps:
                for key, n in a.sheds.items():
                    sheds[key] = sheds.get(key, 0) + n
            for cls in sc.class_names:
                c = report.merged(arm, cls)
                if c is None:
                    continue
                spec = sc.classes[cls]
                mins = [m for a in reps if (m := a.min_window(cls)) is not None]
                window_s = reps[0].window_s if reps else 0.0
                width = min(window_s, sc.duration_s)
                if (cls, width) not in floors:
                    floors[(cls, width)] = window_floor(sc, cls, width, servers)
                floor = floors[(cls, width)]
                ratio_p99 = _ratio(report, arm, cls, "p99_ms", best)
                ratio_p50 = _ratio(report, arm, cls, "p50_ms", best)
                out["points"].append(
                    {
                        "scale": scale,
                        "arm": arm,
                        "class": cls,
                        "rate_rps": spec.mean_rate_rps(sc.duration_s),
                        "p50_ms": c.p50_ms,
                        "p99_ms": c.p99_ms,
                        "slo_p99_ms": c.slo_p99_ms,
                        "slo_attainment": c.slo_attainment,
                        "completion_rate": c.completion_rate,
                        "scheduled": c.scheduled,
                        "shed": c.shed,
                        "shed_reasons": {
                            k.split(" ", 1)[1]: n
                            for k, n in sheds.items()
                            if k.split(" ", 1)[0] == cls
                        },
                        "errors": c.error + c.unfinished,
                        "window_min": min(mins) if mins else None,
                        "window_offered": spec.mean_rate_rps(sc.duration_s) * width,
                        "window_floor": floor,
                        "share_held": (
                            None if floor is None or not mins else _holds(reps, cls, floor)
                        ),
                        "p99_vs_best": ratio_p99,
                        "p50_vs_best": ratio_p50,
                        "proxy_rss_mib_max": max(r["max"] for r in rss) if rss else None,
                        "proxy_rss_mib_first": min(r["first"] for r in rss) if rss else None,
                        "copies_per_request": copies_per_request(reps),
                    }
                )
    out["goodput"] = goodput(out)
    return out


def proxy_cost(report: Report) -> dict[str, dict[str, float]] | None:
    """Per SLO class, ``{"p50_ms", "p99_ms"}``: :data:`COST_ARMS`' pooled difference (None
    without both arms)."""
    with_proxy, without = COST_ARMS
    if with_proxy not in report.arms or without not in report.arms:
        return None
    out: dict[str, dict[str, float]] = {}
    for cls in slo_classes(report):
        a, b = report.merged(with_proxy, cls), report.merged(without, cls)
        if a is None or b is None:
            continue
        diffs = {
            k: getattr(a, k) - getattr(b, k)
            for k in ("p50_ms", "p99_ms")
            if getattr(a, k) is not None and getattr(b, k) is not None
        }
        if diffs:
            out[cls] = diffs
    return out


def _p99(report: Report, arm: str | None, cls: str) -> float | None:
    if arm is None:
        return None
    c = report.merged(arm, cls)
    return c.p99_ms if c is not None else None


def _ratio(report: Report, arm: str, cls: str, metric: str, best: str | None) -> float | None:
    if best is None:
        return None
    saved = report.baseline
    report.baseline = best
    try:
        s = report.ratio(arm, cls, metric)
    finally:
        report.baseline = saved
    return s.median if s is not None else None


def _holds(reps: list[ArmResult], cls: str, floor: float) -> bool:
    return all(a.holds(cls, floor) is not False for a in reps)


def window_floor(scenario: Scenario, cls: str, width_s: float, servers: int) -> float | None:
    """Completions per window that ``cls``'s ``min_share`` guarantees (module doc); None when
    the class sets no share, has an SLO (judged by that) or offers no more than the floor per
    window."""
    spec = scenario.classes[cls]
    if not spec.min_share or spec.slo_p99_ms is not None:
        return None
    floor = spec.min_share * class_capacity(scenario, cls, servers=servers) * width_s
    return floor if spec.mean_rate_rps(scenario.duration_s) * width_s > floor else None


def meets_slos(points: Sequence[Mapping[str, Any]], arm: str, scale: float) -> bool | None:
    """Every SLO class of ``arm`` at ``scale`` reaches the required attainment (None: no data)."""
    mine = [
        p for p in points if p["arm"] == arm and p["scale"] == scale and p["slo_p99_ms"] is not None
    ]
    if not mine or any(p["slo_attainment"] is None for p in mine):
        return None
    return all(p["slo_attainment"] >= SLO_ATTAINMENT for p in mine)


def goodput(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm: the goodput (module doc), and its ratio to ``rr_priority``'s and
    ``haproxy_leastconn``'s when those arms ran."""
    points = summary["points"]
    scales = sorted(summary["scales"])
    offered = {load["scale"]: load["offered_rps"] for load in summary["loads"]}
    arms = list(dict.fromkeys(p["arm"] for p in points))
    per_arm: dict[str, Any] = {}
    for arm in arms:
        passed: float | None = None
        for s in scales:
            ok = meets_slos(points, arm, s)
            if not ok:
                break
            passed = s
        per_arm[arm] = {
            "scale": passed,
            "offered_rps": offered.get(passed) if passed is not None else None,
            "passes": {str(s): meets_slos(points, arm, s) for s in scales},
        }
    for arm, g in per_arm.items():
        for ref in ("rr_priority", "haproxy_leastconn"):
            other = per_arm.get(ref)
            key = f"vs_{ref}"
            if other is None or arm == ref:
                continue
            g[key] = goodput_ratio(g["scale"], other["scale"], scales)
    return per_arm


def goodput_ratio(mine: float | None, theirs: float | None, scales: Sequence[float]) -> str:
    """``"1.50"``, or a bound when either goodput lies outside the sweep ("> 2.00",
    "< 0.50", "n/a" when both are below it)."""
    lowest, highest = min(scales), max(scales)
    if mine is None and theirs is None:
        return "n/a (both below the sweep)"
    if theirs is None:
        return f"> {mine / lowest:.2f}" if mine is not None else "n/a"
    if mine is None:
        return f"< {lowest / theirs:.2f}"
    ratio = mine / theirs
    if mine == highest and theirs == highest:
        return "n/a (both pass the whole sweep)"
    if mine == highest:
        return f">= {ratio:.2f}"  # it might pass above the sweep too
    if theirs == highest:
        return f"<= {ratio:.2f}"
    return f"{ratio:.2f}"


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.{digits}f}" if v < 1000 else f"{v:.0f}"


def render_sweep(summary: Mapping[str, Any]) -> str:
    points = summary["points"]
    classes = list(dict.fromkeys(p["class"] for p in points))
    arms = list(dict.fromkeys(p["arm"] for p in points))
    scales = summary["scales"]
    loads = {load["scale"]: load for load in summary["loads"]}
    lines = [
        "Load sweep: P50 / P99 ms (SLO attainment %) [P99 vs best baseline] per class; "
        "throughput classes: completions per window min (offered per window)",
    ]
    for s in scales:
        load = loads[s]
        idle = loads[min(scales)]["best_baseline_top_p99_ms"]
        cur = load["best_baseline_top_p99_ms"]
        queueing = (
            cur is not None
            and idle is not None
            and cur > QUEUEING_FACTOR * idle
            and s != min(scales)
        )
        lines += [
            "",
            f"x{s:g}: offered {load['offered_rps']:.0f} req/s; best baseline "
            f"{load['best_baseline'] or '-'} ({load['top_class']} P99 {_fmt(cur)} ms)"
            + ("; queueing matters (> 2x the lowest load's)" if queueing else ""),
        ]
        w = max([22, *(len(a) for a in arms)])
        head = f"{'arm':<{w}}" + "".join(f"{c:>34}" for c in classes)
        head += f"{'shed':>8}{'RSS MiB':>10}"
        lines.append(head)
        for arm in arms:
            cells = []
            shed = 0
            rss: float | None = None
            for cls in classes:
                p = next(
                    (q for q in points if (q["arm"], q["class"], q["scale"]) == (arm, cls, s)),
                    None,
                )
                if p is None:
                    cells.append(f"{'-':>34}")
                    continue
                shed += p["shed"]
                rss = p["proxy_rss_mib_max"] if p["proxy_rss_mib_max"] is not None else rss
                if p["slo_p99_ms"] is None:
                    text = f"{p['window_min'] if p['window_min'] is not None else '-'}/win " + (
                        f"({p['window_offered']:.0f})"
                    )
                    text += f" P99 {_fmt(p['p99_ms'], 0)}"
                else:
                    att = p["slo_attainment"]
                    text = f"{_fmt(p['p50_ms'])}/{_fmt(p['p99_ms'])}"
                    text += f" ({100 * att:.1f}%)" if att is not None else ""
                    text += f" [{p['p99_vs_best']:.2f}x]" if p["p99_vs_best"] is not None else ""
                cells.append(f"{text:>34}")
            lines.append(f"{arm:<{w}}" + "".join(cells) + f"{shed:>8}{_fmt(rss, 0):>10}")
        lines += _share_lines([p for p in points if p["scale"] == s])
        lines += _cost_lines(load.get("proxy_cost_ms"), queueing)
    lines += [
        "",
        f"Goodput (every SLO class >= {100 * SLO_ATTAINMENT:g}% within its SLO at this "
        "and every lower load of the sweep):",
    ]
    for arm, g in summary["goodput"].items():
        where = (
            f"x{g['scale']:g} ({g['offered_rps']:.0f} req/s)"
            if g["scale"] is not None
            else f"below x{min(scales):g}"
        )
        ratios = "; ".join(f"{k} {v}" for k, v in g.items() if k.startswith("vs_"))
        lines.append(f"  {arm:<28} {where:<22} {ratios}")
    return "\n".join(lines)


def _cost_lines(cost: Mapping[str, Mapping[str, float]] | None, queueing: bool) -> list[str]:
    if not cost:
        return []
    with_proxy, without = COST_ARMS
    parts = [
        f"{cls} P50 {d.get('p50_ms', math.nan):+.1f} / P99 {d.get('p99_ms', math.nan):+.1f} ms"
        for cls, d in cost.items()
    ]
    # Where queues form, the two arms stop making the same decisions: a small delay changes
    # what Triton batches together, and the proxy's instance feedback moves load (issue 10's
    # long_share at x1: online P99 +3.8 s through the proxy, +0.05 s with feedback off;
    # docs/benchmarks.md, tenth round).
    caveat = " (queueing matters here: not the proxy's cost alone)" if queueing else ""
    return [f"the proxy's own cost ({with_proxy} - {without}, pooled{caveat}): " + "; ".join(parts)]


def _share_lines(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per throughput class with a ``min_share`` floor at this load point."""
    out = []
    for cls in dict.fromkeys(p["class"] for p in points if p.get("window_floor") is not None):
        mine = [p for p in points if p["class"] == cls]
        floor = mine[0]["window_floor"]
        held = [p["arm"] for p in mine if p["share_held"]]
        missed = [f"{p['arm']} ({p['window_min']})" for p in mine if p["share_held"] is False]
        out.append(
            f"{cls} min_share floor {floor:.0f}/win: held by {', '.join(held) or 'none'}"
            + (f"; missed by {', '.join(missed)}" if missed else "")
        )
    return out


def plot_sweep(summary: Mapping[str, Any], path: Path) -> Path:
    from matplotlib import ticker

    from proxy.bench.report import _pyplot

    plt = _pyplot()
    points = summary["points"]
    classes = list(dict.fromkeys(p["class"] for p in points))
    arms = list(dict.fromkeys(p["arm"] for p in points))
    fig, axes = plt.subplots(1, len(classes), figsize=(5.5 * len(classes), 4.2), squeeze=False)
    for j, cls in enumerate(classes):
        ax = axes[0][j]
        slo = next((p["slo_p99_ms"] for p in points if p["class"] == cls), None)
        for arm in arms:
            pts = sorted(
                (p["scale"], p["p99_ms"])
                for p in points
                if p["arm"] == arm and p["class"] == cls and p["p99_ms"] is not None
            )
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=arm, linewidth=1)
        if slo is not None:
            ax.axhline(slo, color="red", linestyle=":", linewidth=1, label="SLO")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(f"{cls}: P99 vs load factor")
        ax.set_xlabel("load factor (x scenario rates)")
        ax.set_ylabel("P99 ms (from scheduled send)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
