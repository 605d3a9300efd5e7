"""The view path (``Router.place``) decides as the linear path (``Router.choose``) does.

Property tests: a real :class:`~proxy.fleet.instances.Fleet` goes through random events
(requests starting and finishing, ejections, models out, drains, new snapshots, busy
connections, slot limits, the clock moving) and, after each batch of events, two routers
built from the same seed decide the same random request: one with every candidate built,
filtered and scanned (the oracle), one from its view. Every policy, every decision, the same
instance.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec, Work
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.placement import FleetPlacement
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.batcher import BatcherModel
from proxy.routing.config import PolicySpec, RoutingConfig
from proxy.routing.engine import Router
from proxy.routing.feedback import FeedbackParams
from proxy.routing.registry import POLICIES

MODELS = ("m", "n")
BATCHER = BatcherModel(max_batch=4, delay_s=0.002, base_s=0.005, per_unit_s=2e-5, default_level=2)


class Connections:
    def __init__(self) -> None:
        self.busy: dict[str, int] = {}

    def open_connections(self, instance: object) -> int:
        return self.busy.get(instance.name, 0)  # type: ignore[attr-defined]


@dataclass
class World:
    """A fleet, its live inputs, and a random driver of events."""

    rng: random.Random
    clock: FakeClock
    fleet: Fleet
    connections: Connections = field(default_factory=Connections)
    snapshots: dict[str, InstanceSnapshot] = field(default_factory=dict)
    limits: dict[tuple[str, str], int] = field(default_factory=dict)
    open: list[contextlib.ExitStack] = field(default_factory=list)
    classes: tuple[str, ...] = ("rt", "batch")
    caps: dict[str, int] = field(default_factory=lambda: {"batch": 1})
    by_level: bool = False
    """Slots counted by priority level (``slot_sharing: by_rank``)."""
    levels: tuple[int | None, ...] = (None, 1, 2)

    def slot_limit(self, instance: str, model: str) -> int | None:
        return self.limits.get((instance, model))

    def placement(self, router: Router) -> FleetPlacement:
        return FleetPlacement(
            self.fleet,
            self.connections,  # type: ignore[arg-type]
            lambda request, source, exclude: router.place(request, source, exclude),
            self.snapshots.get,
            self.slot_limit,
            lambda model: self.by_level,
            keeps_sessions=router.keeps_sessions,
        )

    def names(self) -> list[str]:
        return list(self.fleet.instances)

    def free_sets(self) -> tuple[frozenset[str], ...]:
        """Instances a request may name as free of long work (``short_reserve`` keeps a held
        request off them): one, two, or all of them."""
        names = self.names()
        return (
            frozenset(self.rng.sample(names, 1)),
            frozenset(self.rng.sample(names, min(2, len(names)))),
            frozenset(names),
        )

    def event(self, filters: bool) -> None:
        rng, fleet = self.rng, self.fleet
        inst = fleet.get(rng.choice(self.names()))
        kind = rng.random()
        if kind < 0.35:
            stack = contextlib.ExitStack()
            rows = rng.choice((1, 2))
            work = Work(
                class_name=rng.choice(("rt", "batch")),
                level=rng.choice((0, 1, 2)),
                long=rng.random() < 0.2,
                cost=float(rows * rng.choice((8, 64, 512))),
                rows=rows,
            )
            stack.enter_context(
                fleet.track(inst, rng.choice(MODELS), stream=rng.random() < 0.1, work=work)
            )
            self.open.append(stack)
        elif kind < 0.6 and self.open:
            self.open.pop(rng.randrange(len(self.open))).close()
        elif kind < 0.7:
            load = ModelLoad(
                pending=float(rng.randint(0, 4)),
                queue_us=rng.choice((None, float(rng.randint(0, 3)) * 1000)),
                queue_us_p95=float(rng.choice((0, 50_000, 500_000))),
            )
            self.snapshots[inst.name] = InstanceSnapshot(
                taken_at=self.clock.now() - rng.choice((0.0, 0.5, 3.0)),
                models={"m": load, "n": load},
                kv_cache_fraction=rng.choice((None, 0.25, 0.5)),
            )
            fleet.touch(inst.name)
        elif kind < 0.75:
            self.connections.busy[inst.name] = rng.randint(0, 3)
            fleet.touch(inst.name)
        elif kind < 0.8:
            if inst.healthy and rng.random() < 0.5:
                fleet.eject(inst, "test")
            else:
                fleet.report_success(inst)
        elif kind < 0.85:
            model = rng.choice(MODELS)
            if model in inst.models_out:
                fleet.include_model(inst, model)
            else:
                fleet.exclude_model(inst, model, "test")
        elif kind < 0.88:
            model = rng.choice(MODELS)
            if model in inst.draining:
                inst.draining.discard(model)
            else:
                inst.draining.add(model)
        elif kind < 0.93 and filters:
            # A slot limit moves when a request of the instance finishes (adaptive
            # concurrency observes it right after the in-flight token is released).
            self.limits[(inst.name, rng.choice(MODELS))] = rng.randint(0, 3)
            fleet.touch(inst.name)
        else:
            self.clock.advance(rng.choice((0.1, 0.5, 1.0, 2.5)))

    def request(self, filters: bool) -> tuple[RouteRequest, frozenset[str]]:
        rng = self.rng
        class_name = rng.choice(self.classes)
        cap = self.caps.get(class_name) if filters else None
        request = RouteRequest(
            model=rng.choice(MODELS),
            session_key=rng.choice((None, f"s{rng.randint(0, 30)}")),
            class_name=class_name,
            level=rng.choice(self.levels),
            long=rng.random() < 0.3,
            class_cap=cap,
            class_queued=rng.choice((0, 0, 3)),
            batch=rng.choice((1, 4)),
            occupancy=rng.random(),
            free_of_long=rng.choice((None, frozenset(), *self.free_sets())),
            rows=1,
            cost=float(rng.choice((8, 512))),
            # The replay of expected_finish, or (None) its fallback before a curve is learned.
            batcher=rng.choice((None, BATCHER)),
            now=self.clock.now(),
        )
        names = self.names()
        exclude = (
            frozenset(rng.sample(names, rng.randint(1, 2)))
            if filters and rng.random() < 0.15
            else frozenset()
        )
        return request, exclude

    def close(self) -> None:
        while self.open:
            self.open.pop().close()


def least_requests_placement(w: World, seed: int) -> FleetPlacement:
    """``w``'s placement in front of a ``least_requests`` router."""
    router = Router(
        RoutingConfig(policy=PolicySpec(name="least_requests", params={})),
        w.clock,
        random.Random(seed),
    )
    return w.placement(router)


@contextlib.contextmanager
def world(seed: int, n: int) -> Iterator[World]:
    clock = FakeClock(1000.0)
    specs = tuple(InstanceSpec(name=f"t{i}", http=f"http://10.0.0.{i}:8000") for i in range(n))
    w = World(random.Random(seed), clock, Fleet(specs, HealthConfig(), clock))
    try:
        yield w
    finally:
        w.close()


def routers(
    policy: str,
    clock: FakeClock,
    seed: int,
    feedback: bool,
    params: dict[str, Any] | None = None,
) -> tuple[Router, Router]:
    config = RoutingConfig(
        policy=PolicySpec(name=policy, params=params or {}),
        stale_after_s=2.0,
        # Power-of-two weights keep every sum exact (see WeightTree.pick, Rotation).
        feedback=FeedbackParams(enabled=feedback, windows=1, window_s=1.0, factor=0.5, floor=0.125),
    )
    return (
        Router(config, clock, random.Random(seed)),
        Router(config, clock, random.Random(seed)),
    )


STATEFUL = ("round_robin", "consistent_hash")
"""Policies whose state the view keeps per shape: a model's requests in one class here."""
SHARED_FIELDS = ("name", "in_flight", "model_in_flight", "connections", "long_in_flight")
PREPARED_FIELDS = ("snapshot", "stale", "weight")


def compare(
    policy: str,
    seed: int,
    n: int,
    steps: int,
    *,
    filters: bool,
    feedback: bool,
    journal_limit: int | None = None,
    params: dict[str, Any] | None = None,
    by_level: bool = False,
) -> int:
    """Runs both paths side by side; returns how many decisions were compared."""
    compared = 0
    with world(seed, n) as w:
        if journal_limit is not None:
            w.fleet.journal.limit = journal_limit
        w.by_level = by_level
        if policy in STATEFUL and by_level:
            # The level is then part of the shape: a rotation per level, as per class.
            w.levels = (w.rng.choice(w.levels),)
        if policy in STATEFUL:
            w.classes = (w.rng.choice(w.classes),)
        w.caps["batch"] = w.rng.choice((1, 2))
        oracle, fast = routers(policy, w.clock, seed, feedback, params)
        linear = w.placement(oracle)
        viewed = w.placement(fast)
        for _ in range(steps):
            for _ in range(w.rng.randint(0, 4)):
                w.event(filters)
            request, exclude = w.request(filters)
            expected = oracle.place_linear(request, linear, exclude)
            got = fast.place(request, viewed, exclude)
            assert (got and got.name) == (expected and expected.name), (
                f"{policy} seed {seed}: step {compared}, {request}, exclude {set(exclude)}"
            )
            if got is not None and expected is not None:
                # The same candidate as prepared by the engine (the view builds ``ahead`` and
                # ``class_in_flight`` only where its shape says they are read).
                for f in SHARED_FIELDS + PREPARED_FIELDS:
                    assert getattr(got, f) == getattr(expected, f), f
                if policy == "expected_start":
                    assert (got.ahead, got.above) == (expected.ahead, expected.above)
            compared += 1
    return compared


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_view_decides_as_the_linear_path(policy: str, seed: int) -> None:
    compare(policy, seed, n=12, steps=400, filters=True, feedback=False)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_slots_counted_by_level_decide_as_the_linear_path(policy: str) -> None:
    compare(policy, 7, n=12, steps=400, filters=True, feedback=False, by_level=True)


def test_slots_counted_by_level_keep_a_full_instance_open_to_more_important_work() -> None:
    with world(3, 2) as w:
        placement = least_requests_placement(w, 3)
        t0, t1 = w.fleet.get("t0"), w.fleet.get("t1")
        stack = contextlib.ExitStack()
        for _ in range(2):  # t0: two requests at level 3 (offline), at its limit of 2
            stack.enter_context(w.fleet.track(t0, "m", work=Work(class_name="b", level=3)))
        for _ in range(2):  # t1: three at level 1 (real-time), over its limit
            stack.enter_context(w.fleet.track(t1, "m", work=Work(class_name="rt", level=1)))
        stack.enter_context(w.fleet.track(t1, "m", work=Work(class_name="rt", level=1)))
        w.limits = {("t0", "m"): 2, ("t1", "m"): 2}
        w.fleet.journal.reset()
        rt = RouteRequest(model="m", class_name="rt", level=1)
        off = RouteRequest(model="m", class_name="b", level=3)
        with stack:
            # Shared slots: both instances are full, so least_requests takes t0 (2 < 3).
            assert [c.name for c in placement.filtered(rt)] == ["t0", "t1"]
            w.by_level = True
            # By level: t0's offline work does not count against a real-time request...
            assert [c.name for c in placement.filtered(rt)] == ["t0"]
            # ...but real-time work counts against an offline one: both full again.
            assert [c.name for c in placement.filtered(off)] == ["t0", "t1"]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("lane_depth", [None, 1, 2])
@pytest.mark.parametrize(
    ("to_idle", "idle_reserve", "quiet_depth", "quiet_alone", "pack_above", "short_reserve"),
    [
        (False, 0, 0, False, None, 0),
        (True, 0, 0, False, None, 0),
        (True, 1, 0, False, None, 0),
        (True, 3, 0, False, None, 0),
        (True, 1, 3, False, None, 0),
        (True, 1, 3, True, None, 0),
        (False, 0, 3, False, None, 0),
        (True, 1, 0, False, 0.5, 0),  # requests' occupancy is random: both placements
        (True, 1, 0, True, 0.5, 0),  # quiet_alone stands for spread_alone here too
        (False, 0, 0, False, 0.5, 1),  # requests' free_of_long is random too
        (True, 1, 0, False, None, 2),
    ],
)
def test_expected_start_packing_a_lane_decides_as_the_linear_path(
    seed: int,
    lane_depth: int | None,
    to_idle: bool,
    idle_reserve: int,
    quiet_depth: int,
    quiet_alone: bool,
    pack_above: float | None,
    short_reserve: int,
) -> None:
    params: dict[str, Any] = {
        "short_reserve": short_reserve,
        "long_placement": "pack",
        "lane_depth": lane_depth,
        "long_to_idle": to_idle,
        "idle_reserve": idle_reserve,
        "quiet_depth": quiet_depth,
        "quiet_alone": quiet_alone,
        "pack_above": pack_above,
        "spread_alone": quiet_alone,
    }
    compare("expected_start", seed, n=12, steps=400, filters=True, feedback=False, params=params)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("filters", [False, True])
def test_same_with_feedback_weights(policy: str, filters: bool) -> None:
    # Windows are evaluated only on a decision's candidates, as the linear path does.
    compare(policy, 11, n=10, steps=500, filters=filters, feedback=True)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_larger_fleet_past_random_sample_copy_threshold(policy: str) -> None:
    # random.sample copies populations of up to 21 items and indexes larger ones: both paths.
    compare(policy, 5, n=40, steps=300, filters=True, feedback=False)


@pytest.mark.parametrize("policy", STATEFUL)
@pytest.mark.parametrize("seed", range(6))
def test_stateful_policies_on_small_busy_fleets(policy: str, seed: int) -> None:
    # Few instances: "out" marks, filter levels and rotations change often.
    compare(policy, 100 + seed, n=6, steps=300, filters=True, feedback=False)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_reader_far_behind_the_journal_rebuilds_and_still_agrees(policy: str) -> None:
    compare(policy, 21, n=10, steps=200, filters=True, feedback=False, journal_limit=3)


def test_view_refreshes_only_what_changed() -> None:
    with world(0, 50) as w:
        _, fast = routers("least_requests", w.clock, 0, feedback=False)
        placement = w.placement(fast)
        request = RouteRequest(model="m")
        assert placement.pick(request, frozenset()) is not None
        view = next(iter(fast._views.values()))
        assert view.rebuilds == 1 and len(view.members) == 50
        calls: list[str] = []
        build = view._build

        def counting(name: str) -> tuple[Candidate, int] | None:
            calls.append(name)
            return build(name)

        view._build = counting
        inst = w.fleet.get("t7")
        with w.fleet.track(inst, "m"):
            chosen = placement.pick(request, frozenset())
        assert calls == ["t7"]
        assert chosen is not None and chosen.name != "t7"  # it is the busiest now
        placement.pick(request, frozenset())
        assert calls == ["t7", "t7"] and view.rebuilds == 1


def test_draining_reaches_the_view() -> None:
    with world(0, 3) as w:
        _, fast = routers("least_requests", w.clock, 0, feedback=False)
        placement = w.placement(fast)
        request = RouteRequest(model="m")
        for inst in w.fleet.all()[1:]:
            inst.draining.add("m")
        assert placement.pick(request, frozenset()).name == "t0"  # type: ignore[union-attr]
        w.fleet.get("t2").draining.discard("m")
        with w.fleet.track(w.fleet.get("t0"), "m"):
            assert placement.pick(request, frozenset()).name == "t2"  # type: ignore[union-attr]


def _specs_without(w: World, name: str) -> tuple[InstanceSpec, ...]:
    return tuple(i.spec for i in w.fleet.all() if i.name != name)


def test_reload_of_the_instance_list_rebuilds_the_view() -> None:
    with world(0, 6) as w:
        _, fast = routers("round_robin", w.clock, 0, feedback=False)
        placement = w.placement(fast)
        request = RouteRequest(model="m")
        seen = {placement.pick(request, frozenset()).name for _ in range(6)}  # type: ignore[union-attr]
        assert seen == set(w.names())
        w.fleet.set_specs(_specs_without(w, "t3"), HealthConfig())
        seen = {placement.pick(request, frozenset()).name for _ in range(10)}  # type: ignore[union-attr]
        assert seen == set(w.names()) and "t3" not in seen


def test_no_candidate_is_none() -> None:
    with world(0, 3) as w:
        _, fast = routers("p2c", w.clock, 0, feedback=False)
        placement = w.placement(fast)
        for inst in w.fleet.all():
            w.fleet.eject(inst, "down")
        assert placement.pick(RouteRequest(model="m"), frozenset()) is None
        w.fleet.report_success(w.fleet.get("t1"))
        assert placement.pick(RouteRequest(model="m"), frozenset()).name == "t1"  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(
    "params",
    [
        {"count_delays": True},
        {"consider": 2},
        {"consider": 40},
        {"pack_above": 0.0},
        {"pack_above": 0.5, "count_delays": True},
        {"pack_above": 0.9, "pack_capped": "always", "count_delays": True},
        {"pack_above": 0.9, "pack_capped": "backlogged"},
    ],
)
def test_expected_finish_decides_as_the_linear_path(seed: int, params: dict[str, Any]) -> None:
    # Its shortlist comes from a sorted index on the view path and from a sort of the
    # filtered candidates on the linear one; the replay then reads the same live flights.
    compare("expected_finish", seed, n=12, steps=300, filters=True, feedback=True, params=params)


def _lane_at_its_limit(
    policy: str, cases: list[tuple[dict[str, Any], frozenset[str], set[str]]], **request: Any
) -> None:
    """The lane's two instances (t0, t1) hold four long rows each, at their slot limit of 4;
    t2, the last instance free of long work, holds one short request. For each case
    ``(params, exclude, want)`` both paths place a long online row (``RouteRequest`` fields
    ``request`` on top) in ``want``."""
    with world(5, 3) as w:
        stack = contextlib.ExitStack()
        long_online = Work(class_name="on", level=2, long=True, cost=512.0)
        for name in ("t0", "t1"):
            for _ in range(4):
                stack.enter_context(w.fleet.track(w.fleet.get(name), "m", work=long_online))
        stack.enter_context(w.fleet.track(w.fleet.get("t2"), "m", work=Work(class_name="on")))
        w.limits = {(n, "m"): 4 for n in ("t0", "t1", "t2")}
        w.fleet.journal.reset()
        row = RouteRequest(
            model="m",
            class_name="on",
            level=2,
            long=True,
            batch=4,
            free_of_long=frozenset({"t2"}),
            cost=512.0,
            **request,
        )
        with stack:
            for params, exclude, want in cases:
                oracle, fast = routers(policy, w.clock, 5, False, params)
                got = fast.place(row, w.placement(fast), exclude)
                linear = oracle.place_linear(row, w.placement(oracle), exclude)
                assert got is not None and linear is not None
                assert got.name == linear.name and got.name in want, (params, exclude, got.name)


@pytest.mark.parametrize("policy", ["expected_start", "expected_finish"])
def test_a_held_long_request_keeps_off_the_reserved_instance_before_the_slot_filter(
    policy: str,
) -> None:
    """The slot filter alone leaves only t2 (:func:`_lane_at_its_limit`), so without a
    reserve the long row opens it; with ``short_reserve: 1`` it is kept off t2 before the
    filter and joins the lane past its limit (both paths), unless a retry has excluded the
    lane."""
    params = {"long_placement": "pack"} if policy == "expected_start" else {"pack_above": 0.5}
    none: frozenset[str] = frozenset()
    lane = frozenset({"t0", "t1"})
    cases = [
        ({**params, "short_reserve": 0}, none, {"t2"}),
        ({**params, "short_reserve": 1}, none, {"t0", "t1"}),
        ({**params, "short_reserve": 1}, lane, {"t2"}),  # nothing else serves: back to t2
    ]
    _lane_at_its_limit(policy, cases, occupancy=0.9)


def test_reserve_spread_keeps_a_replayed_long_row_off_the_reserved_instance() -> None:
    """As above with the lane not packing (its fill, ``occupancy``, below ``pack_above``) on
    a busy fleet: ``expected_finish`` replays the long row, which would go to t2 (the lane's
    instances are at their slot limit); with ``reserve_spread`` it is kept off t2 there too,
    on both paths."""
    params = {"pack_above": 0.9, "short_reserve": 1}
    none: frozenset[str] = frozenset()
    cases = [
        ({**params, "reserve_spread": False}, none, {"t2"}),
        ({**params, "reserve_spread": True}, none, {"t0", "t1"}),
    ]
    _lane_at_its_limit("expected_finish", cases, occupancy=0.3, busy=1.0)
