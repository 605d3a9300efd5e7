"""The control loops against real Triton servers: drained window reloads, refusal by a server
without explicit model control, instance feedback with one instance slowed down, the class-limit
loop cutting and releasing the offline class, and dry run changing nothing on the servers.

These tests start their own small fleet (two servers, ``accel_sim`` and ``sleeper``) because
they change model configs, which other tests must not see.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.fleet.instances import Instance
from proxy.fleet.model_control import ModelControl, batching_window_us, with_batching_window
from proxy.local import LocalFleet, TritonServer, group_members, sigterm_raises_exit
from proxy.observer import RequestRecord
from tests.integration.harness import ProxyThread, policy_for, running_proxy, settled_successes

pytestmark = pytest.mark.integration

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
MODEL = "accel_sim"
DEFAULT_WINDOW_US = 2000
SLEEPER = "sleeper"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    log_dir = tmp_path_factory.mktemp("control-logs")
    f = LocalFleet(2, MODEL_REPOSITORY, (MODEL, SLEEPER), log_dir)
    with sigterm_raises_exit():
        f.start(timeout_s=240)
        try:
            yield f
        finally:
            f.stop()
            leaked = {p: group_members(p) for p in f.started_pgids}
            assert not any(leaked.values()), f"processes left: {leaked}"


STAMP_SLACK_S = 0.1


def triton_config(server: TritonServer) -> dict[str, Any]:
    with httpclient.InferenceServerClient(server.http_url.removeprefix("http://")) as c:
        config = c.get_model_config(MODEL)
    assert isinstance(config, dict)
    return config


def ids(n: int) -> list[httpclient.InferInput]:
    i = httpclient.InferInput("INPUT_IDS", [1, n], "INT64")
    i.set_data_from_numpy(np.arange(1, n + 1, dtype=np.int64).reshape(1, n), binary_data=True)
    return [i]


@dataclass
class Traffic:
    latencies: list[tuple[float, float]] = field(default_factory=list)
    """(start, latency) of every answered request, monotonic clock."""
    errors: list[str] = field(default_factory=list)


def closed_loop(url: str, clients: int, stop: threading.Event, out: Traffic) -> None:
    def loop() -> None:
        with httpclient.InferenceServerClient(url, network_timeout=60) as c:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    c.infer(MODEL, ids(16))
                except Exception as exc:
                    out.errors.append(repr(exc))
                    continue
                out.latencies.append((began, time.monotonic() - began))

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(loop) for _ in range(clients)]:
            f.result()


class Recorder:
    """Every finished request as the proxy saw it (which instance, when)."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def on_request(self, record: RequestRecord) -> None:
        self.records.append(record)


@dataclass
class Reloads:
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    """(instance, load sent, load answered) in the proxy's clock."""


def record_reloads(control: ModelControl, clock: Any) -> Reloads:
    """Wrap the real client's ``load`` so the test knows when each instance reloaded."""
    reloads = Reloads()
    real = control.load

    async def load(instance: Instance, model: str, config: Any) -> None:
        began = clock.now()
        try:
            await real(instance, model, config)
        finally:
            reloads.spans.append((instance.name, began, clock.now()))

    control.load = load  # type: ignore[method-assign]
    return reloads


def run_phase(proxy: ProxyThread, seconds: float, action: Any = None) -> Traffic:
    traffic = Traffic()
    stop = threading.Event()
    sender = threading.Thread(target=closed_loop, args=(proxy.http, 6, stop, traffic))
    sender.start()
    try:
        time.sleep(1.0)  # warm: every client has a request in flight
        if action is not None:
            action()
        else:
            time.sleep(seconds)
    finally:
        stop.set()
        sender.join(120)
    return traffic


def test_window_change_under_traffic_is_drained(fleet: LocalFleet) -> None:
    with running_proxy(fleet.servers) as proxy:
        rt = proxy.runtime
        recorder = Recorder()
        rt.observers.add(recorder)
        reloads = record_reloads(rt.model_control, rt.clock)

        baseline = run_phase(proxy, 8.0)

        results: list[Any] = []

        def change() -> None:
            results.append(
                proxy.call(
                    rt.control.applier.apply(
                        MODEL, 5000, drain_timeout_s=10.0, ready_timeout_s=60.0
                    ),
                    timeout=180,
                )
            )
            time.sleep(1.0)

        during = run_phase(proxy, 0.0, change)
        try:
            (result,) = results
            assert result.failed is None and not result.refused, result
            assert sorted(result.changed) == sorted(s.name for s in fleet.servers)
            # What Triton runs now, read from each server directly.
            for server in fleet.servers:
                assert batching_window_us(triton_config(server)) == 5000
            # Every other field of the config survived the override.
            for server in fleet.servers:
                got = triton_config(server)
                got["dynamic_batching"]["max_queue_delay_microseconds"] = DEFAULT_WINDOW_US
                assert got["parameters"]["base_ms"] == {"string_value": "3"}
                assert got["dynamic_batching"]["priority_levels"] == 3
            assert not baseline.errors
            assert not during.errors, during.errors[:3]
            assert during.latencies, "no traffic during the change"
            # No request of the model was on an instance while that instance reloaded.
            assert len(reloads.spans) == 2
            for name, began, ended in reloads.spans:
                # A record is stamped after its in-flight token is released (the drain waits
                # on the token), so one that finished just before the reload began may carry
                # a stamp a few milliseconds after it: STAMP_SLACK_S allows for that.
                overlapping = [
                    r
                    for r in recorder.records
                    if r.instance == name
                    and r.at - r.latency_s < ended
                    and r.at > began + STAMP_SLACK_S
                ]
                assert not overlapping, f"{len(overlapping)} requests ran on {name} during reload"
            # Figures, not assertions (timings vary with the machine): the largest latency
            # during the change against a run without one.
            worst_base = max(lat for _, lat in baseline.latencies)
            worst_during = max(lat for _, lat in during.latencies)
            print(
                f"\nwindow change under traffic: {len(during.latencies)} requests, 0 failed; "
                f"largest latency {worst_during * 1e3:.1f} ms during the change vs "
                f"{worst_base * 1e3:.1f} ms without one ({len(baseline.latencies)} requests); "
                f"reloads took {', '.join(f'{e - b:.1f} s' for _, b, e in reloads.spans)}"
            )
        finally:
            proxy.call(
                rt.control.applier.apply(
                    MODEL, DEFAULT_WINDOW_US, drain_timeout_s=10.0, ready_timeout_s=60.0
                ),
                timeout=180,
            )


def backlog_scheduling() -> dict[str, Any]:
    """Two slots per server, a real-time class that holds its 2 s SLO and an offline class
    whose backlog the batching loop may lengthen the window for."""
    return {
        "concurrency": 2,
        "classes": {
            "realtime": {"rank": 0, "triton_priority": 1, "slo_p99_ms": 2000},
            "offline": {"rank": 1, "triton_priority": 2},
        },
        "default_class": "offline",
    }


def test_control_loop_lengthens_then_shortens_the_window(fleet: LocalFleet) -> None:
    """The whole loop on live servers: an offline backlog with the realtime class holding its
    SLO lengthens the window; once the backlog is gone the window shortens again."""
    policy = {
        "scheduling": backlog_scheduling(),
        "control": {
            "tick_s": 0.2,
            "window_s": 2.0,
            "min_samples": 5,
            "batching": {
                "enabled": True,
                "dwell_s": 0.5,
                "min_us": 1000,
                "max_us": 4000,
                "backlog_min": 1.0,
                "fill_ratio": 0.0,  # the fill rule has its unit tests; here any queue will do
                # 8 clients on 2 x 2 slots: no instance could ever be spared; the headroom
                # rule has its unit tests, this test is about the window moving both ways.
                "headroom": False,
            },
        },
    }
    with running_proxy(fleet.servers, policy) as proxy:
        rt = proxy.runtime
        traffic = Traffic()
        stop = threading.Event()
        sender = threading.Thread(target=closed_loop, args=(proxy.http, 8, stop, traffic))
        sender.start()
        try:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and rt.control.window_target.get(MODEL) != 4000:
                time.sleep(0.2)
        finally:
            stop.set()
            sender.join(120)
        assert rt.control.window_target.get(MODEL) == 4000
        wait_until(lambda: not rt.control.applying(MODEL), 120)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and rt.control.window_target.get(MODEL) != 1000:
            time.sleep(0.2)
        assert rt.control.window_target.get(MODEL) == 1000
        wait_until(lambda: not rt.control.applying(MODEL), 120)
        for server in fleet.servers:
            assert batching_window_us(triton_config(server)) == 1000
        assert not traffic.errors, traffic.errors[:3]
        text = rt.telemetry.exposition().decode()
        assert (
            'triton_proxy_control_decisions_total{direction="up",loop="batching",'
            'model="accel_sim",reason="backlog"}' in text
        )
        assert 'reason="idle"' in text
        windows = {
            s.labels["instance"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "triton_proxy_batching_window_seconds"
            for s in family.samples
        }
        assert windows == {s.name: 0.001 for s in fleet.servers}
        proxy.call(
            rt.control.applier.apply(
                MODEL, DEFAULT_WINDOW_US, drain_timeout_s=10.0, ready_timeout_s=60.0
            ),
            timeout=180,
        )


def wait_until(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_feedback_lowers_the_weight_of_a_slowed_instance(fleet: LocalFleet) -> None:
    """Instance feedback (queue-wait P95) against one instance made 10x slower by a config
    override of the emulated device's fixed cost."""
    slow, fast = fleet.servers[1], fleet.servers[0]
    policy = {
        "scrape": {"interval_s": 0.5, "window_s": 2.0},
        "routing": {
            "policy": {"name": "round_robin"},
            "feedback": {"queue_p95_threshold_us": 20000, "windows": 1, "window_s": 0.5},
        },
    }
    with running_proxy(fleet.servers, policy) as proxy:
        rt = proxy.runtime
        instance = rt.fleet.get(slow.name)
        config = proxy.call(rt.model_control.config(instance, MODEL))
        slowed = json.loads(json.dumps(config))
        slowed["parameters"]["base_ms"] = {"string_value": "30"}
        proxy.call(rt.model_control.load(instance, MODEL, slowed), timeout=120)
        try:
            recorder = Recorder()
            rt.observers.add(recorder)
            traffic = Traffic()
            stop = threading.Event()
            sender = threading.Thread(target=closed_loop, args=(proxy.http, 8, stop, traffic))
            sender.start()
            try:
                deadline = time.monotonic() + 30
                while (
                    time.monotonic() < deadline
                    and rt.router.feedback.current(slow.name, MODEL) > 0.5
                ):
                    time.sleep(0.2)
                weights = {s.name: rt.router.feedback.current(s.name, MODEL) for s in fleet.servers}
                mark = len(recorder.records)
                time.sleep(3.0)
            finally:
                stop.set()
                sender.join(120)
            assert not traffic.errors
            assert weights[slow.name] <= 0.5, weights
            assert weights[fast.name] == 1.0, weights
            after = recorder.records[mark:]
            on_slow = sum(1 for r in after if r.instance == slow.name)
            on_fast = sum(1 for r in after if r.instance == fast.name)
            print(f"\nfeedback: weights {weights}; then {on_fast} requests on the fast "
                  f"instance, {on_slow} on the slow one")  # fmt: skip
            # Round robin alone would split them evenly.
            assert on_fast > 2 * on_slow
        finally:
            proxy.call(rt.model_control.load(instance, MODEL, config), timeout=120)


def test_refused_without_explicit_model_control(
    tmp_path: Path,
) -> None:
    """A server in the default mode ('none') refuses the reload: the loop says so once and
    stays off for that model."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(MODEL_REPOSITORY / MODEL, repo / MODEL)
    f = LocalFleet(2, repo, (), tmp_path, extra_args=["--model-control-mode=none"])
    with sigterm_raises_exit(), f, running_proxy(f.servers) as proxy:
        rt = proxy.runtime
        proxy.call(rt.control.apply_window(MODEL, 5000))
        proxy.call(rt.control.apply_window(MODEL, 6000))
        text = rt.telemetry.exposition().decode()
        assert (
            'triton_proxy_control_off_total{loop="batching",model="accel_sim",'
            'reason="refused"} 1.0' in text
        )
        assert MODEL in rt.control.off_models
        for server in f.servers:
            assert batching_window_us(triton_config(server)) == DEFAULT_WINDOW_US
            assert with_batching_window(triton_config(server), 1)  # still batching


def proxy_metrics(proxy: ProxyThread) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The proxy's own /metrics endpoint over HTTP: family sample name -> labels -> value."""
    assert proxy.ports and proxy.ports.metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.ports.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def sleeper_loop(url: str, clients: int, delay_ms: list[int], stop: threading.Event,
                 out: Traffic, *, reconnect: bool = False) -> None:  # fmt: skip
    """Closed-loop ``sleeper`` requests of the default class; each sleeps ``delay_ms[0]``.
    ``reconnect``: a new connection for every request, so that with several proxy workers on
    one port each request, not each client, lands on a worker of the kernel's choosing."""

    def one(c: httpclient.InferenceServerClient) -> None:
        i = httpclient.InferInput("DELAY_MS", [1, 1], "INT32")
        i.set_data_from_numpy(np.array([[delay_ms[0]]], dtype=np.int32))
        began = time.monotonic()
        try:
            c.infer(SLEEPER, [i])
        except Exception as exc:
            out.errors.append(repr(exc))
            return
        out.latencies.append((began, time.monotonic() - began))

    def loop() -> None:
        if reconnect:
            while not stop.is_set():
                with httpclient.InferenceServerClient(url, network_timeout=60) as c:
                    one(c)
            return
        with httpclient.InferenceServerClient(url, network_timeout=60) as c:
            while not stop.is_set():
                one(c)

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(loop) for _ in range(clients)]:
            f.result()


def test_class_limit_loop_cuts_offline_and_releases_it(fleet: LocalFleet) -> None:
    """The realtime class's P99 driven above its SLO (sleeper requests of 400 ms against a
    200 ms SLO) cuts offline's share step by step down to its floor, as the proxy's /metrics
    shows; once the realtime requests are fast again the share comes back to its maximum."""
    policy = {
        "scheduling": {
            "default_class": "realtime",
            "api_keys": {"off-key": {"class_name": "offline"}},
            "classes": {
                "realtime": {"rank": 0, "triton_priority": 1, "slo_p99_ms": 200},
                "offline": {"rank": 1, "triton_priority": 2, "max_share": 0.8},
            },
        },
        "control": {
            "tick_s": 0.2,
            "window_s": 2.0,
            "min_samples": 5,
            "class_limits": {
                "enabled": True,
                "interval_s": 0.5,
                "decrease_factor": 0.5,
                "increase_step": 0.25,
                "min_factor": 0.1,
            },
        },
    }
    key = (("class", "offline"), ("model", SLEEPER))
    with running_proxy(fleet.servers, policy) as proxy:
        delay = [400]
        traffic = Traffic()
        stop = threading.Event()
        sender = threading.Thread(target=sleeper_loop, args=(proxy.http, 4, delay, stop, traffic))
        sender.start()
        seen: list[float] = []
        try:
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                value = proxy_metrics(proxy).get("triton_proxy_class_limit", {}).get(key)
                if value is not None and (not seen or value != seen[-1]):
                    seen.append(value)
                if value is not None and value <= 0.08 + 1e-9:
                    break
                time.sleep(0.1)
            cut = list(seen)
            delay[0] = 1  # the realtime class recovers
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                value = proxy_metrics(proxy)["triton_proxy_class_limit"][key]
                if value != seen[-1]:
                    seen.append(value)
                if value >= 0.8 - 1e-9:
                    break
                time.sleep(0.1)
        finally:
            stop.set()
            sender.join(120)
        assert not traffic.errors, traffic.errors[:3]
        print(f"\nclass limit of offline on {SLEEPER} as /metrics showed it: {seen}")
        # Cut: 0.8 x 1 -> 0.8 x 0.5 -> ... down to 0.8 x min_factor, never up on the way.
        assert cut[-1] == pytest.approx(0.08), seen
        assert all(b < a for a, b in itertools.pairwise(cut)), seen
        assert len(cut) >= 3, seen  # it went down in steps (AIMD), not in one jump
        # Released: back to max_share, in additive steps.
        released = seen[len(cut) - 1 :]
        assert released[-1] == pytest.approx(0.8), seen
        assert all(b > a for a, b in itertools.pairwise(released)), seen
        decisions = proxy_metrics(proxy)["triton_proxy_control_decisions_total"]

        def count(direction: str, reason: str) -> float:
            k = (("direction", direction), ("loop", "class_limits"), ("model", SLEEPER),
                 ("reason", reason))  # fmt: skip
            return decisions.get(k, 0.0)

        # 1 -> 0.5 -> 0.25 -> 0.125 -> 0.1; 0.1 -> 0.35 -> 0.6 -> 0.85 -> 1.
        assert count("down", "slo_violation") + count("down", "slo_approach") == 4, decisions
        assert count("up", "slo_recovered") == 4, decisions


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_dry_run_decides_but_changes_nothing_on_the_servers(fleet: LocalFleet) -> None:
    """With ``dry_run: true`` the batching loop decides to lengthen the window (an offline
    backlog, the realtime SLO holding): the decision is logged and exported, and yet Triton's
    config is what it was and the model was never reloaded (Triton's success counters, which a
    reload sets back to zero, only grew by what the proxy sent)."""
    policy = {
        "scheduling": backlog_scheduling(),
        "control": {
            "dry_run": True,
            "tick_s": 0.2,
            "window_s": 2.0,
            "min_samples": 5,
            "batching": {
                "enabled": True,
                "dwell_s": 0.5,
                "min_us": 1000,
                "max_us": 4000,
                "backlog_min": 1.0,
                "fill_ratio": 0.0,
                # A would-be change, not a would-be deferral (those have their unit tests).
                "headroom": False,
            },
        },
    }
    before = settled_successes(fleet.servers, MODEL)
    for server in fleet.servers:
        assert batching_window_us(triton_config(server)) == DEFAULT_WINDOW_US
    lines = Lines()
    logger = logging.getLogger("proxy.control")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        with running_proxy(fleet.servers, policy) as proxy:
            rt = proxy.runtime
            recorder = Recorder()
            rt.observers.add(recorder)
            reloads = record_reloads(rt.model_control, rt.clock)
            traffic = Traffic()
            stop = threading.Event()
            sender = threading.Thread(target=closed_loop, args=(proxy.http, 8, stop, traffic))
            sender.start()
            try:
                deadline = time.monotonic() + 45
                while time.monotonic() < deadline and rt.control.window_target.get(MODEL) != 4000:
                    time.sleep(0.2)
                metrics = proxy_metrics(proxy)  # before the backlog goes (then: idle)
            finally:
                stop.set()
                sender.join(120)
            answered = {
                s.name: sum(1 for r in recorder.records if r.instance == s.name and r.succeeded)
                for s in fleet.servers
            }
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    assert not traffic.errors, traffic.errors[:3]
    # Decided, logged and exported ...
    dry = metrics.get("triton_proxy_control_dry_run_decisions_total", {})
    up = (("direction", "up"), ("loop", "batching"), ("model", MODEL), ("reason", "backlog"))
    assert dry.get(up, 0) >= 1, dry
    assert not any(
        dict(k).get("loop") == "batching"
        for k in metrics.get("triton_proxy_control_decisions_total", {})
    )
    assert metrics["triton_proxy_batching_window_target_seconds"] == {(("model", MODEL),): 0.004}
    assert metrics["triton_proxy_control_dry_run"] == {(): 1.0}
    would = [x for x in lines.lines if x.startswith("dry run: would change batching accel_sim")]
    assert any("2 ms -> 4 ms: backlog" in x for x in would), lines.lines
    # ... and nothing changed on the servers.
    assert reloads.spans == []
    assert all(v == 0.002 for v in metrics["triton_proxy_batching_window_seconds"].values())
    after = settled_successes(fleet.servers, MODEL)
    for server in fleet.servers:
        assert batching_window_us(triton_config(server)) == DEFAULT_WINDOW_US
        assert after[server.name] >= before[server.name] + answered[server.name], after
    assert sum(answered.values()) > 0


# -- the loops with --workers 2: the leader's class factors and drain marks reach the other --


@contextlib.contextmanager
def serve_workers(servers: Sequence[TritonServer], policy: dict[str, Any], tmp: Path
                  ) -> Iterator[tuple[str, str, list[str]]]:  # fmt: skip
    """``triton-proxy serve --workers 2`` in a child process; yields (HTTP address, merged
    metrics URL, its output lines so far)."""
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_for(servers, policy), sort_keys=False))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--workers", "2", "--policy", str(path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    got: queue.Queue[str] = queue.Queue()

    def read(stdout: IO[str]) -> None:
        # Every line is kept (and the pipe never fills, so the proxy never blocks on it).
        for line in stdout:
            lines.append(line)
            got.put(line)

    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    try:
        http = metrics = ""
        workers = False
        deadline = time.monotonic() + 60
        while not (http and metrics and workers):
            assert proc.poll() is None, f"the proxy exited: {lines}"
            try:
                line = got.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no banner: {lines}") from None
            if "ready: HTTP localhost:" in line:
                http = f"127.0.0.1:{int(line.rsplit(':', 1)[1])}"
            elif line.strip().startswith("metrics http://localhost:"):
                metrics = line.strip().split()[1].replace("localhost", "127.0.0.1")
            elif "worker processes" in line:
                workers = True
        yield http, metrics, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0, "".join(lines[-30:])
        finally:
            if proc.poll() is None:
                proc.kill()


def worker_metrics(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def scales_by_worker(url: str, model: str, klass: str) -> dict[str, float]:
    got = worker_metrics(url).get("triton_proxy_class_share_scale", {})
    return {
        dict(k)["worker"]: v
        for k, v in got.items()
        if dict(k).get("model") == model and dict(k).get("class") == klass
    }


def test_workers_share_the_leaders_class_limits(fleet: LocalFleet, tmp_path: Path) -> None:
    """With two worker processes the class-limit loop runs in the leader (from its own share
    of the requests); the follower applies the leader's factor to its own gate, as each
    worker's ``triton_proxy_class_share_scale`` in the merged /metrics shows, and releases it
    with the leader."""
    policy = {
        "scrape": {"interval_s": 0.5, "window_s": 2.0},
        "scheduling": {
            "default_class": "realtime",
            "api_keys": {"off-key": {"class_name": "offline"}},
            "classes": {
                "realtime": {"rank": 0, "triton_priority": 1, "slo_p99_ms": 200},
                "offline": {"rank": 1, "triton_priority": 2, "max_share": 0.8},
            },
        },
        "control": {
            "tick_s": 0.2,
            "window_s": 2.0,
            "min_samples": 5,
            "class_limits": {"enabled": True, "interval_s": 0.5, "increase_step": 0.25},
        },
    }
    with serve_workers(fleet.servers, policy, tmp_path) as (http, metrics, _):
        delay = [400]
        traffic = Traffic()
        stop = threading.Event()
        # A new connection per request, which the kernel gives to either worker. With one
        # kept connection per client, about 1 run in 30 puts 7 or 8 of the 8 on the follower,
        # leaving the leader at most one client (about 5 samples per 2 s window, the minimum):
        # the likeliest cause of a CI run in which the loop never cut.
        sender = threading.Thread(
            target=sleeper_loop,
            args=(http, 8, delay, stop, traffic),
            kwargs={"reconnect": True},
        )
        sender.start()
        try:
            deadline = time.monotonic() + 40
            cut: dict[str, float] = {}
            while time.monotonic() < deadline:
                cut = scales_by_worker(metrics, SLEEPER, "offline")
                if set(cut) == {"0", "1"} and max(cut.values()) <= 0.1 + 1e-9:
                    break
                time.sleep(0.2)
            delay[0] = 1
            deadline = time.monotonic() + 40
            released: dict[str, float] = {}
            while time.monotonic() < deadline:
                released = scales_by_worker(metrics, SLEEPER, "offline")
                if released and min(released.values()) >= 1.0:
                    break
                time.sleep(0.2)
        finally:
            stop.set()
            sender.join(120)
    assert not traffic.errors, traffic.errors[:3]
    print(f"\nworkers: offline share scale cut to {cut}, released to {released}")
    assert cut == {"0": pytest.approx(0.1), "1": pytest.approx(0.1)}
    assert released == {"0": 1.0, "1": 1.0}


def test_workers_share_the_leaders_drain_marks(fleet: LocalFleet, tmp_path: Path) -> None:
    """A window change made by the leader worker under traffic that reaches both workers: the
    follower applies each drain mark (its own ``triton_proxy_instance_draining`` in the merged
    /metrics), the change reaches both servers, and no request fails."""
    policy = {
        "scrape": {"interval_s": 0.5, "window_s": 2.0},
        "scheduling": backlog_scheduling(),
        "control": {
            "tick_s": 0.2,
            "window_s": 2.0,
            "min_samples": 5,
            "batching": {
                "enabled": True,
                "models": [MODEL],
                "dwell_s": 30.0,  # one change in this test
                "min_us": DEFAULT_WINDOW_US,  # never shortened (idle, before the traffic)
                "max_us": 4000,
                "backlog_min": 1.0,
                "fill_ratio": 0.0,
                "headroom": False,  # 8 clients on 2 x 2 slots: never room otherwise
            },
        },
    }
    try:
        with serve_workers(fleet.servers, policy, tmp_path) as (http, metrics, lines):
            traffic = Traffic()
            stop = threading.Event()
            sender = threading.Thread(target=closed_loop, args=(http, 8, stop, traffic))
            sender.start()
            follower_drained: set[str] = set()
            try:
                # Two drains and two reloads of a python-backend model (each imports torch):
                # on a loaded 2-core CI machine once still running after 50 s, the change
                # decided but not yet applied (session 36). The loop ends at the change.
                deadline = time.monotonic() + 100
                while time.monotonic() < deadline:
                    m = worker_metrics(metrics)
                    for k, v in m.get("triton_proxy_instance_draining", {}).items():
                        labels = dict(k)
                        if labels["worker"] == "1" and labels["model"] == MODEL and v == 1.0:
                            follower_drained.add(labels["instance"])
                    windows = [batching_window_us(triton_config(s)) for s in fleet.servers]
                    if windows == [4000, 4000] and not any(
                        v for v in m.get("triton_proxy_instance_draining", {}).values()
                    ):
                        break
                    time.sleep(0.1)
            finally:
                stop.set()
                sender.join(120)
            # A kept-alive connection stays with the worker that accepted it: the eight above
            # all land on one worker 1 time in 128 (failed once in CI). Fresh ones spread.
            for _ in range(40):
                with httpclient.InferenceServerClient(http) as c:
                    c.infer(MODEL, ids(16))
            final = worker_metrics(metrics)
        said = [x for x in lines if "proxy.control" in x or "batching" in x]
        assert not traffic.errors, traffic.errors[:3]
        windows = [batching_window_us(triton_config(s)) for s in fleet.servers]
        assert windows == [4000, 4000], said
        print(f"\nworkers: the follower applied the drain mark of {sorted(follower_drained)}")
        assert follower_drained == {s.name for s in fleet.servers}
        served = {
            dict(k)["worker"]
            for k, v in final.get("triton_proxy_requests_total", {}).items()
            if v > 0
        }
        assert served == {"0", "1"}, served
        # The leader's change went through: no drain timed out waiting for the follower.
        assert not any(final.get("triton_proxy_control_apply_failures_total", {}).values())
        changes = final.get("triton_proxy_control_decisions_total", {})
        assert any(
            dict(k).get("loop") == "batching" and dict(k).get("reason") == "backlog"
            for k in changes
        ), changes
    finally:
        for server in fleet.servers:
            restore_window(server, DEFAULT_WINDOW_US)


def restore_window(server: TritonServer, window_us: int) -> None:
    with httpclient.InferenceServerClient(server.http_url.removeprefix("http://")) as c:
        config = c.get_model_config(MODEL)
        if batching_window_us(config) != window_us:
            c.load_model(MODEL, config=json.dumps(with_batching_window(config, window_us)))
