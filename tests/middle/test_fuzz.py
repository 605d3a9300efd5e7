"""Fuzz: 10,000+ generated bad HTTP requests and 1,500 bad gRPC calls against the real proxy
(its own process) in front of recording fake Triton servers (issue 9, point 9).

Rules checked for every case: no 5xx of the proxy's own making (the fakes never answer 5xx in
this test, so every 5xx is the proxy's; the one exception is its documented 501 refusal of
shared-memory registration), an answer to every complete request, 400 in Triton's format for
the targets the issue says must be refused. After the run: the fakes recorded only canonical
paths of the allowed route table (admin off), the SSRF canary recorded nothing, the proxy
still runs and serves, logged no unhandled exception, and its RSS grew boundedly after the
warm-up. A second test checks that 1000 invented model names add a bounded number of metric
series, labelled ``other``.

``FUZZ_SEED`` and ``FUZZ_HTTP_CASES`` override the seed and the case count; ``FUZZ_SKIP``
(comma-separated kinds) leaves families out, to see what else fails behind one bug.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from tests.fakes.fuzz import OTHER_KEY, grpc_cases, http_cases, invented_model
from tests.fakes.fuzzrun import (
    grpc_problem,
    http_problem,
    send_grpc,
    send_http,
    unhandled_errors,
)
from tests.fakes.process import ProxyProcess
from tests.fakes.rawhttp import build, exchange
from tests.fakes.routes import path_problem
from tests.fakes.triton import FakeFleet
from tests.middle.conftest import FAST_HEALTH

SEED = int(os.environ.get("FUZZ_SEED", "9009"))
HTTP_CASES = int(os.environ.get("FUZZ_HTTP_CASES", "10000"))
GRPC_CASES = 1500
WARMUP = 2000
RSS_GROWTH_BOUND = 96 << 20
"""After the warm-up, 8,000 more bad requests may grow the proxy's RSS by at most this much
(generous: allocator slack and caches; unbounded per-request state grows far past it)."""
MAX_BODY = 1 << 20


def fuzz_policy(fakes: FakeFleet) -> dict[str, Any]:
    return {
        "instances": [
            {"name": s.name, "http": s.http_url, "grpc": s.grpc_address} for s in fakes.servers[:3]
        ],
        # Probes and config fetches get a generous timeout: the fakes share a loaded machine.
        "health": dict(FAST_HEALTH, interval_s=0.5, timeout_s=5.0),
        "limits": {"max_body_bytes": MAX_BODY, "connect_timeout_s": 1.0, "request_timeout_s": 10},
        "scheduling": {
            "default_class": "online",
            "api_keys": {OTHER_KEY: {"class_name": "offline"}},
        },
    }


def summarize(bad: list[tuple[str, Any]]) -> str:
    """One example per (kind, first words of the problem), most frequent first."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for problem, case in bad:
        groups.setdefault((case.kind, " ".join(problem.split()[:8])), []).append((problem, case))
    lines = []
    for (kind, _), items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        problem, case = items[0]
        lines.append(f"{len(items):5d} x [{kind}] {problem[:240]}\n        {case.describe()[:240]}")
    return "\n".join(lines) + ("\n" if lines else "")


def series(exposition: str) -> list[str]:
    return [line for line in exposition.splitlines() if line and not line.startswith("#")]


async def get(port: int, path: str) -> Any:
    return await exchange("127.0.0.1", port, build("GET", path, content_length=False))


async def infer_ok(proxy: ProxyProcess) -> bool:
    doc = {
        "inputs": [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
            for n in ("INPUT0", "INPUT1")
        ]
    }
    r = await exchange(
        "127.0.0.1",
        proxy.http_port,
        build("POST", "/v2/models/simple/infer", [], json.dumps(doc).encode()),
    )
    return r.status == 200


def _settings_read(path: str, body: bytes) -> bool:
    """A LogSettings / TraceSetting call that changes nothing: a read, open to anyone (as
    HTTP GET /v2/logging is, on Triton and through the proxy)."""
    method = path.rsplit("/", 1)[-1]
    kinds = {"LogSettings": pb.LogSettingsRequest, "TraceSetting": pb.TraceSettingRequest}
    if method not in kinds:
        return False
    try:
        return not kinds[method].FromString(body).settings
    except DecodeError:
        return False


@pytest.fixture
def fuzz_fakes() -> Any:
    with FakeFleet(3) as fleet:
        fleet.add("canary")  # the SSRF target: not an instance; must never hear from the proxy
        yield fleet


async def test_fuzz_bad_requests(fuzz_fakes: FakeFleet, tmp_path: Path) -> None:
    fakes = fuzz_fakes
    canary = fakes.servers[3]
    rng = random.Random(SEED)
    cases = list(http_cases(rng, HTTP_CASES, canary_port=canary.http_port))
    skip = set(filter(None, os.environ.get("FUZZ_SKIP", "").split(",")))  # for diagnosis
    cases = [c for c in cases if c.kind not in skip]
    rpcs = list(grpc_cases(rng, GRPC_CASES))
    with ProxyProcess(fuzz_policy(fakes), tmp_path) as proxy:
        assert (await get(proxy.http_port, "/v2/health/ready")).status == 200
        t0 = time.monotonic()
        results = await send_http(cases[:WARMUP], proxy.http_port)
        rss_warm = proxy.rss_bytes()
        results += await send_http(cases[WARMUP:], proxy.http_port)
        t1 = time.monotonic()
        grpc_results = await send_grpc(rpcs, f"127.0.0.1:{proxy.grpc_port}")
        t2 = time.monotonic()
        rss_end = proxy.rss_bytes()
        cpu_s = proxy.cpu_seconds()

        alive = proxy.alive()
        ready = (await get(proxy.http_port, "/v2/health/ready")).status
        served = await infer_ok(proxy)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc_port}") as ch:
            reply = await ch.unary_unary("/inference.GRPCInferenceService/ServerReady")(
                pb.ServerReadyRequest().SerializeToString(), timeout=10
            )
        grpc_ready = pb.ServerReadyResponse.FromString(reply).ready
        metrics = (await get(proxy.metrics_port, "/metrics")).body.decode()
        log = proxy.log()

    kinds = Counter(r.case.kind for r in results)
    print(f"seed {SEED}: {len(results)} HTTP cases {dict(kinds)}, {len(grpc_results)} gRPC")
    print(
        f"HTTP {t1 - t0:.1f} s, gRPC {t2 - t1:.1f} s wall (varies with machine load); "
        f"proxy CPU {cpu_s:.1f} s"
    )
    slow = sorted(results, key=lambda r: -r.seconds)[:5]
    print("slowest:", [(r.case.kind, round(r.seconds, 2), r.case.data[:80]) for r in slow])
    print(f"proxy RSS {rss_warm >> 20} MiB after warm-up, {rss_end >> 20} MiB at the end")

    http_bad = [(p, r.case) for r in results if (p := http_problem(r))]
    grpc_bad = [(p, r.case) for r in grpc_results if (p := grpc_problem(r))]
    if http_bad or grpc_bad:
        pytest.fail(f"seed {SEED}:\n" + summarize(http_bad) + summarize(grpc_bad), pytrace=False)

    reached = [
        (p, r)
        for r in fakes.received(lambda r: r.protocol == "http" and r.instance != "canary")
        if (p := path_problem(r.method, r.raw_path))
    ]
    if reached:
        pytest.fail(
            f"{len(reached)} refused requests reached an instance:\n"
            + "\n".join(
                f"{r.instance} got {r.method} {r.raw_path[:200]!r} ({p})" for p, r in reached[:12]
            ),
            pytrace=False,
        )
    heard = canary.seen()
    assert not heard, f"the proxy sent {len(heard)} requests to the SSRF canary: {heard[:3]}"
    grpc_reached = fakes.received(
        lambda r: (
            r.protocol == "grpc"
            and r.raw_path.rsplit("/", 1)[-1]
            not in ("ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelMetadata", "ModelReady")
            and not r.raw_path.endswith(("ServerReady", "ServerLive", "ModelStatistics"))
            and not _settings_read(r.raw_path, r.body)
        )
    )
    assert not grpc_reached, f"admin/shared-memory gRPC calls reached instances: {grpc_reached[:3]}"

    assert alive, "the proxy process died"
    assert ready == 200 and grpc_ready, "the proxy no longer reports ready"
    assert served, "a plain inference request fails after the fuzz run"
    unhealthy = re.findall(r'triton_proxy_instance_healthy\{instance="([^"]+)"\} 0', metrics)
    assert not unhealthy, f"bad requests ejected instances: {unhealthy}"
    unhandled = unhandled_errors(log)
    assert not unhandled, f"{len(unhandled)} unhandled exceptions in the proxy's log:\n" + (
        "\n---\n".join(unhandled[:3])
    )
    assert rss_end - rss_warm < RSS_GROWTH_BOUND, (
        f"proxy RSS grew {(rss_end - rss_warm) >> 20} MiB after the warm-up "
        f"({rss_warm >> 20} -> {rss_end >> 20} MiB)"
    )


async def test_invented_model_names_add_bounded_metric_series(
    fuzz_fakes: FakeFleet, tmp_path: Path
) -> None:
    fakes = fuzz_fakes
    rng = random.Random(SEED + 1)
    names = list(dict.fromkeys(invented_model(rng) for _ in range(1000)))
    with ProxyProcess(fuzz_policy(fakes), tmp_path) as proxy:
        assert await infer_ok(proxy)  # the known model's series exist before
        before = series((await get(proxy.metrics_port, "/metrics")).body.decode())
        body = json.dumps({"inputs": []}).encode()
        http_names, grpc_names = names[:800], names[800:]
        from urllib.parse import quote

        sem = asyncio.Semaphore(64)

        async def send(name: str) -> Any:
            target = f"/v2/models/{quote(name, safe='')}/infer"
            async with sem:
                return await exchange("127.0.0.1", proxy.http_port, build("POST", target, [], body))

        answers = await asyncio.gather(*(send(n) for n in http_names))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc_port}") as ch:
            call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            codes = []
            for n in grpc_names:
                try:
                    await call(pb.ModelInferRequest(model_name=n).SerializeToString(), timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        text = (await get(proxy.metrics_port, "/metrics")).body.decode()
        after = series(text)

    # 404 for an unknown name; 400 for a name the proxy does not accept as a model name at all.
    statuses = Counter(a.status for a in answers)
    assert set(statuses) <= {404, 400}, f"unknown models must get 404 (or 400), got {statuses}"
    assert statuses[404] >= len(http_names) // 2, statuses
    assert all(a.triton_error() for a in answers), "bodies in Triton's error format"
    assert set(codes) <= {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}, Counter(
        codes
    )
    leaked = [n for n in names if f'"{n}"' in text]
    assert not leaked, f"{len(leaked)} invented names became metric label values: {leaked[:5]}"
    assert 'model="other"' in text, "unknown models are labelled 'other'"
    grown = len(after) - len(before)
    assert grown <= 40, f"{len(names)} invented model names added {grown} metric series"
    inferred = [r for r in fakes.inferences() if r.model in set(names)]
    assert not inferred, f"inference requests for unknown models reached instances: {inferred[:3]}"
