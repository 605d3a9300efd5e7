"""Closed-loop overhead: ``C`` clients each sending the next request as soon as one answers.

The open-loop overhead run (:mod:`proxy.bench.overhead`) asks what a proxy adds at a given
rate; this one asks the two questions of issue 13 directly, over HTTP and over gRPC:

- at concurrency 1, how much latency the proxy adds to one request at a time (P50, P99 of the
  arm minus direct's, within the same repetition);
- at concurrency 16, what share of direct throughput the arm reaches, and how much CPU its
  own processes spend per request (from ``/proc``: the arm's process and its descendants).

Every arm is started once and kept running; then each repetition runs every (concurrency,
arm) pair for ``duration_s`` after ``warmup_s``, rotating the arm order between repetitions.
Closed-loop numbers understate queueing (a slow arm slows its own clients); they measure a
hop's cost, not scheduling. The load generator is one Python process: at concurrency 16 its
own CPU is part of what bounds direct's throughput on a small machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Literal

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from proxy.bench.cpu import read_procs
from proxy.fleet import http1
from proxy.fleet.http1 import Http1Pool

Protocol = Literal["http", "grpc"]
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class ClosedTarget:
    """Where an arm is reached, and which processes are its own (for CPU per request)."""

    protocol: Protocol
    addresses: tuple[str, ...]
    """HTTP base URLs or gRPC ``host:port``; several: client round robin (direct)."""
    pids: tuple[int, ...] = ()
    """The arm's processes; their descendants count too (proxy workers)."""


@dataclass(frozen=True)
class ClosedArm:
    name: str
    open: Callable[[], AbstractAsyncContextManager[ClosedTarget]]
    baseline: str | None = None
    """The direct arm this one is compared with (same protocol); None for a direct arm."""


@dataclass(frozen=True)
class SimpleRequest:
    """Triton's ``simple`` model: two INT32 [1, 16] inputs, sent as binary tensors."""

    model: str = "simple"
    api_key: str | None = None

    def http(self) -> tuple[str, bytes, dict[str, str]]:
        data = np.ones(16, dtype=np.int32).tobytes()
        header = (
            b'{"inputs":['
            + b",".join(
                b'{"name":"%s","shape":[1,16],"datatype":"INT32",'
                b'"parameters":{"binary_data_size":%d}}' % (n, len(data))
                for n in (b"INPUT0", b"INPUT1")
            )
            + b'],"parameters":{"binary_data_output":true}}'
        )
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        }
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return f"/v2/models/{self.model}/infer", header + data + data, headers

    def grpc(self) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        data = np.ones(16, dtype=np.int32).tobytes()
        request = pb.ModelInferRequest(
            model_name=self.model,
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name=n, datatype="INT32", shape=[1, 16])
                for n in ("INPUT0", "INPUT1")
            ],
            raw_input_contents=[data, data],
        )
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return request.SerializeToString(), metadata


@dataclass
class ClosedRun:
    arm: str
    protocol: Protocol
    concurrency: int
    repetition: int
    seconds: float
    requests: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    arm_cpu_s: float | None
    """CPU seconds of the arm's own processes during the measured window."""
    first_error: str | None = None

    @property
    def throughput_rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms_per_request(self) -> float | None:
        if self.arm_cpu_s is None or not self.requests:
            return None
        return 1000.0 * self.arm_cpu_s / self.requests

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["throughput_rps"] = self.throughput_rps
        d["cpu_ms_per_request"] = self.cpu_ms_per_request
        return d


def tree_cpu_s(roots: Sequence[int]) -> float:
    """CPU seconds (user + system) of ``roots`` and all their descendants, now."""
    procs = read_procs()
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    by_pid = {p.pid: p for p in procs}
    total, todo, seen = 0.0, list(roots), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if pid in by_pid:
            total += by_pid[pid].cpu_s
        todo += children.get(pid, [])
    return total


Send = Callable[[int], Awaitable[None]]


@contextlib.asynccontextmanager
async def _http_sender(
    target: ClosedTarget, request: SimpleRequest, concurrency: int
) -> AsyncIterator[Send]:
    # The proxy's own HTTP/1.1 client, as the open-loop generator uses (proxy/bench/runner.py):
    # the client shares the machine with every arm, and aiohttp's cost it about twice the CPU.
    path, body, headers = request.http()
    pools = [Http1Pool(a.rstrip("/"), concurrency, 10.0) for a in target.addresses]
    fields = list(headers.items())
    try:

        async def send(k: int) -> None:
            resp = await pools[k % len(pools)].request("POST", path, fields, body)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")

        yield send
    finally:
        for pool in pools:
            pool.close()


@contextlib.asynccontextmanager
async def _grpc_sender(target: ClosedTarget, request: SimpleRequest) -> AsyncIterator[Send]:
    data, metadata = request.grpc()
    channels = [grpc.aio.insecure_channel(a) for a in target.addresses]
    calls = [ch.unary_unary(INFER_METHOD) for ch in channels]
    try:

        async def send(k: int) -> None:
            await calls[k % len(calls)](data, metadata=metadata)

        yield send
    finally:
        for ch in channels:
            await ch.close()


def sender(
    target: ClosedTarget, request: SimpleRequest, concurrency: int
) -> AbstractAsyncContextManager[Send]:
    if target.protocol == "http":
        return _http_sender(target, request, concurrency)
    return _grpc_sender(target, request)


async def run_closed(
    send: Send,
    concurrency: int,
    duration_s: float,
    *,
    warmup_s: float = 0.5,
    cpu: Callable[[], float] | None = None,
) -> tuple[list[float], int, float, float | None, str | None]:
    """``concurrency`` loops of ``send``; returns (latencies s, errors, seconds, CPU s, error).

    Only requests that start and finish inside the measured window count.
    """
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    clock = time.perf_counter
    start = clock() + warmup_s
    end = start + duration_s
    counter = 0
    cpu0: list[float] = []

    async def loop() -> None:
        nonlocal errors, counter, first_error
        while True:
            began = clock()
            if began >= end:
                return
            k = counter
            counter += 1
            try:
                await send(k)
            except (*http1.FAILURES, grpc.aio.AioRpcError, RuntimeError) as exc:
                if began >= start:
                    errors += 1
                    first_error = first_error or f"{type(exc).__name__}: {exc}"[:160]
                continue
            done = clock()
            if began >= start and done <= end:
                latencies.append(done - began)

    async def mark() -> None:
        await asyncio.sleep(max(0.0, start - clock()))
        if cpu is not None:
            cpu0.append(cpu())

    marker = asyncio.create_task(mark())
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    await marker
    cpu_s = cpu() - cpu0[0] if cpu is not None and cpu0 else None
    # The CPU reading at the end includes the last requests' tails: a few requests at most.
    return latencies, errors, duration_s, cpu_s, first_error


@dataclass
class ClosedReport:
    runs: list[ClosedRun] = field(default_factory=list)
    baselines: dict[str, str | None] = field(default_factory=dict)

    def _runs(self, arm: str, concurrency: int) -> list[ClosedRun]:
        return [r for r in self.runs if r.arm == arm and r.concurrency == concurrency]

    def added_ms(self, arm: str, q: str) -> list[float]:
        """Per repetition at concurrency 1: arm quantile minus its baseline's, ms."""
        base = self.baselines.get(arm)
        if base is None:
            return []
        out = []
        for r in self._runs(arm, 1):
            b = next((x for x in self._runs(base, 1) if x.repetition == r.repetition), None)
            mine, theirs = getattr(r, f"{q}_ms"), getattr(b, f"{q}_ms") if b else None
            if mine is not None and theirs is not None:
                out.append(mine - theirs)
        return out

    def throughput_share(self, arm: str, concurrency: int) -> list[float]:
        base = self.baselines.get(arm)
        if base is None:
            return []
        out = []
        for r in self._runs(arm, concurrency):
            b = next(
                (x for x in self._runs(base, concurrency) if x.repetition == r.repetition), None
            )
            if b is not None and b.throughput_rps > 0:
                out.append(r.throughput_rps / b.throughput_rps)
        return out

    def render(self) -> str:
        arms = list(self.baselines)
        concs = sorted({r.concurrency for r in self.runs})
        w = max([24, *(len(a) for a in arms)])
        lines = [
            "Closed loop, model simple: per arm, median over repetitions [min..max]",
            f"{'arm':<{w}} {'c':>3} {'P50 ms':>7} {'P99 ms':>7} {'+P50 ms':>20} {'+P99 ms':>20} "
            f"{'req/s':>8} {'of direct':>18} {'CPU ms/req':>11} {'errors':>7}",
        ]
        for c in concs:
            for arm in arms:
                runs = self._runs(arm, c)
                if not runs:
                    continue
                p50 = _med([r.p50_ms for r in runs])
                p99 = _med([r.p99_ms for r in runs])
                rps = _med([r.throughput_rps for r in runs])
                cpu = _med([r.cpu_ms_per_request for r in runs])
                add50 = _spread(self.added_ms(arm, "p50")) if c == 1 else "-"
                add99 = _spread(self.added_ms(arm, "p99")) if c == 1 else "-"
                share = self.throughput_share(arm, c)
                share_s = _spread(share, pct=True) if share else "-"
                lines.append(
                    f"{arm:<{w}} {c:>3} {_f(p50):>7} {_f(p99):>7} {add50:>20} {add99:>20} "
                    f"{_f(rps, 0):>8} {share_s:>18} {_f(cpu, 3):>11} "
                    f"{sum(r.errors for r in runs):>7}"
                )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        arms = list(self.baselines)
        concs = sorted({r.concurrency for r in self.runs})
        summary = {
            arm: {
                str(c): {
                    "added_p50_ms": self.added_ms(arm, "p50") if c == 1 else None,
                    "added_p99_ms": self.added_ms(arm, "p99") if c == 1 else None,
                    "throughput_share": self.throughput_share(arm, c),
                }
                for c in concs
            }
            for arm in arms
        }
        return {
            "baselines": self.baselines,
            "summary": summary,
            "runs": [r.to_dict() for r in self.runs],
        }


def _med(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _spread(values: Sequence[float], pct: bool = False) -> str:
    if not values:
        return "-"
    k = 100.0 if pct else 1.0
    fmt = "{:.0f}%" if pct else "{:+.2f}"
    med = fmt.format(k * statistics.median(values))
    if len(values) < 2:
        return med
    return f"{med} [{fmt.format(k * min(values))}..{fmt.format(k * max(values))}]"


async def measure_closed(
    arms: Sequence[ClosedArm],
    *,
    concurrencies: Sequence[int] = (1, 16),
    repetitions: int = 3,
    duration_s: float = 5.0,
    warmup_s: float = 0.5,
    api_key: str | None = None,
    settle_s: float = 0.3,
    log: Callable[[str], None] = print,
) -> ClosedReport:
    """Every arm at every concurrency, ``repetitions`` times, arms kept running throughout."""
    report = ClosedReport(baselines={a.name: a.baseline for a in arms})
    request = SimpleRequest(api_key=api_key)
    async with contextlib.AsyncExitStack() as stack:
        targets = {}
        for arm in arms:
            targets[arm.name] = await stack.enter_async_context(arm.open())
        for rep in range(repetitions):
            shift = rep % len(arms)
            order = [*arms[shift:], *arms[:shift]]
            for c in concurrencies:
                for arm in order:
                    target = targets[arm.name]
                    cpu = (lambda t=target: tree_cpu_s(t.pids)) if target.pids else None
                    async with sender(target, request, c) as send:
                        lat, errors, secs, cpu_s, err = await run_closed(
                            send, c, duration_s, warmup_s=warmup_s, cpu=cpu
                        )
                    arr = np.asarray(lat) * 1000.0
                    run = ClosedRun(
                        arm=arm.name,
                        protocol=target.protocol,
                        concurrency=c,
                        repetition=rep,
                        seconds=secs,
                        requests=len(lat),
                        errors=errors,
                        p50_ms=float(np.percentile(arr, 50)) if arr.size else None,
                        p99_ms=float(np.percentile(arr, 99)) if arr.size else None,
                        arm_cpu_s=cpu_s,
                        first_error=err,
                    )
                    report.runs.append(run)
                    log(
                        f"  rep {rep + 1}/{repetitions} c={c:<3} {arm.name:<28} "
                        f"{run.throughput_rps:8.0f} req/s  P50 {_f(run.p50_ms)} ms  "
                        f"P99 {_f(run.p99_ms)} ms  CPU {_f(run.cpu_ms_per_request, 3)} ms/req"
                        + (f"  errors {errors} ({err})" if errors else "")
                    )
                    await asyncio.sleep(settle_s)
    return report


def own_pid() -> int:
    return os.getpid()
