"""The replay of Triton's dynamic batcher (``proxy.routing.batcher``) and the placement that
reads it (``expected_finish``): pure logic, no servers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from proxy.fleet.instances import Work
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.batcher import BatcherModel, Job
from proxy.routing.registry import build_policy

# accel_sim's curve in benchmarks/issue10: 5 ms + 20 us per padded token, 2 ms queue delay.
B = BatcherModel(max_batch=16, delay_s=0.002, base_s=0.005, per_unit_s=20e-6, default_level=2)
NOW = 100.0
SHORT = Job(level=1, rows=1, cost=32.0)


def batch_s(rows: int, longest: float) -> float:
    return 0.005 + 20e-6 * rows * longest


def work(level: int, tokens: int, rows: int = 1) -> Work:
    return Work(level=level, rows=rows, cost=float(rows * tokens))


def test_an_idle_instance_waits_the_queue_delay_then_runs_the_request_alone() -> None:
    assert B.finish([], float("-inf"), NOW, SHORT) == pytest.approx(NOW + 0.002 + batch_s(1, 32))


def test_a_full_batch_does_not_wait_the_delay() -> None:
    big = Job(level=2, rows=16, cost=16 * 8.0)
    assert B.finish([], NOW - 1, NOW, big) == pytest.approx(NOW + batch_s(16, 8))


def test_a_request_joins_the_batch_after_the_running_one_ahead_of_less_important_work() -> None:
    # Sent 5 ms ago to an idle instance: its batch started 3 ms ago (after the queue delay)
    # and runs 5.64 ms. Queued behind it since: offline rows at level 3.
    running = (NOW - 0.005, work(2, 32))
    offline = [(NOW - 0.002, work(3, 512, rows=2)) for _ in range(8)]  # 16 rows queued
    end_running = NOW - 0.005 + 0.002 + batch_s(1, 32)
    finish = B.finish([running, *offline], float("-inf"), NOW, SHORT)
    # The real-time row goes first; Triton fills the batch with offline rows up to 16 rows,
    # padded to 512: 1 + 14 rows.
    assert finish == pytest.approx(end_running + batch_s(15, 512))


def test_a_short_request_pays_for_the_long_row_queued_where_it_goes() -> None:
    busy_until = NOW + 0.003  # a running short batch, then the queue
    running = (NOW - 0.004, work(2, 32))
    long_queued = (NOW - 0.0001, work(2, 512))
    since = NOW - 0.004 - 0.002  # the instance was free when the running one came
    with_long = B.finish([running, long_queued], since, NOW, Job(2, 1, 32.0))
    with_short = B.finish([running, (NOW - 0.0001, work(2, 32))], since, NOW, Job(2, 1, 32.0))
    assert with_long > with_short
    assert with_short == pytest.approx(busy_until + 0.0 + batch_s(2, 32), abs=2e-3)


def test_a_batch_past_its_expected_end_is_still_running() -> None:
    # Sent a second ago and not answered: it runs on, for overrun_s (1 ms) more; the new
    # request starts when its own queue delay (2 ms) has run out.
    stuck = (NOW - 1.0, work(2, 32))
    finish = B.finish([stuck], NOW - 1.0, NOW, SHORT)
    assert finish == pytest.approx(NOW + 0.002 + batch_s(1, 32))
    slow = BatcherModel(16, 0.002, 0.005, 20e-6, overrun_s=0.010)
    assert slow.finish([stuck], NOW - 1.0, NOW, SHORT) == pytest.approx(
        NOW + 0.010 + batch_s(1, 32)
    )


def test_the_default_level_orders_requests_sent_without_one() -> None:
    assert B.rank(0) == 2 and B.rank(1) == 1 and B.rank(3) == 3


def candidate(name: str, flights: list[tuple[float, Work]], since: float) -> Candidate:
    return Candidate(
        name=name,
        in_flight=len(flights),
        model_in_flight=len(flights),
        connections=0,
        snapshot=None,
        stale=False,
        flights={i: f for i, f in enumerate(flights)},
        answered_at=since,
    )


def request(job: Job, batcher: BatcherModel | None = B) -> RouteRequest:
    return RouteRequest(
        model="m", level=job.level, rows=job.rows, cost=job.cost, batcher=batcher, now=NOW, batch=16
    )


def test_expected_finish_keeps_short_work_off_an_instance_about_to_run_a_padded_batch() -> None:
    policy = build_policy("expected_finish", None, random.Random(0))
    # a: one long row queued (sent just now). b: three short rows running, more requests in
    # flight, but short ones.
    a = candidate("a", [(NOW - 0.0001, work(2, 512))], NOW - 0.05)
    b = candidate("b", [(NOW - 0.003, work(2, 32)) for _ in range(3)], NOW - 0.05)
    assert policy.choose([a, b], request(Job(1, 1, 32.0))).name == "b"
    # least requests would take a (1 in flight against 3)
    least = build_policy("least_requests", None, random.Random(0))
    assert least.choose([a, b], request(Job(1, 1, 32.0))).name == "a"


def test_expected_finish_places_by_least_requests_until_the_curve_is_learned() -> None:
    policy = build_policy("expected_finish", None, random.Random(0))
    a = candidate("a", [(NOW - 0.0001, work(2, 512))], NOW - 0.05)
    b = candidate("b", [(NOW - 0.003, work(2, 32)) for _ in range(3)], NOW - 0.05)
    assert policy.choose([a, b], request(Job(1, 1, 32.0), batcher=None)).name == "a"


def test_expected_finish_replays_only_its_shortlist() -> None:
    policy = build_policy("expected_finish", {"consider": 1}, random.Random(0))
    a = candidate("a", [(NOW - 0.0001, work(2, 512))], NOW - 0.05)
    b = candidate("b", [(NOW - 0.003, work(2, 32)) for _ in range(3)], NOW - 0.05)
    assert policy.choose([b, a], request(Job(1, 1, 32.0))).name == "a"
    with pytest.raises(ValueError, match="consider"):
        build_policy("expected_finish", {"consider": 0}, random.Random(0))


def test_ends_cover_every_request_and_match_finish() -> None:
    flights = [(NOW - 0.004, work(2, 32)), (NOW - 0.001, work(3, 512, rows=2))]
    before, ends, finish = B.with_and_without(flights, NOW - 0.01, NOW, SHORT)
    assert {id(f) for f in flights} <= set(ends) and len(ends) == 3
    assert set(before) == {id(f) for f in flights}
    assert finish == pytest.approx(B.finish(flights, NOW - 0.01, NOW, SHORT))
    empty, alone, _ = B.with_and_without([], NOW, NOW, SHORT)
    assert empty == {} and len(alone) == 1


def test_counting_delays_keeps_a_long_request_off_queued_short_rows() -> None:
    # a: two real-time rows queued behind a running batch; b: four offline requests of two
    # 512-token rows queued. A long online row finishes sooner on a (a batch of 3 rows
    # padded to 512, 36 ms, against one of 9, 97 ms), but there it pads the real-time rows'
    # batch (6 ms -> 36 ms); counting their delay (weighted 4:1 over online, 16:1 over
    # offline) sends it to b, where it adds 7 ms to offline work.
    running = (NOW - 0.004, work(2, 32))
    a = candidate("a", [running, *[(NOW - 0.0005, work(1, 32)) for _ in range(2)]], NOW - 0.006)
    b = candidate("b", [running, *[(NOW - 0.0005, work(3, 512, 2)) for _ in range(4)]], NOW - 0.006)
    long_online = request(Job(2, 1, 512.0))
    own = build_policy("expected_finish", None, random.Random(0))
    delays = build_policy("expected_finish", {"count_delays": True}, random.Random(0))
    assert own.choose([a, b], long_online).name == "a"
    assert delays.choose([a, b], long_online).name == "b"
    with pytest.raises(ValueError, match="level_weight"):
        build_policy("expected_finish", {"level_weight": 0.5}, random.Random(0))


def test_pack_above_packs_long_work_into_a_lane_under_load() -> None:
    # An offline request of a class capped at 2 per instance: the replay sends it to the
    # idle instance c (it would finish soonest there); packed, it joins a, which runs one of
    # its class, so b and c keep batches it does not pad. Below ``pack_above`` it is replayed.
    offline = (NOW - 0.001, work(3, 512, rows=4))
    a = replace(candidate("a", [offline], NOW - 0.01), class_in_flight=1, long_in_flight=1)
    b = candidate("b", [(NOW - 0.001, work(1, 32))], NOW - 0.01)
    c = candidate("c", [], NOW - 0.01)
    capped = replace(request(Job(3, 4, 2048.0)), class_cap=2, long=True, occupancy=0.95)
    replay = build_policy("expected_finish", None, random.Random(0))
    lane = build_policy("expected_finish", {"pack_above": 0.9}, random.Random(0))
    assert replay.choose([a, b, c], capped).name == "c"
    assert lane.choose([a, b, c], capped).name == "a"
    assert lane.choose([a, b, c], replace(capped, occupancy=0.5)).name == "c"
    # An uncapped long row (online's 512 tokens) joins the lane too.
    online_long = replace(request(Job(2, 1, 512.0)), long=True, occupancy=0.95)
    assert replay.choose([a, b, c], online_long).name != "a"
    assert lane.choose([a, b, c], online_long).name == "a"
    # Short work is still replayed: a real-time row joins b's forming batch, which starts
    # before c's own queue delay runs out.
    assert lane.choose([a, b, c], replace(request(Job(1, 1, 32.0)), occupancy=0.95)).name == "b"
    with pytest.raises(ValueError, match="pack_above"):
        build_policy("expected_finish", {"pack_above": 1.5}, random.Random(0))


def test_pack_above_lane_depth_is_the_long_work_a_lane_instance_holds() -> None:
    # An online 512-token row under load: the lane instance a holds 3 long rows. With the
    # default depth (2 x max_batch_size = 32) or 4 it joins a; at depth 3 a is full and it
    # opens another instance (the one with the fewest short rows it would pad: c).
    row = (NOW - 0.001, work(2, 512))
    a = replace(candidate("a", [row] * 3, NOW - 0.01), long_in_flight=3)
    b = candidate("b", [(NOW - 0.001, work(1, 32))], NOW - 0.01)
    c = candidate("c", [], NOW - 0.01)
    online_long = replace(request(Job(2, 1, 512.0)), long=True, occupancy=0.95, batch=16)

    def lane(**params: object) -> str:
        policy = build_policy("expected_finish", {"pack_above": 0.9, **params}, random.Random(0))
        return policy.choose([a, b, c], online_long).name

    assert lane() == lane(lane_depth=4) == "a"
    assert lane(lane_depth=3) == "c"
    with pytest.raises(ValueError, match="lane_depth"):
        build_policy("expected_finish", {"pack_above": 0.9, "lane_depth": 0}, random.Random(0))


def test_short_reserve_keeps_the_last_short_instance_free_of_long_work() -> None:
    # The lane (a, b) is full at the default depth; c runs short batches only. Without a
    # reserve the next long row opens c (its batches would all be padded to 512 tokens); with
    # short_reserve 1 and c the only instance free of long work, it joins the lane past its
    # depth (the one with fewer long rows: b). Two instances free of long work: c may open.
    row = (NOW - 0.001, work(2, 512))
    a = replace(candidate("a", [row] * 33, NOW - 0.01), long_in_flight=33)
    b = replace(candidate("b", [row] * 32, NOW - 0.01), long_in_flight=32)
    c = candidate("c", [(NOW - 0.001, work(1, 32))], NOW - 0.01)
    c_and_d = frozenset({"c", "d"})
    online_long = replace(
        request(Job(2, 1, 512.0)),
        long=True,
        occupancy=0.95,
        batch=16,
        free_of_long=frozenset({"c"}),
    )
    plain = build_policy("expected_finish", {"pack_above": 0.9}, random.Random(0))
    held = build_policy(
        "expected_finish", {"pack_above": 0.9, "short_reserve": 1}, random.Random(0)
    )
    assert plain.choose([a, b, c], online_long).name == "c"
    assert held.choose([a, b, c], online_long).name == "b"
    assert held.choose([a, b, c], replace(online_long, free_of_long=c_and_d)).name == "c"
    assert held.choose([a, b, c], replace(online_long, free_of_long=None)).name == "c"
    # below pack_above nothing is packed, so nothing is held either
    assert held.choose([a, b, c], replace(online_long, occupancy=0.5)).name != "b"
    # A capped class whose lane (a, b) holds its max_per_instance is held too while the
    # fleet is busy: it joins its lane past its cap (where the fewest long rows run) rather
    # than open c.
    lane = [replace(a, class_in_flight=8), replace(b, class_in_flight=8), c]
    capped = replace(online_long, class_cap=8, class_name="offline")
    assert plain.choose(lane, capped).name == "c"
    assert held.choose(lane, capped).name == "b"
    # Below pack_above it is not held, even where its backlog has it packed: its gate lends
    # it the spare instances once the more important classes are idle, and then the busy
    # share is low.
    backlog = build_policy(
        "expected_finish",
        {"pack_above": 0.9, "pack_capped": "backlogged", "short_reserve": 1},
        random.Random(0),
    )
    idle_others = replace(capped, occupancy=0.5, class_queued=5)
    assert backlog.choose(lane, idle_others).name == "c"
    assert backlog.choose(lane, replace(idle_others, occupancy=0.95)).name == "b"
    with pytest.raises(ValueError, match="short_reserve"):
        build_policy("expected_finish", {"pack_above": 0.9, "short_reserve": -1}, random.Random(0))


def test_reserve_spread_holds_long_work_the_fill_does_not_pack() -> None:
    # The fill (occupancy 0.5) is below pack_above, so online's long row is replayed, not
    # packed; the fleet is busy (busy share 0.95) and c is the last instance free of long
    # work. With reserve_spread the reserve keeps the row off c all the same; without it,
    # or with the fleet not busy, or two instances free, nothing is kept off.
    online_long = replace(
        request(Job(2, 1, 512.0)),
        long=True,
        occupancy=0.5,
        busy=0.95,
        batch=16,
        free_of_long=frozenset({"c"}),
    )
    params = {"pack_above": 0.9, "short_reserve": 1}
    plain = build_policy("expected_finish", params, random.Random(0))
    spread = build_policy("expected_finish", {**params, "reserve_spread": True}, random.Random(0))
    assert plain.keep_off(online_long) == frozenset()
    assert spread.keep_off(online_long) == frozenset({"c"})
    assert spread.keep_off(replace(online_long, busy=0.5)) == frozenset()
    assert spread.keep_off(replace(online_long, free_of_long=frozenset({"c", "d"}))) == frozenset()
    # short work, and a capped class below pack_above, are never held by it
    assert spread.keep_off(replace(online_long, long=False)) == frozenset()
    assert spread.keep_off(replace(online_long, class_cap=8, busy=0.95)) == frozenset()
    # needs the reserve: without short_reserve there is nothing to keep
    alone = build_policy(
        "expected_finish", {"pack_above": 0.9, "reserve_spread": True}, random.Random(0)
    )
    assert alone.keep_off(online_long) == frozenset()


def test_pack_capped_always_packs_the_capped_class_at_any_occupancy() -> None:
    offline = (NOW - 0.001, work(3, 512, rows=4))
    a = replace(candidate("a", [offline], NOW - 0.01), class_in_flight=1, long_in_flight=1)
    b = candidate("b", [(NOW - 0.001, work(1, 32))], NOW - 0.01)
    c = candidate("c", [], NOW - 0.01)
    light = 0.5
    capped = replace(request(Job(3, 4, 2048.0)), class_cap=2, long=True, occupancy=light)
    online_long = replace(request(Job(2, 1, 512.0)), long=True, occupancy=light)
    policy = build_policy(
        "expected_finish", {"pack_above": 0.9, "pack_capped": "always"}, random.Random(0)
    )
    assert policy.choose([a, b, c], capped).name == "a"  # its lane, though the fleet is light
    assert policy.choose([a, b, c], online_long).name != "a"  # replayed below pack_above


def test_pack_capped_backlogged_packs_the_capped_class_only_while_it_has_a_queue() -> None:
    # An offline job that drops many requests at once queues at the gate: packed into its
    # lane. Offline arriving steadily (nothing queued) is replayed below pack_above.
    offline = (NOW - 0.001, work(3, 512, rows=4))
    a = replace(candidate("a", [offline], NOW - 0.01), class_in_flight=1, long_in_flight=1)
    b = candidate("b", [(NOW - 0.001, work(1, 32))], NOW - 0.01)
    c = candidate("c", [], NOW - 0.01)
    capped = replace(request(Job(3, 4, 2048.0)), class_cap=2, long=True, occupancy=0.5)
    policy = build_policy(
        "expected_finish", {"pack_above": 0.9, "pack_capped": "backlogged"}, random.Random(0)
    )
    assert policy.choose([a, b, c], capped).name == "c"  # nothing queued: replayed
    assert policy.choose([a, b, c], replace(capped, class_queued=5)).name == "a"
    # Uncapped long work is not a class's backlog: replayed below pack_above regardless.
    online_long = replace(request(Job(2, 1, 512.0)), long=True, occupancy=0.5, class_queued=5)
    assert policy.choose([a, b, c], online_long).name != "a"
    # At pack_above every long request is packed, queue or not.
    assert policy.choose([a, b, c], replace(capped, occupancy=0.95)).name == "a"


def reference_replay(
    b: BatcherModel,
    arrivals: list[tuple[float, Work]],
    since: float,
    now: float,
    until: tuple[float, Work] | None,
) -> dict[int, float]:
    """``BatcherModel._replay`` as first written (session 21), the definition the fast one
    must match: the queue sorted by ``(rank, sent)`` at each batch, its rows and oldest
    request counted by scanning it."""
    out: dict[int, float] = {}
    count = len(arrivals)
    if not count:
        return out
    t = since if since > float("-inf") else arrivals[0][0]
    pending: list[tuple[float, Work]] = []
    i = 0
    while i < count or pending:
        while i < count and arrivals[i][0] <= t:
            pending.append(arrivals[i])
            i += 1
        if not pending:
            t = arrivals[i][0]
            continue
        oldest = min(sent for sent, _ in pending)
        if sum(w.rows for _, w in pending) < b.max_batch and t < oldest + b.delay_s:
            t = min(oldest + b.delay_s, arrivals[i][0]) if i < count else oldest + b.delay_s
            continue
        pending.sort(key=lambda p: (b.rank(p[1].level), p[0]))
        rows = longest = 0.0
        taken = 0
        for _, w in pending:
            if taken and rows + w.rows > b.max_batch:
                break
            rows += w.rows
            longest = max(longest, w.cost / max(1, w.rows))
            taken += 1
        end = t + b.base_s + b.per_unit_s * rows * longest
        if t <= now and end < now + b.overrun_s:
            end = now + b.overrun_s
        done = False
        for arrival in pending[:taken]:
            out[id(arrival)] = end
            done = done or arrival is until
        if done:
            return out
        del pending[:taken]
        t = end
    return out


def random_batcher(rng: random.Random) -> BatcherModel:
    return BatcherModel(
        max_batch=rng.choice([1, 4, 16, 32]),
        delay_s=rng.choice([0.0, 0.0005, 0.002]),
        base_s=rng.uniform(0.0, 0.01),
        per_unit_s=rng.uniform(1e-6, 5e-5),
        default_level=rng.randint(0, 3),
        overrun_s=rng.choice([0.0, 0.001]),
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_replay_matches_its_first_form_on_random_queues(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        b = random_batcher(rng)
        now = 100.0
        # One level for every request (a model without classes) as often as several.
        levels = rng.choice([[0], [2], [0, 1, 2, 3, 4]])
        # Sending times on a 0.5 ms grid: ties are common, as for requests sent in one burst.
        flights = sorted(
            (
                (
                    now - rng.randint(0, 60) * 0.0005,
                    work(rng.choice(levels), rng.randint(1, 600), rng.randint(1, 40)),
                )
                for _ in range(rng.randint(0, 40))
            ),
            key=lambda f: f[0],
        )
        since = rng.choice([float("-inf"), now - 0.05, now - 0.003, now])
        new = (now, work(rng.choice(levels), rng.randint(1, 600)))
        arrivals = [*flights, new]
        for until in (new, None):
            assert b._replay(list(arrivals), since, now, until) == reference_replay(
                b, arrivals, since, now, until
            )
        assert b._replay(list(flights), since, now, None) == reference_replay(
            b, flights, since, now, None
        )


@pytest.mark.parametrize("seed", range(5))
def test_a_request_to_an_idle_instance_ends_where_the_replay_ends_it(seed: int) -> None:
    # ``finish`` and ``with_and_without`` skip the replay when nothing is in flight: the
    # closed form must agree with the first form to the bit.
    rng = random.Random(seed)
    now = 100.0
    for _ in range(300):
        b = random_batcher(rng)
        new = work(rng.randint(0, 4), rng.choice([0, 1, rng.randint(1, 600)]), rng.randint(0, 40))
        since = rng.choice([float("-inf"), now - 0.05, now - 0.001, now, now + 0.0005, now + 0.01])
        expected = reference_replay(b, [(now, new)], since, now, None)
        ((_, want),) = expected.items()
        assert b.finish([], since, now, new) == want
        before, after, end = b.with_and_without([], since, now, new)
        assert (before, list(after.values()), end) == ({}, [want], want)


def test_a_new_request_is_replayed_after_every_flight_even_one_that_read_the_clock_later() -> None:
    # The flight was sent 1 ms after the decision read its clock: the new request, sent
    # after it, is replayed as sent then, so it cannot overtake the flight in its level.
    later = (NOW + 0.001, work(1, 32))
    _, ends, finish = B.with_and_without([later], NOW - 1.0, NOW, Job(1, 1, 32.0))
    assert finish == ends[id(later)]  # one batch, formed when the delay ran out
    assert finish == pytest.approx(NOW + 0.001 + 0.002 + batch_s(2, 32))
