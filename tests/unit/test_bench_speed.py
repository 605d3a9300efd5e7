"""Issue 13's benchmark parts that need no fleet: worker options, the closed-loop report and
the routing microbenchmark (run small)."""

from __future__ import annotations

import pytest

from proxy.bench.cli import parse_workers, worker_suffix
from proxy.bench.closed import (
    ClosedReport,
    ClosedRun,
    ClosedTarget,
    SimpleRequest,
    run_closed,
    sender,
)
from proxy.bench.routing import SimulatedFleet, measure_policy, render
from proxy.routing.registry import POLICIES
from tests.unit.fake_triton import fake_triton


def test_worker_counts():
    assert parse_workers("1,2,4") == (1, 2, 4)
    assert parse_workers("2,2") == (2,)
    assert worker_suffix(1) == "" and worker_suffix(4) == " w4"
    for bad in ("0", "x", ""):
        with pytest.raises(ValueError, match="--workers"):
            parse_workers(bad)


def run(arm: str, c: int, rep: int, p50: float, p99: float, n: int, cpu: float | None = None):
    return ClosedRun(arm, "http", c, rep, 1.0, n, 0, p50, p99, cpu)


def test_closed_report_compares_within_each_repetition():
    report = ClosedReport(
        runs=[
            run("direct", 1, 0, 1.0, 2.0, 900),
            run("proxy", 1, 0, 1.3, 2.5, 700, cpu=0.21),
            run("direct", 1, 1, 2.0, 4.0, 500),
            run("proxy", 1, 1, 2.2, 4.1, 450, cpu=0.19),
            run("direct", 16, 0, 5.0, 9.0, 4000),
            run("proxy", 16, 0, 6.0, 12.0, 3000, cpu=0.2),
        ],
        baselines={"direct": None, "proxy": "direct"},
    )
    assert report.added_ms("proxy", "p50") == pytest.approx([0.3, 0.2])
    assert report.added_ms("proxy", "p99") == pytest.approx([0.5, 0.1])
    assert report.throughput_share("proxy", 16) == pytest.approx([0.75])
    assert report.added_ms("direct", "p50") == []
    text = report.render()
    assert "75%" in text and "+0.25 [+0.20..+0.30]" in text
    assert report.to_dict()["summary"]["proxy"]["16"]["throughput_share"] == [0.75]
    assert run("proxy", 16, 0, 1, 1, 3000, cpu=0.6).cpu_ms_per_request == pytest.approx(0.2)


def test_simple_request_bodies_match_the_model():
    path, body, headers = SimpleRequest(api_key="k").http()
    length = int(headers["Inference-Header-Content-Length"])
    assert path == "/v2/models/simple/infer"
    assert len(body) == length + 2 * 16 * 4  # two INT32 [1, 16] tensors after the header
    assert headers["Authorization"] == "Bearer k"
    data, metadata = SimpleRequest().grpc()
    assert data and metadata == ()


def test_routing_microbenchmark_times_every_policy():
    sim = SimulatedFleet(5, 0)
    assert len(sim.fleet.instances) == 5 and len(sim.snapshots) == 5
    before = sim.fleet.total_in_flight()
    sim.between()
    assert sim.fleet.total_in_flight() == before - 1  # one request finished
    sim.close()
    assert sim.fleet.total_in_flight() == 0
    points = []
    for name in POLICIES:
        points += measure_policy(name, 5, calls=20, warmup=2)
    assert {(p.policy, p.kind) for p in points} == {
        (n, k) for n in POLICIES for k in ("linear", "view", "idle")
    }
    assert all(0 < p.p50_us <= p.p99_us for p in points)
    assert all((p.first_view_us is not None) == (p.kind == "view") for p in points)
    assert "least_requests" in render(points)


async def test_http_closed_loop_sends_kserve_requests_and_counts_errors():
    """The closed loop's HTTP client against a small server: every answered request is timed,
    and an answer other than 200 counts as an error, not as a latency."""
    async with fake_triton() as (fake, url):
        target = ClosedTarget("http", (url,))
        async with sender(target, SimpleRequest(api_key=None), 2) as send:
            latencies, errors, _, _, first = await run_closed(send, 2, 0.2, warmup_s=0.05)
        assert latencies and errors == 0 and first is None
        size, header_len = fake.infer_sizes[0]
        assert header_len is not None and size > int(header_len) > 0
        fake.infer_status = 500
        async with sender(target, SimpleRequest(api_key=None), 2) as send:
            latencies, errors, _, _, first = await run_closed(send, 2, 0.2, warmup_s=0.05)
        assert not latencies and errors > 0 and first is not None and "HTTP 500" in first
