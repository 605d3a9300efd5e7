"""The open-loop runner: schedule-based timing, no coordinated omission, outcomes, encoding."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from aiohttp import web

from proxy.bench.runner import (
    HttpTarget,
    Outcome,
    RequestEncoder,
    SendResult,
    TargetSpec,
    run_schedule,
)
from proxy.bench.scenario import Arrival, parse_scenario
from proxy.clock import FakeClock

SCENARIO = parse_scenario(
    {
        "duration_s": 1,
        "timeout_s": 10,
        "classes": {
            "rt": {"rate_rps": 1, "triton_priority": 1, "api_key": "k-rt", "sessions": 3},
            "bulk": {"rate_rps": 1, "triton_priority": 3},
        },
    }
)


def arrival(i: int, t: float, cls: str = "rt", tokens: int = 8, session: str | None = None):
    return Arrival(index=i, t=t, cls=cls, tokens=tokens, session=session, warmup=False)


class FakeTime:
    """A fake clock whose sleep jumps straight to the wake-up time."""

    def __init__(self) -> None:
        self.clock = FakeClock(100.0)

    async def sleep(self, seconds: float) -> None:
        self.clock.advance(max(seconds, 0.0))
        await asyncio.sleep(0)


class ScriptedTarget:
    name = "scripted"

    def __init__(self, behaviour: Callable[[Arrival], object]) -> None:
        self.behaviour = behaviour
        self.sent: list[tuple[int, float]] = []

    async def send(self, a: Arrival) -> SendResult:
        out = self.behaviour(a)
        if asyncio.iscoroutine(out):
            out = await out
        assert isinstance(out, SendResult)
        return out

    async def aclose(self) -> None:
        return None


async def test_generator_stall_is_charged_from_scheduled_time():
    """The loop is blocked for 1 s while sending request 0; request 1 was due at 0.1 s."""
    ft = FakeTime()

    def behaviour(a: Arrival) -> SendResult:
        if a.index == 0:
            ft.clock.advance(1.0)  # synchronous stall: nothing else can run meanwhile
        return SendResult(Outcome.OK, 200)

    sched = [arrival(0, 0.0), arrival(1, 0.1), arrival(2, 2.0)]
    rec = await run_schedule(
        sched, ScriptedTarget(behaviour), clock=ft.clock, sleep=ft.sleep, start_delay_s=0
    )
    assert rec.scheduled[1] == pytest.approx(rec.t0 + 0.1)
    assert rec.started[1] >= rec.t0 + 1.0  # it really left late...
    assert rec.latency[1] >= 0.9  # ...and the lateness is in its latency
    assert rec.latency[2] == pytest.approx(0.0)  # back on schedule afterwards


async def test_open_loop_never_waits_for_earlier_requests():
    ft = FakeTime()
    release = asyncio.Event()
    started_before_release: list[int] = []

    async def hold(a: Arrival) -> SendResult:
        started_before_release.append(a.index)
        if a.index == 19:
            release.set()
        await release.wait()
        return SendResult(Outcome.OK, 200)

    sched = [arrival(i, 0.05 * i) for i in range(20)]
    rec = await run_schedule(sched, ScriptedTarget(hold), clock=ft.clock, sleep=ft.sleep)
    # every request was in flight at once: none waited for an earlier one to finish
    assert sorted(started_before_release) == list(range(20))
    assert (rec.outcome == Outcome.OK).all()
    assert np.all(rec.finished >= rec.started)


async def test_outcomes_and_errors_are_recorded():
    ft = FakeTime()
    results = {
        0: SendResult(Outcome.OK, 200, "a"),
        1: SendResult(Outcome.SHED, 429, "b"),
        2: SendResult(Outcome.ERROR, 503, "a", "Exceeds maximum queue size"),
    }
    sched = [arrival(i, 0.01 * i) for i in range(3)]
    rec = await run_schedule(
        sched, ScriptedTarget(lambda a: results[a.index]), clock=ft.clock, sleep=ft.sleep
    )
    assert rec.outcome.tolist() == [Outcome.OK, Outcome.SHED, Outcome.ERROR]
    assert rec.status.tolist() == [200, 429, 503]
    assert [rec.instances[i] for i in rec.instance] == ["a", "b", "a"]
    assert rec.errors == {"503 Exceeds maximum queue size": 1}


# -- real HTTP ------------------------------------------------------------------------------


class Stub:
    """A tiny in-process KServe-ish server that records what it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[tuple[dict, dict[str, str], bytes]] = []
        self.status = 200
        self.stall_first_s = 0.0
        self.released_at: float | None = None
        self.arrived_at: list[float] = []

    async def infer(self, request: web.Request) -> web.Response:
        self.arrived_at.append(time.monotonic())
        body = await request.read()
        hl = request.headers.get("Inference-Header-Content-Length")
        doc = json.loads(body[: int(hl)] if hl else body)
        self.requests.append((doc, dict(request.headers), body))
        if len(self.requests) == 1 and self.stall_first_s:
            await asyncio.sleep(self.stall_first_s)
            self.released_at = time.monotonic()
        if self.status != 200:
            return web.json_response({"error": f"status {self.status}"}, status=self.status)
        return web.json_response({"outputs": []}, headers={"x-served-by": self.name})


@pytest.fixture
async def stubs() -> AsyncIterator[list[tuple[Stub, str]]]:
    out, runners = [], []
    for name in ("s0", "s1", "s2"):
        stub = Stub(name)
        app = web.Application()
        app.router.add_post("/v2/models/{model}/infer", stub.infer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        out.append((stub, f"http://127.0.0.1:{port}"))
        runners.append(runner)
    yield out
    for r in runners:
        await r.cleanup()


async def test_stalled_server_delay_is_charged_from_scheduled_time(stubs):
    """One connection; the server stalls the first request. The second, due 50 ms later,
    cannot leave until the stall ends, and its latency counts from when it was due."""
    stub, url = stubs[0]
    stub.stall_first_s = 0.4
    target = HttpTarget("one", TargetSpec(urls=(url,), connection_limit=1), SCENARIO)
    sched = [arrival(0, 0.0), arrival(1, 0.05)]
    try:
        rec = await run_schedule(sched, target)
    finally:
        await target.aclose()
    assert (rec.outcome == Outcome.OK).all()
    assert stub.released_at is not None
    # causal facts only: request 1 reached the server after the stall ended...
    assert stub.arrived_at[1] >= stub.released_at
    # ...so it completed after that, and all of the wait since its scheduled time is charged
    assert rec.finished[1] >= stub.released_at
    assert rec.latency[1] >= stub.released_at - rec.scheduled[1]
    assert rec.latency[1] >= 0.4 - 0.05
    # what a closed-loop client would have reported instead (time since really sent)
    assert rec.finished[1] - stub.arrived_at[1] < rec.latency[1]


async def test_round_robin_priority_and_headers(stubs):
    urls = tuple(u for _, u in stubs)
    spec = TargetSpec(urls=urls, priority=True, instance_names=("a", "b", "c"))
    target = HttpTarget("rr", spec, SCENARIO)
    sched = [arrival(i, 0.0, cls="rt" if i % 2 == 0 else "bulk", tokens=4 + i) for i in range(6)]
    sched[0] = arrival(0, 0.0, tokens=4, session="rt-2")
    try:
        results = [await target.send(a) for a in sched]
    finally:
        await target.aclose()
    assert [r.instance for r in results] == ["a", "b", "c", "a", "b", "c"]
    assert [len(s.requests) for s, _ in stubs] == [2, 2, 2]
    doc, headers, body = stubs[0][0].requests[0]
    assert doc["parameters"]["priority"] == 1
    assert doc["inputs"][0]["name"] == "INPUT_IDS"
    assert doc["inputs"][0]["datatype"] == "INT64"
    assert doc["inputs"][0]["shape"] == [1, 4]
    assert len(body) - int(headers["Inference-Header-Content-Length"]) == 4 * 8
    assert headers["Authorization"] == "Bearer k-rt"
    assert headers["x-session-id"] == "rt-2"
    doc_bulk, headers_bulk, _ = stubs[1][0].requests[0]
    assert doc_bulk["parameters"]["priority"] == 3
    assert "Authorization" not in headers_bulk and "x-session-id" not in headers_bulk


async def test_single_url_reads_instance_header_and_maps_statuses(stubs):
    stub, url = stubs[1]
    target = HttpTarget("single", TargetSpec(urls=(url,)), SCENARIO)
    try:
        ok = await target.send(arrival(0, 0.0))
        stub.status = 429
        shed = await target.send(arrival(1, 0.0))
        stub.status = 503
        err = await target.send(arrival(2, 0.0))
    finally:
        await target.aclose()
    assert (ok.outcome, ok.instance) == (Outcome.OK, "s1")
    assert (shed.outcome, shed.status) == (Outcome.SHED, 429)
    assert (err.outcome, err.status, err.error) == (Outcome.ERROR, 503, "status 503")
    doc, _, _ = stub.requests[0]
    assert "priority" not in doc.get("parameters", {})


async def test_connection_refused_is_an_error():
    target = HttpTarget("dead", TargetSpec(urls=("http://127.0.0.1:9",)), SCENARIO)
    try:
        res = await target.send(arrival(0, 0.0))
    finally:
        await target.aclose()
    assert res.outcome == Outcome.ERROR and res.status == 0 and res.error


def test_json_encoding():
    sc = parse_scenario(
        {"duration_s": 1, "model": {"encoding": "json"}, "classes": {"a": {"rate_rps": 1}}}
    )
    enc = RequestEncoder(sc.model, sc.classes, priority=True)
    body, headers = enc.encode(arrival(0, 0.0, cls="a", tokens=3))
    doc = json.loads(body)
    assert doc["inputs"][0]["data"] == [1, 1, 1]
    assert "parameters" not in doc  # priority 0 = model default: nothing to send
    assert headers["Content-Type"] == "application/json"
    assert enc.path == "/v2/models/accel_sim/infer"


async def test_sheds_are_counted_by_class_and_reason_in_the_measured_window_only():
    ft = FakeTime()
    late = "request for model 'm' of class 'rt' was shed: {}; retry after 1 s"
    sched = [
        Arrival(0, 0.0, "rt", 8, None, True),  # warm-up: not counted
        Arrival(1, 0.1, "rt", 8, None, False),
        Arrival(2, 0.2, "rt", 8, None, False),
        Arrival(3, 0.3, "bulk", 8, None, False),
    ]
    why = {
        0: "it would be answered after its class's slo_p99_ms",
        1: "it would be answered after its class's slo_p99_ms",
        2: "its class queue is full",
        3: "its class queue is full",
    }

    def answer(a: Arrival) -> SendResult:
        return SendResult(Outcome.SHED, 429, None, late.format(why[a.index]))

    rec = await run_schedule(sched, ScriptedTarget(answer), clock=ft.clock, sleep=ft.sleep)
    assert rec.sheds == {"rt late": 1, "rt queue_full": 1, "bulk queue_full": 1}
    assert not rec.errors
