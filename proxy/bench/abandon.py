"""Overload with clients that give up: how much of Triton's time goes to abandoned work.

``python -m proxy.bench.abandon --out DIR`` starts local Triton servers serving ``accel_sim``
(an emulated device: each batch *sleeps* ``base_ms + per_token_us x rows x longest``), then, for
each arm (``limits.cancel_upstream`` off / on) and each load (1x and 2x the fleet's capacity),
runs a proxy in a child process and sends it an open-loop Poisson schedule of equal-size requests
in two classes, over HTTP or gRPC. Each client gives up at its class's SLO after its scheduled
send time, and says so: ``Triton-Timeout-Ms`` over HTTP, the call's deadline over gRPC. Reported
per run:

- **abandoned share**: of the requests Triton executed (its statistics' success count), those
  whose client had given up before the answer came (executed minus answered in time). With
  equal-size requests in full batches this is also the share of Triton's compute time;
- **goodput** per class: requests answered (200) before their client gave up, per second;
- the proxy's peak resident memory (``VmHWM``) and Triton's own failures (requests it dropped
  from its queue, e.g. by the handed-on ``timeout``).

Figures describe scheduling on an emulated device, not a real one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from proxy.bench.arms import proxy_subprocess
from proxy.bench.fleet import bench_repository
from proxy.local.fleet import free_ports

ROOT = Path(__file__).resolve().parents[2]
MODEL = "accel_sim"
MAX_BATCH = 16  # accel_sim's max_batch_size


@dataclass(frozen=True)
class ClassSpec:
    name: str
    share: float
    slo_ms: float
    triton_priority: int


CLASSES = (
    ClassSpec("interactive", 0.5, 1000.0, 1),
    ClassSpec("batch", 0.5, 4000.0, 2),
)


@dataclass
class RunResult:
    arm: str
    protocol: str
    load: float
    rate_rps: float
    duration_s: float
    sent: dict[str, int] = field(default_factory=dict)
    in_time: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    goodput_rps: dict[str, float] = field(default_factory=dict)
    triton_executed: int = 0
    triton_failed: int = 0
    triton_compute_s: float = 0.0
    abandoned_executed: int = 0
    abandoned_share: float = 0.0
    proxy_peak_rss_mib: float = 0.0


def batch_time_s(base_ms: float, per_token_us: float, tokens: int) -> float:
    return (base_ms + per_token_us * MAX_BATCH * tokens / 1000.0) / 1000.0


def capacity_rps(servers: int, base_ms: float, per_token_us: float, tokens: int) -> float:
    """Full batches back to back on every server: the most the fleet can answer per second."""
    return servers * MAX_BATCH / batch_time_s(base_ms, per_token_us, tokens)


def schedule(rate: float, duration_s: float, seed: int) -> list[tuple[float, ClassSpec]]:
    rng = random.Random(seed)
    t = 0.0
    out: list[tuple[float, ClassSpec]] = []
    weights = [c.share for c in CLASSES]
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append((t, rng.choices(CLASSES, weights)[0]))


def infer_body(tokens: int) -> bytes:
    doc = {
        "inputs": [
            {"name": "INPUT_IDS", "shape": [1, tokens], "datatype": "INT64", "data": [1] * tokens}
        ]
    }
    return json.dumps(doc).encode()


def grpc_request(tokens: int) -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT_IDS", datatype="INT64", shape=[1, tokens])
    request.raw_input_contents.append(np.ones((1, tokens), dtype=np.int64).tobytes())
    data: bytes = request.SerializeToString()
    return data


def policy(
    servers: Sequence[Any], cancel_upstream: bool, concurrency: int | None, grpc_port: int
) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    for rank, c in enumerate(CLASSES):
        classes[c.name] = {
            "rank": rank,
            "triton_priority": c.triton_priority,
            "slo_p99_ms": c.slo_ms,
        }
        keys[f"bench-{c.name}"] = {"class_name": c.name}
    scheduling: dict[str, Any] = {
        "default_class": CLASSES[-1].name,
        "classes": classes,
        "api_keys": keys,
    }
    if concurrency is not None:
        scheduling["concurrency"] = concurrency
    return {
        "instances": [
            {"name": s.name, "http": s.http_url, "grpc": s.grpc_address, "metrics": s.metrics_url}
            for s in servers
        ],
        "listen": {
            "host": "127.0.0.1",
            "http_port": 0,
            "grpc_port": grpc_port,
            "metrics_port": 0,
        },
        "limits": {"cancel_upstream": cancel_upstream},
        "scheduling": scheduling,
    }


async def triton_totals(
    session: aiohttp.ClientSession, servers: Sequence[Any]
) -> tuple[int, int, float]:
    """(success, fail, compute seconds) of the model, summed over the servers."""
    ok = fail = 0
    compute_ns = 0
    for s in servers:
        async with session.get(f"{s.http_url}/v2/models/{MODEL}/stats") as r:
            stats = (await r.json())["model_stats"][0]["inference_stats"]
        ok += int(stats["success"]["count"])
        fail += int(stats["fail"]["count"])
        compute_ns += int(stats["compute_infer"]["ns"])
    return ok, fail, compute_ns / 1e9


def _rss_mib(pid: int, key: str) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return math.nan


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    klass: ClassSpec,
    due: float,
    start: float,
) -> str:
    give_up_at = start + due + klass.slo_ms / 1000
    await asyncio.sleep(max(0.0, start + due - time.monotonic()))
    left_ms = (give_up_at - time.monotonic()) * 1000
    if left_ms <= 0:
        return "gave_up"
    headers = {
        "Authorization": f"Bearer bench-{klass.name}",
        "Content-Type": "application/json",
        "Triton-Timeout-Ms": f"{left_ms:.0f}",
    }
    try:
        async with asyncio.timeout(left_ms / 1000):
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                status = r.status
    except TimeoutError:
        return "gave_up"  # the client closes its connection: it no longer waits
    except aiohttp.ClientError:
        return "error"
    if status == 200:
        return "in_time"
    return "shed" if status == 429 else f"http_{status}"


async def one_grpc_request(
    infer: Any, data: bytes, klass: ClassSpec, due: float, start: float
) -> str:
    give_up_at = start + due + klass.slo_ms / 1000
    await asyncio.sleep(max(0.0, start + due - time.monotonic()))
    left_s = give_up_at - time.monotonic()
    if left_s <= 0:
        return "gave_up"
    metadata = (("authorization", f"Bearer bench-{klass.name}"),)
    try:
        await infer(data, metadata=metadata, timeout=left_s)
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "gave_up"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "shed"
        return f"grpc_{code.name.lower()}"
    return "in_time"


async def run_arm(
    servers: Sequence[Any],
    workdir: Path,
    *,
    arm: str,
    protocol: str,
    load: float,
    rate: float,
    duration_s: float,
    tokens: int,
    seed: int,
    concurrency: int | None,
) -> RunResult:
    (grpc_port,) = free_ports(1)
    doc = policy(servers, arm == "cancel_on", concurrency, grpc_port)
    result = RunResult(arm, protocol, load, rate, duration_s)
    arrivals = schedule(rate, duration_s, seed)
    body = infer_body(tokens)
    message = grpc_request(tokens)
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        proxy_subprocess(doc, workdir, f"{arm}-{protocol}-{load:g}x") as proxy,
        aiohttp.ClientSession(connector=connector) as session,
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        assert proxy.pid is not None
        before = await triton_totals(session, servers)
        start = time.monotonic() + 0.5
        url = proxy.http_url + f"/v2/models/{MODEL}/infer"
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        tasks = [
            asyncio.ensure_future(
                one_request(session, url, body, klass, due, start)
                if protocol == "http"
                else one_grpc_request(infer, message, klass, due, start)
            )
            for due, klass in arrivals
        ]
        outcomes = await asyncio.gather(*tasks)
        # Let Triton finish what it still holds (abandoned work included), then read it.
        last = None
        while True:
            await asyncio.sleep(1.0)
            now = await triton_totals(session, servers)
            if now == last:
                break
            last = now
        after = last
        result.proxy_peak_rss_mib = round(_rss_mib(proxy.pid, "VmHWM"), 1)
    counts: dict[str, Counter[str]] = {c.name: Counter() for c in CLASSES}
    for (_, klass), outcome in zip(arrivals, outcomes, strict=True):
        counts[klass.name][outcome] += 1
    for c in CLASSES:
        result.sent[c.name] = sum(counts[c.name].values())
        result.in_time[c.name] = counts[c.name]["in_time"]
        result.outcomes[c.name] = dict(counts[c.name])
        result.goodput_rps[c.name] = round(counts[c.name]["in_time"] / duration_s, 2)
    assert after is not None
    result.triton_executed = after[0] - before[0]
    result.triton_failed = after[1] - before[1]
    result.triton_compute_s = round(after[2] - before[2], 2)
    answered = sum(result.in_time.values())
    result.abandoned_executed = max(0, result.triton_executed - answered)
    if result.triton_executed:
        result.abandoned_share = round(result.abandoned_executed / result.triton_executed, 4)
    return result


def render(results: Sequence[RunResult], capacity: float) -> str:
    lines = [
        f"capacity (full batches back to back): {capacity:.1f} req/s",
        "arm        proto load  rate  sent  Triton ran  abandoned  Triton dropped  "
        + "  ".join(f"goodput {c.name}" for c in CLASSES)
        + "  proxy peak RSS",
    ]
    for r in results:
        good = "  ".join(f"{r.goodput_rps[c.name]:>{9 + len(c.name)}.1f}" for c in CLASSES)
        lines.append(
            f"{r.arm:<10} {r.protocol:<5} {r.load:>3g}x {r.rate_rps:>5.0f} "
            f"{sum(r.sent.values()):>5} "
            f"{r.triton_executed:>11} {r.abandoned_share:>9.1%} {r.triton_failed:>15}  {good}"
            f"  {r.proxy_peak_rss_mib:>10.0f} MiB"
        )
    runs: dict[tuple[str, str, float], list[RunResult]] = {}
    for r in results:
        runs.setdefault((r.arm, r.protocol, r.load), []).append(r)
    for arm, protocol in sorted({(r.arm, r.protocol) for r in results}):
        ones, twos = runs.get((arm, protocol, 1.0)), runs.get((arm, protocol, 2.0))
        for one, two in zip(ones or [], twos or [], strict=False):
            ratios = [
                f"{c.name} {two.goodput_rps[c.name] / one.goodput_rps[c.name]:.0%}"
                if one.goodput_rps[c.name]
                else f"{c.name} n/a"
                for c in CLASSES
            ]
            total = sum(two.goodput_rps.values()) / max(1e-9, sum(one.goodput_rps.values()))
            lines.append(f"{arm} {protocol}: goodput 2x / 1x: {', '.join(ratios)}, all {total:.0%}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    from proxy.local import LocalFleet, sigterm_raises_exit

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = {MODEL: {"base_ms": args.base_ms, "per_token_us": args.per_token_us}}
    repo = bench_repository(ROOT / "model_repository", out / "repository", [MODEL], params)
    capacity = capacity_rps(args.instances, args.base_ms, args.per_token_us, args.tokens)
    results: list[RunResult] = []
    with sigterm_raises_exit(), LocalFleet(args.instances, repo, [MODEL], out / "logs") as fleet:
        servers = fleet.servers
        for rep, protocol, load in itertools.product(
            range(args.repetitions), args.protocols, args.loads
        ):
            arms = ["cancel_off", "cancel_on"]
            if rep % 2:
                arms.reverse()
            for arm in arms:
                r = await run_arm(
                    servers,
                    out / "proxies",
                    arm=arm,
                    protocol=protocol,
                    load=load,
                    rate=load * capacity,
                    duration_s=args.duration,
                    tokens=args.tokens,
                    seed=args.seed + rep,
                    concurrency=args.concurrency,
                )
                results.append(r)
                print(render([r], capacity).splitlines()[-1], flush=True)
    text = render(results, capacity)
    print(text)
    (out / "report.txt").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {"args": vars(args), "capacity_rps": capacity, "runs": [asdict(r) for r in results]},
            indent=2,
        )
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.abandon", description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--base-ms", type=float, default=40.0)
    p.add_argument("--per-token-us", type=float, default=100.0)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--protocols", nargs="+", choices=("http", "grpc"), default=["http", "grpc"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--concurrency", type=int, default=None, help="per-instance slots (default: derived)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
