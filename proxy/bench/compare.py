"""Several arms on the same schedule, in one run, repeated with seeds.

An arm is a name and an async context that yields a :class:`TargetSpec` (where and how to
send): a ready URL, direct round robin over Triton servers, or anything started for the arm
and stopped after it (HAProxy, a triton-proxy process). Each repetition builds one schedule
from ``seed + repetition`` and runs every arm on it, one after another, rotating the arm order
between repetitions so slow drift of the machine does not always favour the same arm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proxy.bench.haproxy import Backend, Balance, run_haproxy
from proxy.bench.results import ArmResult, Repetition, Report, summarize_run
from proxy.bench.runner import (
    HttpTarget,
    LoadProbe,
    Progress,
    ProgressLine,
    RunRecords,
    Sleep,
    TargetSpec,
    run_schedule,
)
from proxy.bench.scenario import Arrival, Scenario, build_schedule
from proxy.clock import Clock, MonotonicClock

log = logging.getLogger(__name__)

ACCEL_SIM_NOTE = (
    "accel_sim simulates an accelerator's cost curve on CPU (fixed cost + per-token cost x batch "
    "x longest sequence): figures measure scheduling, not real GPU speed."
)


@dataclass(frozen=True)
class ArmSpec:
    name: str
    open: Callable[[], AbstractAsyncContextManager[TargetSpec]]
    """Starts whatever the arm needs and yields where to send; stops it on exit."""
    description: str = ""
    probe: Callable[[], LoadProbe] | None = None
    """Per-instance load probe for this arm (overrides the comparison's default)."""

    @classmethod
    def direct(
        cls,
        name: str,
        urls: Sequence[str],
        *,
        priority: bool = False,
        instance_names: Sequence[str] | None = None,
        description: str = "",
    ) -> ArmSpec:
        """Client-side round robin over Triton HTTP URLs, optionally with Triton priorities."""
        spec = TargetSpec(
            urls=tuple(urls),
            priority=priority,
            instance_names=tuple(instance_names) if instance_names is not None else None,
        )
        return cls(name, _ready(spec), description or _describe_direct(priority))

    @classmethod
    def url(
        cls, name: str, base_url: str, *, priority: bool = False, description: str = ""
    ) -> ArmSpec:
        """A base URL that is already serving (a running proxy, a load balancer)."""
        return cls(name, _ready(TargetSpec(urls=(base_url,), priority=priority)), description)

    @classmethod
    def started(
        cls,
        name: str,
        start: Callable[[], AbstractAsyncContextManager[str]],
        *,
        priority: bool = False,
        description: str = "",
        probe: Callable[[], LoadProbe] | None = None,
    ) -> ArmSpec:
        """``start()`` is an async context that starts the arm and yields its base URL."""

        @contextlib.asynccontextmanager
        async def open_() -> AsyncIterator[TargetSpec]:
            async with start() as base_url:
                yield TargetSpec(urls=(base_url,), priority=priority)

        return cls(name, open_, description, probe)


def _ready(spec: TargetSpec) -> Callable[[], AbstractAsyncContextManager[TargetSpec]]:
    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[TargetSpec]:
        yield spec

    return open_


def _describe_direct(priority: bool) -> str:
    return (
        "client round robin over Triton servers, class priority in parameters.priority"
        if priority
        else "client round robin over Triton servers (what a Kubernetes Service gives)"
    )


def haproxy_arm(
    balance: Balance,
    backends: Sequence[Backend],
    *,
    name: str | None = None,
    workdir: str | Path | None = None,
    priority: bool = False,
) -> ArmSpec:
    """HAProxy (Debian package) in front of ``backends``, started for the arm only."""
    return ArmSpec.started(
        name or f"haproxy_{balance}",
        lambda: run_haproxy(backends, balance, workdir=workdir),
        priority=priority,
        description=f"HAProxy balance {balance}" + (" + Triton priority" if priority else ""),
    )


def baseline_arms(
    backends: Sequence[Backend], *, workdir: str | Path | None = None, haproxy: bool = True
) -> list[ArmSpec]:
    """The arms every comparison carries: round robin, round robin + priority, HAProxy."""
    urls = [b.http_url for b in backends]
    names = [b.name for b in backends]
    arms = [
        ArmSpec.direct("round_robin", urls, instance_names=names),
        ArmSpec.direct("rr_priority", urls, priority=True, instance_names=names),
    ]
    if haproxy:
        arms += [
            haproxy_arm(b, backends, workdir=workdir) for b in ("leastconn", "random2", "session")
        ]
    return arms


async def run_comparison(
    scenario: Scenario,
    arms: Sequence[ArmSpec],
    *,
    repetitions: int | None = None,
    baseline: str | None = None,
    probe: Callable[[], LoadProbe] | None = None,
    settle_s: float = 2.0,
    progress: Progress | None = None,
    show_progress: bool = True,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
    note: str = ACCEL_SIM_NOTE,
    rng_for_seed: Callable[[int], np.random.Generator] = np.random.default_rng,
    on_run: Callable[[str, int, Sequence[Arrival], RunRecords], None] | None = None,
) -> Report:
    """Run every arm on the same schedule, ``repetitions`` times (default: the scenario's).

    ``baseline`` names the arm ratios are taken against (default: the first arm). An arm that
    fails to start is recorded as failed, with the reason, and the others still run.
    ``on_run(arm, repetition, schedule, records)`` sees each run's raw records (the request
    log).
    """
    if not arms:
        raise ValueError("run_comparison needs at least one arm")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    base = baseline if baseline is not None else names[0]
    if base not in names:
        raise ValueError(f"baseline {base!r} is not an arm; arms: {', '.join(names)}")
    reps = repetitions if repetitions is not None else scenario.repetitions
    clk = clock if clock is not None else MonotonicClock()
    bar = progress if progress is not None else (ProgressLine() if show_progress else None)
    report = Report(scenario=scenario, arms=names, baseline=base, note=note)
    for r in range(reps):
        seed = scenario.seed + r
        schedule = build_schedule(scenario, rng_for_seed(seed))
        shift = r % len(arms)
        order = [*arms[shift:], *arms[:shift]]
        rep = Repetition(index=r, seed=seed, order=[a.name for a in order], requests=len(schedule))
        report.repetitions.append(rep)
        for k, arm in enumerate(order):
            if k:
                await sleep(settle_s)  # let queues drain and connections close between arms
            async with contextlib.AsyncExitStack() as stack:
                try:
                    spec = await stack.enter_async_context(arm.open())
                except Exception as exc:  # any start failure: record it, run the other arms
                    log.warning("arm %s failed to start: %s", arm.name, exc)
                    rep.arms[arm.name] = _failed(arm.name, exc)
                    continue
                target = HttpTarget(f"{arm.name} #{r + 1}/{reps}", spec, scenario)
                stack.push_async_callback(target.aclose)
                make_probe = arm.probe or probe
                load_probe = make_probe() if make_probe is not None else None
                if load_probe is not None:
                    stack.push_async_callback(load_probe.aclose)
                rec = await run_schedule(
                    schedule,
                    target,
                    horizon_s=scenario.horizon_s,
                    clock=clk,
                    sleep=sleep,
                    progress=bar,
                    probe=load_probe,
                )
            if on_run is not None:
                on_run(arm.name, r, schedule, rec)
            rep.arms[arm.name] = summarize_run(arm.name, scenario, schedule, rec)
    return report


def _failed(name: str, exc: BaseException) -> ArmResult:
    return ArmResult(name=name, failed=f"{type(exc).__name__}: {exc}")
