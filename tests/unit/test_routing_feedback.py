"""Instance feedback: weight steps down after K bad windows and back up after K good ones."""

from __future__ import annotations

import pytest

from proxy.clock import FakeClock
from proxy.routing.feedback import FeedbackParams, InstanceFeedback
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
    [{"windows": 0}, {"factor": 1.0}, {"factor": 0.0}, {"floor": 0.0}, {"window_s": 0.0}],
)
def test_params_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FeedbackParams(**kwargs)  # type: ignore[arg-type]
