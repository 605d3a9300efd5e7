"""Dispatch under faults (issue 9, point 5), in seconds, against recording fakes.

"Reached" is judged by what the fakes recorded: a request a fake recorded reached it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.config import LimitsConfig
from tests.fakes.triton import FakeFleet, Fault
from tests.middle.conftest import FAST_HEALTH, ProxyFactory, infer_doc, port_of, raw, wait_for

BODY = json.dumps(infer_doc()).encode()
ROUND_ROBIN = {
    "routing": {"policy": {"name": "round_robin"}, "retry": {"max_retries": 1, "budget_ratio": 1.0}}
}


def infer(port: int, model: str = "simple", body: bytes = BODY, timeout_s: float = 20) -> Any:
    return raw(port, "POST", f"/v2/models/{model}/infer", [], body, timeout_s=timeout_s)


def statuses(port: int, n: int, model: str = "simple") -> list[int | None]:
    return [infer(port, model).status for _ in range(n)]


def test_refused_connection_is_retried_elsewhere(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    with proxy_on(ROUND_ROBIN) as proxy:
        port = port_of(proxy)
        assert statuses(port, 6) == [200] * 6
        fakes.kill(0)
        got = statuses(port, 30)
    assert got == [200] * 30, got


def test_pooled_connections_to_a_dead_server_never_fail_a_request(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """The issue's 1-in-3 flake made deterministic: every instance has idle pooled
    connections when one dies; the next requests must all succeed."""
    with proxy_on(ROUND_ROBIN) as proxy:
        port = port_of(proxy)
        for _ in range(5):
            assert statuses(port, 6) == [200] * 6
            fakes.kill(1)
            got = statuses(port, 12)
            assert got == [200] * 12, got
            fakes.restart(1)
            wait_for(lambda: proxy.runtime.fleet.get("fake-1").healthy, what="fake-1 back")


def test_connection_lost_before_any_answer_byte_is_retried_for_a_stateless_model(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    fakes.servers[0].faults.append(Fault("close", models=frozenset({"simple"})))
    with proxy_on(ROUND_ROBIN) as proxy:
        got = statuses(port_of(proxy), 12)
    assert got == [200] * 12, got
    assert fakes.servers[0].inferences(), "fake-0 never received a request (test did not bite)"


def test_connection_lost_mid_sequence_is_not_retried_and_is_a_triton_error(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    with proxy_on(ROUND_ROBIN) as proxy:
        port = port_of(proxy)
        start = json.dumps(infer_doc({"sequence_id": 7, "sequence_start": True}, 0)).encode()
        assert infer(port, "seq", start).status == 200
        holder = next(f for f in fakes.servers if f.inferences())
        holder.faults.append(Fault("close"))
        step = json.dumps(infer_doc({"sequence_id": 7}, 0)).encode()
        r = infer(port, "seq", step)
    assert r.status is not None and r.status >= 400 and r.triton_error(), (r.status, r.body)
    assert r.status != 500, f"a lost sequence is a clear error, not 500: {r.body!r}"
    continued = [x for x in fakes.inferences() if (x.parameters or {}).get("sequence_id") == 7]
    assert {x.instance for x in continued} == {holder.name}, "a sequence step was retried elsewhere"


def test_one_lost_connection_does_not_eject(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    health = dict(FAST_HEALTH, eject_after_failures=3, interval_s=5.0)
    fakes.servers[0].faults.append(Fault("close", count=1))
    with proxy_on(dict(ROUND_ROBIN, health=health)) as proxy:
        got = statuses(port_of(proxy), 6)
        healthy = proxy.runtime.fleet.get("fake-0").healthy
    assert got == [200] * 6, got
    assert healthy, "one broken connection ejected the instance (eject_after_failures: 3)"


def test_n_consecutive_failures_eject(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    # No re-probe during the test (backoff 5 s): with FAST_HEALTH's 0.1 s, a loaded machine let
    # the prober readmit the instance (its readiness answers) before the check below read it.
    health = dict(
        FAST_HEALTH,
        eject_after_failures=2,
        interval_s=5.0,
        backoff_initial_s=5.0,
        backoff_max_s=5.0,
    )
    fakes.servers[0].faults.append(Fault("close"))
    with proxy_on(dict(ROUND_ROBIN, health=health)) as proxy:
        got = statuses(port_of(proxy), 12)
        healthy = proxy.runtime.fleet.get("fake-0").healthy
    assert got == [200] * 12, got
    assert not healthy, "an instance that breaks every connection stays in rotation"


def test_a_model_unloaded_on_one_instance_leaves_its_other_models_in_rotation(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """As Triton 2.51 does after an unload (measured on the faults branch): the server stays
    ready, the model's own readiness answers 400 and its requests 404 "Request for unknown
    model". The model leaves rotation there; the instance keeps serving its other models."""
    with proxy_on(ROUND_ROBIN) as proxy:
        port = port_of(proxy)
        assert statuses(port, 6) == [200] * 6
        victim = fakes.servers[0]
        victim.models.pop("simple")
        fakes.clear()
        simple = statuses(port, 30, "simple")
        plain = statuses(port, 30, "plain")
    assert simple == [200] * 30, simple
    assert plain == [200] * 30, plain
    on_victim = [r.model for r in victim.inferences()]
    # The first one or two may still be sent there (then retried elsewhere); not ten.
    assert on_victim.count("simple") <= 2, "requests for the unloaded model still sent there"
    assert "plain" in on_victim, "the whole instance left rotation for one unloaded model"


def test_upstream_read_timeout_default_is_finite() -> None:
    assert LimitsConfig().request_timeout_s is not None, "no default upstream read timeout"


def test_a_hung_instance_times_out_as_configured(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    fakes.servers[0].faults.append(Fault("hang", models=frozenset({"simple"})))
    policy = dict(ROUND_ROBIN, limits={"connect_timeout_s": 1.0, "request_timeout_s": 0.5})
    try:
        with proxy_on(policy) as proxy:
            port = port_of(proxy)
            answers = [infer(port, timeout_s=30) for _ in range(6)]
    finally:
        fakes.servers[0].release()
    hung = [a for a in answers if a.status != 200]
    assert hung, "no request reached the hung instance (test did not bite)"
    for a in hung:
        assert a.status is not None and a.status in (503, 504), (a.status, a.error, a.body)
        assert a.triton_error(), a.body
    assert len(hung) <= 2, f"{len(hung)} of 6 failed: the others went to healthy instances"


def test_triton_5xx_is_relayed_unchanged(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    for fake in fakes.servers:
        fake.faults.append(Fault("status", status=500, message="boom from triton"))
    with proxy_on(ROUND_ROBIN) as proxy:
        r = infer(port_of(proxy))
    assert r.status == 500 and r.triton_error() == "boom from triton", (r.status, r.body)


@pytest.mark.parametrize("kind", ["delay"])
def test_slow_instance_does_not_fail_requests(
    proxy_on: ProxyFactory, fakes: FakeFleet, kind: str
) -> None:
    fakes.servers[1].faults.append(Fault("delay", delay_s=0.3))
    with proxy_on(ROUND_ROBIN) as proxy:
        got = statuses(port_of(proxy), 6)
    assert got == [200] * 6
