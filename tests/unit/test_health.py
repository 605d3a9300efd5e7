"""Readiness probes against a tiny HTTP server standing in for Triton's health endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.clock import MonotonicClock
from proxy.fleet.health import HealthChecker
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec


@pytest.fixture
async def slow_server() -> AsyncIterator[str]:
    async def ready(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # slower than the probe's timeout
        return web.Response()

    app = web.Application()
    app.router.add_get("/v2/health/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.parametrize("answering", [True, False], ids=["busy", "silent"])
async def test_probe_timeout_ejects_only_a_server_that_stopped_answering(
    slow_server: str, answering: bool
) -> None:
    clock = MonotonicClock()
    fleet = Fleet(
        (InstanceSpec("t0", slow_server),),
        HealthConfig(timeout_s=0.2, eject_after_failures=1),
        clock,
    )
    inst = fleet.get("t0")
    if answering:
        inst.last_answer_at = clock.now()  # it just answered a forwarded request
    checker = HealthChecker(fleet)
    try:
        await checker.probe(inst)
    finally:
        await checker.stop()
    assert inst.healthy is answering
    if not answering:
        assert "timed out" in inst.ejected_reason


async def test_refused_connection_ejects_even_a_recently_busy_server() -> None:
    clock = MonotonicClock()
    fleet = Fleet((InstanceSpec("t0", "http://127.0.0.1:9"),), HealthConfig(), clock)
    inst = fleet.get("t0")
    inst.last_answer_at = clock.now()
    checker = HealthChecker(fleet)
    try:
        await checker.probe(inst)
    finally:
        await checker.stop()
    assert not inst.healthy
