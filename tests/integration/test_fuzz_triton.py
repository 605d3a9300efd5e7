"""The fuzz suite's share against real Triton (issue 9, point 9): 800 generated bad HTTP
requests and 150 bad unary gRPC calls through the proxy process to the session's 3 servers.

The bulk (10,000+) runs against recording fakes in ``tests/middle/test_fuzz.py``; this share
checks the same rules where Triton itself answers. Here a 5xx may be Triton's own (2.51
answers some malformed JSON with 500): a 5xx counts as relayed only when the same bytes sent
straight to a Triton server get the same status. Traversal targets are limited to read-only
routes (``safe``), and nothing reaches the servers' model control, so the shared fleet cannot
be changed by a proxy bug; the test checks that it was not (every model still ready on every
server, log settings unchanged). gRPC streams stay out: Triton 2.51 can abort on concurrent
stream errors (docs/triton-notes.md).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import pytest

from tests.fakes.fuzz import OTHER_KEY, GrpcCase, grpc_cases, http_cases
from tests.fakes.fuzzrun import (
    GrpcResult,
    HttpResult,
    grpc_problem,
    http_problem,
    send_grpc,
    send_http,
    unhandled_errors,
)
from tests.fakes.process import ProxyProcess
from tests.fakes.rawhttp import build, exchange
from tests.fakes.triton import FakeFleet
from tests.integration.conftest import MODELS

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("FUZZ_SEED", "9009"))
HTTP_CASES = 800
GRPC_CASES = 150
TIMEOUT_S = 10.0
RSS_GROWTH_BOUND = 96 << 20


def _port(url: str) -> int:
    return int(urlparse(url).port or 0)


async def _direct_status(http_port: int, case_data: bytes) -> int | None:
    return (await exchange("127.0.0.1", http_port, case_data, timeout_s=TIMEOUT_S)).status


async def _relayed_5xx(results: list[HttpResult], http_port: int) -> list[str]:
    """The HTTP problems left after 5xx answers Triton itself gives for the same bytes."""
    problems = []
    for r in results:
        problem = http_problem(r)
        if problem is None:
            continue
        status = r.response.status
        if status is not None and status >= 500 and not r.case.must_refuse:
            direct = await _direct_status(http_port, r.case.data)
            if direct == status:
                continue  # Triton's own answer, relayed
            problem += f" (Triton itself answers {direct})"
        problems.append(f"[{r.case.kind}] {problem}\n        {r.case.describe()[:240]}")
    return problems


async def _grpc_relayed(results: list[GrpcResult], target: str) -> list[str]:
    problems = []
    async with grpc.aio.insecure_channel(target) as ch:
        for r in results:
            problem = grpc_problem(r)
            if problem is None:
                continue
            case: GrpcCase = r.case
            try:
                await ch.unary_unary(case.method)(case.messages[0], metadata=(), timeout=TIMEOUT_S)
                direct = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                direct = exc.code()
            if direct == r.code:
                continue
            problems.append(f"[{case.kind}] {problem} (Triton itself: {direct.name})")
    return problems


async def _fleet_state(servers: list[Any]) -> list[Any]:
    """What a leaked model-control call would change: model readiness and log settings."""
    state = []
    for s in servers:
        port = _port(s.http_url)
        for model in MODELS:
            r = await exchange(
                "127.0.0.1", port, build("GET", f"/v2/models/{model}/ready", content_length=False)
            )
            state.append((s.name, model, r.status))
        r = await exchange("127.0.0.1", port, build("GET", "/v2/logging", content_length=False))
        state.append((s.name, "logging", r.body))
    return state


async def test_fuzz_through_the_proxy_to_real_triton(triton_fleet: Any, tmp_path: Path) -> None:
    servers = triton_fleet.servers
    rng = random.Random(SEED + 7)
    with FakeFleet(0) as canaries:
        canary = canaries.add("canary")
        cases = list(http_cases(rng, HTTP_CASES, canary_port=canary.http_port, safe=True))
        rpcs = [c for c in grpc_cases(rng, GRPC_CASES * 2, safe=True) if not c.stream][:GRPC_CASES]
        policy = {
            "instances": [
                {"name": s.name, "http": s.http_url, "grpc": s.grpc_address} for s in servers
            ],
            "limits": {"max_body_bytes": 1 << 20, "request_timeout_s": 30},
            "scheduling": {
                "default_class": "online",
                "api_keys": {OTHER_KEY: {"class_name": "offline"}},
            },
        }
        before = await _fleet_state(servers)
        with ProxyProcess(policy, tmp_path) as proxy:
            t0 = time.monotonic()
            results = await send_http(
                cases[:200], proxy.http_port, concurrency=8, timeout_s=TIMEOUT_S
            )
            rss_warm = proxy.rss_bytes()
            results += await send_http(
                cases[200:], proxy.http_port, concurrency=8, timeout_s=TIMEOUT_S
            )
            t1 = time.monotonic()
            print(f"HTTP share: {t1 - t0:.1f} s", flush=True)
            slow = sorted(results, key=lambda r: -r.seconds)[:5]
            print("slowest:", [(r.case.kind, round(r.seconds, 1), r.case.data[:100]) for r in slow])
            grpc_results = await send_grpc(
                rpcs, f"127.0.0.1:{proxy.grpc_port}", concurrency=4, timeout_s=TIMEOUT_S
            )
            print(f"gRPC share: {time.monotonic() - t1:.1f} s", flush=True)
            rss_end = proxy.rss_bytes()
            alive = proxy.alive()
            ready = (
                await exchange(
                    "127.0.0.1",
                    proxy.http_port,
                    build("GET", "/v2/health/ready", content_length=False),
                )
            ).status
            metrics = (
                await exchange(
                    "127.0.0.1", proxy.metrics_port, build("GET", "/metrics", content_length=False)
                )
            ).body.decode()
            log = proxy.log()
        after = await _fleet_state(servers)
        heard = canary.seen()

    print(f"seed {SEED + 7}: {dict(Counter(r.case.kind for r in results))}")
    print(f"answers {dict(Counter(r.response.status for r in results))}")
    print(f"proxy RSS {rss_warm >> 20} -> {rss_end >> 20} MiB")
    direct_port = _port(servers[0].http_url)
    problems = await _relayed_5xx(results, direct_port)
    problems += await _grpc_relayed(grpc_results, servers[0].grpc_address)
    assert not problems, f"{len(problems)} bad answers:\n" + "\n".join(problems[:12])
    assert not heard, f"the proxy sent {len(heard)} requests to the SSRF canary"
    assert before == after, "the fuzz run changed the Triton servers (model readiness or logging)"
    assert alive and ready == 200
    unhealthy = re.findall(r'triton_proxy_instance_healthy\{instance="([^"]+)"\} 0', metrics)
    assert not unhealthy, f"bad requests ejected instances: {unhealthy}"
    unhandled = unhandled_errors(log)
    assert not unhandled, "unhandled exceptions in the proxy's log:\n" + "\n---\n".join(
        unhandled[:3]
    )
    assert rss_end - rss_warm < RSS_GROWTH_BOUND
