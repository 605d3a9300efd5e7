"""Rendering a :class:`~proxy.bench.results.Report`: terminal table, JSON, PNG plots.

Plots need matplotlib (``pip install 'triton-proxy[bench]'``); it is imported only when a plot
is drawn, with the Agg backend, so the table and JSON work without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import numpy as np

from proxy.bench.results import Report, Spread, copies_per_request, size_label

LAG_WARN_MS = 20.0
"""Dispatch lag above this means the load generator itself fell behind the schedule."""


def _ms(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _ratio(s: Spread | None) -> str:
    if s is None:
        return "-"
    if s.n == 1 or s.lo == s.hi:
        return f"{s.median:.2f}x"
    return f"{s.median:.2f}x [{s.lo:.2f}-{s.hi:.2f}]"


def _range(s: Spread | None) -> str:
    if s is None or s.n < 2:
        return "-"
    return f"{_ms(s.lo)}-{_ms(s.hi)}"


def render_table(report: Report) -> str:
    """Per class and arm: latency quantiles (pooled over repetitions), rates, ratios."""
    reps = len(report.repetitions)
    lines: list[str] = []
    sc = report.scenario
    lines.append(
        f"{len(report.arms)} arms x {reps} repetition(s), {sc.duration_s:g}s measured after "
        f"{sc.warmup_s:g}s warm-up, seeds {sc.seed}..{sc.seed + reps - 1}; "
        f"latency from scheduled send time, ms; baseline {report.baseline}"
    )
    if report.note:
        lines.append(f"note: {report.note}")
    w = max([22, *(len(a) for a in report.arms)])
    head = (
        f"{'arm':<{w}} {'P50':>8} {'P95':>8} {'P99':>8} {'P99.9':>8} {'P99 range':>13} "
        f"{'req/s':>8} {'SLO%':>6} {'done%':>6} {'shed':>6} {'err':>6}  "
        f"{'P99 vs base':<22} {'P50 vs base':<12}"
    )
    for cls in sc.class_names:
        spec = sc.classes[cls]
        slo = f"SLO P99 {spec.slo_p99_ms:g} ms" if spec.slo_p99_ms is not None else "no SLO"
        rate = f"{spec.rate_rps:g} req/s"
        if spec.bursts:
            mean = spec.mean_rate_rps(sc.duration_s)
            rate += f" + {spec.burst_requests(sc.duration_s)} in bursts ({mean:.1f} req/s mean)"
        lines += ["", f"class {cls}: {rate}, {slo}", head, "-" * len(head)]
        for arm in report.arms:
            c = report.merged(arm, cls)
            if c is None:
                lines.append(f"{arm:<{w}} {'(no result)':>8}")
                continue
            lines.append(
                f"{arm:<{w}} {_ms(c.p50_ms):>8} {_ms(c.p95_ms):>8} {_ms(c.p99_ms):>8} "
                f"{_ms(c.p999_ms):>8} {_range(report.spread(arm, cls, 'p99_ms')):>13} "
                f"{c.throughput_rps:>8.1f} {_pct(c.slo_attainment):>6} "
                f"{_pct(c.completion_rate):>6} {c.shed:>6} {c.error + c.unfinished:>6}  "
                f"{_ratio(report.ratio(arm, cls, 'p99_ms')):<22} "
                f"{_ratio(report.ratio(arm, cls, 'p50_ms')):<12}"
            )
    lines += _size_lines(report, w)
    lines += _tail_lines(report, w)
    lines += ["", f"{'arm':<{w}} {'req/s':>8} {'least-served class':>28} {'lag max ms':>11}  notes"]
    for arm in report.arms:
        results = [r.arms[arm] for r in report.repetitions if arm in r.arms]
        failed = [a.failed for a in results if a.failed]
        ok = [a for a in results if not a.failed]
        thr = [a.total().throughput_rps for a in ok]
        least = [ls for a in ok if (ls := a.least_served()) is not None]
        least_txt = "-"
        if least:
            worst = min(least, key=lambda x: x[1])
            least_txt = f"{worst[0]} {100 * worst[1]:.1f}%"
        lags = [a.dispatch_lag_max_ms for a in ok if a.dispatch_lag_max_ms is not None]
        lag = max(lags) if lags else None
        notes = []
        if failed:
            notes.append(f"FAILED {len(failed)}x: {failed[0]}")
        if lag is not None and lag > LAG_WARN_MS:
            notes.append("generator fell behind schedule (latencies still charged from schedule)")
        errors: dict[str, int] = {}
        for a in ok:
            for k, n in a.errors.items():
                errors[k] = errors.get(k, 0) + n
        if errors:
            top = sorted(errors.items(), key=lambda kv: -kv[1])[:2]
            notes.append("errors: " + "; ".join(f"{n}x {k}" for k, n in top))
        sheds: dict[str, int] = {}
        for a in ok:
            for k, n in a.sheds.items():
                sheds[k] = sheds.get(k, 0) + n
        if sheds:
            notes.append("shed: " + ", ".join(f"{k} {n}" for k, n in sorted(sheds.items())))
        for cls in sc.class_names:
            if sc.classes[cls].slo_p99_ms is None:
                mins = [m for a in ok if (m := a.min_window(cls)) is not None]
                if mins:
                    width = min(ok[0].window_s, sc.duration_s)
                    notes.append(f"{cls} done per {width:g}s window min {min(mins)}")
        rss = [a.proxy_rss_mib["max"] for a in ok if a.proxy_rss_mib]
        if rss:
            notes.append(f"proxy RSS max {max(rss):.0f} MiB")
        if per_request := copies_per_request(ok):
            notes.append(f"wake copies {per_request:.2f}/request")
        if boosted := [a.proxy_boosted for a in ok if a.proxy_boosted]:
            notes.append(f"floor boosts {sum(boosted) / len(ok):.0f}/run")
        lines.append(
            f"{arm:<{w}} {(float(np.median(thr)) if thr else 0.0):>8.1f} {least_txt:>28} "
            f"{_ms(lag):>11}  {' | '.join(notes)}"
        )
    return "\n".join(lines)


def _size_lines(report: Report, w: int) -> list[str]:
    """P50 / P99 (pooled) per size bucket of the classes with several."""
    sc = report.scenario
    labels = [
        size_label(sc, cls, b)
        for cls in sc.class_names
        if len(sc.classes[cls].sizes) > 1
        for b in range(len(sc.classes[cls].sizes))
    ]
    if not labels:
        return []
    cw = max(16, *(len(x) for x in labels))
    lines = ["", "by size bucket: P50 / P99 ms (pooled)"]
    lines.append(f"{'arm':<{w}} " + " ".join(f"{x:>{cw}}" for x in labels))
    for arm in report.arms:
        cells = []
        for label in labels:
            c = report.merged(arm, label, sizes=True)
            cells.append("-" if c is None else f"{_ms(c.p50_ms)} / {_ms(c.p99_ms)}")
        lines.append(f"{arm:<{w}} " + " ".join(f"{x:>{cw}}" for x in cells))
    return lines


def _tail_lines(report: Report, w: int) -> list[str]:
    """Where the slowest requests' time went (:attr:`ClassStats.tail`), per class or size
    bucket: median wait before their batch + median run of it, and the batch's median rows x
    padded length. Empty when the model reports no batches."""
    sc = report.scenario
    labels: list[tuple[str, bool]] = []
    for cls in sc.class_names:
        n = len(sc.classes[cls].sizes)
        labels += [(size_label(sc, cls, b), True) for b in range(n)] if n > 1 else [(cls, False)]
    cells: dict[str, list[str]] = {}
    for arm in report.arms:
        row = []
        for label, sized in labels:
            c = report.merged(arm, label, sizes=sized)
            row.append("-" if c is None or not c.tail else _tail_cell(c.tail))
        cells[arm] = row
    if all(x == "-" for row in cells.values() for x in row):
        return []
    cw = max(20, *(len(x) for x, _ in labels))
    lines = [
        "",
        "slowest 1% of each repetition: wait + run ms (median), batch rows x padded length "
        "(median)",
        f"{'arm':<{w}} " + " ".join(f"{x:>{cw}}" for x, _ in labels),
    ]
    for arm, row in cells.items():
        lines.append(f"{arm:<{w}} " + " ".join(f"{x:>{cw}}" for x in row))
    return lines


def _tail_cell(tail: list[tuple[float, int, int, int]]) -> str:
    a = np.asarray(tail, dtype=np.float64)
    run_ms = a[:, 3] / 1000.0
    wait_ms = np.maximum(a[:, 0] - run_ms, 0.0)
    return (
        f"{np.median(wait_ms):.0f}+{np.median(run_ms):.0f} "
        f"{np.median(a[:, 1]):.0f}x{np.median(a[:, 2]):.0f}"
    )


def write_json(report: Report, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report.to_dict(), indent=1, allow_nan=False, default=_jsonable))
    return p


def _jsonable(value: object) -> object:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(
            "PNG plots need matplotlib: pip install 'triton-proxy[bench]' (or pip install "
            "matplotlib); the table and JSON do not"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdf(report: Report, path: str | Path) -> Path:
    """Per class: latency CDF (top) and its tail, 1 - CDF on a log axis (bottom), per arm."""
    plt = _pyplot()
    from matplotlib import ticker

    classes = report.scenario.class_names
    fig, axes = plt.subplots(2, len(classes), figsize=(5.5 * len(classes), 8), squeeze=False)
    for j, cls in enumerate(classes):
        top, tail = axes[0][j], axes[1][j]
        spec = report.scenario.classes[cls]
        for arm in report.arms:
            c = report.merged(arm, cls)
            if c is None or c.latency_us.count == 0:
                continue
            x, y = c.latency_us.cdf()
            x_ms = x / 1000.0
            top.step(x_ms, y, where="post", label=arm)
            tail.step(x_ms, np.maximum(1.0 - y, 1e-6), where="post", label=arm)
        for ax in (top, tail):
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
            if spec.slo_p99_ms is not None:
                ax.axvline(spec.slo_p99_ms, color="red", linestyle=":", linewidth=1)
        tail.set_yscale("log")
        tail.set_ylim(1e-4, 1.0)
        top.set_title(f"{cls} ({spec.rate_rps:g} req/s)")
        top.set_ylabel("CDF")
        tail.set_ylabel("1 - CDF (tail)")
        tail.set_xlabel("latency from scheduled send, ms")
        top.legend(fontsize=8)
    fig.suptitle(report.note or "latency CDF", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_instance_load(report: Report, path: str | Path, repetition: int = 0) -> Path:
    """Per arm: load per instance over time; client in-flight solid, probed load dashed."""
    plt = _pyplot()
    rep = report.repetitions[repetition]
    arms = [a for a in report.arms if a in rep.arms and not rep.arms[a].failed]
    rows = max(len(arms), 1)
    fig, axes = plt.subplots(rows, 1, figsize=(11, 2.4 * rows), squeeze=False, sharex=True)
    names = sorted({k for a in arms for s in rep.arms[a].loads for k in s.values})
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for i, arm in enumerate(arms):
        ax = axes[i][0]
        for series in rep.arms[arm].loads:
            per_instance = sorted(k for k in series.values if k != "(all)")
            client = series.source == "client_in_flight"
            for k in per_instance or list(series.values):
                values = [np.nan if v is None else v for v in series.values[k]]
                ax.plot(
                    series.t,
                    values,
                    "-" if client else "--",
                    color=colour[k],
                    linewidth=0.9,
                    label=f"{k} ({'client in flight' if client else series.source})",
                )
        ax.set_title(arm, fontsize=9)
        ax.set_ylabel("requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1][0].set_xlabel(
        f"seconds into run (repetition {repetition + 1}, seed {rep.seed}); "
        "client in flight = mean over each bin"
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_all(report: Report, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Table (``report.txt``), ``report.json`` and, with ``plots``, the PNGs, in ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    table = d / "report.txt"
    table.write_text(render_table(report) + "\n")
    out = {"table": table, "json": write_json(report, d / "report.json")}
    if plots:
        out["latency_cdf"] = plot_latency_cdf(report, d / "latency_cdf.png")
        out["instance_load"] = plot_instance_load(report, d / "instance_load.png")
    return out
