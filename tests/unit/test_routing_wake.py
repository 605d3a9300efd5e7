"""Waking quiet instances (proxy.routing.wake): the scan, and placement's override."""

from __future__ import annotations

import contextlib
import random

import pytest

from proxy.fleet.instances import Resend, Work
from proxy.routing.base import RouteRequest
from proxy.routing.config import PolicySpec, RoutingConfig
from proxy.routing.engine import Router
from proxy.routing.wake import WakeParams, nudge_targets, quiet_instances, scraped_batch_s
from tests.unit.test_routing_view import least_requests_placement, world

BATCH_S = 0.010
WAKE = WakeParams()


def after(model: str) -> float | None:
    return WAKE.quiet_after_s(BATCH_S) if model == "m" else None


def test_quiet_after_is_a_margin_over_the_batch_time_and_never_unknown() -> None:
    assert WAKE.quiet_after_s(None) is None  # not learned yet: never judged quiet
    assert WAKE.quiet_after_s(0.030) == pytest.approx(0.060)
    assert WAKE.quiet_after_s(0.001) == pytest.approx(0.020)  # the floor
    with pytest.raises(ValueError, match="margin"):
        WakeParams(margin=0.5)


def test_an_instance_is_quiet_when_nothing_was_sent_to_it_for_longer_than_its_batches() -> None:
    with world(1, 3) as w:
        t0, t1, t2 = (w.fleet.get(n) for n in ("t0", "t1", "t2"))
        with contextlib.ExitStack() as stack:
            stack.enter_context(w.fleet.track(t0, "m"))  # short work, sent at 0
            stack.enter_context(w.fleet.track(t1, "m", work=Work(long=True)))  # long work
            stack.enter_context(w.fleet.track(t2, "other"))  # a model with no batch time
            now = w.clock.now()
            assert quiet_instances(w.fleet.instances.values(), now + 0.019, after) == {}
            # t0 only: long work may legitimately run that long; "other" is not learned
            assert quiet_instances(w.fleet.instances.values(), now + 0.021, after) == {"m": {"t0"}}
            # an answer (to any request) shows the instance is working: quiet again 20 ms later
            w.clock.advance(0.025)
            w.fleet.report_answer(t0)
            assert quiet_instances(w.fleet.instances.values(), now + 0.044, after) == {}
            assert quiet_instances(w.fleet.instances.values(), now + 0.046, after) == {"m": {"t0"}}
        # nothing in flight: never quiet, however long ago the last send was
        assert quiet_instances(w.fleet.instances.values(), now + 10, after) == {}
        with w.fleet.track(t0, "m"):
            w.fleet.eject(t0, "down")  # out of rotation: not quiet either
            assert quiet_instances(w.fleet.instances.values(), now + 10, after) == {}


def test_the_next_short_request_goes_to_a_quiet_instance_and_wakes_it_once() -> None:
    with world(2, 3) as w:
        woken: list[str] = []
        placement = least_requests_placement(w, 2)
        placement.on_wake = woken.append
        t0 = w.fleet.get("t0")
        with w.fleet.track(t0, "m"), w.fleet.track(t0, "m"):
            w.clock.advance(1.0)
            w.fleet.quiet = quiet_instances(w.fleet.instances.values(), w.clock.now(), after)
            short = RouteRequest(model="m", batch=16)
            # least_requests alone would avoid t0 (two in flight)
            chosen = placement.placer(short, placement, frozenset())
            assert chosen is not None and chosen.name != "t0"
            # not for long work
            assert placement.pick(RouteRequest(model="m", long=True), frozenset()).name != "t0"
            # nor where a retry excluded it
            assert placement.pick(short, frozenset({"t0"})).name != "t0"
            assert placement.pick(short, frozenset()).name == "t0"
            assert woken == ["t0"]
            # once: the next one goes where the policy says
            assert placement.pick(short, frozenset()).name != "t0"


def test_a_quiet_instance_without_a_free_slot_is_not_sent_more() -> None:
    with world(3, 2) as w:
        placement = least_requests_placement(w, 3)
        t0 = w.fleet.get("t0")
        w.limits = {("t0", "m"): 2}
        with w.fleet.track(t0, "m"), w.fleet.track(t0, "m"):
            w.clock.advance(1.0)
            w.fleet.quiet = quiet_instances(w.fleet.instances.values(), w.clock.now(), after)
            assert w.fleet.quiet == {"m": {"t0"}}
            assert placement.pick(RouteRequest(model="m"), frozenset()).name == "t1"


def test_a_send_there_ends_the_quiet() -> None:
    with world(4, 2) as w:
        t0 = w.fleet.get("t0")
        with w.fleet.track(t0, "m"):
            w.clock.advance(1.0)
            w.fleet.quiet = quiet_instances(w.fleet.instances.values(), w.clock.now(), after)
            assert w.fleet.quiet == {"m": {"t0"}}
            with w.fleet.track(t0, "m"):
                assert w.fleet.quiet == {"m": set()}


def test_an_answer_from_there_ends_the_quiet() -> None:
    # A mark left until the next scan sent a canary's round-robin request to the main arm's
    # home instance after its one request had been answered (a CI failure of test_canary).
    with world(4, 2) as w:
        t0 = w.fleet.get("t0")
        with w.fleet.track(t0, "m"):
            w.clock.advance(1.0)
            w.fleet.quiet = quiet_instances(w.fleet.instances.values(), w.clock.now(), after)
            assert w.fleet.quiet == {"m": {"t0"}}
        assert w.fleet.quiet == {"m": set()}


def test_an_instance_that_has_not_answered_since_its_wake_is_not_woken_again() -> None:
    # A stalled batcher answers within a batch time of the wake; a frozen server does not,
    # and must not draw a short request every min_quiet_ms until it is ejected.
    with world(5, 2) as w:
        placement = least_requests_placement(w, 2)
        t0 = w.fleet.get("t0")

        def scan() -> dict[str, set[str]]:
            w.fleet.quiet = quiet_instances(w.fleet.instances.values(), w.clock.now(), after)
            return w.fleet.quiet

        with w.fleet.track(t0, "m"), w.fleet.track(t0, "m"):
            w.clock.advance(1.0)
            assert scan() == {"m": {"t0"}}
            woken = placement.pick(RouteRequest(model="m"), frozenset())
            assert woken is t0
            with w.fleet.track(t0, "m"):
                w.clock.advance(1.0)
                assert scan() == {}  # no answer since the wake
                w.fleet.report_answer(t0)
                w.clock.advance(1.0)
                assert scan() == {"m": {"t0"}}  # it answered: a later stall is woken again


def test_by_work_an_instance_is_judged_by_the_work_it_holds() -> None:
    # A stalled instance usually holds a few short requests, whose batch takes far less than
    # a full one (module doc): 5 ms + 20 us per unit of estimated cost, one batch of it all.
    def after_work(model: str, cost: float) -> float | None:
        return WAKE.quiet_after_s(0.005 + 20e-6 * cost) if model == "m" else None

    def full_batch(model: str) -> float | None:  # a full batch of 40 ms: quiet after 80 ms
        return WAKE.quiet_after_s(0.040)

    with world(7, 3) as w:
        t0, t1, t2 = (w.fleet.get(n) for n in ("t0", "t1", "t2"))
        with contextlib.ExitStack() as stack:
            stack.enter_context(w.fleet.track(t0, "m", work=Work(cost=40.0)))
            stack.enter_context(w.fleet.track(t0, "m", work=Work(cost=60.0)))
            stack.enter_context(w.fleet.track(t1, "m", work=Work(cost=1200.0)))
            stack.enter_context(w.fleet.track(t2, "m", work=Work(long=True, cost=512.0)))
            assert t0.cost_in_flight == {"m": 100.0}
            now = w.clock.now()
            scan = lambda dt: quiet_instances(  # noqa: E731
                w.fleet.instances.values(), now + dt, full_batch, after_work
            )
            # t0: 2 x (5 + 0.02 x 100) = 14 ms, under the 20 ms floor; t1: 2 x 29 = 58 ms;
            # t2 runs long work and is never judged
            assert scan(0.019) == {}
            assert scan(0.021) == {"m": {"t0"}}
            assert scan(0.059) == {"m": {"t0", "t1"}}
            assert scan(10) == {"m": {"t0", "t1"}}
            # without by_work, both wait for the full-batch rule
            assert quiet_instances(w.fleet.instances.values(), now + 0.079, full_batch) == {}
            # a model without a learned curve falls back to the full-batch rule
            unknown = lambda model, cost: None  # noqa: E731
            judge = lambda dt: quiet_instances(  # noqa: E731
                w.fleet.instances.values(), now + dt, full_batch, unknown
            )
            assert judge(0.079) == {}
            assert judge(0.081) == {"m": {"t0", "t1"}}
        assert t0.cost_in_flight == {} == t1.cost_in_flight  # nothing left behind


@pytest.mark.parametrize(
    ("policy", "wakes"), [("consistent_hash", False), ("least_requests", True)]
)
def test_a_keyed_request_wakes_unless_the_policy_keeps_sessions(policy: str, wakes: bool) -> None:
    with world(6, 3) as w:
        router = Router(
            RoutingConfig(policy=PolicySpec(name=policy, params={})), w.clock, random.Random(6)
        )
        placement = w.placement(router)
        keyed = RouteRequest(model="m", session_key="s")
        home = placement.pick(keyed, frozenset())
        assert home is not None
        quiet = next(i for i in w.fleet.instances.values() if i is not home)
        with w.fleet.track(quiet, "m"):
            w.clock.advance(1.0)
            w.fleet.quiet = quiet_instances(w.fleet.instances.values(), w.clock.now(), after)
            assert w.fleet.quiet == {"m": {quiet.name}}
            assert (placement.pick(keyed, frozenset()) is quiet) is wakes


def test_without_a_learned_curve_the_batch_time_comes_from_tritons_compute_time() -> None:
    # the largest mean compute time per request (= per batch) any instance reported
    assert scraped_batch_s([12_000.0, None, 30_000.0]) == pytest.approx(0.030)
    assert scraped_batch_s([None, 0.0]) is None  # nothing reported: never judged
    assert scraped_batch_s([]) is None


def test_nudge_targets_are_the_quiet_instances_holding_a_request_to_resend() -> None:
    with world(1, 3) as w:
        t0, t1, t2 = (w.fleet.get(n) for n in ("t0", "t1", "t2"))

        async def again() -> None:
            return None

        t0.resend["m"] = Resend(again, expired=False)
        t1.resend["other"] = Resend(again, expired=False)  # quiet for "m": nothing to resend
        t2.resend["m"] = t2.resend["n"] = Resend(again, expired=True)
        quiet = {"m": {"t0", "t1", "t2"}, "n": {"t2"}}
        got = [
            (inst.name, model, resend)
            for inst, model, resend in nudge_targets(quiet, w.fleet.instances)
        ]
        # t2 is quiet for two models: one copy wakes its batcher for one of them; the other
        # model's stalled requests still have the redirect (and the next scan).
        assert got == [("t0", "m", again), ("t2", "m", again)]
        assert nudge_targets({}, w.fleet.instances) == []


def test_the_doorbell_judges_only_instances_with_an_expired_copy_and_sooner_than_a_batch() -> None:
    # routing.wake.ring_after_ms: an expired copy costs no device time, so an instance
    # holding one is judged after the doorbell's delay, long or short work alike; others
    # keep the margin over their batch time (a request redirected there would join a batch
    # that may be running normally).
    async def again() -> None:
        return None

    with world(7, 3) as w:
        t0, t1, t2 = (w.fleet.get(n) for n in ("t0", "t1", "t2"))
        with contextlib.ExitStack() as stack:
            stack.enter_context(w.fleet.track(t0, "m"))
            stack.enter_context(w.fleet.track(t1, "m", work=Work(long=True)))
            stack.enter_context(w.fleet.track(t2, "m"))
            t0.resend["m"] = Resend(again, expired=True)
            t1.resend["m"] = Resend(again, expired=True)
            t2.resend["m"] = Resend(again, expired=False)
            now = w.clock.now()

            def judged(at: float) -> dict[str, set[str]]:
                return quiet_instances(w.fleet.instances.values(), at, after, None, 0.003)

            assert judged(now + 0.002) == {}
            assert judged(now + 0.004) == {"m": {"t0", "t1"}}
            assert judged(now + 0.021) == {"m": {"t0", "t1", "t2"}}  # t2 by its batch time
            # without the doorbell the same instances wait for the margin
            assert quiet_instances(w.fleet.instances.values(), now + 0.004, after) == {}
            # woken and not answered since: not judged again
            t0.woken_at = now + 0.004
            assert judged(now + 0.010) == {"m": {"t1"}}
            w.clock.advance(0.010)
            w.fleet.report_answer(t0)  # rings again 3 ms after its answer
            assert judged(now + 0.012) == {"m": {"t1"}}
            assert judged(now + 0.0135) == {"m": {"t0", "t1"}}
    with pytest.raises(ValueError, match="ring_after_ms"):
        WakeParams(ring_after_ms=0)
    # the doorbell rings only where its copy is an expired one
    assert WakeParams(nudge=True, expired_copy=True, ring_after_ms=3).ring_after_s() == 0.003
    assert WakeParams(nudge=True, ring_after_ms=3).ring_after_s() is None
    assert WakeParams(expired_copy=True, ring_after_ms=3).ring_after_s() is None
    assert WakeParams(nudge=True, expired_copy=True).ring_after_s() is None


def test_an_instance_holding_long_work_is_judged_only_with_an_expired_copy_to_send() -> None:
    # A copy that Triton rejects as expired costs no device time, so a stalled long request
    # can be nudged too (routing.wake.expired_copy). A real copy would run again, and a
    # short request redirected there would join the padded batch: then it is not judged.
    async def again() -> None:
        return None

    with world(6, 1) as w:
        t0 = w.fleet.get("t0")
        with w.fleet.track(t0, "m", work=Work(long=True)):
            w.clock.advance(1.0)
            now = w.clock.now()
            assert quiet_instances(w.fleet.instances.values(), now, after) == {}
            t0.resend["m"] = Resend(again, expired=False)  # a model that ignores timeouts
            assert quiet_instances(w.fleet.instances.values(), now, after) == {}
            t0.resend["m"] = Resend(again, expired=True)
            assert quiet_instances(w.fleet.instances.values(), now, after) == {"m": {"t0"}}
