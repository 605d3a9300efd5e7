"""The loops' wiring: request records in, decisions applied to the gate (or only reported in dry
run), the batching window handed to the applier, refusals turning the loop off once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from proxy.clock import FakeClock
from proxy.control.apply import ApplyResult
from proxy.control.config import BatchingConfig, ClassLimitsConfig, ControlConfig
from proxy.control.loops import ControlLoops
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.instances import Fleet, HealthConfig, Instance, InstanceSpec
from proxy.fleet.snapshot import InstanceSnapshot
from proxy.observer import RequestRecord
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.gate import GateObserver
from proxy.scheduling.models import ModelGates
from proxy.telemetry import Telemetry, control_metrics

INFO = ModelInfo(max_batch_size=8, priority_levels=3, model_instances=1, decoupled=False)


class FakeApplier:
    """Stands in for the drained reload (tested against real Triton in tests/integration)."""

    def __init__(self, window: int | None = 2000, refuse: bool = False) -> None:
        self.window = window
        self.refuse = refuse
        self.applied: list[tuple[str, int]] = []
        self.on_window: Any = lambda i, m, w: None

    async def read(self, instance: Instance, model: str) -> int | None:
        self.on_window(instance.name, model, self.window)
        return self.window

    async def apply(self, model: str, window_us: int, **_: float) -> ApplyResult:
        self.applied.append((model, window_us))
        if self.refuse:
            return ApplyResult(failed="a: load refused: not allowed", refused=True)
        self.window = window_us
        for name in ("a", "b"):
            self.on_window(name, model, window_us)
        return ApplyResult(changed=["a", "b"])


def make(
    control: ControlConfig, applier: FakeApplier
) -> tuple[ControlLoops, ModelGates, Telemetry, FakeClock]:
    clock = FakeClock(1000.0)
    fleet = Fleet(
        (InstanceSpec("a", "http://127.0.0.1:1"), InstanceSpec("b", "http://127.0.0.1:2")),
        HealthConfig(),
        clock,
    )
    sched = SchedulingConfig()
    gates = ModelGates(sched, fleet, clock, GateObserver())
    gates.gate("m", INFO)
    telemetry = Telemetry()
    loops = ControlLoops(
        control,
        sched,
        fleet=fleet,
        gates=lambda: gates,
        snapshots=lambda: {"a": InstanceSnapshot(taken_at=clock.now())},
        applier=applier,  # type: ignore[arg-type]
        clock=clock,
        telemetry=telemetry,
    )
    telemetry.registry.register(_LoopsCollector(loops))
    return loops, gates, telemetry, clock


class _LoopsCollector(Collector):
    def __init__(self, loops: ControlLoops) -> None:
        self.loops = loops

    def collect(self) -> Iterator[Metric]:
        return control_metrics(self.loops)


def feed(
    loops: ControlLoops, clock: FakeClock, latency_s: float, n: int = 100, outcome: str = "200"
) -> None:
    for _ in range(n):
        loops.on_request(
            RequestRecord("m", "realtime", "a", outcome, latency_s, 0.0, 1.0, False, clock.now())
        )


@pytest.mark.parametrize(
    ("outcome", "p99_s"),
    [
        ("200", 0.05),  # HTTP answers carry Triton's status
        ("ok", 0.05),  # gRPC
        ("shed_late", 1.0),  # a shed counts as 10 x the 100 ms SLO
        ("503", 1.0),
        ("unavailable", 1.0),
        ("400", None),  # the client's mistake says nothing about the SLO
    ],
)
def test_outcomes_feed_the_class_p99(outcome: str, p99_s: float | None) -> None:
    loops, _, _, clock = make(LIMITS, FakeApplier())
    feed(loops, clock, 0.05, outcome=outcome)
    got = loops.p99("m", "realtime", clock.now())
    assert got == (None if p99_s is None else pytest.approx(p99_s, rel=0.02))


def samples(telemetry: Telemetry, name: str) -> dict[tuple[str, ...], float]:
    out = {}
    for family in text_string_to_metric_families(telemetry.exposition().decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


LIMITS = ControlConfig(class_limits=ClassLimitsConfig(enabled=True), min_samples=10)


@pytest.mark.parametrize("dry_run", [False, True])
def test_class_limit_decision_applied_or_only_reported(
    dry_run: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses

    loops, gates, telemetry, clock = make(
        dataclasses.replace(LIMITS, dry_run=dry_run), FakeApplier()
    )
    feed(loops, clock, 0.2)  # realtime p99 200 ms against its 100 ms SLO
    with caplog.at_level(logging.INFO, logger="proxy.control"):
        asyncio.run(loops.tick())
    gate = gates.gates["m"]
    limited = gate._core._scale.get("offline", 1.0)
    assert limited == (1.0 if dry_run else 0.5)
    counter = (
        "triton_proxy_control_dry_run_decisions_total"
        if dry_run
        else ("triton_proxy_control_decisions_total")
    )
    got = samples(telemetry, counter)
    key = (("direction", "down"), ("loop", "class_limits"), ("model", "m"),
           ("reason", "slo_violation"))  # fmt: skip
    assert got == {key: 1.0}
    # The exported limit is what the loop decided (or would have): offline's max_share (0.5
    # by default) x 0.5.
    limits = samples(telemetry, "triton_proxy_class_limit")
    assert limits[(("class", "offline"), ("model", "m"))] == pytest.approx(0.25)
    assert limits[(("class", "online"), ("model", "m"))] == pytest.approx(1.0)
    (line,) = [r.getMessage() for r in caplog.records if "class_limits" in r.getMessage()]
    assert "slo_violation" in line and "offline" in line
    assert line.startswith("dry run") == dry_run


def test_turning_class_limits_off_gives_the_share_back() -> None:
    loops, gates, _, clock = make(LIMITS, FakeApplier())
    feed(loops, clock, 0.2)
    asyncio.run(loops.tick())
    assert gates.gates["m"]._core._scale["offline"] == 0.5
    loops.reconfigure(ControlConfig(), SchedulingConfig())
    assert gates.gates["m"]._core._scale["offline"] == 1.0


BATCHING = ControlConfig(
    batching=BatchingConfig(enabled=True, dwell_s=60.0, min_us=500), min_samples=10
)


def test_batching_decision_goes_to_the_applier_once_per_dwell() -> None:
    applier = FakeApplier(window=2000)
    loops, _, telemetry, clock = make(BATCHING, applier)

    async def run() -> None:
        feed(loops, clock, 0.2)
        await loops.tick()
        await asyncio.sleep(0)  # the apply task runs
        await asyncio.sleep(0)
        clock.advance(30.0)
        feed(loops, clock, 0.2)
        await loops.tick()  # within the dwell: nothing
        await loops.stop()

    asyncio.run(run())
    assert applier.applied == [("m", 1000)]
    assert loops.window_target["m"] == 1000
    windows = samples(telemetry, "triton_proxy_batching_window_seconds")
    assert windows == {
        (("instance", "a"), ("model", "m")): 0.001,
        (("instance", "b"), ("model", "m")): 0.001,
    }


def test_dry_run_batching_reports_without_applying() -> None:
    import dataclasses

    applier = FakeApplier(window=2000)
    loops, _, telemetry, clock = make(dataclasses.replace(BATCHING, dry_run=True), applier)
    feed(loops, clock, 0.2)
    asyncio.run(loops.tick())
    assert applier.applied == []
    assert loops.window_target["m"] == 1000  # what it would run
    target = samples(telemetry, "triton_proxy_batching_window_target_seconds")
    assert target == {(("model", "m"),): 0.001}


def test_refusal_turns_the_loop_off_once(caplog: pytest.LogCaptureFixture) -> None:
    applier = FakeApplier(window=2000, refuse=True)
    loops, _, telemetry, _ = make(BATCHING, applier)

    async def run() -> None:
        with caplog.at_level(logging.WARNING, logger="proxy.control"):
            await loops.apply_window("m", 1000)
            await loops.apply_window("m", 500)

    asyncio.run(run())
    assert applier.applied == [("m", 1000)]
    assert loops.off_models == {"m"}
    off = samples(telemetry, "triton_proxy_control_off_total")
    assert off == {(("loop", "batching"), ("model", "m"), ("reason", "refused")): 1.0}
    warnings = [r.getMessage() for r in caplog.records if "explicit" in r.getMessage()]
    assert len(warnings) == 1


def test_not_leader_does_nothing() -> None:
    loops, gates, _, clock = make(LIMITS, FakeApplier())
    loops.is_leader = lambda: False

    async def run() -> None:
        feed(loops, clock, 0.2)
        await loops.start()
        await asyncio.sleep(1.2)
        await loops.stop()

    asyncio.run(run())
    assert gates.gates["m"]._core._scale == {}
