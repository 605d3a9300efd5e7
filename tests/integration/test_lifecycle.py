"""Reloads, idle streams and shutdown against real Triton servers, under real traffic."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from proxy.local import free_ports
from tests.integration.harness import policy_for, running_proxy

pytestmark = pytest.mark.integration


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def simple_inputs(module: Any) -> list[Any]:
    out = []
    for name in ("INPUT0", "INPUT1"):
        i = module.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        out.append(i)
    return out


def ids(n: int) -> list[httpclient.InferInput]:
    i = httpclient.InferInput("INPUT_IDS", [1, n], "INT64")
    i.set_data_from_numpy(np.arange(1, n + 1, dtype=np.int64).reshape(1, n), binary_data=True)
    return [i]


@contextmanager
def traffic(http: str, grpc: str, outcomes: Counter[str], errors: list[str]) -> Iterator[None]:
    """HTTP and gRPC unary clients plus a gRPC stream client, until the block exits."""
    stop = threading.Event()

    def http_loop() -> None:
        with httpclient.InferenceServerClient(http, network_timeout=60) as c:
            while not stop.is_set():
                try:
                    c.infer("simple", simple_inputs(httpclient))
                    outcomes["http"] += 1
                except InferenceServerException as exc:
                    errors.append(f"http: {exc}")

    def grpc_loop() -> None:
        with grpcclient.InferenceServerClient(grpc) as c:
            while not stop.is_set():
                try:
                    c.infer("simple", simple_inputs(grpcclient), client_timeout=60)
                    outcomes["grpc"] += 1
                except InferenceServerException as exc:
                    errors.append(f"grpc: {exc}")

    def stream_loop() -> None:
        while not stop.is_set():
            answers: queue.Queue[Any] = queue.Queue()
            with grpcclient.InferenceServerClient(grpc) as c:
                c.start_stream(callback=lambda result, error, q=answers: q.put(error))
                for _ in range(5):
                    c.async_stream_infer("simple", simple_inputs(grpcclient))
                    error = answers.get(timeout=60)
                    if error is None:
                        outcomes["stream"] += 1
                    else:
                        errors.append(f"stream: {error}")
                c.stop_stream()

    loops = [http_loop, http_loop, grpc_loop, grpc_loop, stream_loop]
    with ThreadPoolExecutor(len(loops)) as pool:
        futures = [pool.submit(loop) for loop in loops]
        try:
            yield
        finally:
            stop.set()
            for f in futures:
                f.result()


def test_reload_loop_under_traffic_fails_nothing(triton_fleet: Any, tmp_path: Path) -> None:
    servers = triton_fleet.servers
    path = tmp_path / "policy.yaml"
    doc = policy_for(servers, {"routing": {"policy": {"name": "round_robin"}}})
    path.write_text(yaml.safe_dump(doc))
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    with (
        running_proxy(servers, doc, policy_path=path, watch_interval_s=0.05) as proxy,
        traffic(proxy.http, proxy.grpc, outcomes, errors),
    ):
        wait_for(lambda: min(outcomes[k] for k in ("http", "grpc", "stream")) > 0)
        telemetry = proxy.proxy.telemetry
        for n in range(1, 13):
            variant = policy_for(
                servers[: 2 if n % 2 else 3],
                {"routing": {"policy": {"name": ("least_requests", "round_robin")[n % 2]}}},
            )
            if n % 3 == 0:
                variant["scheduling"] = {"default_class": "online"}
            # As editors and config managers do: a whole new file, never a half-written one.
            staged = tmp_path / "policy.yaml.new"
            staged.write_text(yaml.safe_dump(variant))
            staged.replace(path)
            wait_for(lambda n=n: telemetry.reloads.labels("ok")._value.get() == n)  # type: ignore[misc]
            before = sum(outcomes.values())
            wait_for(lambda before=before: sum(outcomes.values()) >= before + 10)  # type: ignore[misc]
        assert telemetry.reloads.labels("error")._value.get() == 0
    assert errors == []
    assert min(outcomes[k] for k in ("http", "grpc", "stream")) > 0, outcomes
    print(f"requests served during 12 reloads: {dict(outcomes)}")
    # Pools of the removed instance were retired, and closed once their requests ended.
    rt = proxy.runtime
    assert rt.upstreams.retiring() == 0 and rt.grpc_upstreams.retiring() == 0


def test_idle_streams_hold_no_slot(triton_fleet: Any) -> None:
    # One slot per instance for `simple`: under the old rule (a stream held one slot for its
    # whole life) three idle streams were enough to starve every unary request.
    doc = {"scheduling": {"concurrency": 1, "default_class": "online"}}
    with running_proxy(triton_fleet.servers, doc) as proxy:
        clients = []
        answers: queue.Queue[Any] = queue.Queue()
        try:
            for _ in range(12):
                c = grpcclient.InferenceServerClient(proxy.grpc)
                c.start_stream(callback=lambda result, error: answers.put(error))
                c.async_stream_infer("simple", simple_inputs(grpcclient))
                clients.append(c)
            assert [answers.get(timeout=60) for _ in clients] == [None] * len(clients)
            gates = proxy.runtime.gates
            wait_for(lambda: gates.gates["simple"].in_flight() == 0)
            assert sum(i.streams for i in proxy.runtime.fleet.all()) == len(clients)
            # The streams are open and idle; unary traffic is served.
            with httpclient.InferenceServerClient(proxy.http, network_timeout=30) as h:
                for _ in range(6):
                    h.infer("simple", simple_inputs(httpclient))
            with grpcclient.InferenceServerClient(proxy.grpc) as g:
                for _ in range(6):
                    g.infer("simple", simple_inputs(grpcclient), client_timeout=30)
            # And each stream still serves its next message.
            for c in clients:
                c.async_stream_infer("simple", simple_inputs(grpcclient))
            assert [answers.get(timeout=60) for _ in clients] == [None] * len(clients)
        finally:
            for c in clients:
                c.stop_stream()
                c.close()


def test_sigterm_drains_under_load(triton_fleet: Any, tmp_path: Path) -> None:
    """The real CLI: SIGTERM during load; every request gets its answer or a clean 503, then
    the process exits 0."""
    http_port, grpc_port, metrics_port = free_ports(3)
    doc = policy_for(
        triton_fleet.servers,
        {
            "limits": {"drain_timeout_s": 3},
            "scheduling": {"concurrency": 1, "default_class": "online"},
        },
    )
    doc["listen"] = {
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_port": metrics_port,
    }
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--policy", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"127.0.0.1:{http_port}"
    outcomes: Counter[str] = Counter()
    try:
        with httpclient.InferenceServerClient(url) as c:
            wait_for(lambda: _ready(c), 60)
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    with httpclient.InferenceServerClient(url, network_timeout=60) as c:
                        c.infer("accel_sim", ids(256))
                    outcomes["ok"] += 1
                except InferenceServerException as exc:
                    outcomes[f"status {exc.status()}"] += 1
                except ConnectionRefusedError:
                    outcomes["refused"] += 1  # the listener is closed: new connections fail
                    time.sleep(0.05)
                except (OSError, HTTPConnectionClosed):
                    # A connection accepted just before the listener closed and idle (its
                    # request not read yet) is closed: that request was never processed.
                    # Closed with the request unread, the socket resets, which the client
                    # reports as HTTPConnectionClosed when no byte of an answer came.
                    outcomes["closed"] += 1
                    time.sleep(0.05)

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(load) for _ in range(12)]
            wait_for(lambda: outcomes["ok"] >= 6, 60)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            stop.set()
            for f in futures:
                f.result()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        output = proc.stdout.read().decode() if proc.stdout else ""
    assert set(outcomes) <= {"ok", "status 503", "refused", "closed"}, (outcomes, output[-3000:])
    assert outcomes["ok"] >= 6


def _ready(c: httpclient.InferenceServerClient) -> bool:
    try:
        return bool(c.is_server_ready())
    except (ConnectionRefusedError, InferenceServerException):
        return False


def test_kill_one_then_sequential_requests_fail_none(triton_fleet: Any) -> None:
    """Pooled keep-alive connections to a server that just died never fail a request."""
    victim = 1
    doc = {"routing": {"policy": {"name": "round_robin"}}, "health": {"interval_s": 5.0}}
    name = triton_fleet.server(victim).name
    try:
        with running_proxy(triton_fleet.servers, doc) as proxy:
            with httpclient.InferenceServerClient(proxy.http, concurrency=4) as h:
                # Open pooled connections to every instance first.
                pending = [h.async_infer("simple", simple_inputs(httpclient)) for _ in range(24)]
                for p in pending:
                    p.get_result()
                triton_fleet.kill(victim)
                # The probe interval is long: the requests find the death themselves.
                for _ in range(200):
                    h.infer("simple", simple_inputs(httpclient))
            with grpcclient.InferenceServerClient(proxy.grpc) as g:
                for _ in range(100):
                    g.infer("simple", simple_inputs(grpcclient), client_timeout=30)
            assert not proxy.runtime.fleet.get(name).healthy
    finally:
        triton_fleet.restart(victim)


def test_model_unloaded_on_one_instance_leaves_only_that_model(triton_fleet: Any) -> None:
    server = triton_fleet.server(0)
    doc = {
        "routing": {"policy": {"name": "round_robin"}},
        "health": {"backoff_initial_s": 0.2, "backoff_max_s": 0.5},
    }
    with (
        running_proxy(triton_fleet.servers, doc) as proxy,
        httpclient.InferenceServerClient(proxy.http) as h,
        httpclient.InferenceServerClient(server.http_url.removeprefix("http://")) as direct,
    ):
        h.infer("simple", simple_inputs(httpclient))  # the proxy knows the model
        inst = proxy.runtime.fleet.get(server.name)
        direct.unload_model("simple")
        try:
            for _ in range(30):
                h.infer("simple", simple_inputs(httpclient))
            assert inst.healthy and "simple" in inst.models_out
            with grpcclient.InferenceServerClient(proxy.grpc) as g:
                for _ in range(30):
                    g.infer("simple", simple_inputs(grpcclient), client_timeout=30)
            # Its other models are still served there.
            before = inst_decisions(proxy, "accel_sim", server.name)
            for _ in range(6):
                h.infer("accel_sim", ids(8))
            assert inst_decisions(proxy, "accel_sim", server.name) > before
        finally:
            direct.load_model("simple")
        wait_for(lambda: "simple" not in inst.models_out, 60)
        before = inst_decisions(proxy, "simple", server.name)
        for _ in range(6):
            h.infer("simple", simple_inputs(httpclient))
        assert inst_decisions(proxy, "simple", server.name) > before


def inst_decisions(proxy: Any, model: str, instance: str) -> int:
    decisions = proxy.runtime.router.stats.decisions
    return sum(n for (m, _, inst), n in decisions.items() if m == model and inst == instance)
