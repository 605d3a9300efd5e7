"""The pure scheduling core: order, aging bound, WRR ratios, quotas, caps, TTL, shedding."""

from __future__ import annotations

import copy
import math
import random
from collections import Counter
from typing import Any

import pytest

from proxy.scheduling.config import load_scheduling
from proxy.scheduling.queues import FLOOR_AIM, ClassQueues, Entry, ShedReason


def make(classes: dict[str, dict[str, Any]], **section: Any) -> ClassQueues[str]:
    section.setdefault("default_class", next(iter(classes)))
    return ClassQueues(load_scheduling({"classes": classes, **section}))


def drain(q: ClassQueues[str], now: float, capacity: int, instances: int = 1) -> list[str]:
    """Pop until nothing may be dispatched; slots stay taken."""
    out = []
    while (e := q.pop(now, capacity, instances)) is not None:
        out.append(e.item)
    return out


THREE = {
    "rt": {"rank": 0, "queue_timeout_s": None},
    "on": {"rank": 1, "queue_timeout_s": None},
    "off": {"rank": 2, "queue_timeout_s": None},
}


@pytest.mark.parametrize(
    ("arrivals", "expected"),
    [
        ([("off", "o1"), ("on", "n1"), ("rt", "r1")], ["r1", "n1", "o1"]),
        (
            [("on", "n1"), ("rt", "r1"), ("on", "n2"), ("rt", "r2"), ("off", "o1")],
            ["r1", "r2", "n1", "n2", "o1"],
        ),
        ([("off", "o1"), ("off", "o2"), ("off", "o3")], ["o1", "o2", "o3"]),
    ],
)
def test_strict_order_by_rank_then_fifo(
    arrivals: list[tuple[str, str]], expected: list[str]
) -> None:
    q = make(THREE, aging={"step_s": 100.0})
    for i, (cls, item) in enumerate(arrivals):
        q.push(item, cls, now=i * 0.001)
    assert drain(q, now=0.01, capacity=100) == expected
    assert q.queued() == 0
    assert q.in_flight() == len(expected)


def test_aging_lifts_one_level_per_step() -> None:
    q = make(THREE, aging={"step_s": 1.0})
    q.push("o1", "off", now=0.0)
    q.push("n1", "on", now=1.5)
    # At 1.5 the offline request has gained one level (rank 1), ties with online, and is older.
    q.push("r1", "rt", now=1.5)
    assert drain(q, now=1.5, capacity=1) == ["r1"]
    q.release("rt")
    assert drain(q, now=1.5, capacity=1) == ["o1"]


@pytest.mark.parametrize("waited_s", [0.5, 3.0, 1e6])
def test_aging_never_lifts_a_lower_class_above_the_top_class(waited_s: float) -> None:
    q = make(THREE, aging={"step_s": 1.0})
    q.push("o1", "off", now=0.0)
    q.push("r1", "rt", now=waited_s)
    assert drain(q, now=waited_s, capacity=1) == ["r1"]


@pytest.mark.parametrize(("min_share", "capacity"), [(0.1, 10), (0.25, 8), (0.3, 3), (0.5, 4)])
def test_min_share_keeps_the_lowest_class_served_under_a_saturating_top_class(
    min_share: float, capacity: int
) -> None:
    """Two top-class arrivals per completion keep its queue full for ever; the low class still
    holds floor(min_share x capacity) slots whenever it has work waiting."""
    q = make(
        {
            "hi": {"rank": 0, "queue_timeout_s": None},
            "lo": {"rank": 2, "queue_timeout_s": None, "min_share": min_share},
        },
        aging={"step_s": 0.01},
    )
    reserved = math.floor(min_share * capacity + 1e-9)
    now = 0.0
    running: list[str] = []  # dispatched classes, oldest first: completions are FIFO
    low_served = 0
    for step in range(400):
        q.push(f"hi-a{step}", "hi", now)
        q.push(f"hi-b{step}", "hi", now)
        q.push(f"lo{step}", "lo", now)
        while (entry := q.pop(now, capacity)) is not None:
            running.append(entry.class_name)
            low_served += entry.class_name == "lo"
        if step > capacity:
            # The top class's queue never empties, yet the reservation holds.
            assert q.in_flight("lo") >= max(reserved, 0)
        q.release(running.pop(0))
        now += 0.05
    # Offline got its share of the throughput, not just its first slots.
    assert low_served >= reserved * 400 // capacity - 1


@pytest.mark.parametrize(
    ("weights", "dispatches"),
    [({"a": 4, "b": 1}, 1000), ({"a": 6, "b": 3, "c": 1}, 1000), ({"a": 1, "b": 1}, 999)],
)
def test_weighted_round_robin_ratios(weights: dict[str, int], dispatches: int) -> None:
    classes = {
        name: {"rank": i, "weight": w, "queue_timeout_s": None}
        for i, (name, w) in enumerate(weights.items())
    }
    q = make(classes, dispatch="weighted_round_robin")
    for name in weights:
        for i in range(dispatches):
            q.push(f"{name}{i}", name, 0.0)
    got: Counter[str] = Counter()
    order = []
    for _ in range(dispatches):
        entry = q.pop(0.0, capacity=1)
        assert entry is not None
        got[entry.class_name] += 1
        order.append(entry.class_name)
        q.release(entry.class_name)
    total = sum(weights.values())
    for name, w in weights.items():
        assert abs(got[name] - dispatches * w / total) <= 1, got
    # Smooth: every window of sum(weights) dispatches holds each class exactly weight times.
    for start in range(0, dispatches - total, total):
        window = Counter(order[start : start + total])
        assert dict(window) == weights


def test_weighted_round_robin_gives_an_idle_class_share_to_the_others() -> None:
    q = make(
        {"a": {"rank": 0, "weight": 4}, "b": {"rank": 1, "weight": 1}},
        dispatch="weighted_round_robin",
    )
    for i in range(10):
        q.push(f"b{i}", "b", 0.0)
    assert drain(q, 0.0, capacity=10) == [f"b{i}" for i in range(10)]


@pytest.mark.parametrize(
    ("capacity", "spec", "expected_in_flight"),
    [
        (10, {"max_share": 0.3}, 3),
        (2, {"max_share": 0.3}, 1),  # rounds to at least one slot: never starved for good
        (10, {"max_concurrency": 2}, 2),
        (10, {"max_share": 0.5, "max_concurrency": 4}, 4),
        (10, {"max_share": 0.5, "max_concurrency": 9}, 5),
        (0, {}, 0),
    ],
)
def test_quota_ceiling_and_concurrency_cap(
    capacity: int, spec: dict[str, Any], expected_in_flight: int
) -> None:
    q = make({"rt": {"rank": 0}, "off": {"rank": 1, **spec}})
    for i in range(20):
        q.push(f"o{i}", "off", 0.0)
    assert len(drain(q, 0.0, capacity)) == expected_in_flight
    # The ceiling binds the class only: another class still gets the remaining slots.
    q.push("r1", "rt", 0.0)
    assert drain(q, 0.0, capacity) == (["r1"] if capacity > expected_in_flight else [])
    # A completion frees exactly one slot for the capped class.
    if expected_in_flight:
        q.release("off")
        assert len(drain(q, 0.0, capacity)) == 1


def test_capacity_shrinking_below_in_flight_dispatches_nothing() -> None:
    q = make({"a": {"rank": 0}})
    for i in range(5):
        q.push(f"a{i}", "a", 0.0)
    assert len(drain(q, 0.0, 3)) == 3
    assert drain(q, 0.0, 2) == []
    q.release("a")
    assert drain(q, 0.0, 2) == []  # 2 still in flight
    assert drain(q, 0.0, 4) == ["a3", "a4"]


def test_min_share_floor_reserves_slots_while_the_class_waits() -> None:
    q = make({"hi": {"rank": 0}, "lo": {"rank": 1, "min_share": 0.3}})
    for i in range(20):
        q.push(f"h{i}", "hi", 0.0)
    for i in range(20):
        q.push(f"l{i}", "lo", 0.0)
    got = drain(q, 0.0, capacity=10)
    assert got == [f"h{i}" for i in range(7)] + ["l0", "l1", "l2"]
    # Completions of the floor class go back to it while it is at its floor.
    q.release("lo")
    assert drain(q, 0.0, 10) == ["l3"]
    # Above its floor it competes by rank again: hi gets a freed hi slot.
    q.release("hi")
    assert drain(q, 0.0, 10) == ["h7"]


def test_min_share_reserves_nothing_for_an_idle_class() -> None:
    q = make({"hi": {"rank": 0}, "lo": {"rank": 1, "min_share": 0.5}})
    for i in range(20):
        q.push(f"h{i}", "hi", 0.0)
    assert len(drain(q, 0.0, capacity=10)) == 10


def test_competing_floors_with_fewer_free_slots_than_reserved_do_not_deadlock() -> None:
    q = make(
        {"a": {"rank": 0, "min_share": 0.5}, "b": {"rank": 1, "min_share": 0.5}, "c": {"rank": 2}}
    )
    q.push("c1", "c", 0.0)
    assert drain(q, 0.0, 2) == ["c1"]
    q.push("a1", "a", 0.0)
    q.push("b1", "b", 0.0)
    assert drain(q, 0.0, 2) == ["a1"]
    q.release("c")
    assert drain(q, 0.0, 2) == ["b1"]


_HI_LO = {
    "hi": {"rank": 0, "queue_timeout_s": None},
    "lo": {"rank": 1, "min_share": 0.3, "queue_timeout_s": None},
}


def _starving(
    classes: dict[str, Any] | None = None, fleet_part: float = 1.0, **section: Any
) -> ClassQueues[str]:
    """hi fills every slot but lo's reservation (3 of 10 at min_share 0.3), lo holds its 3
    in flight: stuck behind hi inside Triton from t = 0, with more of both queued."""
    section.setdefault("starved_after_s", 2.0)
    classes = classes or _HI_LO
    section.setdefault("default_class", next(iter(classes)))
    q: ClassQueues[str] = ClassQueues(load_scheduling({"classes": classes, **section}), fleet_part)
    for i in range(20):
        q.push(f"h{i}", "hi", 0.0)
        q.push(f"l{i}", "lo", 0.0)
    assert len(drain(q, 0.0, capacity=10)) == 10
    return q


def test_a_starved_class_is_boosted_beyond_every_slot_until_its_debt_is_paid() -> None:
    q = _starving()
    # lo is owed FLOOR_AIM x min_share x instances = a x 0.3 device-seconds per second while
    # it has work; nothing goes before the debt reaches starved_after_s (2 s) of that: a x 0.6
    # at t = 2. Its answers below take a x 0.3 s of device each, so that the arithmetic
    # reads in the units of its aim.
    a = FLOOR_AIM
    assert q.pop(1.99, 10) is None
    assert q.next_expiry(1.99) == pytest.approx(2.0)
    # Its answers' device time unknown yet: its reservation (floor(0.3 x 10) = 3) goes
    # boosted, whatever hi holds.
    boosted = [q.pop(2.0, 10) for _ in range(4)]
    assert [e.item if e else None for e in boosted] == ["l3", "l4", "l5", None]
    assert all(e is not None and e.boosted for e in boosted[:3])
    assert q.in_flight("lo") == 6 and q.in_flight() == 13
    assert q.floor_debt("lo") == pytest.approx(a * 0.6) and q.floor_debt("hi") is None
    # Each answer pays its device time: a x (0.6 + 0.5 x 0.3 - 2 x 0.3) = a x 0.15 left,
    # below the threshold, so nothing more goes; it is back at a x 0.6 after 0.45 / 0.3 = 1.5 s.
    q.release("lo", 2.5, boosted=True, served_s=a * 0.3)
    q.release("lo", 2.5, boosted=True, served_s=a * 0.3)
    assert q.pop(2.5, 10) is None
    assert q.next_expiry(2.5) == pytest.approx(4.0)
    assert q.pop(3.99, 10) is None
    # Then as many go as pay the debt (a x 0.6 / a x 0.3 each = 2), the one still out included.
    again = [q.pop(4.0, 10) for _ in range(2)]
    assert again[0] is not None and again[0].item == "l6" and again[0].boosted
    assert again[1] is None
    # An answer whose device time is unknown pays it all; with the two boosted answered, a
    # slot is free (7 of hi and 2 of lo in flight) and goes to lo's reservation, not boosted.
    q.release("lo", 4.5, boosted=True, served_s=a * 0.3)
    q.release("lo", 4.5, boosted=True, served_s=a * 0.3)
    q.release("lo", 4.5)
    freed = q.pop(4.5, 10)
    assert freed is not None and freed.class_name == "lo" and not freed.boosted
    assert q.next_expiry(4.5) == pytest.approx(6.5)


def test_a_class_starved_for_good_is_served_above_its_share() -> None:
    # Nothing unboosted of lo is ever answered (stuck behind hi inside Triton); its boosted
    # requests take 0.1 s of device each and are answered 0.4 s after they go. Over 60 s it
    # gets FLOOR_AIM x its 0.3 device-seconds per second, less the threshold it waits for
    # first: more than its share.
    q = _starving()
    for i in range(20, 2000):
        q.push(f"l{i}", "lo", 0.0)
    out: list[float] = []  # when each boosted request in flight is answered
    served = 0.0
    now = 0.0
    while now < 60.0:
        for at in [t for t in out if t <= now]:
            out.remove(at)
            q.release("lo", at, boosted=True, served_s=0.1)
            served += 0.1
        while (entry := q.pop(now, 10)) is not None:
            assert entry.boosted
            out.append(now + 0.4)
        now = round(now + 0.01, 2)
    rate = FLOOR_AIM * 0.3
    assert rate * 60 - rate * 2 - 0.3 <= served <= rate * 60
    assert served > 0.3 * 60


def test_one_worker_of_two_owes_half_the_floor() -> None:
    # serve --workers 2: each worker's gate is owed its part of the class's share, so the
    # two together boost the class's share, not twice it. Both start boosting after 2 s of
    # it; once their answers' device time (a x 0.3 s) is known, the next rounds pay a x 0.6 s
    # and a x 0.3 s.
    sent = []
    for part in (1.0, 0.5):
        q = _starving(fleet_part=part)
        assert len(drain(q, 2.0, 10)) == 3  # the reservation: device time unknown yet
        for _ in range(3):
            q.release("lo", 2.0, boosted=True, served_s=FLOOR_AIM * 0.3)
        assert q.next_expiry(2.0) == pytest.approx(4.0)
        sent.append(len(drain(q, 4.0, 10)))
    assert sent == [2, 1]


def test_a_long_outage_is_not_repaid_in_a_flood() -> None:
    # The debt is held to twice the threshold (a x 2 s here, a = FLOOR_AIM): after a minute
    # stuck, what goes boosted pays a x 2 s of device, not a x 30.
    a = FLOOR_AIM
    q = _starving(classes={**_HI_LO, "lo": {**_HI_LO["lo"], "min_share": 0.5}})
    first = q.pop(2.0, 10)  # owed a x 0.5 x 2: its reservation (5) goes, device time unknown
    assert first is not None and first.boosted
    while q.pop(2.0, 10) is not None:
        pass
    for _ in range(5):
        q.release("lo", 2.0, boosted=True, served_s=a * 0.2)
    sent = 0
    while (entry := q.pop(62.0, 10)) is not None:
        assert entry.boosted
        sent += 1
    assert sent == 5  # ceil(a x min(2.0, 1.0 + 60 x 0.5) / (a x 0.2)) = 10, at most 5
    for _ in range(5):
        q.release("lo", 62.0, boosted=True, served_s=a * 0.2)
    assert q.pop(62.0, 10) is not None  # a x (2.0 - 1.0) paid: a x 1.0 owed, the threshold


@pytest.mark.parametrize(
    "section",
    [
        {"starved_after_s": None},
        {
            "classes": {
                "hi": {"rank": 0, "min_share": 0.3, "queue_timeout_s": None},
                "lo": {"rank": 1, "queue_timeout_s": None},
            }
        },
    ],
    ids=["off", "no_min_share_below_the_top"],
)
def test_the_floor_boost_lifts_only_a_min_share_class_below_the_top(
    section: dict[str, Any],
) -> None:
    classes = section.pop("classes", _HI_LO)
    q = make(classes, **section)
    for i in range(20):
        q.push(f"h{i}", "hi", 0.0)
        q.push(f"l{i}", "lo", 0.0)
    drain(q, 0.0, capacity=10)
    assert q.pop(60.0, 10) is None
    assert q.next_expiry(0.0) is None


def test_a_class_with_nothing_stuck_is_not_starved() -> None:
    # lo queued but nothing of it in flight: its reservation takes the next free slot, as
    # before; the boost needs requests of it stuck in flight.
    q = make({"hi": {"rank": 0}, "lo": {"rank": 1, "min_share": 0.3}})
    for i in range(10):
        q.push(f"h{i}", "hi", 0.0)
    drain(q, 0.0, capacity=10)
    q.push("l0", "lo", 0.0)
    assert q.pop(10.0, 10) is None
    q.release("hi", 10.0)
    popped = q.pop(10.0, 10)
    assert popped is not None and popped.item == "l0" and not popped.boosted


def test_the_fast_path_leaves_a_starved_class_to_the_boost() -> None:
    q = _starving()
    for e in [*q.drain()]:
        assert e.item  # empty the queues: take() only runs with nothing queued
    assert not q.take("lo", 2.0, 10)  # starved: push and pop it, boosted
    q.push("new", "lo", 2.0)
    popped = q.pop(2.0, 10)
    assert popped is not None and popped.boosted


def test_ttl_expiry_per_class() -> None:
    q = make(
        {
            "rt": {"rank": 0, "queue_timeout_s": 1.0},
            "off": {"rank": 1, "queue_timeout_s": 5.0},
            "forever": {"rank": 2, "queue_timeout_s": None},
        }
    )
    q.push("r1", "rt", 0.0)
    q.push("o1", "off", 0.0)
    q.push("r2", "rt", 0.5)
    q.push("f1", "forever", 0.0)
    assert q.next_expiry() == 1.0
    assert q.expire(0.99) == []
    assert [e.item for e in q.expire(1.0)] == ["r1"]
    assert q.next_expiry() == 1.5
    assert [e.item for e in q.expire(4.0)] == ["r2"]
    assert [e.item for e in q.expire(100.0)] == ["o1"]
    assert q.next_expiry() is None
    assert q.queued() == 1
    assert drain(q, 100.0, 1) == ["f1"]


def test_remove_cancels_a_queued_entry_once() -> None:
    q = make({"a": {"rank": 0}})
    entries = [q.push(f"a{i}", "a", 0.0).entry for i in range(4)]
    assert all(e is not None for e in entries)
    e1 = entries[1]
    assert isinstance(e1, Entry)
    assert q.remove(e1) is True
    assert q.remove(e1) is False
    assert q.queued("a") == 3
    popped = q.pop(0.0, 10)
    assert popped is not None and popped.item == "a0"
    assert q.remove(popped) is False  # dispatched, no longer queued
    assert drain(q, 0.0, 10) == ["a2", "a3"]


def test_full_class_queue_sheds_the_newcomer() -> None:
    q = make({"a": {"rank": 0, "max_queue": 2}, "b": {"rank": 1}})
    assert q.push("a1", "a", 0.0).entry is not None
    assert q.push("a2", "a", 0.0).entry is not None
    result = q.push("a3", "a", 0.0)
    assert result.entry is None and result.shed is ShedReason.QUEUE_FULL
    assert q.push("b1", "b", 0.0).entry is not None


def test_overload_sheds_lowest_class_first() -> None:
    q = make(THREE, max_queued_total=4)
    for item, cls in [("o1", "off"), ("o2", "off"), ("n1", "on"), ("n2", "on")]:
        assert q.push(item, cls, 0.0).entry is not None
    # Full: a more important arrival evicts the newest of the least important class.
    r = q.push("r1", "rt", 0.0)
    assert r.entry is not None and [e.item for e in r.evicted] == ["o2"]
    r = q.push("n3", "on", 0.0)
    assert r.entry is not None and [e.item for e in r.evicted] == ["o1"]
    # No less important class left for online: the newcomer is shed.
    r = q.push("n4", "on", 0.0)
    assert r.entry is None and r.shed is ShedReason.OVERLOAD and r.evicted == ()
    r = q.push("o3", "off", 0.0)
    assert r.entry is None and r.shed is ShedReason.OVERLOAD
    r = q.push("r2", "rt", 0.0)
    assert r.entry is not None and [e.item for e in r.evicted] == ["n3"]
    assert q.queued() == 4
    assert drain(q, 0.0, 10) == ["r1", "r2", "n1", "n2"]


def test_release_without_dispatch_is_a_bug() -> None:
    q = make({"a": {"rank": 0}})
    with pytest.raises(RuntimeError):
        q.release("a")


def test_reconfigure_moves_orphans_to_default_in_arrival_order() -> None:
    q = make(THREE)
    q.push("o1", "off", 0.0)
    q.push("n1", "on", 1.0)
    q.push("o2", "off", 2.0)
    q.push("r1", "rt", 0.0)
    assert drain(q, 3.0, 1) == ["r1"]
    new = load_scheduling(
        {"classes": {"on": {"rank": 0}, "batch": {"rank": 1}}, "default_class": "on"}
    )
    q.reconfigure(new)
    assert q.queued("on") == 3 and q.queued("off") == 0
    assert q.in_flight("rt") == 1
    q.release("rt")  # a dropped class's slot still comes back
    assert q.in_flight() == 0
    assert drain(q, 3.0, 10) == ["o1", "n1", "o2"]


@pytest.mark.parametrize("dispatch", ["strict_aging", "weighted_round_robin"])
def test_never_starves_any_class_over_a_long_saturated_run(dispatch: str) -> None:
    """Under strict order the lower classes' guarantee is their min_share (aging never lifts
    them above the top class); under WRR it is their weight."""
    q = make(
        {
            "rt": {"rank": 0, "queue_timeout_s": None},
            "on": {"rank": 1, "queue_timeout_s": None, "min_share": 0.1},
            "off": {"rank": 2, "max_share": 0.3, "queue_timeout_s": None, "min_share": 0.1},
        },
        dispatch=dispatch,
    )
    now = 0.0
    seen: Counter[str] = Counter()
    running: list[str] = []
    for step in range(2000):
        for cls in ("rt", "rt", "on", "off"):  # four arrivals per completion
            q.push(f"{cls}{step}", cls, now)
        while (entry := q.pop(now, capacity=10)) is not None:
            seen[entry.class_name] += 1
            running.append(entry.class_name)
        q.release(running.pop(0))
        now += 0.01
    assert all(seen[c] >= 150 for c in ("rt", "on", "off")), seen


@pytest.mark.parametrize(("instances", "expected"), [(3, 16), (2, 8), (1, 8)])
def test_spare_instances_shrink_a_capped_class_to_its_lane(instances: int, expected: int) -> None:
    # max_per_instance 8 over all but one instance (never fewer than one): the gate admits
    # no more of the class than its lane holds, whatever the capacity
    q = make({"rt": {"rank": 0}, "off": {"rank": 1, "max_per_instance": 8, "spare_instances": 1}})
    q.push("r0", "rt", 0.0)  # the spare is kept while a more important class is active
    assert q.pop(0.0, 96, instances) is not None
    for i in range(40):
        q.push(f"o{i}", "off", 0.0)
    out = []
    while (e := q.pop(0.0, 96, instances)) is not None:
        out.append(e.item)
    assert len(out) == expected
    q.push("r1", "rt", 0.0)
    assert q.pop(0.0, 96, instances) is not None  # the other classes keep the rest


def lane_below_rt(**off: object) -> ClassQueues[str]:
    """rt in flight since 0 s and 40 offline requests queued at 0 s; offline has a lane of
    8 per instance with one spare (and ``off``)."""
    lane = {"rank": 1, "max_per_instance": 8, "spare_instances": 1, "spare_idle_s": 1.0}
    q = make({"rt": {"rank": 0}, "off": {**lane, **off}})
    q.push("r1", "rt", 0.0)
    assert q.pop(0.0, 96, 3) is not None
    for i in range(40):
        q.push(f"o{i}", "off", 0.0)
    return q


def test_spare_instances_are_lent_while_the_more_important_classes_are_idle() -> None:
    q = lane_below_rt()

    def pop_all(now: float) -> int:
        n = 0
        while q.pop(now, 96, 3) is not None:
            n += 1
        return n

    assert pop_all(0.0) == 16  # rt in flight: the lane is 2 of 3 instances
    q.release("rt")
    assert pop_all(0.5) == 0  # rt arrived 0.5 s ago: the spare is still kept
    assert pop_all(1.0) == 8  # idle for spare_idle_s: the spare is lent, 8 more
    q.push("r2", "rt", 1.2)  # rt is back: no more offline until the lane is down to 16
    assert q.pop(1.2, 96, 3) is not None
    q.release("off")
    assert pop_all(1.2) == 0


def test_a_kept_spare_holds_spare_per_instance_of_the_class() -> None:
    q = lane_below_rt(spare_per_instance=2)
    assert len(drain(q, 0.5, 96, instances=3)) == 16  # rt in flight: the lane, 2 of 3
    # offline's oldest has waited deepen_after_s (1 s): behind, 2 on the spare too
    assert len(drain(q, 1.0, 96, instances=3)) == 2
    q.release("rt")
    assert len(drain(q, 2.0, 96, instances=3)) == 6  # rt idle 1 s: the spare lent whole


def test_a_shallow_lane_deepens_while_its_queue_is_stuck() -> None:
    # Depth 2 on each of the 2 lane instances while the oldest queued offline request has
    # waited less than 1 s; 8 while it has waited longer.
    q = make(
        {
            "rt": {"rank": 0},
            "off": {
                "rank": 1,
                "max_per_instance": 8,
                "shallow_per_instance": 2,
                "deepen_after_s": 1.0,
                "spare_instances": 1,
            },
        }
    )
    q.push("r0", "rt", 0.0)  # rt active: the spare is kept, the lane is 2 of 3 instances
    assert q.pop(0.0, 96, 3) is not None

    def pop_all(now: float) -> list[str]:
        return drain(q, now, 96, instances=3)

    for i in range(20):
        q.push(f"o{i}", "off", 0.0)
    assert pop_all(0.5) == ["o0", "o1", "o2", "o3"]  # 2 x 2
    # The head has waited 1 s: deep, as long as the head it reaches is that old.
    assert pop_all(1.0) == [f"o{i}" for i in range(4, 16)]
    q.push("o20", "off", 1.5)
    for _ in range(14):
        q.release("off")
    assert pop_all(1.5) == ["o16", "o17", "o18", "o19"]  # 2 in flight + 4 popped...
    assert pop_all(1.6) == []  # ...then the head (o20) is young: back to 2 per instance
    assert q.in_flight("off") == 6


@pytest.mark.parametrize(
    ("cls", "error"),
    [
        ({"rank": 1, "shallow_per_instance": 2}, "needs max_per_instance"),
        ({"rank": 1, "max_per_instance": 2, "shallow_per_instance": 3}, "between 1 and"),
        ({"rank": 1, "max_per_instance": 2, "shallow_per_instance": 0}, "between 1 and"),
        ({"rank": 1, "deepen_after_s": 0}, "deepen_after_s must be > 0"),
    ],
)
def test_shallow_per_instance_is_checked(cls: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        make({"rt": {"rank": 0}, "off": cls})


# -- slot_sharing: by_rank -------------------------------------------------------------------


@pytest.mark.parametrize("sharing", ["shared", "placed_by_rank"])
def test_shared_slots_make_the_top_class_wait_for_lower_classes(sharing: str) -> None:
    # placed_by_rank counts by rank in placement only: the gate's pool is shared
    q = make(THREE, slot_sharing=sharing)
    for i in range(4):
        q.push(f"n{i}", "on", now=0.0)
    assert drain(q, now=0.0, capacity=4) == ["n0", "n1", "n2", "n3"]
    q.push("r1", "rt", now=0.1)
    assert drain(q, now=0.1, capacity=4) == []


def test_by_rank_the_top_class_ignores_slots_held_by_lower_classes() -> None:
    q = make(THREE, slot_sharing="by_rank")
    for i in range(4):
        q.push(f"n{i}", "on", now=0.0)
    assert drain(q, now=0.0, capacity=4) == ["n0", "n1", "n2", "n3"]
    for i in range(5):
        q.push(f"r{i}", "rt", now=0.1)
    # Four real-time requests go at once (online's four do not count against them); the
    # fifth waits for a real-time slot.
    assert drain(q, now=0.1, capacity=4) == ["r0", "r1", "r2", "r3"]
    assert q.in_flight() == 8
    q.release("on")
    assert drain(q, now=0.2, capacity=4) == []
    q.release("rt")
    assert drain(q, now=0.2, capacity=4) == ["r4"]


def test_by_rank_a_lower_class_still_yields_to_every_class_above_it() -> None:
    q = make(THREE, slot_sharing="by_rank")
    for i in range(3):
        q.push(f"r{i}", "rt", now=0.0)
    assert drain(q, now=0.0, capacity=4) == ["r0", "r1", "r2"]
    q.push("n1", "on", now=0.1)
    q.push("n2", "on", now=0.1)
    q.push("o1", "off", now=0.1)
    # One slot is left after real-time's three: online takes it, offline (counting both) none.
    assert drain(q, now=0.1, capacity=4) == ["n1"]
    q.release("rt")
    assert drain(q, now=0.2, capacity=4) == ["n2"]


def test_by_rank_a_reservation_holds_whatever_the_classes_above_hold() -> None:
    classes = {**THREE, "off": {"rank": 2, "queue_timeout_s": None, "min_share": 0.25}}
    q = make(classes, slot_sharing="by_rank")
    for i in range(8):
        q.push(f"r{i}", "rt", now=0.0)
        q.push(f"o{i}", "off", now=0.0)
    # Real-time takes all 8 slots of its own; offline still gets its floor(0.25 * 8) = 2.
    out = drain(q, now=0.0, capacity=8)
    assert Counter(x[0] for x in out) == Counter({"r": 8, "o": 2})
    q.release("off")
    assert drain(q, now=0.1, capacity=8) == ["o2"]


def test_by_rank_counts_a_dropped_class_as_the_default_class() -> None:
    q = make(THREE, slot_sharing="by_rank", default_class="on")
    q.push("x1", "off", now=0.0)
    q.push("x2", "off", now=0.0)
    assert drain(q, now=0.0, capacity=2) == ["x1", "x2"]
    q.reconfigure(
        load_scheduling(
            {"classes": {k: v for k, v in THREE.items() if k != "off"}, "default_class": "on"}
            | {"slot_sharing": "by_rank"}
        )
    )
    q.push("n1", "on", now=0.1)
    q.push("r1", "rt", now=0.1)
    # The two dropped offline requests now count as online: online has no slot, real-time has.
    assert drain(q, now=0.1, capacity=2) == ["r1"]


def _random_section(rng: random.Random) -> dict[str, Any]:
    classes: dict[str, dict[str, Any]] = {}
    for rank, name in enumerate(("rt", "on", "off")):
        cls: dict[str, Any] = {"rank": rank, "queue_timeout_s": None, "weight": rng.randint(1, 4)}
        if rng.random() < 0.5:
            cls["min_share"] = rng.choice([0.1, 0.25])
        if rng.random() < 0.4:
            cls["max_share"] = rng.choice([0.3, 0.5])
        if rng.random() < 0.3:
            cls["max_concurrency"] = rng.randint(1, 4)
        if rng.random() < 0.4:
            cls["max_per_instance"] = rng.randint(2, 4)
            if rng.random() < 0.5:
                cls["shallow_per_instance"] = 1
            if rank and rng.random() < 0.7:
                cls["spare_instances"] = rng.randint(1, 2)
                if rng.random() < 0.5:
                    cls["spare_per_instance"] = rng.randint(1, 3)
        classes[name] = cls
    return {
        "classes": classes,
        "default_class": "on",
        "slot_sharing": rng.choice(["shared", "by_rank"]),
        "dispatch": rng.choice(["strict_aging", "weighted_round_robin"]),
    }


def _state(q: ClassQueues[str]) -> tuple[object, ...]:
    return (q._in_flight, q._total_in_flight, q._wrr, q._arrived_at, q.queued())


def test_take_decides_as_push_then_pop_with_nothing_queued() -> None:
    """The gate's fast path (ClassQueues.take) against what it stands for, in random states."""
    outcomes = Counter(_take_against_push_and_pop(seed) for seed in range(2000))
    assert outcomes[True] > 200 and outcomes[False] > 200  # both answers were checked


def _take_against_push_and_pop(seed: int) -> bool:
    rng = random.Random(seed)
    q: ClassQueues[str] = ClassQueues(load_scheduling(_random_section(rng)))
    now = 0.0
    entries = []
    for i in range(rng.randint(0, 30)):
        now += rng.choice([0.0, 0.01, 0.5, 2.0])
        step = rng.random()
        if step < 0.5:
            pushed = q.push(f"x{i}", rng.choice(["rt", "on", "off"]), now).entry
            if pushed is not None:
                entries.append(pushed)
        elif step < 0.8:
            q.pop(now, rng.randint(0, 8), rng.randint(1, 3))
        else:
            held = [n for n in ("rt", "on", "off") if q.in_flight(n)]
            if held:
                q.release(rng.choice(held))
    if rng.random() < 0.2:  # a class dropped by a reload, still in flight
        section = _random_section(rng)
        del section["classes"]["off"]
        q.reconfigure(load_scheduling(section))
    if rng.random() < 0.3:  # the class-limit loop's factor
        q.set_share_scale(rng.choice(list(q.config.classes)), rng.choice([0.25, 0.5]))
    for entry in entries:
        q.remove(entry)
    assert q.queued() == 0
    now += rng.choice([0.0, 0.5, 2.0])
    capacity, instances = rng.randint(0, 8), rng.randint(1, 4)
    name = rng.choice(list(q.config.classes))
    pushed_q = copy.deepcopy(q, {id(q.config): q.config})  # the config is shared, frozen
    entry = pushed_q.push("new", name, now).entry
    assert entry is not None
    popped = pushed_q.pop(now, capacity, instances)
    taken = q.take(name, now, capacity, instances)
    if popped is not None and popped.boosted:
        assert not taken, f"seed {seed}"  # the fast path leaves the floor boost to the pop
        return taken
    assert taken == (popped is entry), f"seed {seed}"
    if not taken:
        pushed_q.remove(entry)
    assert _state(q) == _state(pushed_q), f"seed {seed}"
    return taken


def test_only_uncapped_classes_waiting_count_as_the_fleet_at_its_limit() -> None:
    # proxy.routing.occupancy: a model whose uncapped classes wait at the gate is saturated.
    q = make({"online": {"rank": 0}, "offline": {"rank": 1, "max_per_instance": 1}})
    q.push("a", "offline", 0.0)
    assert q.queued_uncapped() == 0  # waits for its own cap, not for the fleet
    q.push("b", "online", 0.0)
    assert q.queued_uncapped() == 1
