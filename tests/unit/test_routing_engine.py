"""Router: per-model policies, staleness rules, feedback weights, stats; routing config."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.routing.base import RouteRequest
from proxy.routing.batcher import BatcherModel
from proxy.routing.config import RoutingConfig, load_routing_config
from proxy.routing.engine import NoCandidatesError, Router, RoutingStats
from proxy.routing.feedback import FeedbackParams
from proxy.strict import ConfigError
from tests.unit.routing_support import MODEL, cand, snap

REQ = RouteRequest(model=MODEL)


def router(data: dict[str, Any] | None = None, now: float = 100.0) -> tuple[Router, FakeClock]:
    clock = FakeClock(now)
    config = load_routing_config(data or {})
    return Router(config, clock, random.Random(7)), clock


def test_defaults() -> None:
    config = load_routing_config({})
    assert config == RoutingConfig()
    assert config.policy.name == "least_requests"


def test_no_candidates_is_an_error_with_a_reason() -> None:
    r, _ = router()
    with pytest.raises(NoCandidatesError, match="model 'm'"):
        r.choose(REQ, [])


def test_per_model_policy_and_stats() -> None:
    r, _ = router(
        {
            "policy": {"name": "least_requests"},
            "models": {"chat": {"name": "round_robin"}},
        }
    )
    candidates = [cand("a"), cand("b", in_flight=3)]
    for _ in range(10):
        r.choose(REQ, candidates)
        r.choose(RouteRequest(model="chat"), candidates)
    assert r.stats.decisions[(MODEL, "least_requests", "a")] == 10
    assert (MODEL, "least_requests", "b") not in r.stats.decisions
    assert r.stats.decisions[("chat", "round_robin", "a")] == 5
    assert r.stats.decisions[("chat", "round_robin", "b")] == 5
    assert set(r.stats.decision_seconds) == set(r.stats.decisions)
    assert r.policy(MODEL)[0] == "least_requests"


def test_stale_is_a_penalty_not_an_exclusion() -> None:
    r, _ = router({"policy": {"name": "weighted_score"}, "stale_after_s": 5.0, "stale_weight": 0.5})
    fresh = cand("fresh", in_flight=1, snapshot=snap(99.0))
    stale = cand("stale", snapshot=snap(90.0))
    prepared = {c.name: c for c in r.prepare(REQ, [fresh, stale])}
    assert prepared["stale"].stale and prepared["stale"].weight == 0.5
    assert prepared["stale"].snapshot is not None  # still used
    assert not prepared["fresh"].stale and prepared["fresh"].weight == 1.0
    # fresh: (1 + 5*1) / 1 = 6; stale: (1 + 10 stale penalty) / 0.5 = 22
    assert r.choose(REQ, [fresh, stale]).name == "fresh"
    # a busy enough fresh instance loses to the stale idle one
    busy = cand("fresh", in_flight=10, snapshot=snap(99.0))
    assert r.choose(REQ, [busy, stale]).name == "stale"


def test_callers_stale_flag_is_recomputed() -> None:
    r, _ = router()
    c = cand("a", snapshot=snap(99.0), stale=True)
    assert not r.prepare(REQ, [c, cand("b", snapshot=snap(99.0))])[0].stale


def test_all_stale_strips_snapshots_and_falls_back_to_in_flight() -> None:
    r, _ = router({"stale_after_s": 5.0})
    # By the stale metrics "a" is swamped, but it is the one with nothing in flight now.
    a = cand("a", in_flight=0, snapshot=snap(10.0, pending=50))
    b = cand("b", in_flight=2, snapshot=snap(10.0, pending=0))
    prepared = r.prepare(REQ, [a, b])
    assert all(c.snapshot is None and not c.stale and c.weight == 1.0 for c in prepared)
    assert r.choose(REQ, [a, b]).name == "a"
    assert r.stats.fallbacks[(MODEL, "all_stale")] == 2


def test_never_scraped_fleet_counts_as_no_metrics() -> None:
    r, _ = router()
    r.choose(REQ, [cand("a"), cand("b")])
    assert r.stats.fallbacks[(MODEL, "no_metrics")] == 1
    assert (MODEL, "all_stale") not in r.stats.fallbacks


def test_one_fresh_snapshot_keeps_metrics_in_play() -> None:
    r, _ = router()
    prepared = r.prepare(
        REQ, [cand("a", snapshot=snap(99.0)), cand("b"), cand("c", snapshot=snap(1.0))]
    )
    assert [c.snapshot is not None for c in prepared] == [True, False, True]
    assert [c.stale for c in prepared] == [False, False, True]
    assert not r.stats.fallbacks


def test_feedback_weight_flows_into_candidates() -> None:
    data = {
        "feedback": {
            "queue_p95_threshold_us": 1000,
            "windows": 2,
            "factor": 0.5,
            "floor": 0.1,
            "window_s": 1.0,
        },
        "policy": {"name": "least_requests"},
    }
    r, clock = router(data)
    for _ in range(2):
        clock.advance(1.0)
        slow = cand("slow", snapshot=snap(clock.now(), queue_us_p95=9000.0))
        fast = cand("fast", in_flight=1, snapshot=snap(clock.now(), queue_us_p95=10.0))
        prepared = {c.name: c for c in r.prepare(REQ, [slow, fast])}
    assert prepared["slow"].weight == 0.5
    assert prepared["fast"].weight == 1.0
    # least_requests with one in flight on each: slow (1+1)/0.5 = 4 > fast (1+1)/1 = 2
    slow_busy = cand("slow", in_flight=1, snapshot=snap(clock.now(), queue_us_p95=9000.0))
    assert r.choose(REQ, [slow_busy, fast]).name == "fast"


def test_feedback_can_be_disabled_and_weights_multiply() -> None:
    r, _ = router({"feedback": {"enabled": False}})
    assert r.feedback is None
    c = cand("a", weight=0.25, snapshot=snap(99.0))
    assert r.prepare(REQ, [c])[0].weight == 0.25


def test_each_model_has_its_own_policy_state() -> None:
    r, _ = router({"policy": {"name": "round_robin"}})
    candidates = [cand("a"), cand("b"), cand("c")]
    one = [r.choose(RouteRequest(model="x"), candidates).name for _ in range(3)]
    assert sorted(one) == ["a", "b", "c"]
    two = [r.choose(RouteRequest(model="y"), candidates).name for _ in range(3)]
    assert sorted(two) == ["a", "b", "c"]


def test_stats_survive_a_new_router() -> None:
    stats = RoutingStats()
    config = RoutingConfig()
    for _ in range(2):
        Router(config, FakeClock(), random.Random(0), stats).choose(REQ, [cand("a")])
    assert stats.decisions[(MODEL, "least_requests", "a")] == 2


def test_retry_budget_is_exposed() -> None:
    r, _ = router({"retry": {"max_retries": 2, "budget_ratio": 0.0, "min_retries_per_s": 0.1}})
    assert r.config.retry.max_retries == 2
    assert r.retry_budget.try_retry()  # 0.1/s over 10 s = 1 retry
    assert not r.retry_budget.try_retry()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"polcy": {}}, r"routing\.polcy: unknown key; did you mean 'policy'"),
        ({"policy": {"name": "nope"}}, r"routing\.policy\.name: unknown routing policy 'nope'"),
        (
            {"models": {"chat": {"name": "p2c", "params": {"queue_depth": "x"}}}},
            r"routing\.models\.chat\.params\.queue_depth: expected a number",
        ),
        ({"stale_after_s": 0}, r"routing: stale_after_s must be > 0"),
        ({"stale_weight": 2}, r"stale_weight must be in"),
        ({"occupancy_depth": 1.5}, r"occupancy_depth must be within \[0, 1\]"),
        ({"fill_from_load": -0.1}, r"fill_from_load must be a finite number >= 0"),
        ({"fill_from_load": float("inf")}, r"fill_from_load must be a finite number >= 0"),
        ({"session_metadata": "X-Session"}, r"lower-case"),
        ({"feedback": {"windows": 0}}, r"routing\.feedback: windows must be >= 1"),
        ({"retry": {"ttl_s": -1}}, r"routing\.retry: ttl_s must be > 0"),
    ],
)
def test_config_errors(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_routing_config(data, source="policy.yaml")


def test_config_accepts_dashed_keys_and_params() -> None:
    config = load_routing_config(
        {
            "policy": {"name": "consistent_hash", "params": {"load_factor": 1.5}},
            "session-header": "x-user",
            "feedback": FeedbackParams().__dict__ | {"windows": 4},
        }
    )
    assert config.session_header == "x-user"
    assert config.feedback.windows == 4
    assert config.policy_for("anything").params["load_factor"] == 1.5


def test_route_request_fast_is_the_same_request():
    fields = {
        "model": "m",
        "session_key": "s",
        "cost": 16.0,
        "class_name": "rt",
        "level": 1,
        "long": False,
        "class_cap": None,
        "class_queued": 3,
        "batch": 8,
        "occupancy": 0.5,
        "busy": 0.9,
        "free_of_long": frozenset({"t1"}),
        "rows": 2,
        "batcher": BatcherModel(16, 0.002, 0.005, 2e-5),
        "now": 12.5,
    }
    fast = RouteRequest.fast(dict(fields))
    assert fast == RouteRequest(**fields)
    assert hash(fast) == hash(RouteRequest(**fields))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.model = "other"  # type: ignore[misc]
    with pytest.raises(TypeError, match="needs all"):
        RouteRequest.fast({"model": "m"})
