"""Deadline admission: latency classes are shed instead of served after their SLO."""

from __future__ import annotations

import asyncio

import pytest

from proxy.clock import FakeClock
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.gate import Gate, RecordingObserver, Shed
from proxy.scheduling.lateness import LatenessPredictor
from proxy.scheduling.queues import ShedReason
from proxy.strict import ConfigError


def test_no_prediction_until_the_gate_has_dispatched_enough() -> None:
    p = LatenessPredictor(window_s=1.0, min_dispatches=5)
    for i in range(4):
        p.on_dispatch(i * 0.1)
    assert p.predicted_s(100, "rt", 0.5) is None
    p.on_dispatch(0.5)
    p.observe_inside("rt", 0.05, 0.0)
    assert p.predicted_s(10, "rt", 0.5) == pytest.approx(10 / 5 + 0.05)
    assert p.rate(5.0) is None  # the window emptied: idle gate, no prediction


def make_gate(
    clock: FakeClock, capacity: int, shed_late: bool = True, late_by: str = "mean"
) -> tuple[Gate, RecordingObserver]:
    config = load_scheduling(
        {
            "classes": {
                "rt": {"rank": 0, "slo_p99_ms": 100, "queue_timeout_s": None},
                "off": {"rank": 1, "queue_timeout_s": None},
            },
            "default_class": "rt",
            "shed_late": shed_late,
            "late_by": late_by,
        }
    )
    observer = RecordingObserver()
    lateness = LatenessPredictor(window_s=1.0, min_dispatches=10)
    return Gate(config, lambda: capacity, clock, observer, lateness=lateness), observer


async def hold_the_slot(gate: Gate) -> tuple[asyncio.Task[None], asyncio.Event]:
    """An rt request holding the gate's only slot until the event is set."""
    release = asyncio.Event()

    async def hold() -> None:
        async with gate.admit("rt"):
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    return holder, release


async def test_a_latency_class_is_shed_when_predicted_late_a_throughput_class_never() -> None:
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=1)
    assert gate.lateness is not None
    # Ten dispatches in the last second: the gate serves about 10 requests per second.
    for i in range(10):
        gate.lateness.on_dispatch(i * 0.1)
    gate.lateness.observe_inside("rt", 0.02, 0.0)
    clock.t = 0.95
    hold = asyncio.Event()

    async def occupy(cls: str) -> None:
        async with gate.admit(cls):
            await hold.wait()

    tasks = [asyncio.create_task(occupy("rt"))]  # takes the only slot
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(occupy("rt")))  # queued, nothing ahead: 0.02 s predicted
    await asyncio.sleep(0)
    with pytest.raises(Shed) as info:  # one queued ahead: 1/10 s + 0.02 s > 100 ms
        async with gate.admit("rt"):
            pass
    assert info.value.reason is ShedReason.LATE
    # The throughput class waits, however long the queue.
    tasks.append(asyncio.create_task(occupy("off")))
    await asyncio.sleep(0)
    assert gate.queued("off") == 1
    hold.set()
    gate.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert ("rt", ShedReason.LATE) in observer.sheds


def test_a_model_slower_than_the_slo_is_not_a_reason_to_shed() -> None:
    p = LatenessPredictor(window_s=1.0, min_dispatches=1)
    p.on_dispatch(0.0)
    p.observe_inside("rt", 0.5, 0.0)  # every answer takes 500 ms: an SLO of 100 ms is unreachable
    assert not p.shed_at_arrival(100, "rt", 0.1, 0.5)
    assert not p.late(10.0, "rt", 0.1, hard=False, now=0.0)
    assert not p.late(10.0, "rt", 0.1, hard=True, now=0.0)
    p.observe_inside("fast", 0.01, 0.0)
    assert p.late(0.2, "fast", 0.1, hard=False, now=0.0)


async def _queue_one_ahead(gate: Gate, hold: asyncio.Event) -> list[asyncio.Task[None]]:
    """The only slot taken and one ``rt`` request queued: 1/10 s of waiting predicted."""

    async def occupy() -> None:
        async with gate.admit("rt"):
            await hold.wait()

    tasks = [asyncio.create_task(occupy()), asyncio.create_task(occupy())]
    await asyncio.sleep(0)
    return tasks


def _busy(gate: Gate, clock: FakeClock, inside_s: float = 0.02) -> None:
    """Ten dispatches in the last second (10 req/s); ``inside_s`` in Triton for every class."""
    assert gate.lateness is not None
    for i in range(10):
        gate.lateness.on_dispatch(i * 0.1)
    clock.t = 0.95
    gate.lateness.observe_inside("rt", inside_s, clock.t)
    gate.lateness.observe_inside("off", inside_s, clock.t)


@pytest.mark.timeout(10)
async def test_a_client_deadline_is_the_budget_of_a_class_without_an_slo() -> None:
    """One deadline per request: a throughput class is never shed for a latency target, but
    a request that says when its client stops waiting is shed when predicted past that."""
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=1)
    _busy(gate, clock)
    hold = asyncio.Event()
    tasks = await _queue_one_ahead(gate, hold)
    with pytest.raises(Shed) as info:  # 1/10 s + 20 ms predicted > 50 ms left
        async with gate.admit("off", deadline=clock.now() + 0.05):
            pass
    assert info.value.reason is ShedReason.LATE
    waiting = asyncio.create_task(gate.admit("off", deadline=clock.now() + 5.0).__aenter__())
    await asyncio.sleep(0)
    assert gate.queued("off") == 1  # 5 s is time enough: it waits
    hold.set()
    gate.close()
    await asyncio.gather(*tasks, waiting, return_exceptions=True)
    assert observer.sheds.count(("off", ShedReason.LATE)) == 1


@pytest.mark.timeout(10)
async def test_the_earlier_of_client_deadline_and_class_slo_binds() -> None:
    clock = FakeClock()
    gate, _ = make_gate(clock, capacity=1)
    _busy(gate, clock, inside_s=0.001)
    hold = asyncio.Event()
    tasks = await _queue_one_ahead(gate, hold)
    # One queued ahead: 1/11 s + 1 ms = 92 ms predicted. Within the 100 ms SLO, past a 50 ms
    # client deadline.
    with pytest.raises(Shed):
        async with gate.admit("rt", deadline=clock.now() + 0.05):
            pass
    waiting = asyncio.create_task(gate.admit("rt", deadline=clock.now() + 0.095).__aenter__())
    await asyncio.sleep(0)
    assert gate.queued("rt") == 2  # 95 ms is enough
    # A client deadline later than the SLO does not lengthen the class's budget.
    with pytest.raises(Shed):  # two ahead now: 2/11 s + 1 ms > 100 ms
        async with gate.admit("rt", deadline=clock.now() + 60.0):
            pass
    hold.set()
    gate.close()
    await asyncio.gather(*tasks, waiting, return_exceptions=True)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("klass", "client_deadline_s"),
    [("rt", None), ("off", 0.1)],
    ids=["class SLO", "client deadline"],
)
async def test_a_request_that_waited_past_its_budget_is_not_dispatched(
    klass: str, client_deadline_s: float | None
) -> None:
    """100 ms of budget either way: rt's SLO, or the client deadline of a class without one."""
    clock = FakeClock()
    gate, _ = make_gate(clock, capacity=1)
    assert gate.lateness is not None
    gate.lateness.observe_inside(klass, 0.03, 0.0)
    holder, release = await hold_the_slot(gate)
    deadline = None if client_deadline_s is None else clock.now() + client_deadline_s
    late = asyncio.create_task(gate.admit(klass, deadline=deadline).__aenter__())
    free = asyncio.create_task(gate.admit("off").__aenter__())  # no budget: never late
    await asyncio.sleep(0)
    clock.advance(0.08)  # 80 ms waited + 30 ms inside > its 100 ms
    release.set()
    await holder
    with pytest.raises(Shed) as info:
        await late
    assert info.value.reason is ShedReason.LATE
    ticket = await free  # the late one's slot went to the next
    assert ticket.class_name == "off"
    ticket.release()
    assert gate.in_flight() == 0
    gate.close()


@pytest.mark.timeout(10)
async def test_without_shed_late_only_a_client_deadline_is_held_at_the_head() -> None:
    """Deadline admission off: nothing is shed at arrival and a class SLO is only a target,
    but a request whose client will be gone before its answer is not sent (abandoned work)."""
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=1, shed_late=False)
    _busy(gate, clock, inside_s=0.03)
    holder, release = await hold_the_slot(gate)
    # Queued, not shed at arrival, whatever is predicted.
    doomed = asyncio.create_task(gate.admit("rt", deadline=clock.now() + 0.1).__aenter__())
    slow = asyncio.create_task(gate.admit("rt").__aenter__())  # only its class SLO: 100 ms
    await asyncio.sleep(0)
    assert gate.queued("rt") == 2 and not observer.sheds
    clock.advance(0.08)  # both waited 80 ms; with 30 ms inside, both would be answered late
    release.set()
    await holder
    with pytest.raises(Shed) as info:
        await doomed
    assert info.value.reason is ShedReason.LATE
    ticket = await slow  # served late: a class SLO is not a client that leaves
    ticket.release()
    assert observer.sheds == [("rt", ShedReason.LATE)]
    gate.close()


def test_late_allows_for_a_slow_answer_when_times_inside_vary() -> None:
    steady, noisy = LatenessPredictor(), LatenessPredictor()
    for i in range(200):
        steady.observe_inside("rt", 0.05, 0.0)
        noisy.observe_inside("rt", 0.02 if i % 2 else 0.08, 0.0)
    assert steady.inside("rt") == pytest.approx(0.05)
    assert noisy.inside("rt") == pytest.approx(0.05, abs=0.004)
    # 60 ms left of a 100 ms client deadline: time for a steady 50 ms answer, not for a
    # noisy one, whose client would likely be gone.
    assert not steady.late(0.04, "rt", 0.1, hard=True, now=0.0)
    assert noisy.late(0.04, "rt", 0.1, hard=True, now=0.0)
    # Of a class SLO, the same wait leaves time for the mean answer: it is served.
    assert not noisy.late(0.04, "rt", 0.1, hard=False, now=0.0)
    assert noisy.late(0.06, "rt", 0.1, hard=False, now=0.0)


def test_late_by_tail_holds_a_class_slo_to_the_slow_answer_once_a_request_waited() -> None:
    noisy = LatenessPredictor(window_s=2.0)
    for i in range(200):
        noisy.observe_inside("rt", 0.02 if i % 2 else 0.08, 0.0)
    # scheduling.late_by: tail: the wait plus a slow answer (mean + 2 deviations) must fit
    assert noisy.late(0.04, "rt", 0.1, hard=False, now=1.0, tail=True)
    assert not noisy.late(0.04, "rt", 0.1, hard=False, now=1.0)
    # never a request that has not waited: the class is always answered
    assert not noisy.late(0.0, "rt", 0.06, hard=False, now=1.0, tail=True)
    assert noisy.late(0.0, "rt", 0.06, hard=True, now=1.0)
    # a stale estimate (no answer for more than window_s) falls back to the mean
    assert not noisy.late(0.04, "rt", 0.1, hard=False, now=3.0, tail=True)


def test_late_by_is_mean_unless_the_file_says_tail() -> None:
    doc = {"classes": {"rt": {"rank": 0, "slo_p99_ms": 100}}, "default_class": "rt"}
    assert load_scheduling(doc).late_by == "mean"
    assert load_scheduling({**doc, "late_by": "tail"}).late_by == "tail"
    with pytest.raises(ConfigError):
        load_scheduling({**doc, "late_by": "p99"})


async def test_a_request_that_has_not_waited_is_never_late_for_its_class_slo() -> None:
    """Only waiting is blamed: with a free slot, a class whose slow answers pass its SLO while
    its mean fits is served, not shed (the rule before session 30 shed 88 % of real-time so)."""
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=4)
    assert gate.lateness is not None
    for i in range(200):  # mean 60 ms inside, mean deviation 40 ms: slow = 140 ms > 100
        gate.lateness.observe_inside("rt", 0.02 if i % 2 else 0.1, 0.0)
    async with gate.admit("rt") as ticket:
        assert ticket.waited_s == 0.0
    assert not observer.sheds
    # The same class with a 100 ms client deadline: that client would likely be gone.
    with pytest.raises(Shed) as info:
        await gate.admit("rt", deadline=clock.now() + 0.1).__aenter__()
    assert info.value.reason is ShedReason.LATE
    gate.close()


async def test_a_request_too_late_even_unqueued_is_shed_with_a_free_slot() -> None:
    """Nothing queued and a free slot (the gate's fast path): a client deadline shorter than a
    slow answer still sheds it, gives the slot back and spends no dispatch order."""
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=1, shed_late=False)
    # No SLO, so only the client deadline binds; mean 100 ms inside, slow 200 ms (2 x 50 ms).
    gate.lateness.observe_inside("off", 0.1, 0.0)
    with pytest.raises(Shed) as info:
        await gate.admit("off", deadline=clock.now() + 0.15).__aenter__()
    assert info.value.reason is ShedReason.LATE and info.value.retry_after_s == 1.0
    assert observer.sheds == [("off", ShedReason.LATE)] and not observer.dispatches
    assert gate.in_flight() == 0 and gate.queued() == 0
    async with gate.admit("off", deadline=clock.now() + 0.25) as ticket:
        assert ticket.order == 0 and ticket.waited_s == 0.0
    assert [d.class_name for d in observer.dispatches] == ["off"]
    gate.close()


async def test_a_stale_estimate_lets_one_request_through_to_refresh_it() -> None:
    """Every request of a class shed by the slow-answer rule leaves its estimate as it was:
    once the class's last answer is older than the window, the mean alone decides and the
    next request is sent (one per window), so a moment of slowness does not shed it for good."""
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=1, shed_late=False)
    gate.lateness.observe_inside("off", 0.1, clock.now())  # slow answer 200 ms, mean 100 ms
    with pytest.raises(Shed):
        await gate.admit("off", deadline=clock.now() + 0.15).__aenter__()
    clock.advance(0.9)
    with pytest.raises(Shed):  # still fresh (window 1 s)
        await gate.admit("off", deadline=clock.now() + 0.15).__aenter__()
    clock.advance(0.2)
    async with gate.admit("off", deadline=clock.now() + 0.15) as ticket:  # stale: the mean fits
        assert ticket.waited_s == 0.0
    gate.lateness.observe_inside("off", 0.1, clock.now())  # its answer refreshes the estimate
    with pytest.raises(Shed):
        await gate.admit("off", deadline=clock.now() + 0.15).__aenter__()
    assert observer.sheds == [("off", ShedReason.LATE)] * 3
    gate.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("late_by", "shed"), [("mean", False), ("tail", True)])
async def test_late_by_decides_what_a_waiting_request_is_held_to(late_by: str, shed: bool) -> None:
    """40 ms waited of rt's 100 ms SLO, answers of 20 or 80 ms (mean 50): the mean answer
    still fits, a slow one does not."""
    clock = FakeClock()
    gate, _ = make_gate(clock, capacity=1, late_by=late_by)
    assert gate.lateness is not None
    for i in range(200):
        gate.lateness.observe_inside("rt", 0.02 if i % 2 else 0.08, 0.0)
    holder, release = await hold_the_slot(gate)
    waiting = asyncio.create_task(gate.admit("rt").__aenter__())
    await asyncio.sleep(0)
    clock.advance(0.04)
    release.set()
    await holder
    if shed:
        with pytest.raises(Shed) as info:
            await waiting
        assert info.value.reason is ShedReason.LATE
    else:
        (await waiting).release()
    assert gate.in_flight() == 0
    gate.close()


def test_the_queue_drains_at_the_slots_rate_not_at_a_quiet_gates_dispatch_rate() -> None:
    # Ten dispatches in the last second on a gate of 3 slots: 10/s is what arrived, not what
    # the slots serve. Slots held 1 ms serve 3,000/s; slots held 300 ms (a saturated gate)
    # serve 10/s, and the dispatch rate stands.
    p = LatenessPredictor(window_s=1.0, min_dispatches=10)
    for i in range(10):
        p.on_dispatch(i * 0.1)
    p.observe_inside("rt", 0.001, 0.0)
    assert p.drain_rate(0.95, capacity=3) == pytest.approx(10.0)  # no hold seen yet
    p.on_release(0.001)
    assert p.drain_rate(0.95, capacity=3) == pytest.approx(3000.0)
    assert not p.shed_at_arrival(11, "rt", 0.5, 0.95, capacity=3)  # 11 / 3000 s + 1 ms
    assert p.shed_at_arrival(11, "rt", 0.5, 0.95, capacity=0)  # unknown slots: 11 / 10 s
    slow = LatenessPredictor(window_s=1.0, min_dispatches=10)
    for i in range(10):
        slow.on_dispatch(i * 0.1)
    slow.on_release(0.3)
    assert slow.drain_rate(0.95, capacity=3) == pytest.approx(10.0)


async def test_a_burst_after_a_quiet_spell_is_not_shed_on_a_fast_model() -> None:
    # What CI found (session 35): twelve requests at once over three slots of a 1 ms model,
    # after a quiet second of ten requests, shed as late against the class's SLO. Each waits
    # for at most three slot turns of 1 ms.
    clock = FakeClock()
    gate, observer = make_gate(clock, capacity=3)
    for _ in range(10):
        async with gate.admit("rt"):
            clock.advance(0.001)
        gate.lateness.observe_inside("rt", 0.001, clock.now())
        clock.advance(0.099)
    hold = asyncio.Event()

    async def one() -> None:
        async with gate.admit("rt"):
            await hold.wait()

    tasks = [asyncio.create_task(one()) for _ in range(12)]
    await asyncio.sleep(0)
    assert gate.queued("rt") == 9
    hold.set()
    await asyncio.gather(*tasks)
    assert observer.sheds == []
    gate.close()
