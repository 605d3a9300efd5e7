"""Proxy overhead: added latency vs direct, and the sustained-rate search."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.bench.compare import ArmSpec
from proxy.bench.overhead import OverheadReport, RatePoint, measure_overhead
from proxy.bench.results import Report
from proxy.bench.scenario import ModelSpec


def point(rate: float, ok: bool, lag: float = 1.0) -> RatePoint:
    return RatePoint(rate, rate, 1.0 if ok else 0.5, 1.0, 2.0, lag, ok)


def report_with(rates: dict[str, list[RatePoint]]) -> OverheadReport:
    idle = Report(scenario=None, arms=list(rates), baseline="direct")  # type: ignore[arg-type]
    return OverheadReport(direct="direct", idle=idle, rates=rates, highest_tried=400)


def test_sustained_rate_and_what_bounds_it():
    r = report_with(
        {
            "direct": [point(100, True), point(200, True), point(400, False)],
            "same": [point(100, True), point(200, True), point(400, False)],
            "slower": [point(100, True), point(200, False)],
            "all_ok": [point(100, True), point(200, True), point(400, True, lag=80.0)],
            "retried": [point(100, True), point(200, False), point(200, True), point(400, False)],
        }
    )
    assert r.sustained("direct") == 200
    assert r.sustained("slower") == 100
    assert r.sustained("retried") == 200
    assert "ceiling of the fleet" in r.bound("direct")
    assert "limit of the arm" in r.bound("slower")
    assert "same as direct" in r.bound("same")
    assert "at least" in r.bound("all_ok") and "generator fell behind" in r.bound("all_ok")
    assert r.sustained("missing") is None and r.bound("missing") == "not measured"


@pytest.fixture
async def stub_url() -> AsyncIterator[str]:
    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"outputs": []})

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_measure_overhead_end_to_end(stub_url):
    direct = ArmSpec.direct("direct", [stub_url])
    other = ArmSpec.url("same_server", stub_url)
    out = await measure_overhead(
        ModelSpec(),
        direct,
        [other],
        idle_rate_rps=30,
        idle_duration_s=0.3,
        repetitions=2,
        rates=(20, 40),
        step_s=0.3,
        p99_limit_ms=10_000,
        settle_s=0.0,
        show_progress=False,
    )
    assert set(out.rates) == {"direct", "same_server"}
    assert [p.offered_rps for p in out.rates["direct"]] == [20, 40]
    added = out.added_ms["direct"]["p50"]
    assert added is not None and added.median == 0.0 and added.n == 2
    assert out.added_ms["same_server"]["p99"] is not None
    text = out.render()
    assert "same_server" in text and "sustained" in text
    doc = out.to_dict()
    assert doc["sustained_rps"]["direct"] == 40
