"""The control benchmark's file, per-phase summary and report (no servers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proxy.bench.control import ControlBench, load, policy, render, repository, summarize
from proxy.bench.runner import Outcome, RunRecords
from proxy.bench.scenario import build_schedule, parse_scenario
from proxy.local import TritonServer

ROOT = Path(__file__).resolve().parents[2]


def bench() -> ControlBench:
    sc = parse_scenario(
        {
            "duration_s": 20,
            "phases": [
                {"name": "light", "duration_s": 10, "rates": {"off": 0}},
                {"name": "surge", "duration_s": 10, "rates": {"off": 50}},
            ],
            "classes": {
                "rt": {"rate_rps": 10, "slo_p99_ms": 100, "triton_priority": 1, "api_key": "k1"},
                "off": {"rate_rps": 0, "triton_priority": 2, "api_key": "k2"},
            },
        }
    )
    return ControlBench(scenario=sc)


def test_summary_per_phase() -> None:
    b = bench()
    schedule = build_schedule(b.scenario, np.random.default_rng(0))
    rec = RunRecords.empty(len(schedule), t0=100.0)
    for i, a in enumerate(schedule):
        rec.scheduled[i] = 100.0 + a.t
        # realtime: 50 ms in the light phase, 150 ms (past the SLO) in the surge
        took = 0.05 if a.t < 10 else 0.15
        rec.finished[i] = rec.scheduled[i] + took
        rec.outcome[i] = int(Outcome.OK)
    rec.load_samples = [
        (5.0, {"exec:a": 0.0, "count:a": 0.0}),
        (9.0, {"exec:a": 10.0, "count:a": 20.0}),
        (11.0, {"exec:a": 12.0, "count:a": 30.0}),
        (15.0, {"exec:a": 1.0, "count:a": 4.0}),  # a reload restarted the counters
        (19.0, {"exec:a": 5.0, "count:a": 36.0}),
    ]
    result = summarize(b, "static 1 ms", schedule, rec, 1000)
    light, surge = result.phases
    assert light["rt"]["slo_attainment"] == 1.0
    assert surge["rt"]["slo_attainment"] == 0.0
    assert light["off"]["sent"] == 0 and surge["off"]["sent"] > 300
    assert surge["off"]["completed_rps"] == pytest.approx(surge["off"]["sent"] / 10, rel=0.05)
    assert light["mean_batch"] == pytest.approx(2.0)
    assert surge["mean_batch"] == pytest.approx((4 + 32) / (1 + 4))
    assert all(w == 1.0 for _, w in result.window)
    text = render([result], b)
    assert "light" in text and "100.0 %" in text and "0.0 %" in text


def test_committed_bench_file_and_its_policy(tmp_path: Path) -> None:
    b = load(ROOT / "benchmarks" / "control.yaml")
    assert b.control.batching.enabled
    servers = [
        TritonServer(f"t{i}", f"http://127.0.0.1:{i + 1}", "", "http://x/metrics", tmp_path, 0)
        for i in range(2)
    ]
    doc = policy(b, servers, controlled=True)
    assert doc["control"]["batching"]["max_us"] == b.control.batching.max_us
    assert "control" not in policy(b, servers, controlled=False)
    from proxy import config as config_mod

    assert config_mod.parse(doc).control == b.control  # the policy round-trips strictly
    repo = repository(b, tmp_path / "repo")
    text = (repo / "accel_sim" / "config.pbtxt").read_text()
    assert "count: 2" in text and "max_batch_size: 8" in text
    assert 'key: "shared_device"\n  value: { string_value: "1" }' in text
