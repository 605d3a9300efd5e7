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
    moves = feed(c, 0.3, 0.0, n=200)
    assert "down" in moves
    assert c.current() == 16  # never below min_batches x B: a batch can still fill


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
    assert a.limit("i", "m", per_batch=16) == 32  # starts where the fixed rule was
    fixed = AdaptiveConcurrency(AdaptiveConcurrencyConfig(target_s=0.05), top_slo_s=0.25)
    assert fixed.target_s == 0.05


@pytest.mark.parametrize(
    "bad",
    [{"target_fraction": 0}, {"min_batches": 2, "max_batches": 1}, {"decrease": 1.0}],
)
def test_config_is_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveConcurrencyConfig(**bad)  # type: ignore[arg-type]


def test_the_target_is_never_below_two_full_batches_of_the_model() -> None:
    c = law()
    for i in range(60):  # 300 ms answers: above the 100 ms SLO target...
        c.observe(0.3, True, 0, i * 0.1, batch_s=0.2)
    assert c.current() == 32  # ...but below two 200 ms batches: no reason to cut slots


def test_the_starting_limit_lies_within_the_configured_bounds() -> None:
    """A policy's max_batches below 2 batches starts at its ceiling, not at 2 x B x n."""
    small = AdaptiveConcurrency(
        AdaptiveConcurrencyConfig(enabled=True, min_batches=0.0625, max_batches=0.125), 0.25
    )
    assert small.limit("triton-0", "m", per_batch=16) == 2
    assert law(limit=500).current() == 64
    assert law(limit=1).current() == 16
