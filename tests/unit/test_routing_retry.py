"""Retry budget: a ratio of recent requests plus a per-second floor, over a sliding window."""

from __future__ import annotations

import pytest

from proxy.clock import FakeClock
from proxy.routing.retry import RetryBudget, RetryParams


def budget(**kwargs: float) -> tuple[RetryBudget, FakeClock]:
    clock = FakeClock(1000.0)
    return RetryBudget(RetryParams(**kwargs), clock), clock  # type: ignore[arg-type]


def drain(b: RetryBudget, limit: int = 10_000) -> int:
    n = 0
    while n < limit and b.try_retry():
        n += 1
    return n


@pytest.mark.parametrize(
    ("requests", "ratio", "min_per_s", "ttl_s", "allowed"),
    [
        (0, 0.2, 0.0, 10.0, 0),
        (100, 0.2, 0.0, 10.0, 20),
        (100, 0.2, 1.0, 10.0, 30),  # floor: 1/s over 10 s
        (0, 0.2, 1.0, 10.0, 10),
        (7, 0.5, 0.0, 10.0, 3),  # 3.5 tokens: whole retries only
        (1000, 0.0, 0.5, 4.0, 2),
    ],
)
def test_allowance(
    requests: int, ratio: float, min_per_s: float, ttl_s: float, allowed: int
) -> None:
    b, _ = budget(budget_ratio=ratio, min_retries_per_s=min_per_s, ttl_s=ttl_s)
    for _ in range(requests):
        b.record_request()
    assert drain(b) == allowed


def test_budget_refills_as_old_requests_and_retries_leave_the_window() -> None:
    b, clock = budget(budget_ratio=0.1, min_retries_per_s=0.0, ttl_s=10.0)
    for _ in range(100):
        b.record_request()
    assert drain(b) == 10
    clock.advance(5.0)
    assert drain(b) == 0  # still inside the window
    for _ in range(50):
        b.record_request()
    assert drain(b) == 5
    clock.advance(5.0)  # the first 100 requests and their 10 retries are gone
    assert drain(b) == 0  # 50 requests and 5 retries remain in the window
    clock.advance(10.0)
    assert b.balance() == 0.0
    for _ in range(30):
        b.record_request()
    assert drain(b) == 3


def test_no_retries_when_disabled() -> None:
    b, _ = budget(max_retries=0, min_retries_per_s=100.0)
    assert not b.try_retry()


@pytest.mark.parametrize(
    "kwargs", [{"max_retries": -1}, {"budget_ratio": -0.1}, {"min_retries_per_s": -1}, {"ttl_s": 0}]
)
def test_params_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryParams(**kwargs)  # type: ignore[arg-type]
