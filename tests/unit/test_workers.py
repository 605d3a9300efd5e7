"""``serve --workers N``: limits split across workers, the shared fleet view, and N processes
on one port in front of a small fake Triton."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.scheduling.config import load_scheduling
from proxy.telemetry import merge_workers
from proxy.workers import (
    STATE_FILE,
    FollowerReports,
    SharedSnapshots,
    WorkerRole,
    leader_state,
    per_worker,
    per_worker_scheduling,
    write_state,
)
from tests.unit.fake_triton import fake_triton

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("limit", "workers", "each", "total_at_most"),
    [(32, 1, 32, 32), (32, 2, 16, 32), (32, 4, 8, 32), (32, 3, 11, 34), (1, 4, 1, 4)],
)
def test_per_worker_limits_and_their_bound(limit, workers, each, total_at_most):
    assert per_worker(limit, workers) == each
    assert workers * each <= limit + workers - 1
    assert workers * each <= total_at_most


def test_scheduling_section_is_split_between_workers():
    cfg = load_scheduling(
        {
            "max_queued_total": 100,
            "concurrency": 10,
            "classes": {
                "rt": {"rank": 0, "max_concurrency": 6, "max_queue": 50, "max_share": 0.5},
                "bulk": {"rank": 1},
            },
            "default_class": "bulk",
        }
    )
    two = per_worker_scheduling(cfg, 2)
    assert two.max_queued_total == 50
    assert two.classes["rt"].max_concurrency == 3
    assert two.classes["rt"].max_queue == 25
    assert two.classes["rt"].max_share == 0.5  # a fraction of each worker's own capacity
    assert two.classes["bulk"].max_concurrency is None
    assert two.concurrency == 10  # per instance: divided by ModelGates, which knows the model
    assert per_worker_scheduling(cfg, 1) is cfg


def _fleet(clock: FakeClock) -> Fleet:
    specs = tuple(InstanceSpec(name=n, http=f"http://{n}:8000") for n in ("a", "b"))
    return Fleet(specs, HealthConfig(), clock)


def test_follower_reads_the_leaders_snapshots_and_health(tmp_path):
    clock = FakeClock(100.0)
    leader, follower = _fleet(clock), _fleet(clock)
    snap = InstanceSnapshot(taken_at=99.5, models={"m": ModelLoad(pending=3)})
    leader.report_failure(leader.get("b"), "readiness probe answered 503", immediate=True)
    write_state(tmp_path / STATE_FILE, leader_state(leader, {"a": snap}, clock.now()))

    view = SharedSnapshots(tmp_path / STATE_FILE, follower, interval_s=1.0)
    assert view.refresh() is True
    assert view.snapshot("a") == snap and view.snapshot("b") is None
    assert not follower.get("b").healthy
    assert follower.get("b").ejected_reason == "readiness probe answered 503"
    assert view.refresh() is False  # unchanged file: nothing to do


def test_a_followers_own_failure_outlives_older_leader_verdicts(tmp_path):
    clock = FakeClock(100.0)
    leader, follower = _fleet(clock), _fleet(clock)
    for inst in leader.all():
        leader.report_success(inst)
    write_state(tmp_path / STATE_FILE, leader_state(leader, {}, clock.now()))
    clock.advance(0.5)
    follower.report_failure(
        follower.get("a"), "connection refused", immediate=True
    )  # seen after the verdict
    view = SharedSnapshots(tmp_path / STATE_FILE, follower, interval_s=1.0)
    view.refresh()
    assert not follower.get("a").healthy
    clock.advance(1.0)  # the leader probes again, after the follower's failure: back in
    leader.report_success(leader.get("a"))
    write_state(tmp_path / STATE_FILE, leader_state(leader, {}, clock.now()))
    view.refresh()
    assert follower.get("a").healthy


def test_followers_take_the_leaders_drain_marks_and_answer_them(tmp_path):
    """The drain protocol between workers: the leader publishes its marks with a new epoch;
    it may reload only once every follower has applied that epoch and has none of the
    model's requests in flight on the instance."""
    clock = FakeClock(100.0)
    leader, f1, f2 = _fleet(clock), _fleet(clock), _fleet(clock)
    roles = [WorkerRole(i, 3, tmp_path) for i in range(3)]
    reports = FollowerReports(roles[0])
    views = []
    seen: list[tuple[dict[str, dict[str, float]], bool]] = []
    for role, fleet in ((roles[1], f1), (roles[2], f2)):
        view = SharedSnapshots(
            tmp_path / STATE_FILE,
            fleet,
            interval_s=1.0,
            report_path=role.report_file(),
            on_state=lambda st, drains: seen.append(
                ({m: dict(c) for m, c in st.class_scales.items()}, drains)
            ),
        )
        views.append(view)
    # No follower has answered yet: the leader cannot know.
    assert reports.in_flight("a", "m", 0) is None
    write_state(tmp_path / STATE_FILE, leader_state(leader, {}, clock.now()))
    for v in views:
        v.refresh()
        v.report()
    assert reports.in_flight("a", "m", 0) == 0

    # The leader marks (a, m) and publishes epoch 1 with the class factors it applied.
    leader.get("a").draining.add("m")
    f1.get("a").model_in_flight["m"] = 2  # follower 1 still has two requests there
    clock.advance(1.0)
    write_state(
        tmp_path / STATE_FILE,
        leader_state(leader, {}, clock.now(), drain_epoch=1, class_scales={"m": {"off": 0.5}}),
    )
    assert reports.in_flight("a", "m", 1) is None  # nobody has applied epoch 1
    views[0].refresh()
    views[0].report()
    assert f1.get("a").draining == {"m"}
    assert reports.in_flight("a", "m", 1) is None  # follower 2 has not
    views[1].refresh()
    views[1].report()
    assert f2.get("a").draining == {"m"}
    assert reports.in_flight("a", "m", 1) == 2  # applied everywhere; two still in flight
    assert seen[-1] == ({"m": {"off": 0.5}}, True)
    f1.get("a").model_in_flight["m"] = 0
    views[0].report()
    assert reports.in_flight("a", "m", 1) == 0  # now the reload may start

    # The mark is cleared: the followers send the model's requests to a again.
    leader.get("a").draining.clear()
    clock.advance(1.0)
    write_state(tmp_path / STATE_FILE, leader_state(leader, {}, clock.now(), drain_epoch=2))
    for v in views:
        v.refresh()
    assert not f1.get("a").draining and not f2.get("a").draining
    assert seen[-1] == ({}, True)


def test_merged_metrics_label_each_workers_series():
    a = '# HELP x_total n\n# TYPE x_total counter\nx_total{m="s"} 2.0\n'
    b = '# HELP x_total n\n# TYPE x_total counter\nx_total{m="s"} 5.0\n'
    text = merge_workers([("0", a), ("1", b)]).decode()
    samples = {
        s.labels["worker"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "x_total"
    }
    assert samples == {"0": 2.0, "1": 5.0}


# -- N processes on one port ----------------------------------------------------------------


async def _serve_two_workers(policy: Path) -> asyncio.subprocess.Process:
    """``triton-proxy serve --workers 2 --policy POLICY``, its output piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy.cli",
        "serve",
        "--workers",
        "2",
        "--policy",
        str(policy),
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def _banner(proc: asyncio.subprocess.Process) -> dict[str, int]:
    ports: dict[str, int] = {}
    assert proc.stdout is not None
    while "workers" not in ports:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line, "the proxy exited before its banner"
        if "ready: HTTP localhost:" in line:
            ports["http"] = int(line.rsplit(":", 1)[1])
        elif line.strip().startswith("metrics http://localhost:"):
            ports["metrics"] = int(line.strip().split(":")[2].split("/")[0])
        elif "worker processes" in line:
            ports["workers"] = int(line.split()[0])
    return ports


async def test_two_workers_share_the_port_and_the_scrape(tmp_path):
    async with fake_triton() as (fake, url):
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "instances": [{"name": "t0", "http": url, "metrics": url + "/metrics"}],
                    "listen": {"host": "127.0.0.1", "http_port": 0, "metrics_port": 0},
                    # One scrape at start, then none during the test: count who scrapes.
                    "scrape": {"interval_s": 600, "window_s": 600},
                    "scheduling": {},
                }
            )
        )
        proc = await _serve_two_workers(policy)
        try:
            ports = await _banner(proc)
            assert ports["workers"] == 2
            base = f"http://127.0.0.1:{ports['http']}"
            body = b'{"inputs":[]}'
            for _ in range(60):
                # A new connection each time: the kernel spreads connections, not requests.
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(base + "/v2/models/m/infer", data=body) as resp,
                ):
                    assert resp.status == 200
            assert fake.hits["infer"] == 60
            assert fake.hits["metrics"] == 1  # the leader's scrape only
            metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"
            async with aiohttp.ClientSession() as s, s.get(metrics_url) as resp:
                text = await resp.text()
            served = Counter[str]()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "triton_proxy_requests_total":
                        served[sample.labels["worker"]] += int(sample.value)
            assert sum(served.values()) == 60
            assert set(served) == {"0", "1"}, f"one worker served everything: {served}"
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_workers_reload_on_sighup_and_a_dead_worker_is_replaced(tmp_path):
    async with fake_triton() as (_fake, url):
        policy = tmp_path / "policy.yaml"
        doc = {
            "instances": [{"name": "t0", "http": url}],
            "listen": {"host": "127.0.0.1", "http_port": 0, "metrics_port": 0},
        }
        policy.write_text(yaml.safe_dump(doc))
        proc = await _serve_two_workers(policy)
        assert proc.stdout is not None

        async def wait_for(text: str) -> list[str]:
            seen: list[str] = []
            while not any(text in line for line in seen):
                line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
                assert line, f"the proxy exited before {text!r}: {seen}"
                seen.append(line)
            return seen

        try:
            await _banner(proc)
            doc["routing"] = {"policy": {"name": "round_robin"}}
            policy.write_text(yaml.safe_dump(doc))
            proc.send_signal(signal.SIGHUP)
            lines = await wait_for("policy reloaded")
            lines += await wait_for("policy reloaded")  # both workers
            # Ports the file leaves at 0 are the ones picked at start: no restart needed.
            assert not any("need a restart" in line for line in lines), lines
            workers = [
                int(p)
                for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            ]
            assert len(workers) == 2
            os.kill(workers[1], signal.SIGKILL)
            await wait_for("restarting it")
            for _ in range(100):
                now = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                if len(now) == 2 and str(workers[1]) not in now:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the dead worker was not replaced")
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0


# A supervisor (its SIGTERM handler forwards and returns) forks workers and stops each one at
# once: a worker that ran the supervisor's handler instead of dying is still there after 5 s.
_STOP_JUST_FORKED = """
import os, signal, sys, tempfile, time
from pathlib import Path
from proxy.workers import Supervisor, WorkerRole
signal.signal(signal.SIGTERM, lambda signum, frame: None)
sup = Supervisor(1, None, lambda role, config: time.sleep(30) or 0)
role = WorkerRole(0, 1, Path(tempfile.mkdtemp()))
for attempt in range(40):
    pid = sup._fork(role, None)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            sys.exit(f"attempt {attempt}: a worker stopped just after its fork served on")
        time.sleep(0.01)
    sup.children.pop(pid)
"""


def test_a_worker_stopped_just_after_its_fork_stops():
    """The supervisor's SIGTERM handler is not the worker's, not even between the fork and
    the worker's own set-up (a restarted worker stopped at once used to serve on)."""
    done = subprocess.run(
        [sys.executable, "-c", _STOP_JUST_FORKED],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


async def test_only_the_leader_worker_fans_model_control_out(tmp_path):
    """A load call that reaches a follower is handed to the leader, which alone calls the
    fleet; the client gets the same answer whichever worker its connection reached."""
    async with fake_triton() as (fake, url):
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "instances": [{"name": "t0", "http": url, "metrics": url + "/metrics"}],
                    "listen": {"host": "127.0.0.1", "http_port": 0, "metrics_port": 0},
                    "admin": {"enabled": True, "token": "s3cret"},
                }
            )
        )
        proc = await _serve_two_workers(policy)
        try:
            ports = await _banner(proc)
            base = f"http://127.0.0.1:{ports['http']}"
            for _ in range(30):
                # A new connection each time: the kernel spreads connections over the workers.
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(
                        base + "/v2/repository/models/m/load",
                        headers={"Authorization": "Bearer s3cret"},
                        data=b"{}",
                    ) as resp,
                ):
                    assert resp.status == 200, await resp.text()
                    assert await resp.json() == {}
            for _ in range(6):
                # Without the token: refused by whichever worker it reached, never relayed.
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(base + "/v2/repository/models/m/load", data=b"{}") as resp,
                ):
                    assert resp.status == 403
            assert fake.hits["load"] == 30
            assert fake.hits["credential leaked"] == 0
            metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"
            async with aiohttp.ClientSession() as s, s.get(metrics_url) as resp:
                text = await resp.text()
            calls = Counter[tuple[str, str]]()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "triton_proxy_model_control_calls_total" and sample.value:
                        calls[sample.labels["worker"], sample.labels["handled"]] += int(
                            sample.value
                        )
            # Both workers were reached; the follower relayed, the leader did every fan-out.
            assert calls[("1", "relayed_to_leader")] > 0, calls
            assert calls[("0", "fanned_out")] == 30, calls
            assert set(calls) == {("0", "fanned_out"), ("1", "relayed_to_leader")}, calls
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
