"""Table-driven tests of the simple policies, the weighted score and the registry."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.registry import POLICIES, build_policy
from proxy.routing.weighted_score import WeightedScoreParams, load_score, weighted_score
from proxy.strict import ConfigError
from tests.unit.routing_support import MODEL, cand, snap

REQ = RouteRequest(model=MODEL)


def picks(name: str, candidates: Sequence[Candidate], n: int, seed: int = 1) -> Counter[str]:
    policy = build_policy(name, {}, random.Random(seed))
    return Counter(policy.choose(candidates, REQ).name for _ in range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_round_robin_is_exact(n: int) -> None:
    candidates = [cand(f"i{k}") for k in range(n)]
    policy = build_policy("round_robin", {}, random.Random(3))
    seq = [policy.choose(candidates, REQ).name for _ in range(n * 20)]
    cycle = seq[:n]
    assert sorted(cycle) == sorted(c.name for c in candidates)  # each once per cycle
    assert seq == cycle * 20  # and always in the same order


def test_round_robin_follows_weights_smoothly() -> None:
    candidates = [cand("a", weight=1.0), cand("b", weight=0.5), cand("c", weight=0.5)]
    policy = build_policy("round_robin", {}, random.Random(0))
    seq = [policy.choose(candidates, REQ).name for _ in range(400)]
    assert Counter(seq) == {"a": 200, "b": 100, "c": 100}
    # Smooth: at every point each instance is within one pick of its weighted share.
    share = {"a": 0.5, "b": 0.25, "c": 0.25}
    for t in range(1, len(seq) + 1):
        counts = Counter(seq[:t])
        for name, w in share.items():
            assert abs(counts[name] - w * t) <= 1.0


def test_round_robin_survives_candidate_changes() -> None:
    policy = build_policy("round_robin", {}, random.Random(0))
    three = [cand("a"), cand("b"), cand("c")]
    for _ in range(5):
        policy.choose(three, REQ)
    two = [cand("a"), cand("c")]
    seq = [policy.choose(two, REQ).name for _ in range(20)]
    # Left-over credit settles within a few picks; then strict alternation.
    tail = seq[4:]
    assert all(x != y for x, y in itertools.pairwise(tail))


def test_random_covers_all_and_follows_weights() -> None:
    candidates = [cand(f"i{k}") for k in range(5)]
    counts = picks("random", candidates, 5000)
    assert set(counts) == {c.name for c in candidates}
    assert min(counts.values()) > 800
    weighted = [cand("heavy", weight=1.0), cand("light", weight=0.25)]
    counts = picks("random", weighted, 5000)
    assert 3.0 < counts["heavy"] / counts["light"] < 5.5


@pytest.mark.parametrize(
    ("policy", "candidates", "expected"),
    [
        ("least_connections", [cand("a", connections=3), cand("b", connections=1)], "b"),
        (
            "least_connections",
            [cand("a", connections=0, weight=0.1), cand("b", connections=1)],
            "b",
        ),
        ("least_requests", [cand("a", in_flight=5), cand("idle"), cand("c", in_flight=1)], "idle"),
        # model first, then the whole instance
        (
            "least_requests",
            [cand("a", in_flight=1, model_in_flight=0), cand("b", in_flight=9, model_in_flight=1)],
            "a",
        ),
        (
            "least_requests",
            [cand("a", in_flight=7, model_in_flight=2), cand("b", in_flight=3, model_in_flight=2)],
            "b",
        ),
        ("least_requests", [cand("a", in_flight=1), cand("b", in_flight=1, weight=0.5)], "a"),
        ("weighted_score", [cand("busy", in_flight=3), cand("idle")], "idle"),
        (
            "weighted_score",
            [cand("queued", snapshot=snap(pending=2)), cand("free", in_flight=3, snapshot=snap())],
            "free",  # 1 + 10*2 = 21 > 1 + 5*3 = 16
        ),
    ],
)
def test_least_loaded_policies_prefer_idle(
    policy: str, candidates: list[Candidate], expected: str
) -> None:
    for seed in range(20):
        assert picks(policy, candidates, 1, seed=seed) == {expected: 1}


@pytest.mark.parametrize("policy", ["least_connections", "least_requests", "weighted_score"])
def test_ties_are_broken_randomly(policy: str) -> None:
    candidates = [cand(f"i{k}") for k in range(4)]
    assert len(picks(policy, candidates, 400)) == 4


def test_p2c_prefers_the_idle_instance() -> None:
    idle = cand("idle")
    busy = [cand(f"busy{k}", in_flight=10) for k in range(3)]
    counts = picks("p2c", [*busy, idle], 4000)
    # idle wins whenever sampled: it is in 3 of the 6 pairs, i.e. half of the picks
    assert counts["idle"] == pytest.approx(2000, rel=0.1)
    # and with two candidates it always wins
    assert picks("p2c", [busy[0], idle], 200) == {"idle": 200}


def test_p2c_picks_two_distinct_candidates() -> None:
    # With 2 candidates where one is better, a p2c that could sample one twice would sometimes
    # return the worse one; covered above. With many equal candidates, every one is reachable.
    counts = picks("p2c", [cand(f"i{k}") for k in range(6)], 3000)
    assert len(counts) == 6


P = WeightedScoreParams()


@pytest.mark.parametrize(
    ("candidate", "params", "expected"),
    [
        (cand("a"), P, 1.0),
        (cand("a", in_flight=2), P, 1 + 5 * 2),
        (cand("a", in_flight=2, snapshot=snap(pending=3)), P, 1 + 5 * 2 + 10 * 3),
        (cand("a", snapshot=snap(kv=0.5)), P, 1 + 0.1 * 50),
        (cand("a", snapshot=snap(pending=1), stale=True), P, 1 + 10 + 10),
        (
            cand("a", snapshot=snap(queue_us=4000, gpu_mem=0.25)),
            WeightedScoreParams(queue_wait=2.0, gpu_memory=1.0),
            1 + 2.0 * 4 + 1.0 * 25,
        ),
        (
            cand("a", in_flight=1, snapshot=snap(pending=1)),
            WeightedScoreParams(queue_depth=1, active_requests=1, base=0),
            2.0,
        ),
        # stale penalty only when a (stale) snapshot is there to be used
        (cand("a", stale=True), P, 1.0),
    ],
)
def test_weighted_score_math(
    candidate: Candidate, params: WeightedScoreParams, expected: float
) -> None:
    assert load_score(candidate, REQ, params) == pytest.approx(expected)


def test_weighted_score_divides_by_weight_and_reads_model_kv_first() -> None:
    c = cand("a", in_flight=1, weight=0.5)
    assert weighted_score(c, REQ, P) == pytest.approx((1 + 5) / 0.5)
    s = InstanceSnapshot(
        taken_at=0.0, models={MODEL: ModelLoad(kv_cache_fraction=0.1)}, kv_cache_fraction=0.9
    )
    assert load_score(cand("a", snapshot=s), REQ, P) == pytest.approx(1 + 0.1 * 10)


def test_weighted_score_of_another_model_ignores_this_models_queue() -> None:
    c = cand("a", snapshot=snap(pending=5, model="other"))
    assert load_score(c, REQ, P) == pytest.approx(1.0)


# --- registry ----------------------------------------------------------------------------


def test_registry_lists_every_policy() -> None:
    assert set(POLICIES) == {
        "round_robin",
        "random",
        "least_connections",
        "least_requests",
        "weighted_score",
        "p2c",
        "consistent_hash",
        "expected_start",
        "expected_finish",
    }
    for name in POLICIES:
        policy = build_policy(name, None, random.Random(0))
        assert policy.choose([cand("only")], REQ).name == "only"


@pytest.mark.parametrize(
    ("name", "params", "packs"),
    [
        ("expected_finish", {"pack_above": 0.9}, True),  # the class default's
        ("expected_finish", {}, False),
        ("expected_start", {"long_placement": "pack"}, True),
        ("expected_start", {}, False),
        *(
            (name, {}, False)
            for name in sorted(set(POLICIES) - {"expected_start", "expected_finish"})
        ),
    ],
)
def test_only_policies_that_gather_long_work_into_a_lane_say_they_pack(
    name: str, params: dict[str, Any], packs: bool
) -> None:
    # Read by the gates: a throughput class gets its derived lane only under such a policy.
    assert build_policy(name, params, random.Random(0)).packs_long is packs


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("leastconn", {}, r"routing\.policy\.name: unknown routing policy 'leastconn'; known"),
        ("round_robin", {"x": 1}, r"routing\.policy\.params\.x: unknown key"),
        ("weighted_score", {"queue_dept": 1}, r"params\.queue_dept: .*did you mean 'queue_depth'"),
        ("weighted_score", {"queue_depth": "lots"}, r"params\.queue_depth: expected a number"),
        ("weighted_score", {"base": -1}, r"routing\.policy\.params: base must be >= 0"),
        ("consistent_hash", {"load_factor": 1.0}, r"load_factor must be > 1"),
        ("consistent_hash", {"reenter-below": 0}, r"reenter_below must be in"),
    ],
)
def test_registry_errors_name_the_path(name: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        build_policy(name, params, random.Random(0), path="routing.policy", source="p.yaml")
    assert str(info.value).startswith("p.yaml: ")
    if name == "leastconn":
        for known in POLICIES:
            assert known in str(info.value)


# --- expected_start ----------------------------------------------------------------------


def _es(
    request: RouteRequest,
    *cands: Candidate,
    seed: int = 0,
    placement: str = "pack",
    to_idle: bool = False,
    idle_reserve: int = 0,
    quiet_depth: int = 0,
    quiet_alone: bool = False,
    pack_above: float | None = None,
) -> str:
    params = {
        "long_weight": 3.0,
        "long_placement": placement,
        "long_to_idle": to_idle,
        "idle_reserve": idle_reserve,
        "quiet_depth": quiet_depth,
        "quiet_alone": quiet_alone,
        "pack_above": pack_above,
    }
    policy = build_policy("expected_start", params, random.Random(seed))
    return policy.choose(list(cands), request).name


def test_expected_start_keeps_short_requests_off_instances_running_long_work() -> None:
    short = RouteRequest(model=MODEL, level=1, batch=16)
    busy_short = dataclasses.replace(cand("a", in_flight=20), ahead=20)
    running_long = dataclasses.replace(cand("b", in_flight=2), ahead=1, long_in_flight=1)
    assert _es(short, busy_short, running_long) == "a"  # 21/16 + 0 < 2/16 + 3


def test_a_deep_lane_repels_short_requests_no_more_than_two_long_requests() -> None:
    short = RouteRequest(model=MODEL, level=1, batch=16)
    lane = dataclasses.replace(cand("b", in_flight=8), ahead=0, long_in_flight=8)
    # 6 short batches ahead on a: 97/16 = 6.06 > 3 x 2 = 6: spills onto the lane
    assert _es(short, dataclasses.replace(cand("a", in_flight=96), ahead=96), lane) == "b"
    assert _es(short, dataclasses.replace(cand("a", in_flight=94), ahead=94), lane) == "a"


def test_expected_start_counts_only_work_at_the_same_or_higher_priority() -> None:
    short = RouteRequest(model=MODEL, level=1, batch=16)
    # b holds 40 requests, but all at lower priority levels: Triton serves this one first.
    a = dataclasses.replace(cand("a", in_flight=20), ahead=20)
    b = dataclasses.replace(cand("b", in_flight=40), ahead=0)
    assert _es(short, a, b) == "b"


def test_expected_start_prefers_an_idle_instance_to_one_running_lower_priority_work() -> None:
    # No priority pre-empts the batch running: a real-time request on b waits for b's online
    # batch, on a it starts at once (busy_weight 0.5: 1/16 < 1/16 + 0.5 on every seed).
    short = RouteRequest(model=MODEL, level=1, batch=16)
    idle = dataclasses.replace(cand("a", in_flight=0), ahead=0)
    running_online = dataclasses.replace(cand("b", in_flight=1), ahead=0)
    assert {_es(short, idle, running_online, seed=s) for s in range(20)} == {"a"}
    # ...and busy is busy: 40 lower-level requests do not count more than one
    b = dataclasses.replace(cand("b", in_flight=40), ahead=0)
    c = dataclasses.replace(cand("c", in_flight=1), ahead=1)
    assert _es(short, b, c) == "b"  # 1/16 + 0.5 < 2/16 + 0.5


def test_expected_start_spreads_long_requests_when_asked() -> None:
    long = RouteRequest(model=MODEL, long=True, batch=16)
    a = dataclasses.replace(cand("a", in_flight=1), long_in_flight=1)
    b = cand("b", in_flight=5)
    assert _es(long, a, b, placement="spread") == "b"


def test_expected_start_packs_long_requests_into_a_lane() -> None:
    long = RouteRequest(model=MODEL, long=True, batch=16)
    lane = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3)
    short = cand("b", in_flight=1)
    idle = cand("c", in_flight=0)
    # joins the instance already running long work, not the idle one
    assert _es(long, short, lane, idle) == "a"
    # a full lane instance (2 x batch long in flight) opens the one with fewest short requests
    full = dataclasses.replace(cand("a", in_flight=32), long_in_flight=32)
    assert _es(long, short, full, idle) == "c"
    assert _es(long, full, short) == "b"  # rather than go deeper into the full one


def test_expected_start_packs_only_while_the_fleet_is_busy_with_pack_above() -> None:
    lane = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3)
    short = cand("b", in_flight=1)
    busy = RouteRequest(model=MODEL, long=True, batch=16, occupancy=0.5)
    light = dataclasses.replace(busy, occupancy=0.49)
    assert _es(busy, short, lane, pack_above=0.5) == "a"  # joins the lane
    assert _es(light, short, lane, pack_above=0.5) == "b"  # as spread: the fewest long
    assert _es(light, short, lane, pack_above=0.5, to_idle=True, idle_reserve=0) == "b"
    assert _es(light, short, lane) == "a"  # no pack_above: always packs


def test_spread_alone_keeps_long_work_off_instances_running_more_important_work() -> None:
    long = RouteRequest(model=MODEL, long=True, level=2, batch=16)
    realtime = dataclasses.replace(cand("a", in_flight=1), ahead=1, above=1)
    online = dataclasses.replace(cand("b", in_flight=2), ahead=2, above=0)
    params = {"long_placement": "spread", "spread_alone": True}
    policy = build_policy("expected_start", params, random.Random(0))
    assert policy.choose([realtime, online], long).name == "b"  # 3 + 2/16 > 3/16
    assert _es(long, realtime, online, placement="spread") == "a"  # 2/16 < 3/16


def test_expected_start_sends_uncapped_long_work_to_an_idle_instance_first() -> None:
    long = RouteRequest(model=MODEL, long=True, batch=16)
    lane = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3)
    short = cand("b", in_flight=1)
    idle = cand("c", in_flight=0)
    assert _es(long, short, lane, idle, to_idle=True) == "c"
    # with no idle instance it joins the lane, as without long_to_idle
    assert _es(long, short, lane, to_idle=True) == "a"
    # a capped class keeps to its lane even when an instance is idle
    capped = dataclasses.replace(long, class_name="offline", class_cap=8)
    own = dataclasses.replace(lane, class_in_flight=3)
    assert _es(capped, short, own, idle, to_idle=True) == "a"
    # off by default (it lost real-time goodput in the benchmark)
    policy = build_policy("expected_start", {"long_placement": "pack"}, random.Random(0))
    assert policy.choose([short, lane, idle], long).name == "a"


def test_expected_start_idle_reserve_keeps_idle_instances_for_short_work() -> None:
    long = RouteRequest(model=MODEL, long=True, batch=16)
    lane = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3)
    idle_c, idle_d = cand("c", in_flight=0), cand("d", in_flight=0)
    # two idle instances: one takes the long request, one stays idle
    assert _es(long, lane, idle_c, idle_d, to_idle=True, idle_reserve=1) in {"c", "d"}
    # the last idle instance is kept for short work: the lane takes it
    assert _es(long, lane, idle_c, to_idle=True, idle_reserve=1) == "a"
    assert _es(long, lane, idle_c, idle_d, to_idle=True, idle_reserve=2) == "a"
    # a full instance with nothing in flight is not idle for this count
    full_idle = dataclasses.replace(cand("d", in_flight=0), long_in_flight=32)
    assert _es(long, lane, idle_c, full_idle, to_idle=True, idle_reserve=1) == "a"


def test_expected_start_quiet_depth_prefers_a_quiet_instance_to_the_lane() -> None:
    long = RouteRequest(model=MODEL, long=True, batch=16)
    lane = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3)
    quiet = cand("b", in_flight=2)
    busy = cand("c", in_flight=4)
    idle = cand("d", in_flight=0)
    kw: dict[str, Any] = {"to_idle": True, "idle_reserve": 1, "quiet_depth": 4}
    # the only idle instance is kept for short work; the quiet one (2 < 4 in flight) takes it
    assert _es(long, lane, quiet, busy, idle, **kw) == "b"
    # without a quiet one it joins the lane, as before
    assert _es(long, lane, busy, idle, **kw) == "a"
    # an instance running long work is never quiet, however few it runs
    long_one = dataclasses.replace(cand("b", in_flight=1), long_in_flight=1)
    assert _es(long, lane, long_one, idle, **kw) == "a"
    # two idle instances: one of them still comes first
    assert _es(long, lane, quiet, idle, cand("e", in_flight=0), **kw) in {"d", "e"}
    # off by default; and a capped class keeps to its lane
    assert _es(long, lane, quiet, idle, to_idle=True, idle_reserve=1) == "a"
    capped = dataclasses.replace(long, class_name="offline", class_cap=8)
    own = dataclasses.replace(lane, class_in_flight=3)
    assert _es(capped, own, quiet, idle, **kw) == "a"


def test_expected_start_quiet_alone_keeps_long_rows_off_more_important_work() -> None:
    """An online long row (level 2) pads the batch it joins: with ``quiet_alone`` a quiet
    instance has no real-time request (level 1) in flight."""
    long = RouteRequest(model=MODEL, long=True, batch=16, level=2)
    lane = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3)
    with_rt = dataclasses.replace(cand("b", in_flight=1), ahead=1, above=1)
    own_level = dataclasses.replace(cand("c", in_flight=2), ahead=2, above=0)
    idle = cand("d", in_flight=0)
    kw: dict[str, Any] = {"to_idle": True, "idle_reserve": 1, "quiet_depth": 4}
    # quiet_depth alone takes the emptier one, real-time row and all
    assert _es(long, lane, with_rt, own_level, idle, **kw) == "b"
    assert _es(long, lane, with_rt, own_level, idle, quiet_alone=True, **kw) == "c"
    # no instance free of more important work: the lane, as without a quiet one
    assert _es(long, lane, with_rt, idle, quiet_alone=True, **kw) == "a"


def test_expected_start_lane_depth_bounds_uncapped_long_work() -> None:
    long = RouteRequest(model=MODEL, long=True, batch=16)
    a = dataclasses.replace(cand("a", in_flight=4), long_in_flight=4)
    b = cand("b", in_flight=0)
    policy = build_policy(
        "expected_start",
        {"lane_depth": 4, "long_placement": "pack", "long_to_idle": False},
        random.Random(0),
    )
    assert policy.choose([a, b], long).name == "b"
    policy = build_policy(
        "expected_start",
        {"lane_depth": 5, "long_placement": "pack", "long_to_idle": False},
        random.Random(0),
    )
    assert policy.choose([a, b], long).name == "a"


def test_expected_start_packs_a_capped_class_by_its_own_work() -> None:
    # a capped class fills the instance that holds the most of *its* requests, even where
    # another instance holds more long work of other classes
    capped = RouteRequest(model=MODEL, long=True, batch=16, class_name="offline", class_cap=8)
    own = dataclasses.replace(cand("a", in_flight=3), long_in_flight=3, class_in_flight=3)
    others = dataclasses.replace(cand("b", in_flight=6), long_in_flight=6, class_in_flight=0)
    assert _es(capped, others, own) == "a"
    # the cap, not the long count, makes an instance full: 5 of the class + 3 other long
    mixed = dataclasses.replace(cand("a", in_flight=8), long_in_flight=8, class_in_flight=5)
    assert _es(capped, mixed, cand("c", in_flight=0)) == "a"


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"long_placement": "scatter"}, "long_placement: must be one of 'pack', 'spread'"),
        ({"lane_depth": 0}, "lane_depth must be"),
        ({"busy_weight": -1}, "busy_weight must be"),
        ({"idle_reserve": -1}, "idle_reserve must be"),
        ({"quiet_depth": -1}, "quiet_depth must be"),
        ({"pack_above": 1.5}, "pack_above must be"),
    ],
)
def test_expected_start_params_are_checked(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_policy("expected_start", params, random.Random(0))
