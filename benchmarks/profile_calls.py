"""Python function calls per request of the proxy, counted by cProfile, against a fake Triton.

    .venv/bin/python benchmarks/profile_calls.py [TREE] [--classes] [--concurrency 1]

Starts the fake Triton of ``benchmarks/cpu_ab.py`` and ``triton-proxy serve`` from ``TREE``
(default: this checkout) under a profiler that is off until the closed loop has warmed up,
then profiles ``--seconds`` of requests over HTTP (``--protocol grpc``: gRPC) and prints the
calls per request, the functions called most often and those with the most own time. Call
counts are deterministic (they do not need a quiet machine); times under cProfile are inflated
by its per-call cost, so confirm a cut with ``timeit`` and ``benchmarks/cpu_ab.py`` (a cut that
removed calls once made the request slower).
Light: about ten seconds of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

from cpu_ab import CLASSES, FAKE, proxy_target  # noqa: E402

from proxy.bench.closed import SimpleRequest, run_closed, sender  # noqa: E402

# Runs the proxy's CLI with cProfile switched on by SIGUSR1 and off (dumped) by SIGUSR2.
WRAP = """
import cProfile, signal, sys
out, prof = sys.argv[1], cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
def stop(*_):
    prof.disable(); prof.dump_stats(out)
signal.signal(signal.SIGUSR2, stop)
sys.argv = ["triton-proxy", *sys.argv[2:]]
from proxy.cli import main
sys.exit(main())
"""


async def profile(
    tree: Path, out: Path, classes: bool, concurrency: int, seconds: float, protocol: str
) -> int:
    """Profile the proxy from ``tree`` into ``out``; returns the requests answered meanwhile."""
    fake = subprocess.Popen([sys.executable, "-c", FAKE], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None
        http_port, grpc_port = fake.stdout.readline().split()
        http = f"http://127.0.0.1:{http_port}"
        with tempfile.TemporaryDirectory() as tmp:
            doc: dict[str, object] = {
                "instances": [
                    {
                        "name": "t0",
                        "http": http,
                        "grpc": f"127.0.0.1:{grpc_port}",
                        "metrics": http + "/metrics",
                    }
                ],
                "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
            }
            if classes:
                doc["scheduling"] = CLASSES
            policy = Path(tmp) / "policy.yaml"
            policy.write_text(yaml.safe_dump(doc))
            log = Path(tmp) / "proxy.log"
            with log.open("w") as sink:
                proc = subprocess.Popen(
                    [sys.executable, "-c", WRAP, str(out), "serve", "--policy", str(policy)],
                    cwd=tree,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONPATH": str(tree)},
                )
            try:
                target = await proxy_target(proc, log, protocol)
                request = SimpleRequest(api_key="ab-key" if classes else None)
                async with sender(target, request, concurrency) as send:
                    await run_closed(send, concurrency, 1.0, warmup_s=0.0)
                    proc.send_signal(signal.SIGUSR1)
                    await asyncio.sleep(0.05)
                    lat, errors, _, _, err = await run_closed(
                        send, concurrency, seconds, warmup_s=0.0
                    )
                    proc.send_signal(signal.SIGUSR2)
                    await asyncio.sleep(0.5)  # let it write the profile
                if errors:
                    raise RuntimeError(f"{errors} errors: {err}")
                return len(lat)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    finally:
        fake.kill()
        fake.wait()


def report(path: Path, requests: int, top: int) -> None:
    stats = pstats.Stats(str(path))
    rows = [
        (f"{Path(file).name}:{line} {name}", calls, own)
        for (file, line, name), (_, calls, own, _, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    print(f"{sum(r[1] for r in rows) / requests:.1f} Python function calls per request")
    print(f"({requests} requests; a coroutine counts one call per resumption)\n")
    print("most called (calls per request):")
    for label, calls, _ in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"  {calls / requests:7.2f}  {label}")
    print("\nmost own time under cProfile (µs per request, inflated by the profiler):")
    for label, _, own in sorted(rows, key=lambda r: -r[2])[:top]:
        print(f"  {own / requests * 1e6:7.2f}  {label}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("tree", nargs="?", default=str(HERE), help="the checkout to profile")
    p.add_argument("--classes", action="store_true", help="with scheduling classes on")
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop clients")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", help="keep the cProfile dump here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "proxy.prof"
        import uvloop

        requests = uvloop.run(
            profile(
                Path(args.tree).resolve(),
                *(out, args.classes, args.concurrency, args.seconds, args.protocol),
            )
        )
        report(out, requests, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
