"""Time to render the proxy's ``/metrics`` page: ``generate_latest`` against the proxy's own
renderer (``proxy/exposition.py``), on the same registry, alternated in one process.

    .venv/bin/python benchmarks/metrics_render.py [--rounds 7] [--number 200] [--profile]

The pages are built like the issue 10 benchmark's (3 instances, a policy with classes
realtime/online/offline, ``least_requests``' defaults otherwise): a Telemetry watching a real
Runtime (no servers: the scraper's snapshots, the catalog and the in-flight counts are set by
hand), with 5000 requests observed so every (model, class, instance, outcome) series exists.
Each round times ``--number`` renders of each renderer, old then new, and reports the per-render
wall and CPU time; the figures printed are medians [min..max] over the rounds. Both renderers
are first checked to write the same bytes. Light: a few seconds of one core.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy import config as config_mod
from proxy.clock import FakeClock
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.observer import RequestRecord
from proxy.runtime import Runtime
from proxy.telemetry import RequestTelemetry, Telemetry

INSTANCES = ("a", "b", "c")
CLASSES = {
    "realtime": {"rank": 0, "slo_p99_ms": 100, "triton_priority": 1},
    "online": {"rank": 1, "slo_p99_ms": 500, "triton_priority": 2},
    "offline": {"rank": 2},
}
OUTCOMES = ("200", "200", "200", "503", "shed_deadline")
INFO = ModelInfo(max_batch_size=16, priority_levels=3, model_instances=1, decoupled=False)


def build_page(models: tuple[str, ...], classes: bool) -> tuple[Runtime, Telemetry]:
    doc: dict[str, object] = {
        "instances": [
            {"name": n, "http": f"http://127.0.0.1:{i + 1}", "metrics": f"http://127.0.0.1:{i + 1}"}
            for i, n in enumerate(INSTANCES)
        ]
    }
    if classes:
        doc["scheduling"] = {"default_class": "offline", "classes": CLASSES}
    telemetry = Telemetry()
    rt = Runtime(config_mod.parse(doc, "bench"), FakeClock(), random.Random(0), telemetry)
    telemetry.watch(lambda: rt)
    for model in models:
        rt.catalog._cache[model] = (INFO, 1e9)
        if rt.gates is not None:
            rt.gates.gate(model, INFO)
    for inst in rt.fleet.all():
        for model in models:
            inst.model_in_flight[model] += 2
    for name in INSTANCES:
        loads = {m: ModelLoad(pending=1, queue_us=100.0, compute_us=5000.0) for m in models}
        rt.scraper._snapshots[name] = InstanceSnapshot(0.0, loads)  # type: ignore[union-attr]
    observe = RequestTelemetry(telemetry).on_request
    names = list(CLASSES) if classes else ["-"]
    r = random.Random(1)
    for _ in range(5000):
        model, klass, inst = r.choice(models), r.choice(names), r.choice(INSTANCES)
        slo = {"realtime": 0.1, "online": 0.5}.get(klass)
        observe(
            RequestRecord(
                model, klass, inst, r.choice(OUTCOMES), r.random(), 0.0, 1.0, False, 0.0, slo_s=slo
            )
        )
        if classes:
            telemetry.queue_wait_by.get(klass).observe(r.random() / 10)
        telemetry.decisions_by.get(model, "least_requests", inst, "main").inc()
        telemetry.decision_time_by.get("least_requests").observe(r.random() * 1e-4)
    for generation in range(3):
        telemetry.gc_pause.labels(str(generation)).observe(0.001)
    telemetry.loop_lag.observe(0.001)
    return rt, telemetry


def timed(render: Callable[[], bytes], number: int) -> tuple[float, float]:
    """Wall and CPU milliseconds per render, over ``number`` renders."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(number):
        render()
    return (
        (time.perf_counter() - wall) / number * 1e3,
        (time.process_time() - cpu) / number * 1e3,
    )


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"


def profile(render: Callable[[], bytes], label: str, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        render()
    prof.disable()
    print(f"--- cProfile, 100 renders, {label}: top {top} by own time")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=200, help="renders per round and renderer")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    args = ap.parse_args()
    pages = {
        "1 model, classes": (("accel_sim",), True),
        "1 model, no classes": (("accel_sim",), False),
        "3 models, classes": (("m1", "m2", "m3"), True),
    }
    print(f"{args.rounds} rounds x {args.number} renders per renderer; ms per render")
    for title, (models, classes) in pages.items():
        _, telemetry = build_page(models, classes)
        renderers = {
            "generate_latest": lambda t=telemetry: generate_latest(t.registry),
            "exposition": telemetry.exposition,
        }
        page = telemetry.exposition()
        assert page == generate_latest(telemetry.registry), "the renderers differ"
        samples = sum(1 for line in page.splitlines() if not line.startswith(b"#"))
        print(f"\n{title}: {len(page)} bytes, {samples} samples")
        wall: dict[str, list[float]] = {name: [] for name in renderers}
        cpu: dict[str, list[float]] = {name: [] for name in renderers}
        for _ in range(args.rounds):
            for name, render in renderers.items():
                w, c = timed(render, args.number)
                wall[name].append(w)
                cpu[name].append(c)
        for name in renderers:
            print(f"  {name:16} wall {spread(wall[name])}  cpu {spread(cpu[name])}")
        ratios = [o / n for o, n in zip(cpu["generate_latest"], cpu["exposition"], strict=True)]
        print(f"  cpu ratio per round (old / new): {spread(ratios)}")
        if args.profile and title == "1 model, classes":
            for name, render in renderers.items():
                profile(render, f"{title}, {name}", 14)


if __name__ == "__main__":
    main()
