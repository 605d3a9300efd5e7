"""The headroom rule (pure) and the batching loop deferring a change while it does not hold."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from proxy.clock import FakeClock
from proxy.control.apply import ApplyResult, WindowApplier
from proxy.control.config import BatchingConfig, ControlConfig
from proxy.control.headroom import (
    Headroom,
    InstanceLoad,
    busy_share,
    check,
    check_all,
    load_of,
)
from proxy.fleet.instances import Fleet, HealthConfig, Instance, InstanceSpec
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from tests.unit.test_control_loops import FakeApplier, feed, make, samples


def two(
    in_flight: tuple[int, int] = (0, 0), slots: int | None = 10, busy: float | None = 0.0
) -> list[InstanceLoad]:
    return [
        InstanceLoad("a", in_flight[0], slots, busy),
        InstanceLoad("b", in_flight[1], slots, busy),
    ]


def test_busy_share() -> None:
    assert busy_share(0.0, None, 2) == 0.0  # nothing executed
    assert busy_share(5.0, None, 2) is None  # executions but no compute time
    # 10 batches/s of 40 ms on 2 model instances: 0.2 of their time.
    assert busy_share(10.0, 40_000.0, 2) == pytest.approx(0.2)
    assert busy_share(100.0, 40_000.0, 1) == 1.0  # capped


@pytest.mark.parametrize(
    ("load", "ok", "reason"),
    [
        (0.0, True, "ok"),
        (8.0, True, "ok"),  # 8 <= 0.8 x 10 slots on the other instance
        (8.5, False, "slots"),
    ],
)
def test_slots_condition(load: float, ok: bool, reason: str) -> None:
    v = check("a", two(), load, 0.8)
    assert (v.ok, v.reason) == (ok, reason)


@pytest.mark.parametrize(
    ("busy", "ok"),
    [
        ((0.4, 0.4), True),  # 0.8 instances busy fits on the other at 0.8 of its time
        ((0.5, 0.4), False),  # 0.9 does not
        ((1.0, 0.0), False),
    ],
)
def test_busy_condition(busy: tuple[float, float], ok: bool) -> None:
    loads = [InstanceLoad("a", 0, 10, busy[0]), InstanceLoad("b", 0, 10, busy[1])]
    v = check("a", loads, 0.0, 0.8)
    assert v.ok == ok
    if not ok:
        assert v.reason == "busy"


def test_unknown_inputs_skip_their_condition_or_count_as_the_busiest() -> None:
    # No slots known (no gate yet): only the busy condition applies.
    assert check("a", two(slots=None), 1000.0, 0.8).ok
    # No busy share known anywhere: only the slots condition applies.
    assert check("a", two(busy=None), 0.0, 0.8).ok
    # One unknown instance counts as busy as the busiest known one: 0.45 + 0.45 > 0.8.
    loads = [InstanceLoad("a", 0, 10, 0.45), InstanceLoad("b", 0, 10, None)]
    assert not check("a", loads, 0.0, 0.8).ok


def test_no_other_instance() -> None:
    v = check("a", [InstanceLoad("a", 0, 10, 0.0)], 0.0, 0.8)
    assert (v.ok, v.reason) == (False, "no_other_instance")


def test_more_instances_give_more_room() -> None:
    # 1.5 instances busy: too much for 1 other (0.8), fits on 2 others (1.6).
    three = [InstanceLoad(n, 0, 10, 0.5) for n in ("a", "b", "c")]
    assert check("a", three, 0.0, 0.8).ok
    assert not check("a", three[:2], 0.0, 0.8).ok


def test_check_all_fails_on_the_first_instance_without_room() -> None:
    # Draining the large instance leaves 4 slots for a load of 6; the small one leaves 20.
    loads = [InstanceLoad("big", 5, 20, None), InstanceLoad("small", 1, 4, None)]
    assert check("small", loads, 6.0, 0.8).ok
    assert not check_all(["small", "big"], loads, 6.0, 0.8).ok
    assert check_all([], loads, 6.0, 0.8).ok
    assert load_of(loads, 3) == 9


# --- the loop ------------------------------------------------------------------------------

LENGTHEN = ControlConfig(
    batching=BatchingConfig(enabled=True, dwell_s=60.0, min_us=500, backlog_min=1.0),
    min_samples=10,
    window_s=5.0,
)


class Loaded:
    """A snapshot source whose busy share the test sets (exec_rate x compute / instances)."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.queue_us: float | None = None

    def __call__(self) -> dict[str, InstanceSnapshot]:
        # INFO has 1 model instance: exec_rate 10/s x compute (busy / 10) s = busy.
        load = ModelLoad(
            pending=3.0,
            exec_rate=10.0,
            compute_us=self.busy / 10 * 1e6,
            queue_us=self.queue_us,
        )
        return {n: InstanceSnapshot(taken_at=0.0, models={"m": load}) for n in ("a", "b")}


def test_change_waits_for_headroom_then_goes_ahead(caplog: pytest.LogCaptureFixture) -> None:
    """A lengthening (backlog, SLO holding) is deferred while both instances are busy, counted
    and logged once for the whole episode, and made at the first tick after the load falls;
    the dwell starts then, not at the deferral."""
    applier = FakeApplier(window=2000)
    loops, _, telemetry, clock = make(LENGTHEN, applier)
    snaps = Loaded()
    loops.snapshots = snaps
    snaps.busy = 0.7  # 1.4 instances busy > 0.8 x 1

    async def run() -> None:
        with caplog.at_level(logging.INFO, logger="proxy.control"):
            for _ in range(5):
                clock.advance(1.0)
                feed(loops, clock, 0.01)  # realtime holds: p99 10 ms vs 100 ms
                await loops.tick()
            assert applier.applied == []
            assert loops.window_target["m"] == 2000
            assert "m" in loops.deferred
            deferred = samples(telemetry, "triton_proxy_control_deferred_seconds")
            assert deferred == {(("loop", "batching"), ("model", "m")): 4.0}
            snaps.busy = 0.3  # 0.6 <= 0.8: room
            clock.advance(1.0)
            feed(loops, clock, 0.01)
            await loops.tick()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            await loops.stop()

    asyncio.run(run())
    assert applier.applied == [("m", 4000)]
    assert loops.deferred == {}
    decisions = samples(telemetry, "triton_proxy_control_decisions_total")
    assert decisions == {
        (("direction", "up"), ("loop", "batching"), ("model", "m"), ("reason", "no_headroom")): 1.0,
        (("direction", "up"), ("loop", "batching"), ("model", "m"), ("reason", "backlog")): 1.0,
    }
    lines = [r.getMessage() for r in caplog.records]
    assert sum("deferred: no_headroom" in x for x in lines) == 1, lines
    assert sum("after 5 s without headroom" in x for x in lines) == 1, lines
    assert loops._batching["m"].last_change == clock.now()


def test_slots_in_use_defer_the_change() -> None:
    """The slots condition on the proxy's own counts: the model's requests in flight plus those
    queued exceed 0.8 x the other instance's slots."""
    applier = FakeApplier(window=2000)
    loops, gates, _, clock = make(LENGTHEN, applier)
    loops.snapshots = Loaded()  # busy 0: only slots can say no
    slots = gates.slot_limit("b", "m")
    assert slots is not None
    loops.fleet.get("a").model_in_flight["m"] = slots  # a whole instance's worth in flight

    async def run() -> None:
        clock.advance(1.0)
        feed(loops, clock, 0.01)
        await loops.tick()
        v = loops.headroom("m", ["a"])
        assert (v.ok, v.reason) == (False, "slots")
        loops.fleet.get("a").model_in_flight["m"] = 0
        await loops.stop()

    asyncio.run(run())
    assert applier.applied == []
    assert "m" in loops.deferred


def test_dry_run_reports_the_deferral_on_the_dry_run_counter() -> None:
    applier = FakeApplier(window=2000)
    loops, _, telemetry, clock = make(dataclasses.replace(LENGTHEN, dry_run=True), applier)
    snaps = Loaded()
    snaps.busy = 0.9
    loops.snapshots = snaps
    clock.advance(1.0)
    feed(loops, clock, 0.01)
    asyncio.run(loops.tick())
    assert samples(telemetry, "triton_proxy_control_decisions_total") == {}
    dry = samples(telemetry, "triton_proxy_control_dry_run_decisions_total")
    assert dry == {
        (("direction", "up"), ("loop", "batching"), ("model", "m"), ("reason", "no_headroom")): 1.0
    }
    assert loops.window_target["m"] == 2000  # it would not change yet either


def test_headroom_off_changes_at_once() -> None:
    applier = FakeApplier(window=2000)
    cfg = dataclasses.replace(
        LENGTHEN, batching=dataclasses.replace(LENGTHEN.batching, headroom=False)
    )
    loops, _, _, clock = make(cfg, applier)
    snaps = Loaded()
    snaps.busy = 1.0
    loops.snapshots = snaps

    async def run() -> None:
        clock.advance(1.0)
        feed(loops, clock, 0.01)
        await loops.tick()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await loops.stop()

    asyncio.run(run())
    assert applier.applied == [("m", 4000)]


class PartialApplier(FakeApplier):
    """Changes instance a, then the headroom check stops it before b (as the real applier
    does when ``can_drain`` says no); then changes what is left."""

    def __init__(self) -> None:
        super().__init__(window=2000)
        self.calls: list[tuple[str, int]] = []
        self.checked: list[bool] = []

    async def apply(self, model: str, window_us: int, **kw: object) -> ApplyResult:
        self.calls.append((model, window_us))
        can_drain = kw["can_drain"]
        assert callable(can_drain)
        if len(self.calls) == 1:
            self.on_window("a", model, window_us)
            self.on_window("b", model, 2000)  # the real applier reads b's config first
            verdict = can_drain(loops_instance(self, "b"), model)
            self.checked.append(verdict.ok)
            assert not verdict.ok
            return ApplyResult(changed=["a"], failed="b: busy", deferred=verdict)
        self.on_window("b", model, window_us)
        return ApplyResult(changed=["b"])


def loops_instance(applier: PartialApplier, name: str) -> object:
    return applier.fleet.get(name)  # type: ignore[attr-defined]


def test_a_rollout_stopped_for_headroom_resumes_when_it_returns() -> None:
    applier = PartialApplier()
    loops, _, telemetry, clock = make(LENGTHEN, applier)
    applier.fleet = loops.fleet  # type: ignore[attr-defined]
    snaps = Loaded()
    loops.snapshots = snaps

    async def run() -> None:
        clock.advance(1.0)
        feed(loops, clock, 0.01)
        snaps.busy = 0.3
        await loops.tick()  # decides 2 -> 4 ms; room to start
        snaps.busy = 0.9  # the load rises while instance a reloads
        for _ in range(3):
            await asyncio.sleep(0)
        assert applier.calls == [("m", 4000)]
        assert loops.windows == {("a", "m"): 4000, ("b", "m"): 2000}
        assert "m" in loops.deferred
        for _ in range(3):  # still busy: the rest of the rollout waits (within the dwell)
            clock.advance(1.0)
            await loops.tick()
        assert len(applier.calls) == 1
        snaps.busy = 0.3
        clock.advance(1.0)
        await loops.tick()
        for _ in range(3):
            await asyncio.sleep(0)
        await loops.stop()

    asyncio.run(run())
    assert applier.calls == [("m", 4000), ("m", 4000)]
    assert loops.windows == {("a", "m"): 4000, ("b", "m"): 4000}
    assert loops.deferred == {}
    decisions = samples(telemetry, "triton_proxy_control_decisions_total")
    assert (
        decisions[
            (("direction", "up"), ("loop", "batching"), ("model", "m"), ("reason", "no_headroom"))
        ]
        == 1.0
    )


class FakeControl:
    """Stands in for Triton's model-control endpoints (real ones: tests/integration)."""

    def __init__(self) -> None:
        self.configs = {
            n: {"dynamic_batching": {"max_queue_delay_microseconds": 2000}} for n in ("a", "b")
        }
        self.loaded: list[str] = []

    async def config(self, instance: Instance, model: str) -> dict[str, object]:
        return self.configs[instance.name]

    async def load(self, instance: Instance, model: str, config: dict[str, object]) -> None:
        self.loaded.append(instance.name)
        self.configs[instance.name] = config

    async def wait_ready(self, instance: Instance, model: str, timeout_s: float) -> bool:
        return True


def test_applier_asks_before_draining_each_instance() -> None:
    clock = FakeClock(0.0)
    fleet = Fleet(
        (InstanceSpec("a", "http://127.0.0.1:1"), InstanceSpec("b", "http://127.0.0.1:2")),
        HealthConfig(),
        clock,
    )
    control = FakeControl()
    applier = WindowApplier(fleet, control)  # type: ignore[arg-type]
    asked: list[tuple[str, set[str]]] = []

    def can_drain(instance: Instance, model: str) -> Headroom:
        asked.append((instance.name, set(instance.draining)))
        if instance.name == "b":
            return Headroom(False, "busy", "1.2 instances busy > 0.8 x 1 other instance(s)")
        return Headroom(True, "ok", "")

    result = asyncio.run(
        applier.apply("m", 4000, drain_timeout_s=1.0, ready_timeout_s=1.0, can_drain=can_drain)
    )
    # Asked before the mark was set; a was changed, b was not drained.
    assert asked == [("a", set()), ("b", set())]
    assert control.loaded == ["a"]
    assert result.changed == ["a"]
    assert result.deferred is not None and result.deferred.reason == "busy"
    assert not fleet.get("b").draining


def test_a_flickering_wish_is_one_episode(caplog: pytest.LogCaptureFixture) -> None:
    """The lengthening is wanted, then not (Triton's queue time drops: batches fill), then
    again, all without room:
    one deferral counted and logged; the episode ends only after ``window_s`` unwanted."""
    applier = FakeApplier(window=2000)
    loops, _, telemetry, clock = make(LENGTHEN, applier)
    snaps = Loaded()
    snaps.busy = 0.9
    loops.snapshots = snaps

    async def tick(queue_us: float | None) -> None:
        snaps.queue_us = queue_us
        clock.advance(1.0)
        feed(loops, clock, 0.01)
        await loops.tick()

    async def run() -> None:
        with caplog.at_level(logging.INFO, logger="proxy.control"):
            await tick(None)  # wanted, deferred
            await tick(10.0)  # queue time << window: a longer window buys nothing
            await tick(None)  # wanted again: the same episode
            assert "m" in loops.deferred
            for _ in range(6):  # not wanted for window_s (5 s): the episode ends
                await tick(10.0)
        await loops.stop()

    asyncio.run(run())
    decisions = samples(telemetry, "triton_proxy_control_decisions_total")
    key = (("direction", "up"), ("loop", "batching"), ("model", "m"), ("reason", "no_headroom"))
    assert decisions[key] == 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert sum("deferred: no_headroom" in x for x in lines) == 1, lines
    assert loops.deferred == {}
    assert any("change not wanted for 5 s" in x for x in lines), lines
