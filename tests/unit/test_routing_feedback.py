"""Instance feedback: weight steps down after K bad windows and back up after K good ones."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from proxy.clock import FakeClock
from proxy.routing.feedback import FeedbackParams, InstanceFeedback, _Peers
from tests.unit.routing_support import MODEL, snap

PARAMS = FeedbackParams(
    queue_p95_threshold_us=1000.0, windows=3, factor=0.5, floor=0.2, window_s=1.0
)
BAD, GOOD, IDLE = 5000.0, 100.0, None


def run(series: list[float | None], params: FeedbackParams = PARAMS) -> list[float]:
    """Weights after each window, one new snapshot per window."""
    clock = FakeClock()
    fb = InstanceFeedback(params, clock)
    out = []
    for p95 in series:
        clock.advance(params.window_s)
        out.append(fb.weight("i", MODEL, snap(clock.now(), queue_us_p95=p95)))
    return out


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ([BAD, BAD], [1, 1]),
        ([BAD, BAD, BAD], [1, 1, 0.5]),
        ([BAD] * 6, [1, 1, 0.5, 0.5, 0.5, 0.25]),
        ([BAD] * 12, [1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.2, 0.2, 0.2, 0.2]),  # floor
        # a good window breaks the bad streak
        ([BAD, BAD, GOOD, BAD, BAD], [1] * 5),
        # release after K good windows, one step per K
        ([BAD] * 6 + [GOOD] * 6, [1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.5, 0.5, 0.5, 1.0]),
        # no traffic (P95 unknown) counts as good
        ([BAD] * 3 + [IDLE] * 3, [1, 1, 0.5, 0.5, 0.5, 1.0]),
        # never above 1
        ([GOOD] * 7, [1] * 7),
        # exactly at the threshold is not bad
        ([1000.0] * 4, [1] * 4),
    ],
)
def test_penalty_engages_and_releases(series: list[float | None], expected: list[float]) -> None:
    assert run(series) == pytest.approx(expected)


def test_one_evaluation_per_window_and_per_new_snapshot() -> None:
    clock = FakeClock()
    fb = InstanceFeedback(PARAMS, clock)
    bad = snap(0.0, queue_us_p95=BAD)
    # Many calls within one window, or on the same (stale) snapshot, are one window at most.
    for _ in range(10):
        fb.weight("i", MODEL, bad)
    for _ in range(10):
        clock.advance(2.0)
        assert fb.weight("i", MODEL, bad) == 1.0
    for t in (20.0, 20.5, 20.9):
        clock.t = t
        fb.weight("i", MODEL, snap(t, queue_us_p95=BAD))
    assert fb.current("i", MODEL) == 1.0  # windows 20.0 (and 0.0) only: 2 bad so far
    clock.t = 21.0
    assert fb.weight("i", MODEL, snap(21.0, queue_us_p95=BAD)) == 0.5


def test_state_is_per_instance_and_model_and_can_be_forgotten() -> None:
    clock = FakeClock()
    fb = InstanceFeedback(PARAMS, clock)
    for _ in range(3):
        clock.advance(1.0)
        fb.weight("slow", MODEL, snap(clock.now(), queue_us_p95=BAD))
        fb.weight("fast", MODEL, snap(clock.now(), queue_us_p95=GOOD))
        fb.weight("slow", "other", snap(clock.now(), queue_us_p95=BAD, model="other2"))
    assert fb.current("slow", MODEL) == 0.5
    assert fb.current("fast", MODEL) == 1.0
    assert fb.current("slow", "other") == 1.0  # that model had no traffic on "slow"
    fb.forget("slow")
    assert fb.current("slow", MODEL) == 1.0


def test_missing_snapshot_is_no_evidence() -> None:
    clock = FakeClock()
    fb = InstanceFeedback(PARAMS, clock)
    for _ in range(5):
        clock.advance(1.0)
        assert fb.weight("i", MODEL, None) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"windows": 0},
        {"peer_ratio": 0.9},
        {"factor": 1.0},
        {"factor": 0.0},
        {"floor": 0.0},
        {"window_s": 0.0},
    ],
)
def test_params_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FeedbackParams(**kwargs)  # type: ignore[arg-type]


def fleet_weights(
    series: dict[str, list[float | None]], params: FeedbackParams = PARAMS
) -> dict[str, float]:
    """Weights after the windows of several instances of one model, evaluated in turn."""
    clock = FakeClock()
    fb = InstanceFeedback(params, clock)
    for step in range(len(next(iter(series.values())))):
        clock.advance(params.window_s)
        for name, p95s in series.items():
            fb.weight(name, MODEL, snap(clock.now(), queue_us_p95=p95s[step]))
    return {name: fb.current(name, MODEL) for name in series}


def test_a_fleet_slow_as_a_whole_keeps_its_weights() -> None:
    """Every instance above the absolute threshold, none far above its peers: cutting one
    would only move its queue to the others."""
    slow = {"a": [5000.0] * 6, "b": [7000.0] * 6, "c": [9000.0] * 6}
    assert fleet_weights(slow) == {"a": 1.0, "b": 1.0, "c": 1.0}
    absolute = replace(PARAMS, peer_ratio=None)
    assert fleet_weights(slow, absolute) == {"a": 0.25, "b": 0.25, "c": 0.25}


def test_an_instance_far_above_its_peers_is_penalised() -> None:
    series = {"a": [GOOD] * 6, "slow": [BAD] * 6, "b": [IDLE] * 6}
    # The slow one's first window has one peer known (a): 5000 > 2 x 100.
    assert fleet_weights(series) == {"a": 1.0, "slow": 0.25, "b": 1.0}
    # Above 2x the peers' median, the absolute threshold still decides: 900 is not bad.
    quiet = {"a": [100.0] * 3, "b": [300.0] * 3, "c": [900.0] * 3}
    assert fleet_weights(quiet) == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_peer_ratio_is_a_ratio_of_the_median_of_the_others() -> None:
    # c's peers: median(600, 700) = 650; 2 x 650 = 1300 is not bad, 1301 is.
    at = {"a": [600.0] * 3, "b": [700.0] * 3, "c": [1300.0] * 3}
    assert fleet_weights(at)["c"] == 1.0
    above = {"a": [600.0] * 3, "b": [700.0] * 3, "c": [1301.0] * 3}
    assert fleet_weights(above)["c"] == 0.5


def test_no_penalty_while_the_peers_have_no_room() -> None:
    """Peers above the threshold themselves: a weight cut would only move the queue."""
    crowded = {"a": [2000.0] * 3, "b": [3000.0] * 3, "c": [20000.0] * 3}
    assert fleet_weights(crowded)["c"] == 1.0
    # Their median exactly at the threshold still leaves room.
    room = {"a": [1000.0] * 3, "b": [1000.0] * 3, "c": [20000.0] * 3}
    assert fleet_weights(room)["c"] == 0.5


def test_forgotten_instances_are_no_peers() -> None:
    clock = FakeClock()
    fb = InstanceFeedback(replace(PARAMS, windows=1), clock)
    fb.weight("idle", MODEL, snap(clock.now(), queue_us_p95=None))
    fb.forget("idle")
    clock.advance(1.0)
    # Alone again: the absolute threshold alone (an idle peer would have made it 5000 > 0).
    assert fb.weight("slow", MODEL, snap(clock.now(), queue_us_p95=BAD)) == 0.5
    fb.weight("idle", MODEL, snap(clock.now(), queue_us_p95=BAD))
    assert fb.current("idle", MODEL) == 1.0  # its peer "slow" is as slow


@pytest.mark.parametrize("seed", range(20))
def test_median_of_the_others(seed: int) -> None:
    rng = random.Random(seed)
    peers = _Peers()
    values: dict[str, float] = {}
    for _ in range(60):
        name = f"i{rng.randrange(8)}"
        if rng.random() < 0.2:
            peers.drop(name)
            values.pop(name, None)
        else:
            values[name] = float(rng.choice((0, 1, 2, 3, 5, 8)))
            peers.set(name, values[name])
        for own, v in values.items():
            others = [x for n, x in values.items() if n != own]
            expected = statistics.median(others) if others else None
            assert peers.median_without(v) == expected
