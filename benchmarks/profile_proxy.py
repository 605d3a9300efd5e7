"""Where the proxy's CPU goes per request: py-spy on a proxy process under closed-loop load.

    flock /tmp/triton.lock .venv/bin/python benchmarks/profile_proxy.py --out bench-results/prof

Starts 3 local Triton servers serving ``simple``, one ``triton-proxy serve`` child process
(``least_requests``, with and without classes), drives it at concurrency 16 over HTTP, then
over gRPC, for ``--seconds`` each while ``py-spy record`` samples the proxy (``--format raw``:
collapsed stacks). Prints, per run, the functions with the largest share of samples, inclusive
("in") and on top of the stack ("self"), and writes the collapsed stacks for flame graphs.
Needs ``pip install py-spy``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.bench.arms import CATALOG, proxy_policy, proxy_subprocess  # noqa: E402
from proxy.bench.closed import ClosedTarget, SimpleRequest, run_closed, sender  # noqa: E402
from proxy.bench.fleet import bench_repository  # noqa: E402
from proxy.bench.scenario import load_scenario  # noqa: E402
from proxy.local import LocalFleet, sigterm_raises_exit  # noqa: E402


def summarize(raw: Path, top: int = 25) -> str:
    """Top functions by inclusive and self share of the samples in a py-spy raw file."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_s)
        frames = [f.split(" (")[0] + " " + _where(f) for f in stack.split(";")]
        total += count
        for f in set(frames):
            inclusive[f] += count
        own[frames[-1]] += count
    lines = [f"{total} samples"]
    lines.append("inclusive:")
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    lines.append("self:")
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    return "\n".join(lines)


def category(stack: str, protocol: str) -> str:
    """Which part of the request path a collapsed stack belongs to (its outermost owner)."""
    frames = stack.split(";")
    if "_bootstrap" in frames[0] or ("Thread.run" in stack and "Runner.run" not in stack):
        return "idle"  # gRPC's poller thread: py-spy samples it, /proc shows it uses no CPU
    if protocol == "http":
        if "HttpFrontend._exchange" in stack:
            return "upstream exchange: aiohttp client + relaying the answer"
        if "Dispatcher.run" in stack:
            return "dispatch: classify, admission, placement, routing, in-flight, telemetry"
        if "HttpFrontend" in stack:
            return "frontend: route match, body read, headers, parameters"
        if any(m in stack for m in ("web_protocol", "web_app", "web_response")):
            return "aiohttp server: parse, request/response objects, write"
        if "http_server" in stack:
            return "HTTP server (proxy/frontends/http_server.py): parse, answer, write"
        return "event loop (uvloop) and other"
    if any(m in stack for m in ("GrpcUpstreams.unary", "UnaryUnaryCall", "grpc/aio/_channel")):
        return "upstream call: grpc.aio client"
    if "Dispatcher.run" in stack:
        return "dispatch: classify, admission, placement, routing, in-flight, telemetry"
    if "GrpcFrontend" in stack or "_guard" in stack:
        return "frontend: read_infer, metadata"
    return "event loop + gRPC core (C, no Python frame) and other"


def breakdown(raw: Path, protocol: str) -> str:
    """Share of the non-idle samples per part of the request path."""
    parts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if stack:
            parts[category(stack, protocol)] += int(count_s)
    idle = parts.pop("idle", 0)
    busy = sum(parts.values()) or 1
    lines = [f"by part ({busy} busy samples, {idle} idle-thread samples left out):"]
    lines += [f"  {100 * n / busy:5.1f}%  {name}" for name, n in parts.most_common()]
    return "\n".join(lines)


def _where(frame: str) -> str:
    inside = frame.split(" (", 1)[1].rstrip(")") if " (" in frame else ""
    path = inside.rsplit(":", 1)[0]
    for marker in ("site-packages/", "wt-speed/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"({path})"


async def profile(args: argparse.Namespace, servers: list, work: Path, out: Path) -> None:
    scenario = load_scenario(ROOT / "benchmarks" / "mixed.yaml")
    grpc = [s.grpc_address for s in servers]
    for arm in ("proxy_least_requests", "proxy_least_requests+classes"):
        doc = proxy_policy(servers, CATALOG[arm], scenario, grpc_addresses=grpc)
        key = scenario.classes["realtime"].api_key if "classes" in arm else None
        async with proxy_subprocess(doc, work, arm, workers=args.workers) as ep:
            assert ep.pid is not None and ep.grpc_address is not None
            for protocol, address in (("http", ep.http_url), ("grpc", ep.grpc_address)):
                target = ClosedTarget(protocol, (address,))  # type: ignore[arg-type]
                stem = f"{arm.replace('+', '_')}-{protocol}"
                raw = out / f"{stem}.txt"
                spy = subprocess.Popen(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        str(ep.pid),
                        "--format",
                        "raw",
                        "--rate",
                        "500",
                        "--duration",
                        str(int(args.seconds)),
                        "--output",
                        str(raw),
                        *(["--subprocesses"] if args.workers > 1 else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                async with sender(target, SimpleRequest(api_key=key), 16) as send:
                    lat, errors, secs, _, _ = await run_closed(
                        send, 16, args.seconds + 1.0, warmup_s=0.5
                    )
                await asyncio.to_thread(spy.wait)
                text = breakdown(raw, protocol) + "\n" + summarize(raw)
                head = f"== {stem}: {len(lat) / secs:.0f} req/s at c=16, {errors} errors"
                (out / f"{stem}.summary.txt").write_text(head + "\n" + text + "\n")
                print(head + "\n" + text + "\n", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(ROOT / "bench-results" / "profile"))
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    )
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    repo = bench_repository(ROOT / "model_repository", work / "repository", ["simple"])
    with sigterm_raises_exit(), LocalFleet(3, repo, ["simple"], work / "logs") as fleet:
        servers = fleet.start()
        try:
            import uvloop

            uvloop.run(profile(args, servers, work, out))
        except ImportError:
            asyncio.run(profile(args, servers, work, out))
    with contextlib.suppress(OSError):
        shutil.rmtree(work / "repository")
    return 0


if __name__ == "__main__":
    sys.exit(main())
