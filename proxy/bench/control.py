"""Benchmark of the batching-window loop: static windows against the controlled one, per phase.

::

    flock /tmp/bench.lock flock /tmp/triton.lock \\
        python -m proxy.bench.control benchmarks/control.yaml --out docs/bench/control

The file holds a phased scenario (:class:`proxy.bench.scenario.Scenario` with ``phases``), the
fleet (servers, model instances per server), the static windows to compare and the ``control``
policy section of the controlled arm. Every arm runs the same open-loop schedule through the
proxy (a child process, the scenario's classes as its scheduling section) in front of the same
servers; before each arm every server is reloaded with the arm's starting window. Per phase it
reports the real-time classes' SLO attainment and P99, the throughput classes' completed
requests per second, and Triton's mean batch size; and it plots the window over time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from proxy import strict
from proxy.bench.arms import ROOT, proxy_subprocess, scheduling_section
from proxy.bench.fleet import bench_repository
from proxy.bench.runner import (
    HttpTarget,
    Outcome,
    ProgressLine,
    PrometheusGaugeProbe,
    RunRecords,
    TargetSpec,
    run_schedule,
)
from proxy.bench.scenario import Scenario, build_schedule
from proxy.control.config import ControlConfig
from proxy.fleet.model_control import batching_window_us, with_batching_window


@dataclass(frozen=True)
class ControlBench:
    scenario: Scenario
    instances: int = 2
    model_instances: int = 1
    """``instance_group`` count written into the bench's copy of the model."""
    max_batch_size: int | None = None
    """Written into the bench's copy of the model when set."""
    static_windows_us: tuple[int, ...] = (1000, 100_000)
    start_window_us: int = 1000
    """The controlled arm's window when it starts."""
    concurrency: int | None = None
    """The proxy's per-instance dispatch slots (``scheduling.concurrency``); null = derived."""
    control: ControlConfig = field(default_factory=ControlConfig)

    def __post_init__(self) -> None:
        if not self.scenario.phases:
            raise ValueError("scenario.phases: the control bench needs phases")
        if self.instances < 2:
            raise ValueError("instances must be >= 2 (a drained reload needs another instance)")


def load(path: Path) -> ControlBench:
    return strict.load(ControlBench, yaml.safe_load(path.read_text()), "", str(path))


def repository(bench: ControlBench, dest: Path) -> Path:
    model = bench.scenario.model
    repo = bench_repository(
        ROOT / "model_repository",
        dest,
        [model.name],
        {model.name: dict(model.parameters)} if model.parameters else None,
    )
    cfg = repo / model.name / "config.pbtxt"
    text = cfg.read_text()
    text = re.sub(r"(\n\s*count:\s*)\d+", rf"\g<1>{bench.model_instances}", text, count=1)
    if bench.max_batch_size is not None:
        text = re.sub(r"max_batch_size:\s*\d+", f"max_batch_size: {bench.max_batch_size}", text)
    cfg.write_text(text)
    return repo


async def set_window(servers: Sequence[Any], model: str, window_us: int) -> None:
    """Reload ``model`` on every server with ``window_us`` (same config otherwise)."""
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for s in servers:
            async with session.get(f"{s.http_url}/v2/models/{model}/config") as resp:
                config = json.loads(await resp.read())
            if batching_window_us(config) == window_us:
                continue
            body = {"parameters": {"config": json.dumps(with_batching_window(config, window_us))}}
            async with session.post(
                f"{s.http_url}/v2/repository/models/{model}/load", json=body
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{s.name}: load failed: {await resp.text()}")


class Probes:
    """Several gauges sampled together (run_schedule takes one probe)."""

    def __init__(self, probes: Mapping[str, PrometheusGaugeProbe]) -> None:
        self.probes = dict(probes)

    async def sample(self) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for prefix, probe in self.probes.items():
            for k, v in (await probe.sample()).items():
                out[f"{prefix}:{k}"] = v
        return out

    async def aclose(self) -> None:
        for p in self.probes.values():
            await p.aclose()


def policy(bench: ControlBench, servers: Sequence[Any], controlled: bool) -> dict[str, Any]:
    sched = scheduling_section(bench.scenario)
    if bench.concurrency is not None:
        sched["concurrency"] = bench.concurrency
    doc: dict[str, Any] = {
        "instances": [
            {"name": s.name, "http": s.http_url, "metrics": s.metrics_url} for s in servers
        ],
        "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
        "scrape": {"interval_s": 1.0, "window_s": 5.0},
        "scheduling": sched,
    }
    if controlled:
        doc["control"] = _plain(dataclasses.asdict(bench.control))
    return doc


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


@dataclass
class ArmResult:
    name: str
    phases: list[dict[str, Any]]
    window: list[tuple[float, float]]
    """(seconds since the schedule's start, window in ms) as probed (mean over instances)."""
    errors: dict[str, int]


def summarize(
    bench: ControlBench, name: str, schedule: Sequence[Any], rec: RunRecords, static: int | None
) -> ArmResult:
    sc = bench.scenario
    lat = rec.latency
    finished_rel = rec.finished - rec.t0
    classes = np.array([a.cls for a in schedule])
    t = np.array([a.t for a in schedule])
    ok = rec.outcome == int(Outcome.OK)
    phases = []
    samples = rec.load_samples
    for seg_name, lo, hi, rates in sc.segments():
        if seg_name == "warmup":
            continue
        row: dict[str, Any] = {"phase": seg_name, "start_s": lo, "end_s": hi}
        for cname, spec in sc.classes.items():
            sel = (classes == cname) & (t >= lo) & (t < hi)
            n = int(sel.sum())
            entry: dict[str, Any] = {
                "offered_rps": rates[cname],
                "sent": n,
                "shed": int((sel & (rec.outcome == int(Outcome.SHED))).sum()),
                "errors": int((sel & (rec.outcome == int(Outcome.ERROR))).sum()),
            }
            if spec.slo_p99_ms is not None and n:
                met = ok[sel] & (lat[sel] <= spec.slo_p99_ms / 1e3)
                entry["slo_attainment"] = float(met.mean())
                good = lat[sel & ok]
                entry["p99_ms"] = float(np.percentile(good, 99) * 1e3) if good.size else None
            done = (classes == cname) & ok & (finished_rel >= lo) & (finished_rel < hi)
            entry["completed_rps"] = float(done.sum() / (hi - lo))
            row[cname] = entry
        row["mean_batch"] = _mean_batch(samples, lo, hi)
        phases.append(row)
    window: list[tuple[float, float]] = []
    for at, values in samples:
        ws = [v for k, v in values.items() if k.startswith("window:")]
        if ws:
            window.append((at, 1e3 * sum(ws) / len(ws)))
        elif static is not None:
            window.append((at, static / 1e3))
    return ArmResult(name, phases, window, dict(rec.errors))


def _mean_batch(samples: Sequence[tuple[float, Mapping[str, float]]], lo: float, hi: float) -> Any:
    """Inferences per execution over the probes between ``lo`` and ``hi``. Triton's counters
    restart from 0 when a model reloads: a drop counts the new value as the increment."""
    inside = [v for at, v in samples if lo <= at <= hi]
    totals = {"exec:": 0.0, "count:": 0.0}
    for a, b in itertools.pairwise(inside):
        for key, now in b.items():
            prefix = next((p for p in totals if key.startswith(p)), None)
            if prefix is None:
                continue
            before = a.get(key)
            if before is None:
                continue
            totals[prefix] += now - before if now >= before else now
    if totals["exec:"] <= 0:
        return None
    return totals["count:"] / totals["exec:"]


def render(results: Sequence[ArmResult], bench: ControlBench) -> str:
    sc = bench.scenario
    slo = [n for n, c in sc.classes.items() if c.slo_p99_ms is not None]
    thr = [n for n, c in sc.classes.items() if c.slo_p99_ms is None]
    lines = []
    head = f"{'arm':<22} {'phase':<10}"
    for n in slo:
        head += f" {n + ' SLO met':>16} {n + ' p99 ms':>14} {'shed':>5}"
    for n in thr:
        head += f" {n + ' done/s':>15} {'offered':>8}"
    head += f" {'batch':>6}"
    lines.append(head)
    for r in results:
        for p in r.phases:
            line = f"{r.name:<22} {p['phase']:<10}"
            for n in slo:
                e = p[n]
                att = e.get("slo_attainment")
                p99 = e.get("p99_ms")
                line += f" {'-' if att is None else f'{att * 100:.1f} %':>16}"
                line += f" {'-' if p99 is None else f'{p99:.0f}':>14}"
                line += f" {e['shed']:>5}"
            for n in thr:
                e = p[n]
                line += f" {e['completed_rps']:>15.1f} {e['offered_rps']:>8.0f}"
            mb = p.get("mean_batch")
            line += f" {'-' if mb is None else f'{mb:.1f}':>6}"
            lines.append(line)
        if r.errors:
            lines.append(f"{'':<22} errors: {r.errors}")
    return "\n".join(lines)


def plot(results: Sequence[ArmResult], bench: ControlBench, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for seg_name, lo, hi, _ in bench.scenario.segments():
        if seg_name == "warmup":
            continue
        ax.axvspan(lo, hi, alpha=0.08 if "surge" in seg_name else 0.0, color="tab:orange")
        ax.text((lo + hi) / 2, 1.0, seg_name, transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=8)  # fmt: skip
    for r in results:
        if not r.window:
            continue
        xs, ys = zip(*r.window, strict=True)
        style = "-" if r.name == "controlled" else "--"
        ax.step(xs, ys, style, where="post", label=r.name)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since start (warm-up included)")
    ax.set_ylabel("max_queue_delay (ms, mean over instances)")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_arm(
    bench: ControlBench,
    servers: Sequence[Any],
    name: str,
    start_us: int,
    controlled: bool,
    work: Path,
) -> ArmResult:
    sc = bench.scenario
    model = sc.model.name
    print(f"control bench: arm {name}: setting the window to {start_us} us", flush=True)
    await set_window(servers, model, start_us)
    schedule = build_schedule(sc, np.random.default_rng(sc.seed))
    doc = policy(bench, servers, controlled)
    triton = {s.name: s.metrics_url for s in servers}
    async with proxy_subprocess(doc, work, name) as endpoints:
        probes: dict[str, PrometheusGaugeProbe] = {
            "exec": PrometheusGaugeProbe(triton, "nv_inference_exec_count_total", {"model": model}),
            "count": PrometheusGaugeProbe(triton, "nv_inference_count_total", {"model": model}),
        }
        if controlled and endpoints.metrics_url:
            probes["window"] = PrometheusGaugeProbe(
                {"proxy": endpoints.metrics_url},
                "triton_proxy_batching_window_seconds",
                {"model": model},
                split_label="instance",
            )
        probe = Probes(probes)
        # Enough client connections that a backlog never queues in the generator's own pool
        # (first come first served there would replace the proxy's class order).
        target = HttpTarget(name, TargetSpec(urls=(endpoints.http_url,), connection_limit=8000), sc)
        try:
            rec = await run_schedule(
                schedule,
                target,
                horizon_s=sc.horizon_s,
                progress=ProgressLine(every_s=30.0),
                probe=probe,
                probe_interval_s=1.0,
            )
        finally:
            await target.aclose()
            await probe.aclose()
    return summarize(bench, name, schedule, rec, None if controlled else start_us)


async def main_async(bench: ControlBench, servers: Sequence[Any], out: Path, arms: str) -> None:
    plan: list[tuple[str, int, bool]] = []
    for item in arms.split(","):
        if item == "controlled":
            plan.append(("controlled", bench.start_window_us, True))
        else:
            us = int(item)
            plan.append((f"static {us / 1e3:g} ms", us, False))
    results = []
    for name, start, controlled in plan:
        results.append(await run_arm(bench, servers, name, start, controlled, out / "work"))
        text = render(results, bench)
        (out / "report.txt").write_text(text + "\n")
        (out / "report.json").write_text(
            json.dumps([dataclasses.asdict(r) for r in results], indent=1) + "\n"
        )
        plot(results, bench, out / "window.png")
        print(text, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.bench.control", description=__doc__)
    parser.add_argument("bench", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--arms",
        default=None,
        help="comma list: window values in us (static arms) and 'controlled'; default: the "
        "file's static windows, then controlled",
    )
    args = parser.parse_args(argv)
    from proxy.local import LocalFleet, sigterm_raises_exit

    bench = load(args.bench)
    arms = args.arms or ",".join([*map(str, bench.static_windows_us), "controlled"])
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    repo = repository(bench, out / "work" / "repository")
    model = bench.scenario.model.name
    with (
        sigterm_raises_exit(),
        LocalFleet(bench.instances, repo, [model], out / "work" / "logs") as f,
    ):
        asyncio.run(main_async(bench, f.servers, out, arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
