"""The dashboards proven on a real Prometheus scraping the real proxy and real Triton servers.

Prometheus (Debian's package, run directly on a free port with a temporary config and storage)
scrapes the proxy and the three local Triton servers every second, with the job names and
label handling of docker/prometheus/prometheus.yml, and loads docker/prometheus/alerts.yml. The
proxy runs with three classes (one shed when its queue is full, one when it waits at all), a
canary arm on another routing policy, and a fourth instance that does not exist, so that
ejections and retries happen. Traffic of every
class then flows for a few seconds, and every query of every panel of every dashboard is
evaluated through Prometheus' HTTP API: each must parse and return data, except the GPU
panels (``GPU_METRICS`` in proxy/ops/dashboards.py: Triton exports them only where it sees a
GPU), which are reported, not passed. The control loops run in dry run (they decide and export,
change nothing), with adaptive concurrency on, so that the control dashboard has data too. The
dashboards are also rendered to PNG (set TRITON_PROXY_RENDER_DIR to keep them).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
import yaml

from proxy.canary import CANARY, MAIN
from proxy.local import TritonServer
from proxy.ops import dashboards
from proxy.ops.canary_report import format_report, report
from proxy.ops.render import Prometheus, PromQLError, render, substitute
from proxy.routing.config import CLASS_POLICY
from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RATE = "10s"  # $__rate_interval: ten 1-second scrapes
RT_KEY, OFF_KEY = "prom-rt-key", "prom-off-key"
POLICY: dict[str, Any] = {
    "health": {"interval_s": 0.5, "backoff_initial_s": 0.5, "backoff_max_s": 2},
    # A canary arm on another routing policy, so the per-arm panels have both arms.
    "canary": {"share": 0.3, "routing": {"policy": {"name": "round_robin"}}},
    # No routing section: the class default's placement and fill (routing.occupancy_depth
    # 0.25), so the fill's panel has data too.
    # Every loop on, in dry run: decisions are exported and logged, nothing is changed. The
    # real-time SLO is below what this load gives it, so the loops have something to decide.
    "control": {
        "dry_run": True,
        "tick_s": 0.5,
        "window_s": 5,
        "min_samples": 5,
        "class_limits": {"enabled": True, "interval_s": 1},
        "batching": {"enabled": True, "dwell_s": 1},
    },
    "scheduling": {
        "default_class": "online",
        # Adaptive concurrency between 1 and 2 slots per instance (max_batch_size 16): 3-6
        # slots over 3 instances, so that bursts queue in the proxy.
        "adaptive_concurrency": {"enabled": True, "min_batches": 0.0625, "max_batches": 0.125},
        # The overload guard on, with a limit this test's loop never reaches: its pressure gauge
        # is exported (at 0) and no request is refused for it.
        "overload": {"lag_ms": 1000},
        "api_keys": {RT_KEY: {"class_name": "realtime"}, OFF_KEY: {"class_name": "offline"}},
        "classes": {
            "realtime": {"rank": 0, "triton_priority": 1, "slo_p99_ms": 5, "max_queue": 100},
            # Any wait in the queue at all times out: shed_timeout.
            "online": {
                "rank": 1,
                "triton_priority": 2,
                "slo_p99_ms": 1000,
                "max_queue": 100,
                "queue_timeout_s": 0.001,
            },
            # A short queue: bursts overflow it, shed_queue_full. A min_share: the floor
            # boost's counter is exported (at 0) for it.
            "offline": {
                "rank": 2,
                "triton_priority": 3,
                "max_queue": 3,
                "queue_timeout_s": 30,
                "min_share": 0.1,
            },
        },
    },
}


def body(tokens: int) -> bytes:
    ids = (np.arange(tokens) % 999 + 1).tolist()  # accel_sim: ids < 1000
    return json.dumps(
        {"inputs": [{"name": "INPUT_IDS", "shape": [1, tokens], "datatype": "INT64", "data": ids}]}
    ).encode()


BODY = body(128)
LONG_BODY = body(2048)
"""16x what is typical in this mix: long work of online (an SLO class without a cap), so the
long load panel has data."""
# Longer runs (for the rendered example in docs/) with TRITON_PROXY_PROOF_TRAFFIC_S.
TRAFFIC_S = float(os.environ.get("TRITON_PROXY_PROOF_TRAFFIC_S", "8"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dead_instance() -> SimpleNamespace:
    """An instance in the policy that nothing listens on: ejected, its requests retried."""
    http, grpc, metrics = free_port(), free_port(), free_port()
    return SimpleNamespace(
        name="triton-gone",
        http_url=f"http://127.0.0.1:{http}",
        grpc_address=f"127.0.0.1:{grpc}",
        metrics_url=f"http://127.0.0.1:{metrics}/metrics",
    )


def prometheus_config(proxy_metrics: int, servers: list[TritonServer]) -> dict[str, Any]:
    """docker/prometheus/prometheus.yml's jobs, pointed at this machine's processes."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {
                "job_name": "triton-proxy",
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{proxy_metrics}"]}],
            },
            {
                "job_name": "triton",
                "static_configs": [
                    {
                        "targets": [s.metrics_url.split("//")[1].split("/")[0]],
                        "labels": {"instance": s.name},
                    }
                    for s in servers
                ],
            },
        ],
    }


class PrometheusProcess:
    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: Debian package prometheus (.ci/run)")
        self.port = free_port()
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(ROOT / "docker" / "prometheus" / "alerts.yml", workdir / "alerts.yml")
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"prometheus not ready after {timeout_s}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


async def traffic(proxy: ProxyThread, seconds: float) -> Counter[tuple[str, int]]:
    """Rounds of concurrent requests of every class; returns (class, status) counts."""
    url = f"http://{proxy.http}/v2/models/accel_sim/infer"
    keys = {"realtime": RT_KEY, "online": None, "offline": OFF_KEY}
    counts: Counter[tuple[str, int]] = Counter()

    async def one(session: aiohttp.ClientSession, klass: str, data: bytes = BODY) -> None:
        key = keys[klass]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with session.post(url, data=data, headers=headers) as r:
            await r.read()
            counts[(klass, r.status)] += 1

    mix = ["realtime"] * 4 + ["online"] * 6 + ["offline"] * 12
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            await asyncio.gather(*(one(session, k) for k in mix), one(session, "online", LONG_BODY))
    return counts


class Proof:
    def __init__(self, prom: Prometheus, start: float, end: float, counts: Counter[Any]) -> None:
        self.prom, self.start, self.end, self.counts = prom, start, end, counts


@pytest.fixture(scope="module")
def proof(
    triton_servers: list[TritonServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proof]:
    workdir = tmp_path_factory.mktemp("prometheus")
    with running_proxy([*triton_servers, dead_instance()], POLICY) as proxy:
        assert proxy.ports and proxy.ports.metrics
        prom_proc = PrometheusProcess(
            prometheus_config(proxy.ports.metrics, triton_servers), workdir
        )
        try:
            prom_proc.wait_ready()
            prom = Prometheus(prom_proc.url)
            time.sleep(2)  # a couple of scrapes before the traffic: rates start from zero
            start = time.time()
            counts = asyncio.run(traffic(proxy, TRAFFIC_S))
            time.sleep(3)  # the last scrapes and rule evaluations after the traffic
            yield Proof(prom, start - 2, time.time(), counts)
        finally:
            prom_proc.stop()


def test_traffic_covered_every_class_and_was_partly_shed(proof: Proof) -> None:
    by_class = Counter(k for k, _ in proof.counts.elements())
    assert set(by_class) == {"realtime", "online", "offline"}
    assert proof.counts[("realtime", 200)] > 0
    assert proof.counts[("offline", 429)] > 0, proof.counts
    assert proof.counts[("online", 429)] > 0, proof.counts
    targets = proof.prom.query('up{job=~"triton-proxy|triton"}')
    assert {t["metric"]["job"] for t in targets if t["value"][1] == "1"} == {
        "triton-proxy",
        "triton",
    }


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_panel_query_parses_and_returns_data(proof: Proof, name: str) -> None:
    doc = dashboards.to_json(dashboards.DASHBOARDS[name]())
    empty, gpu = [], []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], RATE)
            try:
                series = proof.prom.query_range(expr, proof.start, proof.end, 1.0)
            except PromQLError as exc:
                pytest.fail(f"{name} / {panel['title']}: Prometheus refused {expr!r}: {exc}")
            has_data = any(s.finite() for s in series)
            why = dashboards.requirement(target["expr"])
            where = f"{name} / {panel['title']} / {target['refId']}"
            if why == "gpu" and not has_data:
                gpu.append(where)
            elif not has_data:
                empty.append(f"{where}: {expr}")
    for where in gpu:
        warnings.warn(f"no data without a GPU (nv_gpu_*): {where}", stacklevel=1)
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_the_loops_decided_in_dry_run_and_changed_nothing(proof: Proof) -> None:
    """The control panels' data comes from real decisions, which dry run did not apply."""
    made = proof.prom.query("sum(triton_proxy_control_decisions_total)")
    would = proof.prom.query("sum by (loop) (triton_proxy_control_dry_run_decisions_total)")
    assert not made or float(made[0]["value"][1]) == 0
    assert {r["metric"]["loop"] for r in would} >= {"class_limits"}, would
    assert all(float(r["value"][1]) > 0 for r in would)
    assert proof.prom.query("triton_proxy_control_dry_run == 1")


def test_both_canary_arms_are_on_the_dashboards(proof: Proof) -> None:
    expr = 'sum by (arm, policy) (triton_proxy_routing_decisions_total{model="accel_sim"})'
    seen = {(r["metric"]["arm"], r["metric"]["policy"]) for r in proof.prom.query(expr)}
    # The main arm has classes and names no policy: the default with classes.
    assert seen == {("main", CLASS_POLICY.name), ("canary", "round_robin")}


def test_canary_report_compares_the_arms_on_real_data(proof: Proof) -> None:
    reports = report(proof.prom, "2m", "accel_sim", resamples=500)
    assert {r.klass for r in reports} == {"realtime", "online", "offline"}
    for r in reports:
        assert all(sum(r.histograms[arm]) > 0 for arm in (MAIN, CANARY))
        assert [d.q for d in r.differences] == [0.5, 0.95, 0.99]
        assert all(d.low <= d.high and 0.0 <= d.p_canary_lower <= 1.0 for d in r.differences)
    text = format_report(reports, "2m")
    print(text)
    assert "Δ P99" in text and "realtime" in text


def test_recording_rules_evaluate_on_the_real_series(proof: Proof) -> None:
    result = proof.prom.query("triton_proxy:slo_missed:ratio_rate5m")
    classes = {r["metric"]["class"] for r in result}
    assert {"realtime", "online"} <= classes  # the classes with an SLO
    online = next(float(r["value"][1]) for r in result if r["metric"]["class"] == "online")
    assert online > 0  # its sheds count as missed


def test_dashboards_render_to_png(proof: Proof, tmp_path: Path) -> None:
    keep = os.environ.get("TRITON_PROXY_RENDER_DIR")
    out_dir = Path(keep) if keep else tmp_path
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in dashboards.DASHBOARDS:
        out = out_dir / f"{name}.png"
        panels = render(
            proof.prom,
            dashboards.DASHBOARD_DIR / f"{name}.json",
            out,
            proof.start,
            proof.end,
            rate_interval=RATE,
        )
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        drawn = [p for p in panels if p.kind != "row"]
        assert drawn and all(p.lines or p.notes for p in drawn)
        if name == "overview":
            assert all(p.lines for p in drawn), [p.title for p in drawn if not p.lines]
