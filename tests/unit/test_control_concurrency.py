"""Adaptive concurrency: the AIMD law on the top class's time inside Triton."""

from __future__ import annotations

import pytest

from proxy.control.concurrency import (
    AdaptiveConcurrency,
    AdaptiveConcurrencyConfig,
    ConcurrencyLimit,
)


def law(limit: float = 32) -> ConcurrencyLimit:
    return ConcurrencyLimit(
        low=16, high=64, step=4, target_s=0.1, decrease=0.8, window_s=1.0, limit=limit
    )


def feed(
    c: ConcurrencyLimit,
    seconds: float,
    start: float,
    *,
    top: bool = True,
    in_flight: int = 0,
    n: int = 20,
) -> list[str | None]:
    return [c.observe(seconds, top, in_flight, start + i * 0.1) for i in range(n)]


def test_slow_top_class_answers_decrease_the_limit_down_to_its_floor() -> None:
    c = law()
    moves = [c.observe(0.3, True, c.current(), i * 0.1) for i in range(200)]
    assert "down" in moves
    assert c.current() == 16  # never below min_batches x B: a batch can still fill


def test_slow_answers_do_not_cut_slots_that_were_never_all_in_use() -> None:
    # 300 ms answers with 5 of 32 slots in use: not queueing the slots allow, so no cut
    c = law()
    moves = feed(c, 0.3, 0.0, in_flight=5, n=200)
    assert "down" not in moves
    assert c.current() == 32


def test_an_instance_without_top_class_answers_holds_its_limit() -> None:
    # a lane instance: only long, lower-class work, slow as expected, every slot in use
    c = law()
    for i in range(200):
        c.observe(0.5, False, c.current(), i * 0.1)
    assert c.current() == 64  # bound and never judged slow: it grows


def test_the_target_leaves_room_for_the_batch_running() -> None:
    # Long work shares the instance: its batches take ~90 ms, and a top-class request that
    # finds one running waits for it. 110 ms top-class answers against a 50 ms target are the
    # running batch, not the slots: the target becomes running + own batch (capped at the SLO).
    c = ConcurrencyLimit(
        low=16,
        high=64,
        step=4,
        target_s=0.05,
        decrease=0.8,
        window_s=1.0,
        limit=32,
        ceiling_s=0.2,
    )
    for i in range(100):
        t = i * 0.1
        c.observe(0.09, False, c.current(), t)
        assert c.observe(0.11, True, c.current(), t, batch_s=0.03) != "down"
    assert c.target(10.0, batch_s=0.03) == pytest.approx(0.12)
    # ...but not above the SLO: past it the slots are cut again
    for i in range(100):
        t = 20.0 + i * 0.1
        c.observe(0.5, False, c.current(), t)
        c.observe(0.3, True, c.current(), t, batch_s=0.03)
    assert c.target(30.0, batch_s=0.03) == pytest.approx(0.2)
    assert c.current() == 16


def test_the_limit_grows_only_while_it_binds() -> None:
    c = law()
    feed(c, 0.02, 0.0, in_flight=5, n=50)
    assert c.current() == 32  # fast answers, but never at the limit: no reason to grow
    for i in range(200):  # always full: every slot in use
        c.observe(0.02, True, c.current(), 10.0 + i * 0.1)
    assert c.current() == 64


def test_lower_classes_long_answers_do_not_count_when_the_top_class_answered() -> None:
    c = law()
    for i in range(40):
        t = i * 0.05
        c.observe(0.5, False, 0, t)  # offline: long, as expected
        c.observe(0.02, True, 0, t)
    assert c.current() == 32


def test_targets_come_from_the_top_class_slo() -> None:
    a = AdaptiveConcurrency(AdaptiveConcurrencyConfig(target_fraction=0.5), top_slo_s=0.25)
    assert a.target_s == pytest.approx(0.125)
    assert a.limit("i", "m", per_batch=16) == 64  # starts at its ceiling, max_batches x B
    two = AdaptiveConcurrency(AdaptiveConcurrencyConfig(start_batches=2), top_slo_s=0.25)
    assert two.limit("i", "m", per_batch=16) == 32  # where the fixed rule was
    fixed = AdaptiveConcurrency(AdaptiveConcurrencyConfig(target_s=0.05), top_slo_s=0.25)
    assert fixed.target_s == 0.05


@pytest.mark.parametrize(
    "bad",
    [
        {"target_fraction": 0},
        {"min_batches": 2, "max_batches": 1},
        {"decrease": 1.0},
        {"start_batches": 5},
        {"start_batches": 0.5},
    ],
)
def test_config_is_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveConcurrencyConfig(**bad)  # type: ignore[arg-type]


def test_the_target_is_never_below_two_full_batches_of_the_model() -> None:
    c = law()
    for i in range(60):  # 300 ms answers: above the 100 ms SLO target...
        c.observe(0.3, True, c.current(), i * 0.1, batch_s=0.2)
    assert c.current() >= 32  # ...but below two 200 ms batches: never cut (bound: it grows)


def test_the_starting_limit_lies_within_the_configured_bounds() -> None:
    """A policy's max_batches below 2 batches starts at its ceiling, not at 2 x B x n."""
    small = AdaptiveConcurrency(
        AdaptiveConcurrencyConfig(enabled=True, min_batches=0.0625, max_batches=0.125), 0.25
    )
    assert small.limit("triton-0", "m", per_batch=16) == 2
    assert law(limit=500).current() == 64
    assert law(limit=1).current() == 16
