"""``triton-proxy bench``: every arm on the same open-loop schedule against a local fleet.

    triton-proxy bench [--scenario benchmarks/mixed.yaml ...] [--instances 3] [--arms default]
                       [--repetitions N] [--scale 0.8 1.0 1.2] [--out bench-results/DIR]
                       [--overhead [--overhead-parts closed,open]] [--workers 1,2,4]
    triton-proxy bench --routing      # routing decision microbenchmark, no servers

    # issue 10's sweep (4 scenarios x 5 loads x 6 arms x 3 repetitions; see docs/benchmarks.md)
    triton-proxy bench --scenario benchmarks/issue10/*.yaml --arms issue10
                       --scale 0.25 0.5 1 1.5 2 --repetitions 3 --out bench-results/issue10

Starts ``--instances`` local Triton servers (``proxy.local.LocalFleet``) serving the scenario's
model, with the scenario's ``model.parameters`` written into a private copy of its
``config.pbtxt`` (``accel_sim``: the emulated device), plus ``simple`` for ``--overhead``. Then,
for each ``--scale``, runs the chosen arms (:mod:`proxy.bench.arms`) one after another on one
schedule per repetition, prints the table and writes ``report.json``, ``report.txt`` and the
PNGs; then a sweep summary over the loads (``sweep.txt`` / ``sweep.json``: P50/P99 and SLO
attainment per class, ratios vs the best baseline, goodput, completions per 10 s window of the
throughput classes, sheds by reason, proxy memory; :mod:`proxy.bench.sweep`). Several
``--scenario`` files run one after another, each on a fresh fleet, into ``OUT/<file stem>/``.
Before starting, each scenario's FIFO capacity (:mod:`proxy.bench.capacity`) and the run's
estimated time are printed. ``--overhead`` adds the idle-fleet overhead and sustained-rate
measurement (:mod:`proxy.bench.overhead`) of the proxy next to direct access and HAProxy, and a
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
from proxy.bench.capacity import Capacity, fifo_capacity
from proxy.bench.closed import ClosedArm, ClosedReport, ClosedTarget, measure_closed
from proxy.bench.compare import ACCEL_SIM_NOTE, ArmSpec, run_comparison
from proxy.bench.cpu import CpuMeter
from proxy.bench.fleet import bench_repository
from proxy.bench.overhead import OverheadReport, measure_overhead
from proxy.bench.report import render_table, write_all
from proxy.bench.request_log import RequestLog, analyse, file_name
from proxy.bench.results import Report
from proxy.bench.runner import RunRecords
from proxy.bench.scenario import Arrival, ModelSpec, Scenario, load_scenario
from proxy.bench.sweep import best_baseline, plot_sweep, render_sweep, sweep_summary
from proxy.bench.trace import render_trace

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
    b.add_argument(
        "--scenario",
        nargs="+",
        default=[str(DEFAULT_SCENARIO)],
        help="scenario YAML file(s); several run one after another, each into OUT/<stem>/",
    )
    b.add_argument("--instances", type=int, default=3, help="local Triton servers (default 3)")
    b.add_argument(
        "--arms",
        default="default",
        help="comma list of arms and presets (" + ", ".join(PRESETS) + "); see --list-arms",
    )
    b.add_argument("--list-arms", action="store_true", help="print the arms and presets, exit")
    b.add_argument(
        "--dry-run",
        action="store_true",
        help="print each scenario's FIFO capacity and the run's estimated time, start nothing",
    )
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
        help="most connections the generator opens to an arm, per URL and class (default "
        "8000); requests beyond wait in its pool, first come first served, which hides the "
        "arm's own ordering",
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
    b.add_argument(
        "--request-log",
        action="store_true",
        help="also keep every request of every run (LOAD/requests/<arm>#<rep>.npz) and write "
        "where they waited (LOAD/stalls.txt; python -m proxy.bench.request_log)",
    )
    b.add_argument(
        "--trace",
        action="store_true",
        help="also write what each Triton's batcher did every 0.5 s of every run (rows per "
        "batch, batch time, queue) beside the proxy's in-flight counts by class "
        "(LOAD/trace.txt; proxy.bench.trace)",
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


FLEET_START_S = 30.0
"""Starting (and stopping) the local Triton fleet for one scenario, roughly."""


def estimate_sweep_seconds(
    scenario: Scenario,
    arms: int,
    scales: Sequence[float],
    rho: float | None = None,
    per_arm_s: float = 6.0,
) -> float:
    """Rough wall time of one scenario's sweep, fleet start included.

    Each run takes its horizon plus ``per_arm_s`` (start, settle); above FIFO capacity
    (``rho`` x factor > 1, ``rho`` the offered load / FIFO capacity at factor 1) a FIFO arm
    also drains its backlog after the last arrival, about ``horizon x (load - 1)`` seconds, at
    most the client timeout: counted for every arm, so the figure leans long.
    """
    total = FLEET_START_S
    for f in scales:
        drain = 0.0
        if rho is not None:
            drain = min(scenario.timeout_s, scenario.horizon_s * max(0.0, rho * f - 1.0))
        total += scenario.repetitions * arms * (scenario.horizon_s + per_arm_s + drain)
    return total


def scenario_dir(out: Path, path: str | Path, paths: Sequence[str | Path]) -> Path:
    """One scenario writes into ``out``; several write ``out/<file stem>`` each."""
    return out if len(paths) == 1 else out / Path(path).stem


def baseline_arms(plans: Sequence[ArmPlan]) -> list[str]:
    """The arms that are not the proxy (the baselines the proxy is judged against)."""
    return [p.name for p in plans if p.kind != "proxy"]


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
    from proxy.local import sigterm_raises_exit

    try:
        scenarios = [
            bench_scenario(path, args.repetitions, args.duration) for path in args.scenario
        ]
        plans = resolve_arms(args.arms)
        rates = parse_rates(args.overhead_rates)
        workers = parse_workers(args.workers)
        parts = {x.strip() for x in args.overhead_parts.split(",") if x.strip()}
        if not parts <= {"closed", "open"}:
            raise ValueError("--overhead-parts: closed, open")
        capacities = [fifo_capacity(sc, servers=args.instances) for sc in scenarios]
    except ValueError as exc:
        print(f"triton-proxy bench: {exc}", file=sys.stderr)
        return 2
    if any(s <= 0 for s in args.scale):
        print("triton-proxy bench: --scale factors must be > 0", file=sys.stderr)
        return 2
    args.workers_list = workers
    args.parts = parts
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench-results" / stamp
    per_proxy = len(workers) + (1 if args.baseline_tree else 0)
    n_arms = sum(per_proxy if p.kind == "proxy" else 1 for p in plans)
    total = 0.0
    for path, sc, cap in zip(args.scenario, scenarios, capacities, strict=True):
        est = estimate_sweep_seconds(sc, n_arms, args.scale, cap.rho)
        total += est
        if not args.no_compare:
            print(
                f"bench: {path}: {cap.render(args.instances)}; x{max(args.scale):g} = "
                f"{cap.rho * max(args.scale):.2f} x FIFO capacity; about {est / 60:.0f} min",
                flush=True,
            )
    if not args.no_compare:
        print(
            f"bench: {len(scenarios)} scenario(s) x {n_arms} arms x "
            f"{scenarios[0].repetitions} repetition(s) x {len(args.scale)} load factor(s), "
            f"about {total / 60:.0f} min in all; results in {out}",
            flush=True,
        )
    if args.dry_run:
        return 0
    with sigterm_raises_exit():
        for path, sc, cap in zip(args.scenario, scenarios, capacities, strict=True):
            _bench_scenario(args, path, sc, cap, plans, rates, out)
    if args.publish:
        from proxy.bench.publish import publish

        files = publish(out, Path(args.publish))
        print(f"bench: {len(files)} small copies in {args.publish}", flush=True)
    return 0


def _bench_scenario(
    args: argparse.Namespace,
    path: str,
    scenario: Scenario,
    capacity: Capacity,
    plans: Sequence[ArmPlan],
    rates: Sequence[float],
    root: Path,
) -> None:
    from proxy.local import LocalFleet

    out = scenario_dir(root, path, args.scenario)
    work = out / "work"
    env = _environment(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    env["scenario"] = str(path)
    env["fifo_capacity_rps"] = capacity.requests_per_s
    env["offered_rps_at_1"] = capacity.offered_rps
    env["proxy_mode"] = args.proxy_mode
    env["instances"] = args.instances
    env["connections"] = args.connections
    env["workers"] = list(args.workers_list)
    models = models_needed(scenario, args.overhead)
    repo = bench_repository(
        Path(args.model_repository),
        work / "repository",
        models,
        {scenario.model.name: dict(scenario.model.parameters)}
        if scenario.model.parameters
        else None,
    )
    with LocalFleet(args.instances, repo, models, work / "logs") as fleet:
        servers = fleet.servers
        print(
            f"bench: {path}: servers " + ", ".join(f"{s.name} {s.http_url}" for s in servers),
            flush=True,
        )
        meter = CpuMeter(lambda: set(fleet.started_pgids))
        _run_async(_bench(args, scenario, plans, servers, out, rates, meter))
    env["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    env["load_average_end"] = list(os.getloadavg())
    (out / "run.json").write_text(json.dumps(env, indent=1) + "\n")
    print(f"bench: results in {out}", flush=True)


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
                trace=args.trace,
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
                    trace=args.trace,
                )
                for p in plans
                if p.kind == "proxy"
            ]
        reports: list[tuple[float, Report]] = []
        note = device_note(scenario)
        logs: list[RequestLog] = []
        traces: list[str] = []
        names = [s.name for s in servers]

        def keep(arm: str, rep: int, schedule: Sequence[Arrival], rec: RunRecords) -> None:
            if args.request_log:
                logs.append(RequestLog.of(arm, rep, schedule, rec))
            if args.trace:
                heading = f"== {arm}, repetition {rep + 1}"
                traces.append(f"{heading}\n{render_trace(rec.load_samples, names)}")

        for scale in args.scale:
            meter.runs.clear()
            sc = scenario.scaled(scale) if scale != 1.0 else scenario
            print(f"\nbench: load factor {scale:g}", flush=True)
            folder = scale_dir(out, scale, args.scale)
            logs.clear()
            traces.clear()
            report = await run_comparison(
                sc,
                [meter.wrap(with_connection_limit(a, args.connections)) for a in arms],
                baseline=baseline_name(plans),
                probe=lambda: triton_pending_probe(servers, scenario.model.name, args.trace),
                show_progress=show,
                note=note,
                on_run=keep if args.request_log or args.trace else None,
            )
            # ratios in the table: against this load's best baseline when there is one
            report.baseline = best_baseline(report, baseline_arms(plans)) or report.baseline
            reports.append((scale, report))
            write_all(report, folder, plots=not args.no_plots)
            if logs:
                (folder / "requests").mkdir(parents=True, exist_ok=True)
                for log in logs:
                    log.save(folder / "requests" / file_name(log.arm, log.repetition))
                (folder / "stalls.txt").write_text(analyse(logs))
            if traces:
                (folder / "trace.txt").write_text("\n\n".join(traces) + "\n")
            (folder / "cpu.txt").write_text(meter.render() + "\n")
            (folder / "cpu.json").write_text(json.dumps(meter.to_dict(), indent=1) + "\n")
            print(render_table(report) + "\n\n" + meter.render(), flush=True)
        summary = sweep_summary(reports, baseline_arms(plans), servers=args.instances)
        (out / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
        text = render_sweep(summary)
        (out / "sweep.txt").write_text(text + "\n")
        print("\n" + text, flush=True)
        if len(reports) > 1 and not args.no_plots:
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
