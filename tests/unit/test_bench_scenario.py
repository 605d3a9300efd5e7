"""The schedule follows the configured rates, class mix, sizes and sessions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from proxy.bench.scenario import Scenario, build_schedule, load_scenario, parse_scenario
from proxy.strict import ConfigError

ROOT = Path(__file__).resolve().parents[2]

LONG = {
    "duration_s": 1800,
    "warmup_s": 200,
    "seed": 11,
    "classes": {
        "realtime": {"rate_rps": 40, "sizes": [{"tokens": [8, 64]}], "triton_priority": 1},
        "online": {
            "rate_rps": 15,
            "sizes": [
                {"tokens": [8, 64], "weight": 0.9},
                {"tokens": [512, 512], "weight": 0.1},
            ],
            "sessions": 7,
        },
        "offline": {"rate_rps": 2.5, "sizes": [{"tokens": [100, 300]}]},
    },
}


@pytest.fixture(scope="module")
def long_run() -> tuple[Scenario, list]:
    sc = parse_scenario(LONG)
    return sc, build_schedule(sc, np.random.default_rng(sc.seed))


def test_schedule_is_sorted_indexed_and_within_horizon(long_run):
    sc, sched = long_run
    times = [a.t for a in sched]
    assert times == sorted(times)
    assert [a.index for a in sched] == list(range(len(sched)))
    assert times[0] >= 0.0 and times[-1] < sc.horizon_s
    assert all(a.warmup == (a.t < sc.warmup_s) for a in sched)


@pytest.mark.parametrize("cls", ["realtime", "online", "offline"])
def test_class_counts_match_rates(long_run, cls):
    sc, sched = long_run
    expected = sc.classes[cls].rate_rps * sc.horizon_s
    n = sum(a.cls == cls for a in sched)
    # Poisson count: 5 standard deviations
    assert abs(n - expected) < 5 * math.sqrt(expected), (n, expected)


def test_class_mix_matches_rates(long_run):
    sc, sched = long_run
    total_rate = sum(c.rate_rps for c in sc.classes.values())
    n = len(sched)
    for name, spec in sc.classes.items():
        p = spec.rate_rps / total_rate
        share = sum(a.cls == name for a in sched) / n
        assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / n), (name, share, p)


@pytest.mark.parametrize("cls", ["realtime", "online"])
def test_arrivals_are_poisson(long_run, cls):
    """Exponential gaps (mean 1/rate, coefficient of variation 1) and Poisson window counts."""
    sc, sched = long_run
    rate = sc.classes[cls].rate_rps
    t = np.array([a.t for a in sched if a.cls == cls])
    gaps = np.diff(t)
    assert abs(gaps.mean() * rate - 1) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03
    counts = np.histogram(t, bins=np.arange(0, sc.horizon_s + 1, 1.0))[0]
    dispersion = counts.var() / counts.mean()  # 1 for Poisson; < 1 if paced, > 1 if bursty
    assert 0.9 < dispersion < 1.1, dispersion
    # stationary: the first and second halves carry the same load
    half = sc.horizon_s / 2
    a, b = (t < half).sum(), (t >= half).sum()
    assert abs(a - b) < 5 * math.sqrt(a + b)


def test_sizes_follow_buckets(long_run):
    _sc, sched = long_run
    rt = np.array([a.tokens for a in sched if a.cls == "realtime"])
    assert rt.min() == 8 and rt.max() == 64  # inclusive bounds, both reached
    assert abs(rt.mean() - 36) < 0.5  # uniform on 8..64
    on = np.array([a.tokens for a in sched if a.cls == "online"])
    long_share = (on == 512).mean()
    n = on.size
    assert abs(long_share - 0.1) < 5 * math.sqrt(0.1 * 0.9 / n)
    assert set(on[on != 512].tolist()) <= set(range(8, 65))
    off = np.array([a.tokens for a in sched if a.cls == "offline"])
    assert off.min() >= 100 and off.max() <= 300


def test_sessions(long_run):
    _, sched = long_run
    sessions = {a.session for a in sched if a.cls == "online"}
    assert sessions == {f"online-{k}" for k in range(7)}
    assert all(a.session is None for a in sched if a.cls != "online")


def test_schedule_is_reproducible_per_seed():
    sc = parse_scenario({**LONG, "duration_s": 20, "warmup_s": 0})
    a = build_schedule(sc, np.random.default_rng(3))
    b = build_schedule(sc, np.random.default_rng(3))
    c = build_schedule(sc, np.random.default_rng(4))
    assert a == b
    assert a != c


def test_scaled_multiplies_rates():
    sc = parse_scenario(LONG).scaled(2.0)
    assert sc.classes["realtime"].rate_rps == 80
    assert sc.classes["offline"].rate_rps == 5


def test_zero_rate_class_sends_nothing():
    sc = parse_scenario({"duration_s": 10, "classes": {"a": {"rate_rps": 0}, "b": {"rate_rps": 5}}})
    sched = build_schedule(sc, np.random.default_rng(0))
    assert sched and all(a.cls == "b" for a in sched)


def test_defaults():
    sc = parse_scenario({"duration_s": 10, "classes": {"a": {"rate_rps": 1}}})
    assert sc.model.name == "accel_sim"
    assert sc.model.input == "INPUT_IDS" and sc.model.datatype == "INT64"
    assert sc.classes["a"].sizes[0].tokens == (8, 64)
    assert sc.warmup_s == 0 and sc.repetitions == 1


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"duraton_s": 5}, "did you mean 'duration_s'"),
        ({"classes": {"a": {"rate_rps": 1, "sizes": [{"tokens": [64, 8]}]}}}, "lo <= hi"),
        ({"classes": {"a": {"rate_rps": 1, "sizes": [{"tokens": [8]}]}}}, "[lo, hi]"),
        ({"classes": {"a": {"rate_rps": -1}}}, "rate_rps"),
        ({"classes": {"a": {"rate_rps": 1, "sessions": "x"}}}, "expected an integer"),
        ({"classes": {}}, "at least one class"),
        ({"model": {"encoding": "protobuf"}}, "must be one of"),
    ],
)
def test_strict_parse_errors(patch, message):
    data = {"duration_s": 10, "classes": {"a": {"rate_rps": 1}}, **patch}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_scenario(data, source="x.yaml")


@pytest.mark.parametrize("name", ["mixed.yaml", "smoke.yaml"])
def test_shipped_scenarios_load(name):
    sc = load_scenario(ROOT / "benchmarks" / name)
    assert sc.model.name == "accel_sim"
    assert {"realtime", "online", "offline"} <= set(sc.classes)


def test_phases_change_the_rates_over_time() -> None:
    from proxy.bench.scenario import build_schedule, parse_scenario

    sc = parse_scenario(
        {
            "duration_s": 30,
            "warmup_s": 5,
            "phases": [
                {"name": "light", "duration_s": 10, "rates": {"b": 0}},
                {"name": "surge", "duration_s": 20, "rates": {"b": 200}},
            ],
            "classes": {"a": {"rate_rps": 20}, "b": {"rate_rps": 0}},
        }
    )
    assert [s[0] for s in sc.segments()] == ["warmup", "light", "surge"]
    arrivals = build_schedule(sc, np.random.default_rng(3))
    b_times = [a.t for a in arrivals if a.cls == "b"]
    assert b_times and min(b_times) >= 15.0  # none during warm-up or the light phase
    assert 3000 < len(b_times) < 5000  # 200/s for 20 s
    a_count = sum(1 for a in arrivals if a.cls == "a")
    assert 500 < a_count < 900  # 20/s for 35 s, every phase


def test_phases_must_cover_the_duration() -> None:
    from proxy.bench.scenario import parse_scenario

    with pytest.raises(ValueError, match="duration_s must be the same"):
        parse_scenario(
            {
                "duration_s": 30,
                "phases": [{"name": "x", "duration_s": 10}],
                "classes": {"a": {"rate_rps": 1}},
            }
        )
    with pytest.raises(ValueError, match="unknown classes"):
        parse_scenario(
            {
                "duration_s": 10,
                "phases": [{"name": "x", "duration_s": 10, "rates": {"zz": 1}}],
                "classes": {"a": {"rate_rps": 1}},
            }
        )
