"""The canary arm: its policy section, the split, the gates' shares, and the report's math."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest

from proxy import config as config_mod
from proxy.canary import CANARY, MAIN, Splitter, session_point
from proxy.clock import FakeClock
from proxy.ops.canary_report import compare, format_report, histograms, quantile
from proxy.routing.config import CLASS_POLICY
from proxy.runtime import Runtime
from proxy.strict import ConfigError
from proxy.telemetry import Telemetry

INSTANCES = [
    {"name": "a", "http": "http://127.0.0.1:1"},
    {"name": "b", "http": "http://127.0.0.1:2"},
]


def parse(canary: Any, **extra: Any) -> config_mod.ProxyConfig:
    return config_mod.parse({"instances": INSTANCES, "canary": canary, **extra}, "policy.yaml")


def binomial_ok(hits: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    """Within ``sigmas`` standard deviations of the binomial mean: a false alarm about once
    in 150 000 runs."""
    return abs(hits - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


# --- policy section ---------------------------------------------------------------------------
def test_canary_section_parses_with_its_own_routing_and_scheduling() -> None:
    cfg = parse(
        {
            "share": 0.25,
            "split": "session",
            "routing": {"policy": {"name": "round_robin"}},
            "scheduling": {"classes": {"online": {"rank": 0}}, "default_class": "online"},
        }
    )
    assert cfg.canary is not None
    assert cfg.canary.share == 0.25 and cfg.canary.split == "session"
    assert cfg.canary.routing is not None and cfg.canary.routing.policy.name == "round_robin"
    assert cfg.canary.scheduling is not None


@pytest.mark.parametrize(
    ("canary", "where", "says"),
    [
        ({"share": 1.5, "routing": {}}, "canary", "share must be in [0, 1]"),
        ({"share": 0.1}, "canary", "needs its own routing or scheduling"),
        ({"share": 0.1, "split": "user", "routing": {}}, "canary.split", "must be one of"),
        (
            {"share": 0.1, "routing": {"policy": {"name": "fastest"}}},
            "canary.routing.policy.name",
            "unknown routing policy",
        ),
        ({"share": 0.1, "routting": {}}, "canary.routting", "did you mean 'routing'"),
        ({"routing": {}}, "canary.share", "required key is missing"),
    ],
)
def test_bad_canary_sections_are_refused_with_the_path(canary: Any, where: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(canary)
    assert f"policy.yaml: {where}:" in str(info.value) and says in str(info.value)


# --- the split --------------------------------------------------------------------------------
@pytest.mark.parametrize("share", [0.0, 0.05, 0.3, 0.5, 1.0])
def test_per_request_split_holds_the_share(share: float) -> None:
    splitter = Splitter(share, "request", random.Random(7))
    n = 20_000
    arms = Counter(splitter.arm("same-session") for _ in range(n))
    assert set(arms) <= {MAIN, CANARY}
    if share in (0.0, 1.0):
        assert arms[CANARY] == n * share
    else:
        assert binomial_ok(arms[CANARY], n, share), arms


def test_per_session_split_keeps_each_session_in_one_arm_and_holds_the_share() -> None:
    share = 0.2
    splitter = Splitter(share, "session", random.Random(1))
    sessions = [f"user-{i}" for i in range(10_000)]
    first = {s: splitter.arm(s) for s in sessions}
    for _ in range(3):
        assert all(splitter.arm(s) == first[s] for s in sessions)
    # Another proxy replica (another random generator) puts each session in the same arm.
    other = Splitter(share, "session", random.Random(99))
    assert all(other.arm(s) == first[s] for s in sessions[:500])
    assert binomial_ok(sum(a == CANARY for a in first.values()), len(sessions), share)
    # Raising the share only moves sessions from main to the canary.
    wider = Splitter(0.5, "session", random.Random(1))
    assert all(wider.arm(s) == CANARY for s in sessions if first[s] == CANARY)


def test_per_session_split_without_a_key_falls_back_to_per_request() -> None:
    splitter = Splitter(0.5, "session", random.Random(3))
    arms = Counter(splitter.arm(None) for _ in range(4000))
    assert binomial_ok(arms[CANARY], 4000, 0.5)


def test_session_points_are_uniform() -> None:
    points = [session_point(f"s{i}") for i in range(20_000)]
    assert all(0.0 <= p < 1.0 for p in points)
    deciles = Counter(int(p * 10) for p in points)
    assert all(binomial_ok(deciles[d], len(points), 0.1) for d in range(10))


# --- the runtime's arms -----------------------------------------------------------------------
SCHED = {"default_class": "online", "classes": {"online": {"rank": 0}}, "concurrency": 4}


def runtime(doc: dict[str, Any]) -> Runtime:
    cfg = config_mod.parse({"instances": INSTANCES, **doc}, "p")
    return Runtime(cfg, FakeClock(), random.Random(0), Telemetry())


async def test_routing_only_canary_shares_the_main_gates() -> None:
    rt = runtime(
        {
            "scheduling": SCHED,
            "canary": {"share": 0.1, "routing": {"policy": {"name": "round_robin"}}},
        }
    )
    d = rt.dispatcher
    assert d.canary is not None and d.splitter is not None
    assert d.canary.admission is rt.gates and rt.gates is not None and rt.gates.share == 1.0
    assert rt.canary_router is not None and rt.canary_router.policy("m")[0] == "round_robin"
    # The main arm names no policy and has classes: the default with classes.
    assert rt.router.policy("m")[0] == CLASS_POLICY.name
    await rt.stop()


async def test_canary_with_its_own_classes_gets_its_share_of_the_slots() -> None:
    doc = {"scheduling": SCHED, "canary": {"share": 0.25, "scheduling": SCHED}}
    rt = runtime(doc)
    assert rt.gates is not None and rt.canary_gates is not None
    assert rt.dispatcher.canary is not None and rt.dispatcher.canary.admission is rt.canary_gates
    assert (rt.gates.share, rt.canary_gates.share) == (0.75, 0.25)
    info: Any = type("Info", (), {"max_batch_size": 8, "model_instances": 1})()
    # 2 instances x 4 = 8 slots: 6 for main, 2 for the canary.
    assert rt.gates.capacity(info, "m") == 6 and rt.canary_gates.capacity(info, "m") == 2
    # Rollback: the canary section goes; main gets all the slots back.
    await rt.apply(config_mod.parse({"instances": INSTANCES, "scheduling": SCHED}, "p"))
    assert rt.dispatcher.canary is None and rt.canary_router is None
    assert rt.gates.capacity(info, "m") == 8
    await rt.stop()


# --- the report -------------------------------------------------------------------------------
BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0, math.inf)


@pytest.mark.parametrize(
    ("counts", "q", "expected"),
    [
        ([10, 10, 0, 0, 0, 0], 0.5, 0.01),  # rank 10 fills the first bucket exactly
        ([0, 10, 0, 0, 0, 0], 0.5, 0.03),  # halfway through (0.01, 0.05]
        ([0, 0, 0, 0, 0, 5], 0.99, 1.0),  # in +Inf: the highest finite bound
        ([0, 0, 0, 0, 0, 0], 0.5, math.nan),
    ],
)
def test_quantile_matches_histogram_quantile(counts: list[int], q: float, expected: float) -> None:
    got = float(quantile(BOUNDS, counts, q)[0])
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_bootstrap_says_unsure_for_equal_arms_and_sure_for_different_ones() -> None:
    rng = np.random.default_rng(5)
    same = [400, 400, 150, 40, 10, 0]
    d = compare(BOUNDS, same, same, 0.99, rng)
    assert d.low <= 0 <= d.high and 0.3 < d.p_canary_lower < 0.7
    faster = [700, 280, 20, 0, 0, 0]
    d = compare(BOUNDS, same, faster, 0.99, rng)
    assert d.canary < d.main and d.high < 0 and d.p_canary_lower > 0.99
    d = compare(BOUNDS, faster, same, 0.99, rng)
    assert d.low > 0 and d.p_canary_lower < 0.01


def test_histograms_from_prometheus_results_and_the_table() -> None:
    results = []
    for arm, cum in ((MAIN, [50, 90, 100]), (CANARY, [5, 9, 10])):
        for le, v in zip(("0.1", "0.5", "+Inf"), cum, strict=True):
            results.append(
                {"metric": {"class": "online", "arm": arm, "le": le}, "value": [0, str(v)]}
            )
    h = histograms(results)
    assert h[("online", MAIN)] == ((0.1, 0.5, math.inf), (50.0, 40.0, 10.0))
    assert h[("online", CANARY)] == ((0.1, 0.5, math.inf), (5.0, 4.0, 1.0))
    assert "no class has requests in both arms" in format_report([], "5m")
