"""Issue 10's benchmark, pure parts: rows and bursts in the schedule, FIFO capacity,
completions per window, shed reasons, proxy memory, goodput and the best baseline."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from proxy import config as config_mod
from proxy.bench import cli as bench_cli
from proxy.bench.arms import (
    CATALOG,
    CLASS_DEFAULT_ARM,
    FILL_SHIPPED_ARM,
    LANE_CONCURRENCY,
    LANE_DEPTH,
    PLACED_DEFAULT_ARM,
    PLACED_SHIPPED_ARM,
    PRESETS,
    PREVIOUS_CONCURRENCY,
    SHALLOW_DEPTH,
    SHARED_DEFAULT_ARM,
    SHIPPED_ARM,
    STARVED_DEFAULT_ARM,
    ArmPlan,
    parse_vm_rss_mib,
    proxy_policy,
    read_rss_mib,
    resolve_arms,
    scheduling_section,
)
from proxy.bench.capacity import ACCEL_SIM_MAX_BATCH, class_capacity, fifo_batches, fifo_capacity
from proxy.bench.report import render_table
from proxy.bench.results import (
    PROXY_BOOSTED,
    PROXY_COPIES,
    PROXY_RSS,
    ArmResult,
    ClassStats,
    Repetition,
    Report,
    copies_per_request,
    counted,
    rss_summary,
    summarize_run,
    window_counts,
    window_owed,
)
from proxy.bench.runner import (
    BATCH_ORIGIN,
    BATCH_OUTPUTS,
    Outcome,
    RequestEncoder,
    RunRecords,
    batch_origin,
    batch_seen,
    int_outputs,
    shed_reason,
)
from proxy.bench.scenario import (
    Arrival,
    Burst,
    build_schedule,
    load_scenario,
    parse_scenario,
)
from proxy.bench.sweep import (
    best_baseline,
    goodput,
    goodput_ratio,
    sweep_summary,
    window_floor,
)
from proxy.routing.wake import WakeParams
from proxy.scheduling.config import SchedulingConfig
from proxy.strict import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FAMILY = sorted((ROOT / "benchmarks" / "issue10").glob("*.yaml"))


class _Server:
    def __init__(self, k: int) -> None:
        self.name = f"t{k}"
        self.http_url = f"http://127.0.0.1:{8000 + k}"
        self.metrics_url = f"http://127.0.0.1:{9000 + k}/metrics"


SERVERS = [_Server(k) for k in range(3)]


# -- schedule: rows and bursts -------------------------------------------------------------

BURSTY = {
    "duration_s": 30,
    "warmup_s": 5,
    "seed": 3,
    "classes": {
        "rt": {"rate_rps": 50, "sizes": [{"tokens": [8, 64]}]},
        "off": {
            "rate_rps": 2,
            "sizes": [{"tokens": [512, 512], "rows": 4, "weight": 3}, {"tokens": [8, 8]}],
            "bursts": [{"at_s": 4, "count": 100, "every_s": 10}, {"at_s": 25, "count": 7}],
        },
    },
}


def test_rows_follow_their_bucket():
    sc = parse_scenario(BURSTY)
    sched = build_schedule(sc, np.random.default_rng(1))
    off = [a for a in sched if a.cls == "off"]
    assert all(a.rows == 4 for a in off if a.tokens == 512)
    assert all(a.rows == 1 for a in off if a.tokens == 8)
    assert all(a.rows == 1 for a in sched if a.cls == "rt")
    assert all(a.bucket == (0 if a.tokens == 512 else 1) for a in off)
    share = sum(a.rows == 4 for a in off) / len(off)
    assert abs(share - 0.75) < 5 * (0.75 * 0.25 / len(off)) ** 0.5


def test_bursts_drop_their_requests_at_once_inside_the_measured_window():
    sc = parse_scenario(BURSTY)
    sched = build_schedule(sc, np.random.default_rng(1))
    burst = [a for a in sched if a.burst]
    assert all(a.cls == "off" for a in burst)
    # at 4, 14, 24 s into the measured window (every 10 s while < 30) and one at 25 s
    times = Counter(a.t for a in burst)
    assert times == {9.0: 100, 19.0: 100, 29.0: 100, 30.0: 7}
    assert not any(a.warmup for a in burst)
    assert [a.index for a in sched] == list(range(len(sched)))
    assert [a.t for a in sched] == sorted(a.t for a in sched)
    # the Poisson part of the class is still there
    assert 0 < sum(a.cls == "off" and not a.burst for a in sched) < 3 * 2 * sc.horizon_s
    assert sc.classes["off"].burst_requests(sc.duration_s) == 307
    assert sc.classes["off"].mean_rate_rps(sc.duration_s) == pytest.approx(2 + 307 / 30)
    assert sc.offered_rps == pytest.approx(50 + 2 + 307 / 30)


def test_burst_spread_and_scaling():
    data = {
        "duration_s": 10,
        "classes": {"a": {"rate_rps": 0, "bursts": [{"at_s": 1, "count": 40, "spread_s": 2}]}},
    }
    sc = parse_scenario(data)
    ts = [a.t for a in build_schedule(sc, np.random.default_rng(0))]
    assert len(ts) == 40 and min(ts) >= 1.0 and max(ts) < 3.0 and len(set(ts)) == 40
    doubled = sc.scaled(2.0)
    assert doubled.classes["a"].bursts[0].count == 80
    assert len(build_schedule(doubled, np.random.default_rng(0))) == 80
    assert sc.scaled(0.25).classes["a"].bursts[0].count == 10


def test_burst_starts():
    assert Burst(at_s=2, count=1).starts(10) == [2]
    assert Burst(at_s=2, count=1, every_s=4).starts(10) == [2, 6]
    assert Burst(at_s=12, count=1).starts(10) == []


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"sizes": [{"tokens": [8, 8], "rows": 0}]}, "rows must be >= 1"),
        ({"bursts": [{"at_s": -1, "count": 3}]}, "at_s"),
        ({"bursts": [{"at_s": 1, "count": -3}]}, "count"),
        ({"bursts": [{"at_s": 1, "count": 3, "every_s": 0}]}, "every_s"),
        ({"bursts": [{"at": 1, "count": 3}]}, "did you mean 'at_s'"),
    ],
)
def test_bad_rows_and_bursts_are_refused(patch, message):
    with pytest.raises(ConfigError, match=message):
        parse_scenario({"duration_s": 5, "classes": {"a": {"rate_rps": 1, **patch}}})


def test_encoder_sends_rows_as_the_batch_dimension():
    sc = parse_scenario(BURSTY)
    enc = RequestEncoder(sc.model, sc.classes, priority=False)
    body, headers = enc.encode(Arrival(0, 0.0, "off", 512, None, False, rows=4))
    size = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:size])
    assert header["inputs"][0]["shape"] == [4, 512]
    assert len(body) - size == 4 * 512 * 8  # INT64
    one, _ = enc.encode(Arrival(1, 0.0, "off", 512, None, False))
    assert len(one) < len(body)


# -- FIFO capacity -------------------------------------------------------------------------


def test_fifo_batches_close_before_passing_max_rows():
    rows = np.array([4, 4, 4, 4, 1, 4, 16, 1])
    toks = np.array([512, 10, 10, 10, 20, 30, 5, 7])
    assert fifo_batches(rows, toks, 16) == [(16, 512), (5, 30), (16, 5), (1, 7)]


def test_fifo_capacity_of_a_uniform_mix_is_exact():
    # every request 1 row of 100 tokens: batches of 16, 5 + 0.02 * 16 * 100 = 37 ms
    sc = parse_scenario(
        {
            "duration_s": 10,
            "model": {"parameters": {"base_ms": 5, "per_token_us": 20}},
            "classes": {"a": {"rate_rps": 50, "sizes": [{"tokens": [100, 100]}]}},
        }
    )
    cap = fifo_capacity(sc, servers=3, requests=1600)
    assert cap.batch_ms == pytest.approx(37.0)
    assert cap.requests_per_s == pytest.approx(3 * 16 / 0.037)
    assert cap.sorted_requests_per_s == pytest.approx(cap.requests_per_s)
    assert cap.rho == pytest.approx(50 / cap.requests_per_s)
    assert cap.scale_for(1.0) * cap.rho == pytest.approx(1.0)


def test_class_capacity_counts_that_class_alone():
    # "a": 1 row of 100 tokens, batches of 16 in 37 ms; "b" (long) would pad a FIFO mix
    sc = parse_scenario(
        {
            "duration_s": 10,
            "model": {"parameters": {"base_ms": 5, "per_token_us": 20}},
            "classes": {
                "a": {"rate_rps": 50, "sizes": [{"tokens": [100, 100]}]},
                "b": {"rate_rps": 50, "sizes": [{"tokens": [512, 512], "rows": 4}]},
            },
        }
    )
    assert class_capacity(sc, "a", servers=3) == pytest.approx(3 * 16 / 0.037)
    # 4 requests of 4 rows per batch, padded to 512: 5 + 0.02 * 16 * 512 ms
    assert class_capacity(sc, "b", servers=2) == pytest.approx(2 * 4 / 0.16884)
    assert fifo_capacity(sc).requests_per_s < class_capacity(sc, "a")


def test_min_share_is_a_fraction():
    with pytest.raises(ConfigError, match="min_share"):
        parse_scenario({"classes": {"a": {"rate_rps": 1, "min_share": 1.5}}})


def test_fifo_capacity_matches_mixed_yaml_comment():
    cap = fifo_capacity(load_scenario(ROOT / "benchmarks" / "mixed.yaml"))
    assert 345 < cap.requests_per_s < 370  # the file says 358 req/s
    assert cap.sorted_requests_per_s > 3 * cap.requests_per_s


@pytest.mark.parametrize("path", FAMILY, ids=lambda p: p.stem)
def test_family_offers_its_fifo_capacity_at_scale_1(path):
    sc = load_scenario(path)
    cap = fifo_capacity(sc)
    assert 0.95 < cap.rho < 1.05, cap.render(3)
    assert f"{cap.requests_per_s:.0f} req/s" in path.read_text() or (
        f"{cap.requests_per_s + 1:.0f} req/s" in path.read_text()
        or f"{cap.requests_per_s - 1:.0f} req/s" in path.read_text()
    ), "the file's comment quotes its FIFO capacity"
    # throughput class without SLO, latency classes with one
    assert sc.classes["offline"].slo_p99_ms is None
    assert sc.classes["realtime"].slo_p99_ms is not None


def test_family_has_the_issue_case():
    names = {p.stem for p in FAMILY}
    assert {"case", "burst"} <= names
    case = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
    mixed = load_scenario(ROOT / "benchmarks" / "mixed.yaml")
    assert case.model.parameters["per_token_us"] < mixed.model.parameters["per_token_us"]
    assert case.classes["realtime"].slo_p99_ms < mixed.classes["realtime"].slo_p99_ms
    assert {b.rows for b in case.classes["offline"].sizes} == {4}
    assert {b.tokens for b in case.classes["offline"].sizes} == {(512, 512)}
    burst = load_scenario(ROOT / "benchmarks" / "issue10" / "burst.yaml")
    assert burst.classes["offline"].bursts and burst.classes["offline"].rate_rps == 0


# -- windows, sheds, memory ----------------------------------------------------------------


def test_window_counts():
    fin = np.array([100.0, 104.9, 105.0, 119.9, 120.0, 130.0, 131.0, np.nan, 99.9])
    assert window_counts(fin, 100.0, 30.0, 10.0) == [3, 1, 1]  # 130 and later: past it
    assert window_counts(fin, 100.0, 35.0, 10.0) == [3, 1, 1]  # a 5 s tail is left out
    assert window_counts(fin, 100.0, 6.0, 10.0) == [3]  # shorter than a window: one of 6 s
    assert window_counts(np.array([]), 0.0, 20.0) == [0, 0]


def test_window_owed():
    # windows [100, 110) and [110, 120); arrivals from the warm-up on, 1 s of grace
    sched = np.array([95.0, 98.0, 101.0, 108.9, 109.5, 112.0, 125.0])
    fin = np.array([99.0, 103.0, 111.0, np.nan])
    # first: 4 arrived before 109, 1 done before 100; second: 6 before 119, 2 done before 110
    assert window_owed(sched, fin, 100.0, 20.0, 10.0) == [3, 4]
    # without grace, 108.9 and 109.5 are owed to the first
    assert window_owed(sched, fin, 100.0, 20.0, 10.0, grace_s=0.0) == [4, 4]
    # a window shorter than the grace owes what waited at its start: 95 and 98, less 99
    assert window_owed(sched, fin, 100.0, 0.5, 10.0) == [1]


def test_a_floor_asks_a_window_at_most_what_it_owed():
    arm = ArmResult(name="x", windows={"off": [36, 31, 40]}, owed={"off": [50, 31, 60]})
    assert arm.holds("off", 36.0) is True  # 31 of 31 owed in the short window
    arm.owed["off"][1] = 32
    assert arm.holds("off", 36.0) is False
    assert ArmResult(name="old", windows={"off": [36, 31]}).holds("off", 36.0) is False
    assert ArmResult(name="none").holds("off", 36.0) is None


def test_summarize_run_counts_ok_completions_per_window_by_finish_time():
    sc = parse_scenario({"duration_s": 20, "warmup_s": 2, "classes": {"off": {"rate_rps": 1}}})
    # arrivals in the warm-up count too when they finish inside the measured period
    plan = [(1.0, 3.0, Outcome.OK), (5.0, 1.0, Outcome.OK), (6.0, 1.0, Outcome.SHED)]
    plan += [(13.0, 1.0, Outcome.OK), (20.0, 5.0, Outcome.OK)]
    sched = [Arrival(i, t, "off", 8, None, t < 2) for i, (t, _, _) in enumerate(plan)]
    rec = RunRecords.empty(len(plan), t0=50.0)
    for i, (t, lat, out) in enumerate(plan):
        rec.scheduled[i] = rec.started[i] = 50.0 + t
        rec.finished[i] = 50.0 + t + lat
        rec.outcome[i] = out
    rec.sheds["off late"] = 1
    rec.load_samples = [(0.5, {PROXY_RSS: 80.0}), (1.0, {PROXY_RSS: 95.0, "t0": 1}), (1.5, {})]
    rec.load_samples.append((2.5, {PROXY_COPIES: 3.0, PROXY_BOOSTED: 7.0}))  # first samples
    arm = summarize_run("x", sc, sched, rec)
    # windows [52, 62) and [62, 72): finishes at 54, 56, 64 (25 s is past the period)
    assert arm.windows["off"] == [2, 1]
    assert arm.min_window("off") == 1
    # owed [52, 62): 3 arrived by 61 (the shed one included), none done before 52;
    # [62, 72): 5 arrived by 71, 2 done before 62
    assert arm.owed["off"] == [3, 3]
    assert arm.sheds == {"off late": 1}
    assert arm.proxy_rss_mib == {"first": 80.0, "max": 95.0, "last": 95.0}
    probe = next(s for s in arm.loads if s.source == "probe")
    assert PROXY_RSS not in probe.values  # memory is not an instance's load
    assert PROXY_COPIES not in probe.values and PROXY_BOOSTED not in probe.values
    assert arm.proxy_copies == 3.0  # counted from 0: no probe by the warm-up's end saw it
    assert arm.proxy_boosted == 7.0
    assert copies_per_request([arm]) == 3.0 / 4  # the measured period schedules 4
    rec.load_samples[1][1][PROXY_COPIES] = 1.0  # seen at 1 s, in the warm-up (2 s)
    assert counted(rec, PROXY_COPIES, 2.0) == 2.0
    assert counted(rec, PROXY_COPIES, 0.7) == 3.0
    assert copies_per_request([summarize_run("y", sc, sched, RunRecords.empty(5, 0.0))]) is None
    assert json.dumps(arm.to_dict())


def test_classes_with_several_sizes_get_figures_per_size():
    sc = parse_scenario(BURSTY)
    sched = build_schedule(sc, np.random.default_rng(1))
    rec = RunRecords.empty(len(sched), t0=0.0)
    for i, a in enumerate(sched):
        rec.scheduled[i] = rec.started[i] = a.t
        # 512-token requests take 100 ms, 8-token ones 10 ms
        rec.finished[i] = a.t + (0.1 if a.tokens == 512 else 0.01)
        rec.outcome[i] = Outcome.OK
        # the long ones ran in batches of 4 x 512 tokens taking 60 ms: 40 ms waited before
        rec.batch[i] = (4, 512, 60_000) if a.tokens == 512 else (1, 8, 5_000)
    rec.batch[0] = -1  # one answer did not say: left out of the tail, counted in the rest
    arm = summarize_run("x", sc, sched, rec)
    assert set(arm.sizes) == {"off 512-512x4", "off 8-8"}  # "rt" has one size: none
    long, short = arm.sizes["off 512-512x4"], arm.sizes["off 8-8"]
    assert long.scheduled + short.scheduled == arm.classes["off"].scheduled
    assert long.p99_ms == pytest.approx(100, rel=0.01)
    assert short.p99_ms == pytest.approx(10, rel=0.01)
    rep = Repetition(index=0, seed=1, order=["x"])
    rep.arms["x"] = arm
    r = Report(scenario=sc, arms=["x"], baseline=None, repetitions=[rep])
    table = render_table(r)
    assert "by size bucket: P50 / P99 ms (pooled)" in table
    row = next(line for line in table.splitlines() if line.startswith("x ") and "/" in line)
    assert row.split()[1:] == ["100.0", "/", "100.0", "10.0", "/", "10.0"]
    assert len(long.tail) == max(1, long.ok // 100) and long.tail[0] == (100.0, 4, 512, 60_000)
    tail = table.split("slowest 1% of each repetition")[1].splitlines()
    row = next(line for line in tail if line.startswith("x "))
    # rt, off 512-512x4, off 8-8: wait + run, rows x padded length
    assert row.split()[1:] == ["5+5", "1x8", "40+60", "4x512", "5+5", "1x8"]
    assert json.dumps(arm.to_dict())


def _answer(outputs: list[tuple[str, str, bytes]]) -> tuple[list[tuple[str, str]], bytes]:
    header = json.dumps(
        {
            "model_name": "accel_sim",
            "outputs": [
                {
                    "name": n,
                    "datatype": d,
                    "shape": [2, 1],
                    "parameters": {"binary_data_size": len(b)},
                }
                for n, d, b in outputs
            ],
        }
    ).encode()
    headers = [("Inference-Header-Content-Length", str(len(header)))]
    return headers, header + b"".join(b for _, _, b in outputs)


def _seen(headers, body):
    found = int_outputs(headers, body, BATCH_OUTPUTS + BATCH_ORIGIN)
    return batch_seen(found), batch_origin(found)


def test_batch_seen_reads_the_batch_a_request_ran_in():
    i64 = lambda *v: np.array(v, dtype=np.int64).tobytes()  # noqa: E731
    outputs = [
        ("OUTPUT", "FP32", np.zeros(16, dtype=np.float32).tobytes()),
        ("BATCH_SIZE", "INT64", i64(5, 5)),
        ("PADDED_LENGTH", "INT64", i64(512, 512)),
        ("BATCH_COST_US", "INT64", i64(56_200, 56_200)),
        ("BATCH_START_US", "INT64", i64(123_456_789_012, 123_456_789_012)),
        ("BATCH_SERVER", "INT64", i64(4242, 4242)),
    ]
    assert _seen(*_answer(outputs)) == ((5, 512, 56_200), (123_456_789_012, 4242))
    # a model that reports the batch but not its origin, or not all of the batch
    assert _seen(*_answer(outputs[:4])) == ((5, 512, 56_200), None)
    assert _seen(*_answer(outputs[:3])) == (None, None)
    assert _seen(*_answer([])) == (None, None)
    assert _seen([("Inference-Header-Content-Length", "9")], b"not json at all") == (None, None)
    doc = {
        "outputs": [
            {"name": "BATCH_SIZE", "datatype": "INT64", "shape": [1, 1], "data": [3]},
            {"name": "PADDED_LENGTH", "datatype": "INT64", "shape": [1, 1], "data": [64]},
            {"name": "BATCH_COST_US", "datatype": "INT64", "shape": [1, 1], "data": [9000]},
            {"name": "BATCH_SERVER", "datatype": "INT64", "shape": [1, 1], "data": [77]},
        ]
    }
    body = json.dumps(doc).encode()
    assert _seen([("Content-Type", "application/json")], body) == ((3, 64, 9000), None)


def test_rss_parsing(tmp_path):
    assert parse_vm_rss_mib("Name:\tpython\nVmRSS:\t  204800 kB\n") == 200.0
    assert parse_vm_rss_mib("Name:\tzombie\n") is None
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("VmRSS:\t1024 kB\n")
    assert read_rss_mib(42, tmp_path) == 1.0
    assert read_rss_mib(43, tmp_path) is None
    assert rss_summary(RunRecords.empty(0, 0.0)) is None


def test_shed_reason_of_other_words():
    def msg(why: str) -> str:
        return f"request for model 'accel_sim' of class 'realtime' was shed: {why}; retry after 1 s"

    assert shed_reason(msg("something new")) == "something new"
    assert shed_reason("too many requests") == "other"
    assert shed_reason(None) == "unknown"


# -- arms ----------------------------------------------------------------------------------


def test_issue10_preset():
    assert PRESETS["issue10"] == (
        "round_robin",
        "rr_priority",
        "haproxy_leastconn",
        "haproxy_random2",
        "proxy_previous_best",
        "proxy_shallow_lane",
        "proxy_expected_finish+lane+pack90+backlog+expired+ring+adaptive+late+reserve+busy4+from5"
        "+placed_by_rank+rspread",
    )
    plans = resolve_arms("issue10")
    assert bench_cli.baseline_arms(plans) == [
        "round_robin",
        "rr_priority",
        "haproxy_leastconn",
        "haproxy_random2",
    ]


def test_previous_best_and_class_aware_policies():
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
    prev = config_mod.parse(proxy_policy(SERVERS, CATALOG["proxy_previous_best"], sc), "<t>")
    assert prev.routing.policy.name == "least_requests"
    assert prev.scheduling is not None
    assert prev.scheduling.concurrency == PREVIOUS_CONCURRENCY == 2 * 16
    assert prev.scheduling.shed_late is False and not prev.scheduling.adaptive()
    assert all(c.max_per_instance is None for c in prev.scheduling.classes.values())
    new = config_mod.parse(proxy_policy(SERVERS, CATALOG["proxy_class_aware"], sc), "<t>")
    assert new.routing.policy.name == "expected_start"
    assert new.routing.policy.params == {"long_placement": "spread"}  # as first measured
    assert new.scheduling is not None
    # adaptive concurrency is a default since session 31; the arm keeps the fixed slots it
    # was measured with
    assert new.scheduling.concurrency is None and not new.scheduling.adaptive()
    assert new.scheduling.shed_late is False
    caps = {n: c.max_per_instance for n, c in new.scheduling.classes.items()}
    assert caps == {"realtime": None, "online": None, "offline": 1}
    assert new.scheduling.default_class == "offline"
    both = config_mod.parse(proxy_policy(SERVERS, CATALOG["proxy_class_aware+adaptive"], sc), "<t>")
    assert both.scheduling is not None
    assert both.scheduling.adaptive() and both.scheduling.shed_late is True
    assert both.routing.policy.name == "expected_start"


def test_long_lane_policy():
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
    lane = config_mod.parse(proxy_policy(SERVERS, CATALOG["proxy_long_lane"], sc), "<t>")
    assert lane.routing.policy.name == "expected_start"
    assert lane.scheduling is not None and not lane.scheduling.adaptive()
    assert lane.scheduling.concurrency == LANE_CONCURRENCY == 4 * 16
    offline = lane.scheduling.classes["offline"]
    assert (offline.max_per_instance, offline.spare_instances) == (LANE_DEPTH, 1)
    assert all(
        c.max_per_instance is None and c.spare_instances == 0
        for n, c in lane.scheduling.classes.items()
        if n != "offline"
    )
    adaptive = config_mod.parse(
        proxy_policy(SERVERS, CATALOG["proxy_long_lane+adaptive"], sc), "<t>"
    )
    assert adaptive.scheduling is not None and adaptive.scheduling.adaptive()
    assert adaptive.scheduling.concurrency is None
    assert adaptive.scheduling.shed_late is False
    assert lane.scheduling.slot_sharing == "shared"
    ranked = config_mod.parse(proxy_policy(SERVERS, CATALOG["proxy_rank_lane"], sc), "<t>")
    assert ranked.scheduling is not None and ranked.scheduling.slot_sharing == "by_rank"
    assert ranked.scheduling.classes == lane.scheduling.classes
    assert ranked.routing == lane.routing
    shallow = config_mod.parse(proxy_policy(SERVERS, CATALOG["proxy_shallow_lane"], sc), "<t>")
    assert shallow.scheduling is not None
    off = shallow.scheduling.classes["offline"]
    assert (off.max_per_instance, off.shallow_per_instance) == (LANE_DEPTH, SHALLOW_DEPTH)
    assert SHALLOW_DEPTH < LANE_DEPTH


def test_shared_level_arm_sends_offline_at_onlines_priority():
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "long_share.yaml")
    shipped = "proxy_expected_finish+lane+pack90+backlog+expired+ring+adaptive+late"
    base = config_mod.parse(proxy_policy(SERVERS, CATALOG[shipped], sc), "<t>")
    shared = config_mod.parse(proxy_policy(SERVERS, CATALOG[shipped + "+shared_level"], sc), "<t>")
    assert base.scheduling is not None and shared.scheduling is not None
    levels = {n: c.triton_priority for n, c in shared.scheduling.classes.items()}
    assert levels == {"realtime": 1, "online": 2, "offline": 2}
    assert base.scheduling.classes["offline"].triton_priority == 3
    # nothing else differs from the shipped arm
    assert (
        replace(shared.scheduling.classes["offline"], triton_priority=3)
        == (base.scheduling.classes["offline"])
    )
    assert shared.routing == base.routing


@pytest.mark.parametrize(
    ("suffix", "param"), [("+depth64", {"lane_depth": 64}), ("+reserve", {"short_reserve": 1})]
)
def test_class_default_lane_variants_differ_from_the_default_in_one_parameter(
    suffix: str, param: dict[str, int]
) -> None:
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "online_burst.yaml")
    base = config_mod.parse(
        proxy_policy(SERVERS, CATALOG["proxy_classes_default+adaptive"], sc), "<t>"
    )
    variant = config_mod.parse(
        proxy_policy(SERVERS, CATALOG["proxy_classes_default+adaptive" + suffix], sc), "<t>"
    )
    assert variant.scheduling == base.scheduling
    assert variant.routing.wake == base.routing.wake
    assert dict(variant.routing.policy.params) == {**base.routing.policy.params, **param}
    assert variant.routing.policy.name == base.routing.policy.name


def test_estimates():
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
    light = bench_cli.estimate_sweep_seconds(sc, arms=6, scales=[0.5], rho=1.0)
    assert light == pytest.approx(bench_cli.FLEET_START_S + 3 * 6 * (sc.horizon_s + 6.0))
    heavy = bench_cli.estimate_sweep_seconds(sc, arms=6, scales=[2.0], rho=1.0)
    assert heavy == pytest.approx(light + 3 * 6 * sc.horizon_s)  # drains one horizon
    assert bench_cli.scenario_dir(Path("o"), "b/case.yaml", ["b/case.yaml"]) == Path("o")
    two = ["b/case.yaml", "b/burst.yaml"]
    assert bench_cli.scenario_dir(Path("o"), "b/case.yaml", two) == Path("o/case")


# -- sweep: best baseline, goodput ---------------------------------------------------------

SC2 = parse_scenario(
    {
        "duration_s": 10,
        "classes": {
            "rt": {"rate_rps": 10, "slo_p99_ms": 100},
            "on": {"rate_rps": 10, "slo_p99_ms": 500},
            "off": {"rate_rps": 1},
        },
    }
)


def stats(ok_ms: list[float], slo: float | None, shed: int = 0) -> ClassStats:
    c = ClassStats(slo_p99_ms=slo, duration_s=10.0)
    c.scheduled = len(ok_ms) + shed
    c.ok = len(ok_ms)
    c.shed = shed
    c.within_slo = sum(x <= slo for x in ok_ms) if slo is not None else 0
    c.latency_us.record_many(np.array([round(x * 1000) for x in ok_ms], dtype=np.int64))
    return c


def report(arms: dict[str, tuple[float, float, int]], scale: float) -> Report:
    """arms: name -> (rt latency ms, online latency ms, rt shed) for 100 requests each."""
    rep = Repetition(index=0, seed=1, order=list(arms))
    for name, (rt, on, shed) in arms.items():
        a = ArmResult(name=name)
        a.classes["rt"] = stats([rt] * 100, 100, shed)
        a.classes["on"] = stats([on] * 100, 500)
        a.classes["off"] = stats([1000.0] * 10, None)
        a.windows = {"rt": [50, 50], "on": [50, 50], "off": [4, 6]}
        rep.arms[name] = a
    return Report(scenario=SC2.scaled(scale), arms=list(arms), baseline=None, repetitions=[rep])


def test_best_baseline_is_the_lowest_top_class_p99_among_baselines():
    r = report({"rr": (90, 10, 0), "hap": (50, 10, 0), "proxy": (5, 10, 0)}, 1.0)
    assert best_baseline(r, ["rr", "hap"]) == "hap"
    assert best_baseline(r, []) is None


def sweep():
    # rr passes x0.5 and x1; hap passes x0.5 only; proxy passes all but sheds nothing;
    # shedder's P99 looks fine but 2% shed: attainment 98% fails.
    loads = {
        0.5: {"rr": (50, 100, 0), "hap": (40, 100, 0), "proxy": (20, 100, 0), "shedder": (9, 9, 2)},
        1.0: {
            "rr": (90, 400, 0),
            "hap": (200, 100, 0),
            "proxy": (30, 100, 0),
            "shedder": (9, 9, 2),
        },
        2.0: {
            "rr": (900, 400, 0),
            "hap": (80, 100, 0),
            "proxy": (60, 450, 0),
            "shedder": (9, 9, 0),
        },
    }
    return sweep_summary([(s, report(a, s)) for s, a in loads.items()], ["rr", "hap"])


def test_goodput_is_the_highest_load_passing_with_every_lower_one():
    g = sweep()["goodput"]
    assert g["rr"]["scale"] == 1.0
    assert g["hap"]["scale"] == 0.5  # its pass at x2 comes after a failure: not counted
    assert g["proxy"]["scale"] == 2.0
    assert g["shedder"]["scale"] is None  # sheds count as misses
    assert g["rr"]["offered_rps"] == pytest.approx(21.0)
    summary = sweep()
    assert summary["goodput"]["proxy"]["passes"] == {"0.5": True, "1.0": True, "2.0": True}


def test_goodput_ratio_bounds():
    scales = [0.5, 1.0, 2.0]
    assert goodput_ratio(1.0, 0.5, scales) == "2.00"
    assert goodput_ratio(2.0, 1.0, scales) == ">= 2.00"
    assert goodput_ratio(0.5, 2.0, scales) == "<= 0.25"
    assert goodput_ratio(2.0, None, scales) == "> 4.00"
    assert goodput_ratio(None, 1.0, scales) == "< 0.50"
    assert goodput_ratio(None, None, scales).startswith("n/a")
    assert goodput_ratio(2.0, 2.0, scales).startswith("n/a")


def test_goodput_ratios_name_the_issue_references():
    g = goodput(
        {
            "scales": [1.0, 2.0],
            "loads": [{"scale": 1.0, "offered_rps": 10}, {"scale": 2.0, "offered_rps": 20}],
            "points": [
                {"arm": a, "scale": s, "slo_p99_ms": 100, "slo_attainment": att}
                for a, s, att in [
                    ("rr_priority", 1.0, 1.0),
                    ("rr_priority", 2.0, 0.5),
                    ("haproxy_leastconn", 1.0, 0.5),
                    ("haproxy_leastconn", 2.0, 0.5),
                    ("new", 1.0, 1.0),
                    ("new", 2.0, 0.995),
                ]
            ],
        }
    )
    assert g["new"]["vs_rr_priority"] == ">= 2.00"
    assert g["new"]["vs_haproxy_leastconn"] == "> 2.00"
    assert "vs_rr_priority" not in g["rr_priority"]


def test_sweep_points_carry_ratios_windows_and_best_baseline():
    summary = sweep()
    loads = {x["scale"]: x for x in summary["loads"]}
    assert loads[1.0]["best_baseline"] == "rr" and loads[0.5]["best_baseline"] == "hap"
    p = next(
        q for q in summary["points"] if (q["arm"], q["class"], q["scale"]) == ("proxy", "rt", 1.0)
    )
    assert p["p99_vs_best"] == pytest.approx(30 / 90, rel=0.01)
    off = next(
        q for q in summary["points"] if (q["arm"], q["class"], q["scale"]) == ("proxy", "off", 1.0)
    )
    assert off["window_min"] == 4 and off["window_offered"] == pytest.approx(10.0)
    text = bench_cli.render_sweep(summary)
    assert "Goodput" in text and "best baseline rr" in text
    assert json.dumps(summary)


def test_the_proxys_own_cost_is_rr_priority_through_it_minus_rr_priority():
    r = report({"rr_priority": (20, 30, 0), "proxy_rr_priority": (21.5, 33, 0)}, 0.5)
    load = sweep_summary([(0.5, r)], ["rr_priority"])["loads"][0]
    cost = load["proxy_cost_ms"]
    assert set(cost) == {"rt", "on"}  # SLO classes only
    assert cost["rt"]["p99_ms"] == pytest.approx(1.5, abs=0.05)
    assert cost["on"]["p50_ms"] == pytest.approx(3.0, abs=0.05)
    text = bench_cli.render_sweep(sweep_summary([(0.5, r)], ["rr_priority"]))
    assert "own cost (proxy_rr_priority - rr_priority, pooled): rt P50 +1.5" in text
    # without the pair, nothing is claimed
    alone = report({"rr_priority": (20, 30, 0)}, 0.5)
    assert sweep_summary([(0.5, alone)], ["rr_priority"])["loads"][0]["proxy_cost_ms"] is None
    assert "proxy_rr_priority -" not in bench_cli.render_sweep(sweep_summary([(0.5, alone)], []))


def test_proxy_rr_priority_is_a_proxy_arm_whose_client_sets_the_priority():
    plan = CATALOG["proxy_rr_priority"]
    assert plan.kind == "proxy" and plan.priority and not plan.classes
    assert plan.policy == "round_robin"
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
    doc = config_mod.parse(proxy_policy(SERVERS, plan, sc), "<t>")
    assert doc.scheduling is None  # no classes: the client's priority is forwarded as sent
    assert doc.routing.feedback.enabled  # the default
    off = CATALOG["proxy_rr_priority+no_feedback"]
    doc = config_mod.parse(proxy_policy(SERVERS, off, sc), "<t>")
    assert not doc.routing.feedback.enabled and doc.routing.policy.name == "round_robin"


def shared(min_share: float, rate: float, windows: dict[str, list[int]]) -> dict:
    """A sweep of one load point whose throughput class "off" (1 row of 100 tokens: the
    fleet completes 3 x 16 / 37 ms = 1297 req/s of it alone) has ``min_share``."""
    sc = parse_scenario(
        {
            "duration_s": 10,
            "model": {"parameters": {"base_ms": 5, "per_token_us": 20}},
            "classes": {
                "rt": {"rate_rps": 10, "slo_p99_ms": 100},
                "off": {
                    "rate_rps": rate,
                    "sizes": [{"tokens": [100, 100]}],
                    "min_share": min_share,
                },
            },
        }
    )
    rep = Repetition(index=0, seed=1, order=list(windows))
    for name, off in windows.items():
        a = ArmResult(name=name)
        a.classes["rt"] = stats([10.0] * 100, 100)
        a.classes["off"] = stats([1000.0] * 10, None)
        a.windows = {"rt": [50], "off": off}
        rep.arms[name] = a
    r = Report(scenario=sc, arms=list(windows), baseline=None, repetitions=[rep])
    return sweep_summary([(1.0, r)], [], servers=3)


def test_a_throughput_class_holds_its_min_share_per_window():
    floor = 0.1 * 3 * 16 / 0.037 * 10  # 1297 req/s alone, 10 s windows
    summary = shared(0.1, 2000, {"keeps": [2000, int(floor) + 1], "starves": [2000, 100]})
    off = {p["arm"]: p for p in summary["points"] if p["class"] == "off"}
    assert off["keeps"]["window_floor"] == pytest.approx(floor)
    assert off["keeps"]["share_held"] is True and off["starves"]["share_held"] is False
    rt = next(p for p in summary["points"] if p["class"] == "rt")
    assert rt["window_floor"] is None and rt["share_held"] is None  # judged by its SLO
    text = bench_cli.render_sweep(summary)
    assert f"off min_share floor {floor:.0f}/win: held by keeps; missed by starves (100)" in text


def test_a_min_share_is_not_judged_where_the_class_offers_less():
    # offers 1000 per window, less than its floor of 1297: not backlogged, not judged
    summary = shared(0.1, 100, {"a": [3]})
    off = next(p for p in summary["points"] if p["class"] == "off")
    assert off["window_floor"] is None and off["share_held"] is None
    assert "min_share floor" not in bench_cli.render_sweep(summary)
    assert window_floor(SC2, "off", 10.0, 3) is None  # no min_share


def test_shed_reason_reads_every_message_the_proxy_sends():
    from proxy.dispatch import _shed_error
    from proxy.scheduling.gate import Shed
    from proxy.scheduling.queues import ShedReason

    for reason in ShedReason:
        if reason is ShedReason.SHUTDOWN:
            continue  # answered 503, not 429
        err = _shed_error("accel_sim", Shed(reason, 1.0, "realtime"))
        assert shed_reason(str(err)) == reason.value, str(err)


ACCEL_SIM_PRIORITY_LEVELS = int(
    re.search(
        r"priority_levels:\s*(\d+)",
        (ROOT / "model_repository" / "accel_sim" / "config.pbtxt").read_text(),
    ).group(1)  # type: ignore[union-attr]
)


@pytest.mark.parametrize("scenario", ["case.yaml", "online_burst.yaml"])
def test_the_class_default_arm_is_what_a_file_with_classes_and_no_routing_gets(scenario: str):
    """The class default arms are pinned (MEASURED_CLASS_POLICY); CLASS_DEFAULT_ARM names the
    one that is today's default, so a change of CLASS_POLICY must name its arm here."""
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / scenario)
    arm = CATALOG[CLASS_DEFAULT_ARM]
    # What a user writes: the classes, nothing else (no routing, no lane, no scheduling keys).
    doc = proxy_policy(SERVERS, ArmPlan("bare", "proxy", "", classes=True), sc)
    assert doc["routing"] == {}
    doc["scheduling"] = scheduling_section(sc)
    today = config_mod.parse(doc, "<t>")
    measured = config_mod.parse(proxy_policy(SERVERS, arm, sc), "<t>")
    assert measured.routing == today.routing
    assert measured.scheduling is not None and today.scheduling is not None
    # The arm spells its lowest class's lane out; the default derives it from the model.
    lowest = today.scheduling.default_class
    assert today.scheduling.lane_classes() == (lowest,)
    assert measured.scheduling.lane_classes() == ()
    # What the model's gate enforces (the lane, deadline admission) is the same.
    gate = today.scheduling.for_model(
        ACCEL_SIM_MAX_BATCH, packs_long=True, priority_levels=ACCEL_SIM_PRIORITY_LEVELS
    )
    assert replace(measured.scheduling, throughput_lane=gate.throughput_lane) == gate
    assert gate.shed_late is True
    assert gate.slot_sharing == "placed_by_rank"


def test_class_default_arms_keep_their_slots_and_adaptive_is_session_31s_default():
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")

    def scheduling(arm: str):
        parsed = config_mod.parse(proxy_policy(SERVERS, CATALOG[arm], sc), "<t>").scheduling
        assert parsed is not None
        return parsed

    # measured before adaptive concurrency became a default: the slots derived from the model
    assert not scheduling("proxy_classes_default").adaptive()
    assert not scheduling("proxy_least_requests+classes").adaptive()
    # measured before the derived lane of throughput classes became one (session 34)
    for arm in ("proxy_classes_default", "proxy_least_requests+classes", "proxy_previous_best"):
        assert not scheduling(arm).lane_classes()
        assert scheduling(arm).for_model(ACCEL_SIM_MAX_BATCH) == scheduling(arm)
    then = scheduling("proxy_classes_default+adaptive")
    assert then.adaptive()
    defaults = SchedulingConfig(
        classes=then.classes, default_class=then.default_class, api_keys=then.api_keys
    )
    # ... before the floor boost (session 36), and before slots counted by rank (session 40)
    assert then == replace(
        defaults,
        throughput_lane=False,
        shed_late=False,
        starved_after_s=None,
        slot_sharing="shared",
    )
    for arm in ("proxy_classes_default", "proxy_least_requests+classes", SHARED_DEFAULT_ARM):
        packed = scheduling(arm).for_model(ACCEL_SIM_MAX_BATCH, True, ACCEL_SIM_PRIORITY_LEVELS)
        assert packed.slot_sharing == "shared"


def test_the_least_requests_lane_arm_spells_out_the_lane_a_packing_policy_derives():
    """Measured in session 34 when throughput_lane derived it under every policy; since
    session 35 only a policy that packs gets it, so the arm writes the same lane itself."""
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "burst.yaml")

    def scheduling(arm: str):
        parsed = config_mod.parse(proxy_policy(SERVERS, CATALOG[arm], sc), "<t>").scheduling
        assert parsed is not None
        return parsed

    lane = scheduling("proxy_least_requests+classes+lane")
    derived = replace(scheduling("proxy_least_requests+classes"), throughput_lane=True)
    classes = dict(derived.for_model(ACCEL_SIM_MAX_BATCH, packs_long=True).classes)
    # Measured on three servers, where one spare is the derived third (spare_fraction).
    lowest = derived.default_class
    classes[lowest] = replace(classes[lowest], spare_fraction=0.0)
    assert dict(lane.classes) == classes


@pytest.mark.parametrize("sharing", ["by_rank", "placed_by_rank"])
def test_the_slot_sharing_arms_are_the_shared_default_with_another_count(sharing: str) -> None:
    base, arm = CATALOG[SHARED_DEFAULT_ARM], CATALOG[f"{SHARED_DEFAULT_ARM}+{sharing}"]
    assert arm.scheduling == {**(base.scheduling or {}), "slot_sharing": sharing}
    assert (
        replace(arm, name=base.name, description=base.description, scheduling=base.scheduling)
        == base
    )
    assert f"{SHARED_DEFAULT_ARM}+placed_by_rank" == PLACED_DEFAULT_ARM


@pytest.mark.parametrize("after", [1, 2, 3])
def test_the_starved_arms_are_the_placed_default_with_another_floor_threshold(after: int) -> None:
    base, arm = CATALOG[PLACED_DEFAULT_ARM], CATALOG[f"{PLACED_DEFAULT_ARM}+starved{after}"]
    assert arm.scheduling == {**(base.scheduling or {}), "starved_after_s": float(after)}
    assert f"{PLACED_DEFAULT_ARM}+starved2+rspread" == CLASS_DEFAULT_ARM


def test_the_shipped_arm_counts_by_rank_and_its_placed_variant_only_in_placement() -> None:
    shipped, placed = CATALOG[FILL_SHIPPED_ARM], CATALOG[PLACED_SHIPPED_ARM]
    assert placed.name == f"{FILL_SHIPPED_ARM}+placed_by_rank"
    assert shipped.scheduling is not None and shipped.scheduling["slot_sharing"] == "by_rank"
    assert placed.scheduling == {**shipped.scheduling, "slot_sharing": "placed_by_rank"}
    assert replace(placed, name=shipped.name, description=shipped.description) == replace(
        shipped, scheduling=placed.scheduling
    )


def test_the_rspread_arms_add_reserve_spread_and_nothing_else() -> None:
    for base, arm in ((STARVED_DEFAULT_ARM, CLASS_DEFAULT_ARM), (PLACED_SHIPPED_ARM, SHIPPED_ARM)):
        before, after = CATALOG[base], CATALOG[arm]
        assert after.name == f"{base}+rspread"
        assert after.policy_params == {**(before.policy_params or {}), "reserve_spread": True}
        assert replace(after, name=base, description=before.description) == replace(
            before, policy_params=after.policy_params
        )


def test_the_no_copy_arm_is_the_shared_default_with_the_redirect_wake() -> None:
    sc = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
    base = config_mod.parse(proxy_policy(SERVERS, CATALOG[SHARED_DEFAULT_ARM], sc), "<t>")
    plain = config_mod.parse(
        proxy_policy(SERVERS, CATALOG[f"{SHARED_DEFAULT_ARM}+no_copy"], sc), "<t>"
    )
    assert base.routing.wake.expired_copy and base.routing.wake.nudge
    assert plain.routing.wake == WakeParams()
    assert not plain.routing.wake.nudge
    assert replace(plain.routing, wake=base.routing.wake) == base.routing
    assert plain.scheduling == base.scheduling
