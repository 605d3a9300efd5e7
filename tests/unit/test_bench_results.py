"""From run records to figures; comparisons, ratios, table, JSON and plots."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest
from aiohttp import web

from proxy.bench.compare import ArmSpec, run_comparison
from proxy.bench.report import render_table, write_all
from proxy.bench.results import client_in_flight, summarize_run
from proxy.bench.runner import PENDING, Outcome, RunRecords, TargetSpec
from proxy.bench.scenario import Arrival, parse_scenario

SC = parse_scenario(
    {
        "duration_s": 10,
        "warmup_s": 1,
        "classes": {"rt": {"rate_rps": 1, "slo_p99_ms": 50}, "bulk": {"rate_rps": 1}},
    }
)


def make(rows: list[tuple[str, float, float, int]]) -> tuple[list[Arrival], RunRecords]:
    """rows: (class, t, latency_s, outcome)."""
    sched = [Arrival(i, t, c, 8, None, t < SC.warmup_s) for i, (c, t, _, _) in enumerate(rows)]
    rec = RunRecords.empty(len(rows), t0=1000.0)
    for i, (_, t, lat, out) in enumerate(rows):
        rec.scheduled[i] = 1000.0 + t
        rec.started[i] = 1000.0 + t
        if out != PENDING:
            rec.finished[i] = 1000.0 + t + lat
        rec.outcome[i] = out
    return sched, rec


def test_summary_counts_only_the_measured_window_and_charges_failures():
    rows = [
        ("rt", 0.5, 9.0, Outcome.OK),  # warm-up: ignored however slow
        ("rt", 2.0, 0.010, Outcome.OK),
        ("rt", 3.0, 0.020, Outcome.OK),
        ("rt", 4.0, 0.080, Outcome.OK),  # over the 50 ms SLO
        ("rt", 5.0, 0.001, Outcome.SHED),
        ("bulk", 2.0, 1.0, Outcome.OK),
        ("bulk", 6.0, 0.0, Outcome.ERROR),
        ("bulk", 7.0, 0.0, PENDING),
    ]
    sched, rec = make(rows)
    arm = summarize_run("x", SC, sched, rec)
    rt, bulk = arm.classes["rt"], arm.classes["bulk"]
    assert (rt.scheduled, rt.ok, rt.shed, rt.error) == (4, 3, 1, 0)
    assert rt.completion_rate == pytest.approx(0.75)
    assert rt.slo_attainment == pytest.approx(0.5)  # 2 of 4 scheduled were OK within 50 ms
    assert rt.p99_ms == pytest.approx(80, rel=1e-3)
    assert rt.slo_met is False
    assert rt.throughput_rps == pytest.approx(3 / 10)
    assert (bulk.scheduled, bulk.ok, bulk.error, bulk.unfinished) == (3, 1, 1, 1)
    assert bulk.slo_attainment is None
    assert arm.least_served() == ("bulk", pytest.approx(1 / 3))


def test_client_in_flight_is_a_time_average():
    _sched, rec = make([("rt", 0.0, 1.0, Outcome.OK), ("rt", 0.5, 1.0, Outcome.OK)])
    rec.instances = ["a"]
    rec.instance[:] = [0, -1]
    series = client_in_flight(rec, grid_s=0.5)
    assert series.t == [0.0, 0.5, 1.0]
    assert series.values["(all)"] == [1.0, 2.0, 1.0]
    assert series.values["a"] == [1.0, 1.0, 0.0]


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


@contextlib.asynccontextmanager
async def boom() -> AsyncIterator[TargetSpec]:
    raise RuntimeError("could not start")
    yield TargetSpec(urls=("http://unreachable",))


async def test_run_comparison_same_schedule_ratios_and_outputs(stub_url, tmp_path):
    sc = parse_scenario(
        {
            "duration_s": 0.4,
            "warmup_s": 0.1,
            "seed": 3,
            "classes": {"rt": {"rate_rps": 40, "slo_p99_ms": 500}, "bulk": {"rate_rps": 20}},
        }
    )
    arms = [
        ArmSpec.url("direct", stub_url),
        ArmSpec.direct("rr", [stub_url, stub_url], priority=True),
        ArmSpec("broken", boom),
    ]
    report = await run_comparison(sc, arms, repetitions=2, settle_s=0.0, show_progress=False)
    assert [r.seed for r in report.repetitions] == [3, 4]
    assert report.repetitions[0].order[0] == "direct" and report.repetitions[1].order[0] == "rr"
    for rep in report.repetitions:
        a, b = rep.arms["direct"], rep.arms["rr"]
        assert a.classes["rt"].scheduled == b.classes["rt"].scheduled  # same schedule
        assert a.classes["rt"].ok + a.classes["bulk"].ok > 0
        assert rep.arms["broken"].failed == "RuntimeError: could not start"
    ratio = report.ratio("direct", "rt", "p99_ms")
    assert ratio is not None and ratio.median == 1.0 and ratio.n == 2
    table = render_table(report)
    assert "broken" in table and "FAILED" in table and "class rt" in table
    paths = write_all(report, tmp_path, plots=importlib.util.find_spec("matplotlib") is not None)
    doc = json.loads(paths["json"].read_text())
    assert doc["baseline"] == "direct"
    assert doc["summary"]["rr"]["classes"]["rt"]["pooled"]["scheduled"] > 0
    assert len(doc["repetitions"]) == 2
    for key in ("latency_cdf", "instance_load"):
        if key in paths:
            assert paths[key].stat().st_size > 0


async def test_run_comparison_rejects_bad_arms():
    with pytest.raises(ValueError, match="unique"):
        await run_comparison(SC, [ArmSpec.url("a", "http://x"), ArmSpec.url("a", "http://y")])
    with pytest.raises(ValueError, match="baseline"):
        await run_comparison(SC, [ArmSpec.url("a", "http://x")], baseline="b")


def test_histogram_in_report_is_in_microseconds():
    sched, rec = make([("rt", 2.0, 0.0123, Outcome.OK)])
    arm = summarize_run("x", SC, sched, rec)
    assert arm.classes["rt"].latency_us.max == 12300
    assert np.isclose(arm.classes["rt"].p50_ms, 12.3, rtol=1e-3)
