"""``triton-proxy bench``: every arm on the same open-loop schedule against a local fleet.

    triton-proxy bench [--scenario benchmarks/mixed.yaml] [--instances 3] [--arms default]
                       [--repetitions N] [--scale 0.8 1.0 1.2] [--out bench-results/DIR]
                       [--overhead [--overhead-parts closed,open]] [--workers 1,2,4]
    triton-proxy bench --routing      # routing decision microbenchmark, no servers

Starts ``--instances`` local Triton servers (``proxy.local.LocalFleet``) serving the scenario's
model, with the scenario's ``model.parameters`` written into a private copy of its
``config.pbtxt`` (``accel_sim``: the emulated device), plus ``simple`` for ``--overhead``. Then,
for each ``--scale``, runs the chosen arms (:mod:`proxy.bench.arms`) one after another on one
schedule per repetition, prints the table and writes ``report.json``, ``report.txt`` and the
PNGs. ``--overhead`` adds the idle-fleet overhead and sustained-rate measurement
(:mod:`proxy.bench.overhead`) of the proxy next to direct access and HAProxy, and a
closed-loop run at concurrency 1 and 16 over HTTP and gRPC (:mod:`proxy.bench.closed`).
``--workers 1,2,4`` runs every proxy arm once per worker count (``serve --workers N``).
``--routing`` times one routing decision per policy and fleet size
(:mod:`proxy.bench.routing`) and exits; it starts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.arms import (
    CATALOG,
    PRESETS,
    PROXY_MODES,
    ArmPlan,
    Server,
    build_arm,
    proxy_policy,
    proxy_subprocess,
    resolve_arms,
    scheduling_section,
    triton_pending_probe,
    with_connection_limit,
)
from proxy.bench.closed import ClosedArm, ClosedReport, ClosedTarget, measure_closed
from proxy.bench.compare import ACCEL_SIM_NOTE, ArmSpec, run_comparison
from proxy.bench.cpu import CpuMeter
from proxy.bench.fleet import bench_repository
from proxy.bench.overhead import OverheadReport, measure_overhead
from proxy.bench.report import render_table, write_all
from proxy.bench.results import Report
from proxy.bench.scenario import ModelSpec, Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SCENARIO = ROOT / "benchmarks" / "mixed.yaml"
DEFAULT_REPOSITORY = ROOT / "model_repository"

OVERHEAD_MODEL = ModelSpec(
    name="simple", input="INPUT0", extra_inputs=("INPUT1",), datatype="INT32", encoding="binary"
)
"""Triton's quick-start model: a tiny request whose server time is well under a millisecond."""
OVERHEAD_TOKENS = 16
OVERHEAD_ARMS = ("haproxy_leastconn", "proxy_least_requests", "proxy_least_requests+classes")
INPROCESS_SUFFIX = " (in-process)"
BASE_SUFFIX = " @base"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on ``triton-proxy``'s sub-command parsers."""
    b: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmark the proxy against round robin and HAProxy on a local fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--scenario", default=str(DEFAULT_SCENARIO), help="scenario YAML")
    b.add_argument("--instances", type=int, default=3, help="local Triton servers (default 3)")
    b.add_argument(
        "--arms",
        default="default",
        help="comma list of arms and presets (" + ", ".join(PRESETS) + "); see --list-arms",
    )
    b.add_argument("--list-arms", action="store_true", help="print the arms and presets, exit")
    b.add_argument("--repetitions", type=int, default=None, help="override the scenario's")
    b.add_argument(
        "--duration", type=float, default=None, help="measured seconds per run (override)"
    )
    b.add_argument(
        "--scale",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="F",
        help="load factors to sweep (every class's rate x F); default 1.0",
    )
    b.add_argument("--out", default=None, help="output folder (default bench-results/<time>)")
    b.add_argument(
        "--overhead",
        action="store_true",
        help="also measure the proxy's added latency on an idle fleet and its sustained rate",
    )
    b.add_argument(
        "--no-compare", action="store_true", help="skip the comparison (with --overhead)"
    )
    b.add_argument(
        "--proxy-mode",
        choices=PROXY_MODES,
        default="subprocess",
        help="proxy arms in a child process (default) or in the generator's event loop",
    )
    b.add_argument(
        "--connections",
        type=int,
        default=8000,
        help="most connections the generator opens to an arm (default 8000); requests beyond "
        "wait in its pool, first come first served, which hides the arm's own ordering",
    )
    b.add_argument(
        "--overhead-parts",
        default="closed,open",
        help="comma list: closed (concurrency 1/16, HTTP and gRPC), open (idle rate + "
        "sustained-rate search); default both",
    )
    b.add_argument("--closed-duration", type=float, default=5.0, help="seconds per closed-loop run")
    b.add_argument(
        "--workers",
        default="1",
        help="comma list of proxy worker counts; each proxy arm runs once per count",
    )
    b.add_argument(
        "--baseline-tree",
        default=None,
        metavar="DIR",
        help="also run every proxy arm from this checkout (e.g. `git archive <commit>` "
        "unpacked), named '<arm> @base', to compare two revisions in one run",
    )
    b.add_argument(
        "--routing",
        action="store_true",
        help="routing decision microbenchmark (every policy, 3..1000 instances); no servers",
    )
    b.add_argument("--overhead-duration", type=float, default=10.0, help="idle run seconds")
    b.add_argument("--overhead-rate", type=float, default=50.0, help="idle run req/s")
    b.add_argument(
        "--overhead-rates",
        default="250,500,1000,1500,2000,3000",
        help="comma list of req/s steps for the sustained-rate search",
    )
    b.add_argument(
        "--publish",
        default=None,
        metavar="DIR",
        help="also write small copies to commit (tables, JSON without histograms, PNGs)",
    )
    b.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    b.add_argument("--no-plots", action="store_true", help="table and JSON only")
    b.add_argument("--quiet", action="store_true", help="no progress line")
    b.set_defaults(func=cmd_bench)
    return b


# -- pure helpers (tested without a fleet) -------------------------------------------------


def bench_scenario(
    path: str | Path, repetitions: int | None = None, duration_s: float | None = None
) -> Scenario:
    """The scenario file with the command line's overrides applied."""
    sc = load_scenario(path)
    changes: dict[str, Any] = {}
    if repetitions is not None:
        changes["repetitions"] = repetitions
    if duration_s is not None:
        changes["duration_s"] = duration_s
    return dataclasses.replace(sc, **changes) if changes else sc


def parse_workers(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--workers: {exc}") from None
    if not counts or any(n < 1 for n in counts):
        raise ValueError("--workers: give worker counts >= 1")
    return tuple(dict.fromkeys(counts))


def worker_suffix(workers: int) -> str:
    return "" if workers == 1 else f" w{workers}"


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--overhead-rates: {exc}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("--overhead-rates: give positive req/s values")
    return rates


def scale_dir(out: Path, scale: float, scales: Sequence[float]) -> Path:
    """One scale writes into ``out``; a sweep writes ``out/scale-<F>`` per factor."""
    return out if len(scales) == 1 else out / f"scale-{scale:g}"


def baseline_name(plans: Sequence[ArmPlan]) -> str:
    names = [p.name for p in plans]
    return "round_robin" if "round_robin" in names else names[0]


def estimate_seconds(scenario: Scenario, arms: int, scales: int, per_arm_s: float = 6.0) -> float:
    """Rough wall time of the comparison (start, settle and drain cost ``per_arm_s``)."""
    return scales * scenario.repetitions * arms * (scenario.horizon_s + per_arm_s)


def models_needed(scenario: Scenario, overhead: bool) -> list[str]:
    models = [scenario.model.name]
    if overhead and OVERHEAD_MODEL.name not in models:
        models.append(OVERHEAD_MODEL.name)
    return models


def render_arm_list() -> str:
    lines = ["arms:"]
    lines += [f"  {n:<30} {p.description}" for n, p in CATALOG.items()]
    lines.append("presets:")
    lines += [f"  {n:<30} {', '.join(names)}" for n, names in PRESETS.items()]
    return "\n".join(lines)


def device_note(scenario: Scenario) -> str:
    params = dict(scenario.model.parameters)
    if not params:
        return ACCEL_SIM_NOTE if scenario.model.name == "accel_sim" else ""
    shown = ", ".join(f"{k}={v:g}" for k, v in params.items())
    return f"{ACCEL_SIM_NOTE} Emulated device: {scenario.model.name} {shown}."


# -- sweep summary -------------------------------------------------------------------------


def sweep_summary(reports: Sequence[tuple[float, Report]]) -> dict[str, Any]:
    """Per scale, arm and class: pooled P50/P99, SLO attainment and completion."""
    out: dict[str, Any] = {"scales": [s for s, _ in reports], "points": []}
    for scale, report in reports:
        for arm in report.arms:
            for cls in report.scenario.class_names:
                c = report.merged(arm, cls)
                if c is None:
                    continue
                out["points"].append(
                    {
                        "scale": scale,
                        "arm": arm,
                        "class": cls,
                        "rate_rps": report.scenario.classes[cls].rate_rps,
                        "p50_ms": c.p50_ms,
                        "p99_ms": c.p99_ms,
                        "slo_p99_ms": c.slo_p99_ms,
                        "slo_attainment": c.slo_attainment,
                        "completion_rate": c.completion_rate,
                    }
                )
    return out


def render_sweep(summary: dict[str, Any]) -> str:
    points = summary["points"]
    classes = list(dict.fromkeys(p["class"] for p in points))
    arms = list(dict.fromkeys(p["arm"] for p in points))
    scales = summary["scales"]
    lines = ["Load sweep: P99 ms (SLO attainment %) per class, arm and load factor"]
    for cls in classes:
        head = f"{'arm':<30}" + "".join(f"{'x' + format(s, 'g'):>18}" for s in scales)
        lines += ["", f"class {cls}", head]
        for arm in arms:
            cells = []
            for s in scales:
                p = next(
                    (q for q in points if (q["arm"], q["class"], q["scale"]) == (arm, cls, s)), None
                )
                if p is None or p["p99_ms"] is None:
                    cells.append(f"{'-':>18}")
                    continue
                att = p["slo_attainment"]
                extra = f" ({100 * att:.1f}%)" if att is not None else ""
                cells.append(f"{p['p99_ms']:>10.1f}{extra:>8}")
            lines.append(f"{arm:<30}" + "".join(cells))
    return "\n".join(lines)


def plot_sweep(summary: dict[str, Any], path: Path) -> Path:
    from proxy.bench.report import _pyplot

    plt = _pyplot()
    from matplotlib import ticker

    points = summary["points"]
    classes = list(dict.fromkeys(p["class"] for p in points))
    arms = list(dict.fromkeys(p["arm"] for p in points))
    fig, axes = plt.subplots(1, len(classes), figsize=(5.5 * len(classes), 4.2), squeeze=False)
    for j, cls in enumerate(classes):
        ax = axes[0][j]
        slo = None
        for arm in arms:
            pts = sorted(
                (p["scale"], p["p99_ms"])
                for p in points
                if p["arm"] == arm and p["class"] == cls and p["p99_ms"] is not None
            )
            slo = next((p["slo_p99_ms"] for p in points if p["class"] == cls), None)
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


# -- the command ---------------------------------------------------------------------------


def _run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _environment(argv: Sequence[str]) -> dict[str, Any]:
    return {
        "command": "triton-proxy bench " + " ".join(shlex.quote(a) for a in argv),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def cmd_routing(args: argparse.Namespace) -> int:
    from proxy.bench.routing import measure_all, render

    out = Path(args.out) if args.out else None
    points = measure_all()
    text = render(points)
    print(text, flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "routing.txt").write_text(text + "\n")
        env = _environment(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
        doc = {"environment": env, "points": [p.to_dict() for p in points]}
        (out / "routing.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.list_arms:
        print(render_arm_list())
        return 0
    if args.routing:
        return cmd_routing(args)
    from proxy.local import LocalFleet, sigterm_raises_exit

    try:
        scenario = bench_scenario(args.scenario, args.repetitions, args.duration)
        plans = resolve_arms(args.arms)
        rates = parse_rates(args.overhead_rates)
        workers = parse_workers(args.workers)
        parts = {x.strip() for x in args.overhead_parts.split(",") if x.strip()}
        if not parts <= {"closed", "open"}:
            raise ValueError("--overhead-parts: closed, open")
    except ValueError as exc:
        print(f"triton-proxy bench: {exc}", file=sys.stderr)
        return 2
    if any(s <= 0 for s in args.scale):
        print("triton-proxy bench: --scale factors must be > 0", file=sys.stderr)
        return 2
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench-results" / stamp
    work = out / "work"
    env = _environment(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    env["scenario"] = str(args.scenario)
    env["proxy_mode"] = args.proxy_mode
    env["instances"] = args.instances
    env["connections"] = args.connections
    env["workers"] = list(workers)
    args.workers_list = workers
    args.parts = parts
    models = models_needed(scenario, args.overhead)
    repo = bench_repository(
        Path(args.model_repository),
        work / "repository",
        models,
        {scenario.model.name: dict(scenario.model.parameters)}
        if scenario.model.parameters
        else None,
    )
    if not args.no_compare:
        per_proxy = len(workers) + (1 if args.baseline_tree else 0)
        n_arms = sum(per_proxy if p.kind == "proxy" else 1 for p in plans)
        est = estimate_seconds(scenario, n_arms, len(args.scale))
        print(
            f"bench: {n_arms} arms x {scenario.repetitions} repetition(s) x "
            f"{len(args.scale)} load factor(s), about {est / 60:.0f} min; results in {out}",
            flush=True,
        )
    with (
        sigterm_raises_exit(),
        LocalFleet(args.instances, repo, models, work / "logs") as fleet,
    ):
        servers = fleet.servers
        print("bench: servers " + ", ".join(f"{s.name} {s.http_url}" for s in servers), flush=True)
        meter = CpuMeter(lambda: set(fleet.started_pgids))
        _run_async(_bench(args, scenario, plans, servers, out, rates, meter))
    env["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    env["load_average_end"] = list(os.getloadavg())
    (out / "run.json").write_text(json.dumps(env, indent=1) + "\n")
    print(f"bench: results in {out}", flush=True)
    if args.publish:
        from proxy.bench.publish import publish

        files = publish(out, Path(args.publish))
        print(f"bench: {len(files)} small copies in {args.publish}", flush=True)
    return 0


async def _bench(
    args: argparse.Namespace,
    scenario: Scenario,
    plans: Sequence[ArmPlan],
    servers: Sequence[Server],
    out: Path,
    rates: Sequence[float],
    meter: CpuMeter,
) -> None:
    work = out / "work"
    show = not args.quiet
    if not args.no_compare:
        arms = [
            build_arm(
                p,
                servers,
                scenario,
                model=scenario.model,
                workdir=work,
                mode=args.proxy_mode,
                name=p.name + worker_suffix(n),
                workers=n,
            )
            for p in plans
            for n in (args.workers_list if p.kind == "proxy" else (1,))
        ]
        if args.baseline_tree:
            arms += [
                build_arm(
                    p,
                    servers,
                    scenario,
                    model=scenario.model,
                    workdir=work,
                    name=p.name + BASE_SUFFIX,
                    root=Path(args.baseline_tree),
                )
                for p in plans
                if p.kind == "proxy"
            ]
        reports: list[tuple[float, Report]] = []
        note = device_note(scenario)
        for scale in args.scale:
            meter.runs.clear()
            sc = scenario.scaled(scale) if scale != 1.0 else scenario
            print(f"\nbench: load factor {scale:g}", flush=True)
            report = await run_comparison(
                sc,
                [meter.wrap(with_connection_limit(a, args.connections)) for a in arms],
                baseline=baseline_name(plans),
                probe=lambda: triton_pending_probe(servers, scenario.model.name),
                show_progress=show,
                note=note,
            )
            reports.append((scale, report))
            folder = scale_dir(out, scale, args.scale)
            write_all(report, folder, plots=not args.no_plots)
            (folder / "cpu.txt").write_text(meter.render() + "\n")
            (folder / "cpu.json").write_text(json.dumps(meter.to_dict(), indent=1) + "\n")
            print(render_table(report) + "\n\n" + meter.render(), flush=True)
        if len(reports) > 1:
            summary = sweep_summary(reports)
            (out / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
            text = render_sweep(summary)
            (out / "sweep.txt").write_text(text + "\n")
            print("\n" + text, flush=True)
            if not args.no_plots:
                plot_sweep(summary, out / "sweep.png")
    if args.overhead and "closed" in args.parts:
        closed = await _closed(args, scenario, servers, work)
        text = closed.render()
        (out / "closed.txt").write_text(text + "\n")
        (out / "closed.json").write_text(json.dumps(closed.to_dict(), indent=1) + "\n")
        print("\n" + text, flush=True)
    if args.overhead and "open" in args.parts:
        overhead = await _overhead(args, scenario, servers, work, rates, show)
        text = overhead.render()
        (out / "overhead.txt").write_text(text + "\n")
        (out / "overhead.json").write_text(
            json.dumps(overhead.to_dict(), indent=1, allow_nan=False) + "\n"
        )
        print("\n" + text, flush=True)


async def _overhead(
    args: argparse.Namespace,
    scenario: Scenario,
    servers: Sequence[Server],
    work: Path,
    rates: Sequence[float],
    show: bool,
) -> OverheadReport:
    """Direct round robin vs HAProxy vs the proxy (child process and in-process) on ``simple``."""
    urls = [s.http_url for s in servers]
    direct = ArmSpec.direct("direct", urls, instance_names=[s.name for s in servers])
    arms = [
        build_arm(CATALOG[n], servers, scenario, model=OVERHEAD_MODEL, workdir=work)
        for n in OVERHEAD_ARMS
    ]
    inproc = CATALOG["proxy_least_requests"]
    arms.insert(
        2,
        build_arm(
            inproc,
            servers,
            scenario,
            model=OVERHEAD_MODEL,
            workdir=work,
            mode="inprocess",
            name=inproc.name + INPROCESS_SUFFIX,
        ),
    )
    # Classes arms classify by API key: send the most important class's key.
    top = next(iter(scheduling_section(scenario)["classes"]))
    print("\nbench: proxy overhead on an idle fleet (model simple)", flush=True)
    return await measure_overhead(
        OVERHEAD_MODEL,
        direct,
        arms,
        idle_rate_rps=args.overhead_rate,
        idle_duration_s=args.overhead_duration,
        repetitions=3,
        tokens=OVERHEAD_TOKENS,
        rates=rates,
        api_key=scenario.classes[top].api_key,
        show_progress=show,
    )


async def _closed(
    args: argparse.Namespace, scenario: Scenario, servers: Sequence[Server], work: Path
) -> ClosedReport:
    """Closed loop at concurrency 1 and 16: direct, HAProxy and the proxy, HTTP and gRPC."""
    from proxy.bench.haproxy import Backend, run_haproxy

    grpc_addresses = [s.grpc_address for s in servers]
    top = next(iter(scheduling_section(scenario)["classes"]))
    print("\nbench: closed-loop overhead (model simple, HTTP and gRPC)", flush=True)
    async with contextlib.AsyncExitStack() as stack:
        haproxy_url = await stack.enter_async_context(
            run_haproxy(
                [Backend(s.name, s.http_url) for s in servers],
                "leastconn",
                workdir=work / "haproxy-closed",
            )
        )
        arms = [
            _ready_arm("direct http", ClosedTarget("http", tuple(s.http_url for s in servers))),
            _ready_arm(
                "haproxy_leastconn http", ClosedTarget("http", (haproxy_url,)), "direct http"
            ),
            _ready_arm("direct grpc", ClosedTarget("grpc", tuple(grpc_addresses))),
        ]
        variants: list[tuple[int, str, Path]] = [
            (n, worker_suffix(n), ROOT) for n in args.workers_list
        ]
        if args.baseline_tree:
            variants.append((1, BASE_SUFFIX, Path(args.baseline_tree)))
        for name in ("proxy_least_requests", "proxy_least_requests+classes"):
            plan = CATALOG[name]
            doc = proxy_policy(servers, plan, scenario, grpc_addresses=grpc_addresses)
            for n, suffix, root in variants:
                label = name + suffix
                ep = await stack.enter_async_context(
                    proxy_subprocess(doc, work / "proxy-closed", label, workers=n, root=root)
                )
                pids = (ep.pid,) if ep.pid else ()
                arms.append(
                    _ready_arm(
                        f"{label} http", ClosedTarget("http", (ep.http_url,), pids), "direct http"
                    )
                )
                if ep.grpc_address:
                    arms.append(
                        _ready_arm(
                            f"{label} grpc",
                            ClosedTarget("grpc", (ep.grpc_address,), pids),
                            "direct grpc",
                        )
                    )
        return await measure_closed(
            arms,
            repetitions=3,
            duration_s=args.closed_duration,
            api_key=scenario.classes[top].api_key,
        )


def _ready_arm(name: str, target: ClosedTarget, baseline: str | None = None) -> ClosedArm:
    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[ClosedTarget]:
        yield target

    return ClosedArm(name, open_, baseline)
