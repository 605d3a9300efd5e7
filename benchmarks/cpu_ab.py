"""CPU per request of the proxy from several checkouts, alternated, against a fake Triton.

    flock /tmp/bench.lock .venv/bin/python benchmarks/cpu_ab.py OLD_TREE . --rounds 5

Each round starts, for every checkout in turn, ``triton-proxy serve`` from that checkout (one
process) in front of one fake Triton (aiohttp HTTP + grpc.aio, answering at once, in its own
process), drives it closed-loop at concurrency 16 (``--concurrency``) for ``--seconds`` over
HTTP or gRPC, with and without classes, and reads the CPU time of every thread of the proxy
process from ``/proc``.
The fake server's answer costs nothing to compute, so the figure is the proxy's own cost per
request; alternating the checkouts round by round spreads a noisy machine's drift over all of
them. Prints the median over rounds per (checkout, protocol, classes). ``--floor`` also measures a
bare byte pipe in Python (``PIPE``, HTTP), a bare grpc.aio relay (``GRPC_PIPE``) and a bare
relay on the proxy's own HTTP/2 (``H2_PIPE``) in front of the same fake server: the floor of
any proxy written like this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from proxy.bench.closed import (  # noqa: E402
    ClosedTarget,
    Protocol,
    SimpleRequest,
    run_closed,
    sender,
)

FAKE = """
import asyncio, sys, grpc, uvloop
from aiohttp import web
from tritonclient.grpc import service_pb2 as pb
ANSWER = pb.ModelInferResponse(model_name="simple").SerializeToString()
async def main():
    async def ready(r): return web.Response()
    async def config(r):
        return web.json_response({"max_batch_size": 8, "dynamic_batching": {"priority_levels": 3}})
    async def infer(r):
        await r.read(); return web.json_response({"outputs": []})
    async def metrics(r): return web.Response(text="")
    async def model_infer(request, context): return ANSWER
    app = web.Application()
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2/models/{m}/config", config)
    app.router.add_post("/v2/models/{m}/infer", infer)
    app.router.add_get("/metrics", metrics)
    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)})
    server = grpc.aio.server(); server.add_generic_rpc_handlers([handler])
    gport = server.add_insecure_port("127.0.0.1:0"); await server.start()
    runner = web.AppRunner(app, access_log=None); await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(runner.addresses[0][1], gport, flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""

# The floor: a byte pipe in Python (uvloop), one upstream connection per client connection,
# no parsing, no routing. What a proxy in this language cannot go below per request.
PIPE = """
import asyncio, sys, uvloop
UP = int(sys.argv[1])
class Up(asyncio.Protocol):
    def __init__(self, down): self.down = down
    def data_received(self, data): self.down.write(data)
    def connection_lost(self, exc): self.down.close()
class Down(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.up, self.early = transport, None, []
        transport.pause_reading()
        asyncio.ensure_future(self.connect())
    async def connect(self):
        loop = asyncio.get_running_loop()
        self.up, _ = await loop.create_connection(lambda: Up(self.transport), "127.0.0.1", UP)
        for data in self.early: self.up.write(data)  # read before the pause took hold
        self.transport.resume_reading()
    def data_received(self, data):
        if self.up is None: self.early.append(data)
        else: self.up.write(data)
    def connection_lost(self, exc):
        if self.up: self.up.close()
async def main():
    server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""

# The gRPC floor: a bare grpc.aio relay (generic handler, bytes in and out, one pooled
# channel), which is how the proxy's gRPC frontend is built. What any proxy on grpc.aio pays.
GRPC_PIPE = """
import asyncio, sys, grpc, uvloop
async def main():
    call = grpc.aio.insecure_channel(sys.argv[1]).unary_unary(
        "/inference.GRPCInferenceService/ModelInfer")
    async def model_infer(request, context): return await call(request)
    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)})
    server = grpc.aio.server(); server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0"); await server.start()
    print(port, flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""

# The floor of the proxy's own HTTP/2 (proxy.h2, from this checkout): its server and its
# client with nothing between them but one handler. What the gRPC path pays before routing.
H2_PIPE = """
import asyncio, sys, uvloop
from types import SimpleNamespace
from proxy.h2.client import H2Upstreams
from proxy.h2.server import H2GrpcServer
PATH = "/inference.GRPCInferenceService/ModelInfer"
async def main():
    inst = SimpleNamespace(name="t0", spec=SimpleNamespace(grpc=sys.argv[1]))
    ups = H2Upstreams(SimpleNamespace(instances={"t0": inst}), max_send_bytes=1 << 26,
                      connect_timeout_s=2.0, request_timeout_s=None)
    async def model_infer(request, context): return await ups.unary(inst, PATH, request, (), None)
    server = H2GrpcServer({PATH: model_infer}, {}, max_receive_bytes=1 << 26)
    print(await server.start("127.0.0.1", 0), flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""

# py-spy comes with the bench extras, beside this interpreter
PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"

CLASSES = {
    "classes": {"rt": {"rank": 0, "triton_priority": 1}, "bulk": {"rank": 1, "triton_priority": 2}},
    "default_class": "bulk",
    "api_keys": {"ab-key": {"class_name": "rt"}},
}
# ``+slo`` configs: the same with an SLO on the class the client is in, so every request has a
# class budget (deadline admission's work; the fake never makes anyone wait).
CLASSES_SLO = {
    **CLASSES,
    "classes": {**CLASSES["classes"], "rt": {**CLASSES["classes"]["rt"], "slo_p99_ms": 1000}},
}


def thread_cpu_s(pid: int) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        total += (int(rest[11]) + int(rest[12])) / tick
    return total


async def one(
    tree: Path,
    http: str,
    grpc_address: str,
    protocol: str,
    classes: bool,
    seconds: float,
    profile: Path | None = None,
    concurrency: int = 16,
    slo: bool = False,
) -> tuple[float, float]:
    """(req/s, CPU ms per request) of one proxy run from ``tree``.

    With ``profile``, py-spy samples the proxy during the measured window and writes its raw
    (collapsed) stacks there; py-spy's own reads slow the process, so take CPU figures from a
    run without it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy.yaml"
        doc: dict[str, object] = {
            "instances": [
                {"name": "t0", "http": http, "grpc": grpc_address, "metrics": http + "/metrics"}
            ],
            "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
        }
        if classes:
            doc["scheduling"] = CLASSES_SLO if slo else CLASSES
        policy.write_text(yaml.safe_dump(doc))
        log = Path(tmp) / "proxy.log"
        proc = spawn_proxy(tree, policy, log)
        try:
            target = await proxy_target(proc, log, protocol)
            request = SimpleRequest(api_key="ab-key" if classes else None)
            return await measure(
                target, request, proc.pid, seconds, concurrency, str(tree), profile
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def spawn_proxy(tree: Path, policy: Path, log: Path) -> subprocess.Popen[bytes]:
    """``triton-proxy serve --policy POLICY`` from the checkout ``tree``, writing to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--policy", str(policy)],
            cwd=tree,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )


async def proxy_target(
    proc: subprocess.Popen[Any], log: Path, protocol: str, timeout_s: float = 30.0
) -> ClosedTarget:
    """Where a starting ``triton-proxy serve`` (``proc``, writing ``log``) listens for
    ``protocol``, once it has said so."""
    ports: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    while protocol not in ports:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"proxy did not start:\n{log.read_text()}")
        await asyncio.sleep(0.1)
        for line in log.read_text().splitlines():
            if "ready: HTTP localhost:" in line:
                ports["http"] = int(line.rsplit(":", 1)[1])
            elif line.strip().startswith("gRPC localhost:"):
                ports["grpc"] = int(line.rsplit(":", 1)[1])
    if protocol == "http":
        return ClosedTarget("http", (f"http://127.0.0.1:{ports['http']}",))
    return ClosedTarget("grpc", (f"127.0.0.1:{ports['grpc']}",))


async def measure(
    target: ClosedTarget,
    request: SimpleRequest,
    pid: int,
    seconds: float,
    concurrency: int,
    what: str,
    profile: Path | None = None,
) -> tuple[float, float]:
    """(req/s, CPU ms per request of process ``pid``) over ``seconds`` of a closed loop to
    ``target``, after one second that opens the connections and warms caches. With
    ``profile``, py-spy samples ``pid`` meanwhile."""
    async with sender(target, request, concurrency) as send:
        await run_closed(send, concurrency, 1.0, warmup_s=0.0)
        spy = None
        if profile is not None:
            spy = subprocess.Popen(
                [
                    *(PY_SPY, "record", "--format", "raw", "--rate", "500"),
                    *("--nonblocking", "--duration", str(int(seconds))),
                    *("--pid", str(pid), "--output", str(profile)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        before = thread_cpu_s(pid)
        lat, errors, secs, _, err = await run_closed(send, concurrency, seconds, warmup_s=0.0)
        after = thread_cpu_s(pid)
        if spy is not None:
            spy.wait(30)
    if errors:
        raise RuntimeError(f"{errors} errors from {what}: {err}")
    return len(lat) / secs, 1000.0 * (after - before) / max(1, len(lat))


@contextlib.contextmanager
def script_process(script: str, *argv: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run one of the scripts above (this checkout importable) and yield it with the first
    line it prints (its ports); it is killed on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *argv],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


async def floor(
    relay: str, upstream: str, seconds: float, concurrency: int = 16
) -> tuple[float, float]:
    """(req/s, CPU ms per request) of a bare relay: ``PIPE`` over HTTP (``upstream``: the
    fake server's HTTP port), ``GRPC_PIPE`` and ``H2_PIPE`` over gRPC (its gRPC address)."""
    script = {"http": PIPE, "grpc": GRPC_PIPE, "h2": H2_PIPE}[relay]
    protocol: Protocol = "http" if relay == "http" else "grpc"
    with script_process(script, upstream) as (pipe, port):
        address = f"http://127.0.0.1:{port}" if protocol == "http" else f"127.0.0.1:{port}"
        target = ClosedTarget(protocol, (address,))
        request = SimpleRequest(api_key=None)
        return await measure(
            target, request, pipe.pid, seconds, concurrency, f"the {protocol} pipe"
        )


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trees", nargs="+", help="checkouts to compare (the proxy package's root)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    p.add_argument(
        "--configs",
        default="http,http+classes,grpc,grpc+classes",
        help="also http+classes+slo, grpc+classes+slo (the client's class has an SLO)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also measure bare relays each round (HTTP byte pipe; gRPC: grpc.aio, proxy.h2)",
    )
    p.add_argument("--py-spy", metavar="DIR", help="also write py-spy raw stacks of each run here")
    args = p.parse_args()
    trees = [Path(t).resolve() for t in args.trees]
    with script_process(FAKE) as (_, ports):
        http_port, grpc_port = ports.split()
        http, grpc_address = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        floors: dict[str, list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            if args.floor:
                floor_of = (("http", http_port), ("grpc", grpc_address), ("h2", grpc_address))
                for relay, upstream in floor_of:
                    got = await floor(relay, upstream, args.seconds, args.concurrency)
                    floors.setdefault(relay, []).append(got)
                    print(
                        f"round {r + 1} floor: {relay} relay: {got[0]:6.0f} req/s  "
                        f"{got[1]:.3f} ms/req"
                    )
            for config in args.configs.split(","):
                protocol, *extras = config.split("+")
                classes, slo = "classes" in extras, "slo" in extras
                order = trees[r % len(trees) :] + trees[: r % len(trees)]
                for tree in order:
                    profile = None
                    if args.py_spy:
                        Path(args.py_spy).mkdir(parents=True, exist_ok=True)
                        profile = Path(args.py_spy) / f"{tree.name}-{config}-r{r + 1}.txt"
                    rps, cpu = await one(
                        *(tree, http, grpc_address, protocol, classes, args.seconds, profile),
                        concurrency=args.concurrency,
                        slo=slo,
                    )
                    results.setdefault((str(tree), config), []).append((rps, cpu))
                    print(f"round {r + 1} {config:<13} {tree}: {rps:6.0f} req/s  {cpu:.3f} ms/req")
        print(f"\nmedian over rounds: CPU ms per request (req/s at concurrency {args.concurrency})")
        for config in args.configs.split(","):
            cells = []
            for tree in trees:
                runs = results[(str(tree), config)]
                cpu = statistics.median(c for _, c in runs)
                rps = statistics.median(x for x, _ in runs)
                cells.append(f"{tree.name}: {cpu:.3f} ({rps:.0f})")
            print(f"  {config:<13} " + "   ".join(cells))
        for relay, runs in floors.items():
            cpu = statistics.median(c for _, c in runs)
            rps = statistics.median(x for x, _ in runs)
            print(f"  {relay} relay    {cpu:.3f} ({rps:.0f})")
    return 0


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(main()))
