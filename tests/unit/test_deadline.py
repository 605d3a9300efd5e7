"""Client deadlines: one budget per request, shed before dispatch, cancelled past it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.clock import FakeClock, MonotonicClock
from proxy.errors import Code, ProxyError
from proxy.fleet.catalog import model_info
from proxy.scheduling import deadline
from proxy.scheduling.deadline import Budget


def test_the_earlier_of_client_deadline_and_class_budget_wins() -> None:
    assert Budget.of(None) == Budget(None, False)
    assert Budget.of(None, 5.0) == Budget(5.0, False)
    assert Budget.of(3.0, 5.0) == Budget(3.0, True)
    assert Budget.of(7.0, 5.0) == Budget(5.0, False)


def test_only_a_hard_budget_becomes_tritons_timeout() -> None:
    clock = FakeClock(100.0)
    hard = Budget(100.25, True)
    assert hard.remaining_s(clock.now()) == pytest.approx(0.25)
    assert hard.triton_timeout_us(clock.now()) == 250_000
    assert not hard.expired(clock.now())
    clock.advance(0.25)
    assert hard.expired(clock.now())
    # Past it: the smallest timeout Triton takes (0 would mean "none").
    assert hard.triton_timeout_us(clock.now()) == 1
    assert Budget(100.25, False).triton_timeout_us(100.0) is None
    assert Budget().triton_timeout_us(100.0) is None
    assert not Budget().expired(1e12)


@pytest.mark.parametrize(
    ("grpc_s", "timeout_us", "header_s", "expected"),
    [
        (None, None, None, None),
        (2.0, None, None, 12.0),
        (None, 500_000, None, 10.5),
        (None, None, 0.25, 10.25),
        (2.0, 500_000, 0.25, 10.25),  # the earliest of the three
        (-1.0, None, None, 10.0),  # a gRPC deadline already past stays past
        (1e9, None, None, None),  # longer than a year: no deadline
    ],
)
def test_client_deadline_is_the_earliest_given(
    grpc_s: float | None, timeout_us: int | None, header_s: float | None, expected: float | None
) -> None:
    got = deadline.client_deadline(
        10.0, grpc_remaining_s=grpc_s, timeout_us=timeout_us, header_s=header_s
    )
    assert got == (None if expected is None else pytest.approx(expected))


def test_timeout_header() -> None:
    assert deadline.parse_timeout_ms(None) is None
    assert deadline.parse_timeout_ms(" 250 ") == pytest.approx(0.25)
    assert deadline.parse_timeout_ms("0.5") == pytest.approx(0.0005)
    for bad in ("0", "-3", "abc", "nan", "inf", ""):
        with pytest.raises(ProxyError) as info:
            deadline.parse_timeout_ms(bad)
        assert info.value.code is Code.INVALID_ARG
        assert "Triton-Timeout-Ms" in info.value.message


def test_check_sheds_once_the_deadline_is_reached() -> None:
    deadline.check(None, 5.0, "m")
    deadline.check(5.1, 5.0, "m")
    with pytest.raises(ProxyError) as info:
        deadline.check(5.0, 5.0, "m")
    assert info.value.code is Code.CLIENT_DEADLINE
    assert "'m'" in info.value.message


async def test_before_cancels_the_work_at_the_deadline() -> None:
    clock = MonotonicClock()
    unwound = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(10)
        finally:
            unwound.set()  # the work's own exit path ran (slots, tokens, upstream call)
        return "late"

    with pytest.raises(ProxyError) as info:
        await deadline.before(clock.now() + 0.05, clock, "m", work())
    assert info.value.code is Code.CLIENT_DEADLINE
    assert unwound.is_set()


async def test_before_passes_results_and_the_works_own_errors_through() -> None:
    clock = MonotonicClock()

    async def ok() -> int:
        return 7

    async def own_timeout() -> int:
        raise TimeoutError("upstream")

    assert await deadline.before(None, clock, "m", ok()) == 7
    assert await deadline.before(clock.now() + 5, clock, "m", ok()) == 7
    with pytest.raises(TimeoutError, match="upstream"):
        await deadline.before(clock.now() + 5, clock, "m", own_timeout())


async def test_before_with_a_past_deadline_never_starts_the_work() -> None:
    started = False

    async def work() -> None:
        nonlocal started
        started = True

    clock = FakeClock(3.0)
    with pytest.raises(ProxyError):
        await deadline.before(2.0, clock, "m", work())
    assert not started


async def test_detached_work_outlives_its_cancelled_caller() -> None:
    finished = asyncio.Event()

    async def work() -> str:
        await asyncio.sleep(0.05)
        finished.set()
        return "done"

    caller = asyncio.ensure_future(deadline.detached(work()))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(finished.wait(), 5)
    assert await deadline.detached(work()) == "done"


def _config(batching: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {"max_batch_size": 8}
    if batching is not None:
        config["dynamic_batching"] = batching
    return config


ON = {"allow_timeout_override": True, "default_timeout_microseconds": "300000000"}
"""A queue policy that honours a request's ``timeout`` (shorter than its default)."""


@pytest.mark.parametrize(
    ("batching", "levels"),
    [
        (None, {None: False, 1: False}),
        ({}, {None: False}),
        # Triton's JSON config, as /v2/models/NAME/config gives it (uint64 as a string).
        ({"default_queue_policy": {**ON, "allow_timeout_override": False}}, {None: False}),
        ({"default_queue_policy": ON}, {None: True, 1: True}),
        # Without a default timeout a request's own is never below it: ignored.
        ({"default_queue_policy": {"allow_timeout_override": True}}, {None: False, 1: False}),
        (
            {
                "default_queue_policy": {
                    "allow_timeout_override": True,
                    "default_timeout_microseconds": "0",
                }
            },
            {None: False},
        ),
        (
            {
                "priority_levels": 3,
                "default_priority_level": 2,
                "default_queue_policy": {"allow_timeout_override": False},
                "priority_queue_policy": {"1": ON},
            },
            # Unset, 0 and above the levels mean the default level (2).
            {1: True, 2: False, 3: False, None: False, 0: False, 9: False},
        ),
        (
            {
                "priority_levels": 3,
                "default_priority_level": 1,
                "default_queue_policy": ON,
                "priority_queue_policy": {"1": ON, "3": {}},
            },
            {None: True, 1: True, 2: True, 3: False},
        ),
    ],
)
def test_which_priority_levels_honour_a_timeout(
    batching: dict[str, Any] | None, levels: dict[int | None, bool]
) -> None:
    info = model_info(_config(batching))
    for level, honoured in levels.items():
        assert info.honours_timeout(level) is honoured, level
