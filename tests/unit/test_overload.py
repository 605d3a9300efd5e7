"""proxy.scheduling.overload: the pressure's steps and who is refused at each pressure."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.overload import OverloadGuard
from proxy.strict import ConfigError

CLASSES = {
    "realtime": {"rank": 0, "slo_p99_ms": 100},
    "online": {"rank": 1, "slo_p99_ms": 500},
    "offline": {"rank": 2},
}


class FixedRandom(random.Random):
    """``random()`` always answers ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def guard(
    classes: dict[str, Any] | None = None,
    rng: random.Random | None = None,
    **overload: float,
) -> tuple[OverloadGuard, FakeClock]:
    section = load_scheduling(
        {
            "classes": classes or CLASSES,
            "default_class": "online" if classes is None else next(iter(classes)),
            "overload": {"lag_ms": 20, **overload},
        }
    )
    assert section.overload is not None
    clock = FakeClock()
    return OverloadGuard(section.overload, section.classes, clock, rng or random.Random(1)), clock


def step(g: OverloadGuard, clock: FakeClock, lag_ms: float, samples: int = 5) -> bool:
    """One step of ``samples`` lag samples; returns whether the pressure moved."""
    moved = False
    for _ in range(samples):
        clock.advance(g.config.step_s / samples + 1e-9)
        moved = g.observe_lag(lag_ms / 1000.0) or moved
    return moved


def test_the_pressure_rises_above_the_limit_falls_below_half_and_holds_between() -> None:
    g, clock = guard()
    assert g.ceiling == 2.0  # online and offline; never the top class
    assert step(g, clock, 30.0)
    assert g.pressure == pytest.approx(0.25)
    assert not step(g, clock, 15.0)  # the dead band: between half the limit and the limit
    assert g.pressure == pytest.approx(0.25)
    for _ in range(20):
        step(g, clock, 100.0)
    assert g.pressure == pytest.approx(2.0)  # held at the ceiling
    step(g, clock, 5.0)
    assert g.pressure == pytest.approx(1.9)
    for _ in range(30):
        step(g, clock, 0.0)
    assert g.pressure == 0.0
    assert g.last_lag_ms == 0.0


def test_the_mean_of_a_step_decides_not_one_sample() -> None:
    g, clock = guard()
    # One sample of 90 ms among four of 0: a mean of 18 ms, under the 20 ms limit.
    for lag in (0.0, 0.0, 90.0, 0.0, 0.0):
        clock.advance(0.1)
        g.observe_lag(lag / 1000.0)
    assert g.last_lag_ms == pytest.approx(18.0)
    assert g.pressure == 0.0


def test_the_least_important_class_is_refused_wholly_before_the_next() -> None:
    g, clock = guard(rng=FixedRandom(0.4))
    for _ in range(4):
        step(g, clock, 50.0)
    assert g.pressure == pytest.approx(1.0)
    assert g.refuses("offline")
    assert not g.refuses("online")
    assert not g.refuses("realtime")
    step(g, clock, 50.0)
    step(g, clock, 50.0)  # 1.5: online refused with probability 0.5
    assert g.refuses("online")  # 0.4 < 0.5
    g2, clock2 = guard(rng=FixedRandom(0.6))
    for _ in range(6):
        step(g2, clock2, 50.0)
    assert not g2.refuses("online")  # 0.6 >= 0.5
    assert g2.refuses("offline")


def test_the_top_class_and_unknown_classes_are_never_refused() -> None:
    classes = {
        "realtime": {"rank": 0, "slo_p99_ms": 100},
        "interactive": {"rank": 0, "slo_p99_ms": 100},
        "offline": {"rank": 1},
    }
    g, clock = guard(classes, rng=FixedRandom(0.0))
    for _ in range(20):
        step(g, clock, 500.0)
    assert g.ceiling == 1.0
    assert g.refuses("offline")
    assert not any(g.refuses(c) for c in ("realtime", "interactive", "nope") for _ in range(50))


def test_a_class_keeps_its_min_share_of_the_admitted_requests() -> None:
    classes = {
        "realtime": {"rank": 0, "slo_p99_ms": 100},
        "offline": {"rank": 1, "min_share": 0.1},
    }
    g, clock = guard(classes, rng=FixedRandom(0.0))
    for _ in range(8):
        step(g, clock, 500.0)
    assert g.pressure == 1.0  # offline refused wholly but for its share
    admitted = {"realtime": 0, "offline": 0}
    for i in range(20_000):
        klass = "offline" if i % 2 else "realtime"  # offline asks for half
        if not g.refuses(klass):
            admitted[klass] += 1
        if i % 1000 == 999:
            step(g, clock, 500.0)
    share = admitted["offline"] / sum(admitted.values())
    assert 0.09 <= share <= 0.12
    assert admitted["realtime"] == 10_000


@pytest.mark.parametrize("key", ["lag_ms", "step_s", "up", "down"])
def test_settings_must_be_positive(key: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=key):
        load_scheduling({"overload": {key: 0}})
