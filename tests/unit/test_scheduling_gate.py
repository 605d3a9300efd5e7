"""The asyncio gate: waiting, order, shedding, cancellation, release exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from proxy.clock import Clock, FakeClock, MonotonicClock
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.gate import Gate, RecordingObserver, Shed, Ticket
from proxy.scheduling.models import ModelGates
from proxy.scheduling.queues import FLOOR_AIM, ShedReason

CLASSES = {
    "rt": {"rank": 0, "queue_timeout_s": 1.0},
    "on": {"rank": 1, "queue_timeout_s": 5.0},
    "off": {"rank": 2, "queue_timeout_s": 10.0},
}


class Harness:
    def __init__(self, capacity: int = 1, clock: Clock | None = None, **section: Any) -> None:
        section.setdefault("classes", CLASSES)
        section.setdefault("default_class", "on")
        section.setdefault("retry_after_s", 2.5)
        self.capacity = capacity
        self.clock = FakeClock()
        self.observer = RecordingObserver()
        self.gate = Gate(
            load_scheduling(section), lambda: self.capacity, clock or self.clock, self.observer
        )
        self.tasks: list[asyncio.Task[Any]] = []

    def start(self, cls: str, hold: asyncio.Event | None = None) -> asyncio.Task[Ticket]:
        """A request that waits for admission, then holds its slot until ``hold`` is set."""

        async def run() -> Ticket:
            async with self.gate.admit(cls) as ticket:
                if hold is not None:
                    await hold.wait()
                return ticket

        task = asyncio.create_task(run())
        self.tasks.append(task)
        return task


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness()
    yield harness
    harness.gate.close()
    for task in harness.tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*harness.tasks, return_exceptions=True)
    assert harness.gate.in_flight() == 0, "a slot leaked"
    assert harness.gate.queued() == 0


async def test_free_capacity_admits_at_once_and_releases_on_exit(h: Harness) -> None:
    async with h.gate.admit("rt") as ticket:
        assert ticket.class_name == "rt" and ticket.waited_s == 0.0 and ticket.order == 0
        assert h.gate.in_flight("rt") == 1
    assert h.gate.in_flight() == 0
    assert ticket.released
    assert h.observer.completes == ["rt"]


async def test_waiters_dispatch_in_class_order(h: Harness) -> None:
    hold = asyncio.Event()
    first = h.start("off", hold)
    await settle()
    waiting = [h.start(c) for c in ("off", "on", "rt", "on")]
    await settle()
    assert h.gate.queued() == 4
    h.clock.advance(0.5)
    hold.set()
    await asyncio.gather(first, *waiting)
    assert h.observer.order() == ["off", "rt", "on", "on", "off"]
    assert [d.order for d in h.observer.dispatches] == [0, 1, 2, 3, 4]
    assert h.observer.dispatches[1].waited_s == pytest.approx(0.5)
    assert h.observer.completes.count("off") == 2


async def test_cancelled_waiter_leaves_the_queue_at_once(h: Harness) -> None:
    hold = asyncio.Event()
    holder = h.start("on", hold)
    await settle()
    waiter = h.start("rt")
    await settle()
    assert h.gate.queued("rt") == 1
    waiter.cancel()
    await settle()
    assert waiter.cancelled()
    assert h.gate.queued() == 0
    assert h.observer.cancels == ["rt"]
    hold.set()
    await holder
    assert h.observer.order() == ["on"]  # the cancelled one was never dispatched
    assert h.gate.in_flight() == 0


async def test_cancelled_in_the_same_tick_as_its_dispatch_gives_the_slot_back(h: Harness) -> None:
    admission = h.gate.admit("on")
    held = await admission.__aenter__()
    waiter = h.start("rt")
    await settle()
    held.release()  # dispatches the waiter, which has not run yet...
    waiter.cancel()  # ...and is cancelled before it can
    await admission.__aexit__(None, None, None)
    await settle()
    assert waiter.cancelled()
    assert h.observer.order() == ["on", "rt"]
    assert h.gate.in_flight() == 0
    assert h.observer.completes == ["on", "rt"]


async def test_waiter_cancelled_before_its_handler_ran_is_skipped(h: Harness) -> None:
    admission = h.gate.admit("on")
    held = await admission.__aenter__()
    first = h.start("rt")
    second = h.start("on")
    await settle()
    first.cancel()  # its future is cancelled now; its except-handler runs later
    held.release()  # the pump pops the cancelled one, gives its slot back, takes the next
    await admission.__aexit__(None, None, None)
    assert (await second).class_name == "on"
    await settle()
    assert first.cancelled()
    assert h.observer.order() == ["on", "on"]
    assert h.observer.cancels == ["rt"]


async def test_release_exactly_once_on_error_and_explicit_release(h: Harness) -> None:
    h.capacity = 2
    with pytest.raises(KeyError):
        async with h.gate.admit("rt"):
            raise KeyError("boom")
    assert h.gate.in_flight() == 0
    async with h.gate.admit("rt") as ticket:
        ticket.release()
        ticket.release()
        assert h.gate.in_flight() == 0
    assert h.gate.in_flight() == 0
    assert h.observer.completes == ["rt", "rt"]


async def test_full_queue_sheds_with_retry_after() -> None:
    h = Harness(capacity=0, classes={"a": {"rank": 0, "max_queue": 1}}, default_class="a")
    waiter = h.start("a")
    await settle()
    with pytest.raises(Shed) as info:
        async with h.gate.admit("a"):
            pass
    assert info.value.reason is ShedReason.QUEUE_FULL
    assert info.value.retry_after_s == 2.5
    assert info.value.class_name == "a"
    assert h.observer.sheds == [("a", ShedReason.QUEUE_FULL)]
    h.gate.close()
    with pytest.raises(Shed) as closed:
        await waiter
    assert closed.value.reason is ShedReason.SHUTDOWN


async def test_queue_timeout_sheds_the_waiter(h: Harness) -> None:
    hold = asyncio.Event()
    holder = h.start("off", hold)
    await settle()
    rt = h.start("rt")
    on = h.start("on")
    await settle()
    h.clock.advance(1.0)
    h.gate.poke()
    await settle()
    with pytest.raises(Shed) as info:
        await rt
    assert info.value.reason is ShedReason.TIMEOUT
    assert not on.done()
    hold.set()
    await holder
    assert (await on).class_name == "on"
    assert h.observer.sheds == [("rt", ShedReason.TIMEOUT)]


async def test_timer_expires_waiters_without_a_poke() -> None:
    h = Harness(
        capacity=0,
        clock=MonotonicClock(),
        classes={"a": {"rank": 0, "queue_timeout_s": 0.02}},
        default_class="a",
    )
    with pytest.raises(Shed) as info:
        await asyncio.wait_for(h.start("a"), timeout=5)
    assert info.value.reason is ShedReason.TIMEOUT
    h.gate.close()


async def test_overload_evicts_a_waiting_lower_class() -> None:
    h = Harness(capacity=0, max_queued_total=2)
    off = h.start("off")
    on = h.start("on")
    await settle()
    rt = h.start("rt")
    await settle()
    with pytest.raises(Shed) as info:
        await off
    assert info.value.reason is ShedReason.OVERLOAD and info.value.class_name == "off"
    h.capacity = 5
    h.gate.poke()
    assert (await rt).class_name == "rt"
    assert (await on).class_name == "on"
    h.gate.close()


async def test_capacity_growth_is_picked_up_by_poke(h: Harness) -> None:
    h.capacity = 0
    waiters = [h.start("on") for _ in range(3)]
    await settle()
    assert h.gate.queued() == 3
    h.capacity = 2
    h.gate.poke()
    await settle()
    assert sum(w.done() for w in waiters) == 3  # two dispatched, then their releases the third
    assert h.observer.order() == ["on", "on", "on"]


async def test_unknown_class_counts_as_default(h: Harness) -> None:
    async with h.gate.admit("gone") as ticket:
        assert ticket.class_name == "on"


async def test_reconfigure_keeps_waiters(h: Harness) -> None:
    hold = asyncio.Event()
    holder = h.start("off", hold)
    await settle()
    waiter = h.start("rt")
    await settle()
    h.gate.reconfigure(load_scheduling({"classes": {"on": {"rank": 0}}, "default_class": "on"}))
    hold.set()
    await holder
    assert (await waiter).class_name == "on"
    assert h.gate.in_flight() == 0


async def test_a_ticket_carries_the_depth_its_slot_was_given_under() -> None:
    # Placement caps the class per instance at the depth the gate's limit had for this slot:
    # shallow (1) while the queue moves, full (3) for a request that waited deepen_after_s.
    classes = {
        "rt": {"rank": 0},
        "off": {
            "rank": 1,
            "max_per_instance": 3,
            "shallow_per_instance": 1,
            "deepen_after_s": 1.0,
        },
    }
    h = Harness(capacity=10, classes=classes, default_class="off")
    hold = asyncio.Event()
    first = h.start("off", hold)
    await settle()
    later = [h.start("off", hold) for _ in range(2)]
    await settle()
    assert h.gate.in_flight("off") == 1 and h.gate.queued("off") == 2  # shallow: 1 x 1
    h.clock.advance(1.0)
    h.gate.poke()
    await settle()
    assert h.gate.in_flight("off") == 3  # the head waited 1 s: full depth
    hold.set()
    tickets = await asyncio.gather(first, *later)
    assert [t.depth for t in tickets] == [1, 3, 3]
    async with h.gate.admit("rt") as ticket:
        assert ticket.depth is None  # no per-instance cap
    h.gate.close()


async def test_admission_with_a_free_slot_does_not_yield_to_the_loop(h: Harness) -> None:
    """A cancellation asked for before admission is delivered at the first suspension inside
    the block, and the slot is still released once."""
    entered = []

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        async with h.gate.admit("rt") as ticket:
            entered.append(ticket.order)
            await asyncio.sleep(0)
        entered.append("not reached")

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(run())
    assert entered == [0]
    assert h.gate.in_flight() == 0 and h.observer.completes == ["rt"]


async def test_a_model_is_saturated_once_a_batch_per_instance_is_in_flight_or_one_waits() -> None:
    # proxy.routing.occupancy reads it: the fleet is at its limit now.
    clock = FakeClock()
    fleet = Fleet(
        (InstanceSpec("a", "http://127.0.0.1:1"), InstanceSpec("b", "http://127.0.0.1:2")),
        HealthConfig(),
        clock,
    )
    section = {
        "default_class": "on",
        "concurrency": 8,
        "classes": {"on": {"rank": 0}, "off": {"rank": 1, "max_per_instance": 1}},
    }
    gates = ModelGates(load_scheduling(section), fleet, clock, RecordingObserver())
    info = ModelInfo(max_batch_size=4, priority_levels=0, model_instances=1, decoupled=False)
    hold = asyncio.Event()

    async def request(cls: str, g: ModelGates = gates, info: ModelInfo = info) -> None:
        async with g.admit("m", info, cls):
            await hold.wait()

    tasks = [asyncio.create_task(request("on")) for _ in range(7)]
    await settle()
    assert gates.saturated() == set()  # 7 in flight: less than a batch of 4 on each of 2
    tasks.append(asyncio.create_task(request("on")))
    await settle()
    assert gates.saturated() == {"m"}
    hold.set()
    await asyncio.gather(*tasks)
    hold.clear()
    # Slots of 2 x 1: the third request of a capped class waits for its own cap (no); one of
    # an uncapped class waits for the fleet (yes).
    small = ModelGates(
        load_scheduling({**section, "concurrency": 1}), fleet, clock, RecordingObserver()
    )
    big = ModelInfo(max_batch_size=16, priority_levels=0, model_instances=1, decoupled=False)
    tasks = [asyncio.create_task(request("off", small, big)) for _ in range(3)]
    await settle()
    assert small.gates["m"].queued() == 1 and small.saturated() == set()
    tasks.append(asyncio.create_task(request("on", small, big)))
    await settle()
    assert small.saturated() == {"m"}
    hold.set()
    await asyncio.gather(*tasks)
    small.close()
    gates.close()


def _hi_lo_gates() -> tuple[FakeClock, ModelGates, RecordingObserver, ModelInfo]:
    """One instance, 4 slots; lo (min_share 0.5) below hi, boosted once it owes 2 s."""
    clock = FakeClock()
    fleet = Fleet((InstanceSpec("a", "http://127.0.0.1:1"),), HealthConfig(), clock)
    section = {
        "default_class": "lo",
        "concurrency": 4,
        "starved_after_s": 2.0,
        "classes": {
            "hi": {"rank": 0, "triton_priority": 1},
            "lo": {"rank": 1, "triton_priority": 2, "min_share": 0.5},
        },
    }
    observer = RecordingObserver()
    gates = ModelGates(load_scheduling(section), fleet, clock, observer)
    info = ModelInfo(max_batch_size=4, priority_levels=2, model_instances=1, decoupled=False)
    return clock, gates, observer, info


async def test_a_starved_class_is_admitted_at_the_top_classes_triton_priority() -> None:
    # The floor boost (SchedulingConfig.starved_after_s): lo's two requests in flight answer
    # nothing while hi holds the other slots and both classes queue; once lo owes 2 s of its
    # share (0.5 x 1 instance), its next two (its reservation, floor(0.5 x 4): the device
    # time of its answers is not known yet) go at hi's Triton priority, beyond the slots.
    clock, gates, observer, info = _hi_lo_gates()
    hold = asyncio.Event()
    given: list[tuple[str, int | None]] = []

    async def request(cls: str) -> None:
        async with gates.admit("m", info, cls) as priority:
            given.append((cls, priority))
            await hold.wait()

    tasks = [asyncio.create_task(request(c)) for c in ("lo", "lo", "hi", "hi", "hi", "lo", "lo")]
    await settle()
    gate = gates.gates["m"]
    assert given == [("lo", 2), ("lo", 2), ("hi", 1), ("hi", 1)] and gate.queued() == 3
    clock.advance(1.9)
    gates.poke()
    await settle()
    assert gate.queued() == 3 and observer.boosts == []
    clock.advance(0.1)
    gates.poke()
    await settle()
    assert given[4:] == [("lo", 1), ("lo", 1)] and observer.boosts == ["lo", "lo"]
    assert gate.in_flight() == 6 and gate.queued() == 1  # hi's third waits for a slot
    hold.set()
    await asyncio.gather(*tasks)
    assert gate.in_flight() == 0 and given[-1] == ("hi", 1)
    gates.close()


async def test_a_boosted_answer_pays_its_device_time_off_the_class_debt() -> None:
    # As above, lo owes a x 1.0 s of device at t = 2 (a = FLOOR_AIM) and two go boosted.
    # Answered at 2.5 having taken a x 0.5 s each (ModelAdmission.served), they leave
    # a x (1.0 + 0.25 - 1.0) = a x 0.25 owed: the next two (a x 1.0 / a x 0.5 each) go
    # boosted only once the debt is back at a x 1.0, at t = 4.
    clock, gates, observer, info = _hi_lo_gates()
    answer = {name: asyncio.Event() for name in ("a", "b", "c", "d", "e", "f", "g", "h")}
    given: list[tuple[str, int | None]] = []

    async def request(name: str, cls: str) -> None:
        admission = gates.admit("m", info, cls)
        async with admission as priority:
            given.append((name, priority))
            await answer[name].wait()
            admission.served(FLOOR_AIM * 0.5)

    classes = {"a": "lo", "b": "lo", "c": "hi", "d": "hi"} | dict.fromkeys("efgh", "lo")
    tasks = [asyncio.create_task(request(n, c)) for n, c in classes.items()]

    async def at(t: float) -> list[str]:
        clock.advance(t - clock.now())
        gates.poke()
        await settle()
        return [n for n, _ in given]

    assert await at(0.0) == ["a", "b", "c", "d"]
    assert await at(2.0) == ["a", "b", "c", "d", "e", "f"] and given[4:] == [("e", 1), ("f", 1)]
    answer["e"].set()
    answer["f"].set()
    assert len(await at(2.5)) == 6  # 0.25 s owed
    assert len(await at(3.9)) == 6
    assert await at(4.0) == ["a", "b", "c", "d", "e", "f", "g", "h"]
    assert given[6:] == [("g", 1), ("h", 1)] and observer.boosts == ["lo"] * 4
    for event in answer.values():
        event.set()
    await asyncio.gather(*tasks)
    gates.close()


async def test_an_admission_reads_its_class_backlog_when_it_leaves_the_queue() -> None:
    # Placement packs a capped class into its lane while the class's requests queue
    # (``pack_capped: backlogged``): it reads the backlog when the request leaves the gate.
    h = Harness(capacity=2)
    hold = asyncio.Event()
    other = h.start("on", hold)  # holds one of the two slots throughout
    first = h.gate.admit("off")
    await first.__aenter__()
    assert first.backlog == 0  # nothing behind it
    later = [h.gate.admit("off") for _ in range(3)]
    waiting = [asyncio.create_task(a.__aenter__()) for a in later]
    waiter = h.start("rt")
    await settle()
    assert first.backlog == 3  # another class's waiter does not count
    first.release()
    await waiter  # rt outranks off: it took the slot, and gave it back
    await waiting[0]
    assert later[0].backlog == 2
    for admission, task in zip(later, waiting, strict=True):
        await task
        admission.release()
    hold.set()
    await other


def test_top_class_answers_sent_beside_long_work_never_cut_adaptive_slots() -> None:
    """A real-time request sent while long work was in flight on its instance ran in, or
    behind, a padded batch: slots cannot shorten it, and cutting them pushes the long work
    onto the instances without it (session 30). Only answers sent without it count."""
    clock = FakeClock()
    fleet = Fleet((InstanceSpec("a", "http://127.0.0.1:1"),), HealthConfig(), clock)
    section = {
        "default_class": "rt",
        "adaptive_concurrency": {"enabled": True},
        "classes": {"rt": {"rank": 0, "slo_p99_ms": 100}, "off": {"rank": 1}},
    }
    gates = ModelGates(load_scheduling(section), fleet, clock, RecordingObserver())
    info = ModelInfo(max_batch_size=4, priority_levels=0, model_instances=1, decoupled=False)
    gates.gate("m", info)
    start = gates.slot_limit("a", "m")
    assert start == 16  # max_batches (4) x max_batch_size (4)

    def feed(beside_long: bool) -> list[str | None]:
        moves = []
        for _ in range(30):  # 300 ms inside against a 50 ms target, every slot in use
            clock.advance(0.1)
            moves.append(gates.observe_inside("a", "m", "rt", 0.3, 16, beside_long))
        return moves

    assert set(feed(beside_long=True)) <= {None, "up"}
    assert gates.slot_limit("a", "m") == start
    assert "down" in feed(beside_long=False)
    assert gates.slot_limit("a", "m") < start
    gates.close()


async def test_a_models_gate_derives_the_lane_of_a_throughput_class() -> None:
    # Offline has no SLO and no lane of its own: accel_sim-like max_batch_size 16 gives it 8
    # per instance over all but one instance, 2 while its queue moves (SchedulingConfig.
    # for_model); the tickets carry the depth placement caps each instance at.
    clock = FakeClock()
    specs = tuple(InstanceSpec(n, f"http://127.0.0.1:{k + 1}") for k, n in enumerate("abc"))
    fleet = Fleet(specs, HealthConfig(), clock)
    section = {
        "default_class": "off",
        "concurrency": 64,
        "classes": {"rt": {"rank": 0, "slo_p99_ms": 100}, "off": {"rank": 1}},
    }
    info = ModelInfo(max_batch_size=16, priority_levels=0, model_instances=1, decoupled=False)
    for lane, shallow, deep in ((True, 4, 16), (False, 40, 40)):
        gates = ModelGates(
            load_scheduling({**section, "throughput_lane": lane}), fleet, clock, RecordingObserver()
        )
        hold = asyncio.Event()
        depths: list[int | None] = []

        async def request(
            cls: str, g: ModelGates = gates, seen: list = depths, hold: asyncio.Event = hold
        ) -> None:
            admission = g.admit("m", info, cls)
            async with admission:
                seen.append(admission.depth)
                await hold.wait()

        tasks = [asyncio.create_task(request("rt"))]  # real-time active: the spare is kept
        await settle()
        tasks += [asyncio.create_task(request("off")) for _ in range(40)]
        await settle()
        assert gates.gates["m"].in_flight() - 1 == shallow
        clock.advance(1.0)  # offline's oldest has waited deepen_after_s: the lane deepens
        gates.poke()
        await settle()
        assert gates.gates["m"].in_flight() - 1 == deep
        assert set(depths[1:]) == ({2, 8} if lane else {None})
        hold.set()
        await asyncio.gather(*tasks)
        # A reload derives the lane again for every model's gate.
        assert gates.config_for("m").classes["off"].max_per_instance == (8 if lane else None)
        gates.reconfigure(load_scheduling({**section, "throughput_lane": not lane}))
        assert gates.config_for("m").classes["off"].max_per_instance == (None if lane else 8)
        gates.close()


def test_only_a_model_whose_routing_packs_long_work_gets_the_derived_lane() -> None:
    # ModelGates asks per model whether its routing gathers long work into a lane, when the
    # gate is made and on every reconfigure (a reload may change the model's policy).
    clock = FakeClock()
    fleet = Fleet((InstanceSpec("a", "http://127.0.0.1:1"),), HealthConfig(), clock)
    config = load_scheduling(
        {
            "default_class": "off",
            "classes": {"rt": {"rank": 0, "slo_p99_ms": 100}, "off": {"rank": 1}},
        }
    )
    packing = {"packs": True, "spreads": False}
    gates = ModelGates(config, fleet, clock, RecordingObserver(), packs_long=packing.__getitem__)
    info = ModelInfo(max_batch_size=16, priority_levels=0, model_instances=1, decoupled=False)
    for model in packing:
        gates.gate(model, info)

    def lanes() -> dict[str, int | None]:
        return {m: gates.config_for(m).classes["off"].max_per_instance for m in packing}

    assert lanes() == {"packs": 8, "spreads": None}
    packing["packs"], packing["spreads"] = False, True
    gates.reconfigure(config)
    assert lanes() == {"packs": None, "spreads": 8}
    gates.close()


def test_placement_counts_slots_by_rank_per_model_as_its_gate_resolves_the_default() -> None:
    # slot_sharing left null: placed_by_rank for a model with priority levels whose routing
    # packs long work, shared for one without levels or whose routing does not pack.
    clock = FakeClock()
    fleet = Fleet((InstanceSpec("a", "http://127.0.0.1:1"),), HealthConfig(), clock)
    section = {
        "default_class": "lo",
        "classes": {
            "hi": {"rank": 0, "triton_priority": 1},
            "lo": {"rank": 1, "triton_priority": 2},
        },
    }
    gates = ModelGates(
        load_scheduling(section),
        fleet,
        clock,
        RecordingObserver(),
        packs_long=lambda model: model != "spread",
    )
    levels = ModelInfo(max_batch_size=8, priority_levels=2, model_instances=1, decoupled=False)
    fifo = replace(levels, priority_levels=0)
    assert not gates.slots_by_level("m")  # no gate yet: the section as written
    for model, info in (("m", levels), ("fifo", fifo), ("spread", levels)):
        gates.gate(model, info)
    assert gates.config_for("m").slot_sharing == "placed_by_rank"
    assert [gates.slots_by_level(m) for m in ("m", "fifo", "spread")] == [True, False, False]
    gates.close()
    written = ModelGates(
        load_scheduling({**section, "slot_sharing": "by_rank"}), fleet, clock, RecordingObserver()
    )
    written.gate("fifo", fifo)
    assert written.slots_by_level("fifo")  # what the file says wins
    written.close()


def test_a_gates_floors_are_owed_its_workers_and_arms_part_of_the_fleet() -> None:
    # serve --workers 2 with a canary arm taking a quarter: the main arm's floors are owed
    # 3/4 of 1/2 of each class's share, set on gates made before the split and after it.
    clock = FakeClock()
    fleet = Fleet((InstanceSpec("a", "http://127.0.0.1:1"),), HealthConfig(), clock)
    section = {"default_class": "lo", "classes": {"hi": {"rank": 0}, "lo": {"rank": 1}}}
    gates = ModelGates(load_scheduling(section), fleet, clock, RecordingObserver(), workers=2)
    info = ModelInfo(max_batch_size=4, priority_levels=2, model_instances=1, decoupled=False)
    before = gates.gate("m", info)
    assert before._core.fleet_part == 0.5
    gates.share = 0.75
    after = gates.gate("n", info)
    assert before._core.fleet_part == after._core.fleet_part == 0.375
    gates.close()
