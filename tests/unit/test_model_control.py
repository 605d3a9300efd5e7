"""The fan-out both admin frontends and the controller share."""

from __future__ import annotations

import asyncio

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, Instance, InstanceSpec
from proxy.fleet.model_control import FanOut, InstanceFailure, to_every_instance


def fleet(n: int) -> Fleet:
    specs = tuple(InstanceSpec(f"t{i}", f"http://127.0.0.1:{i + 1}") for i in range(n))
    return Fleet(specs, HealthConfig(), FakeClock())


def run(n: int, failing: set[str]) -> FanOut[str, int]:
    calls: list[str] = []

    async def call(instance: Instance) -> str:
        calls.append(instance.name)
        if instance.name in failing:
            raise InstanceFailure(503, f"{instance.name} down")
        return f"ok {instance.name}"

    out = asyncio.run(to_every_instance(fleet(n).all(), call))
    assert calls == [f"t{i}" for i in range(n)]  # every instance, whatever the others said
    return out


def test_all_succeed() -> None:
    out = run(3, set())
    assert out.failure() is None
    assert [a for _, a in out.answers] == ["ok t0", "ok t1", "ok t2"]


def test_first_failure_names_the_instance_and_the_count() -> None:
    out = run(3, {"t1", "t2"})
    failed = out.failure()
    assert failed is not None
    first, message = failed
    assert first.code == 503
    assert message == "t1 down (on instance 't1'; 2 of 3 instances failed)"


def test_single_instance_message_is_triton_s_own() -> None:
    out = run(1, {"t0"})
    failed = out.failure()
    assert failed is not None and failed[1] == "t0 down"
