"""``routing.wake.nudge`` against fakes that stall as Triton's dynamic batcher can: a request
left queued on an idle instance until the next request for its model arrives
(docs/triton-notes.md, "Dynamic batcher"). The nudge is that arrival: a copy of a short,
stateless request the quiet instance holds, its answer dropped."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.fakes.triton import FakeFleet, Fault, default_models
from tests.integration.harness import ProxyThread
from tests.middle.conftest import (
    ProxyFactory,
    grpc_inputs,
    http_inputs,
    infer_doc,
    port_of,
    raw,
    running_proxy,
    wait_for,
    with_defaults,
)

WAKE = {"min_quiet_ms": 20, "scan_ms": 5, "margin": 1.0}
"""Quiet 20 ms after the last send or answer (the fakes answer in about a millisecond)."""


def policy(nudge: bool) -> dict[str, Any]:
    return {
        "routing": {"policy": {"name": "round_robin"}, "wake": {**WAKE, "nudge": nudge}},
        "limits": {"connect_timeout_s": 1.0, "request_timeout_s": 30},
    }


def timed_models() -> dict[str, dict[str, Any]]:
    """The fakes' models, ``simple`` honouring a request's ``timeout`` as accel_sim does."""
    models = default_models()
    batching = models["simple"]["dynamic_batching"]
    batching["default_queue_policy"] = {
        "allow_timeout_override": True,
        "default_timeout_microseconds": "300000000",
    }
    return models


@pytest.fixture
def fakes() -> Iterator[FakeFleet]:
    with FakeFleet(3, models=timed_models) as fleet:
        yield fleet


def nudges(proxy: ProxyThread) -> int:
    registry = proxy.runtime.telemetry.registry
    return int(
        sum(
            registry.get_sample_value("triton_proxy_quiet_nudges_total", {"instance": i.name}) or 0
            for i in proxy.runtime.fleet.all()
        )
    )


def warm(proxy: ProxyThread) -> None:
    """Requests that run alone, so the proxy learns the model's batch time (an instance is
    judged quiet only against a known one)."""
    port = port_of(proxy)
    body = json.dumps(infer_doc()).encode()
    for _ in range(12):
        assert raw(port, "POST", "/v2/models/simple/infer", [], body).status == 200
    wait_for(
        lambda: proxy.runtime.dispatcher.costs.seconds("simple", 32) is not None,
        what="the learned batch time",
    )


def stall_everywhere(fakes: FakeFleet, model: str) -> None:
    for fake in fakes.servers:
        fake.faults.append(Fault("stall", models=frozenset({model}), count=1))


def in_thread(send: Any) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(send()), daemon=True)
    t.start()
    return t, got


def held_request(proxy: ProxyThread, fakes: FakeFleet, wait_s: float) -> Any:
    """A request for ``simple`` sent in a thread after every fake is set to stall it, and
    waited for ``wait_s``: (thread, its answers, a function that ends the stall the way
    Triton's ends, by arrivals, and waits for the answer)."""
    warm(proxy)
    stall_everywhere(fakes, "simple")
    body = json.dumps(infer_doc()).encode()
    port = port_of(proxy)
    t, got = in_thread(lambda: raw(port, "POST", "/v2/models/simple/infer", [], body).status)
    t.join(wait_s)

    def release() -> None:
        for fake in fakes.servers:  # only the request already held stays stalled
            fake.faults.clear()
        # The next requests: round robin (or the wake) sends one to the stalled one's fake.
        for _ in range(3):
            assert raw(port, "POST", "/v2/models/simple/infer", [], body).status == 200
        t.join(5)
        assert got == [200]

    return t, got, release


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_stalled_request_is_released_by_a_copy_and_answered_once(
    proxy_on: ProxyFactory, fakes: FakeFleet, protocol: str
) -> None:
    with proxy_on(policy(nudge=True)) as proxy:
        warm(proxy)
        stall_everywhere(fakes, "simple")
        before = [len(f.inferences()) for f in fakes.servers]
        started = time.monotonic()
        if protocol == "http":
            with httpclient.InferenceServerClient(f"127.0.0.1:{port_of(proxy)}") as c:
                answer = c.infer("simple", http_inputs())
        else:
            assert proxy.ports is not None
            with grpcclient.InferenceServerClient(f"127.0.0.1:{proxy.ports.grpc}") as c:
                answer = c.infer("simple", grpc_inputs())
        took = time.monotonic() - started
        assert answer.as_numpy("OUTPUT0") is not None
        assert took < 5.0, f"the stalled request waited {took:.1f} s"
        assert nudges(proxy) == 1
        # The request and its copy reached the same instance; the client got one answer.
        wait_for(lambda: sum(len(f.inferences()) for f in fakes.servers) == sum(before) + 2)
        added = [len(f.inferences()) - n for f, n in zip(fakes.servers, before, strict=True)]
        assert sorted(added) == [0, 0, 2], added


def test_without_the_nudge_a_stalled_request_waits_for_the_next_arrival(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """The control: the fakes' stall holds the request until another request arrives."""
    with proxy_on(policy(nudge=False)) as proxy:
        t, got, release = held_request(proxy, fakes, 0.5)
        assert t.is_alive() and not got, "the stall did not hold the request"
        release()
        assert nudges(proxy) == 0


def test_a_sequence_request_is_never_copied(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    with proxy_on(policy(nudge=True)) as proxy:
        warm(proxy)
        stall_everywhere(fakes, "seq")
        port = port_of(proxy)
        start = json.dumps(infer_doc({"sequence_id": 9, "sequence_start": True}, 0)).encode()
        t, got = in_thread(lambda: raw(port, "POST", "/v2/models/seq/infer", [], start).status)
        t.join(0.5)
        assert t.is_alive() and not got
        assert nudges(proxy) == 0
        seen = [r for f in fakes.servers for r in f.inferences() if r.path.endswith("/seq/infer")]
        assert len(seen) == 1, "a sequence step reached Triton twice"
        for fake in fakes.servers:  # end the stall the way Triton's would end
            fake.faults.clear()
        other = json.dumps(infer_doc({"sequence_id": 10, "sequence_start": True}, 0)).encode()
        for _ in range(3):
            assert raw(port, "POST", "/v2/models/seq/infer", [], other).status == 200
        t.join(5)
        assert got == [200]


def test_an_expired_copy_releases_a_stalled_request(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """``expired_copy``: the copy carries Triton's ``timeout`` of 1 µs, so a real Triton
    rejects it when it forms the batch (tests/integration/test_cancellation.py shows that
    with the real server); its arrival is what releases the stall."""
    doc = policy(nudge=True)
    doc["routing"]["wake"]["expired_copy"] = True
    with proxy_on(doc) as proxy:
        warm(proxy)
        stall_everywhere(fakes, "simple")
        before = [len(f.inferences()) for f in fakes.servers]
        with httpclient.InferenceServerClient(f"127.0.0.1:{port_of(proxy)}") as c:
            answer = c.infer("simple", http_inputs())
        assert answer.as_numpy("OUTPUT0") is not None
        assert nudges(proxy) == 1
        wait_for(lambda: sum(len(f.inferences()) for f in fakes.servers) == sum(before) + 2)
        fake = next(
            f for f, n in zip(fakes.servers, before, strict=True) if len(f.inferences()) > n
        )
        original, copy = fake.inferences()[-2:]
        assert "timeout" not in (original.parameters or {})
        assert (copy.parameters or {}).get("timeout") == 1


@pytest.mark.parametrize("expired", [True, False])
def test_the_doorbell_rings_only_with_an_expired_copy(
    proxy_on: ProxyFactory, fakes: FakeFleet, expired: bool
) -> None:
    """``ring_after_ms``: with ``expired_copy`` a stalled request is released after that
    silence, long before the margin rule (here 10 s) would judge its instance; without an
    expired copy to send the doorbell does not ring, and the request stays stalled."""
    doc = policy(nudge=True)
    doc["routing"]["wake"].update(
        {"expired_copy": expired, "ring_after_ms": 5, "min_quiet_ms": 10_000}
    )
    with proxy_on(doc) as proxy:
        t, got, release = held_request(proxy, fakes, 1.0)
        if expired:
            assert got == [200], "the doorbell did not release the stalled request"
            # At least once: it rings again, legitimately, when the held request's answer
            # comes more than ring_after_ms after the expired copy's (seen once in CI on a
            # loaded 2-core machine: 2 rings).
            assert nudges(proxy) >= 1
            return
        assert t.is_alive() and not got, "released without an expired copy to send"
        assert nudges(proxy) == 0
        release()


@pytest.mark.parametrize("honours_timeout", [True, False])
def test_without_real_copies_only_a_model_that_honours_timeouts_is_copied(
    honours_timeout: bool,
) -> None:
    """``real_copy: false`` (the default with classes): an expired copy still rings the
    doorbell, but a model whose queue policy ignores a request's timeout gets no copy at
    all, since that one would run."""
    doc = policy(nudge=True)
    doc["routing"]["wake"].update(
        {"expired_copy": True, "real_copy": False, "ring_after_ms": 5, "min_quiet_ms": 10_000}
    )
    models = timed_models if honours_timeout else default_models
    with (
        FakeFleet(3, models=models) as fleet,
        running_proxy(fleet.servers, with_defaults(doc)) as proxy,
    ):
        t, got, release = held_request(proxy, fleet, 1.0)
        if honours_timeout:
            assert got == [200], "the doorbell did not release the stalled request"
            assert nudges(proxy) >= 1  # a slow warm-up request may have drawn one too
            return
        assert t.is_alive() and not got, "a model that ignores timeouts was copied"
        assert nudges(proxy) == 0
        release()
