"""Where do requests wait when Triton's batcher stalls, sent directly and through the proxy?

    flock /tmp/bench.lock .venv/bin/python benchmarks/triton_trace_stall.py --seconds 40 --rounds 4
    flock /tmp/bench.lock .venv/bin/python benchmarks/triton_trace_stall.py --servers 3

``--servers`` local Tritons (`nvidia-pytriton`'s), model `accel_sim` with
`benchmarks/issue10/case.yaml`'s parameters (5 ms + 10 us per token), fed each server's share
of `case.yaml` x0.25 (Poisson, per server: real-time 19 req/s of 8-64 tokens at priority 1,
online 13 req/s (a tenth 512 tokens) at priority 2, offline 4.3 req/s of 4 x 512 at priority
3), each request on its own connection, in alternated blocks: sent straight to Triton
(``direct``, round robin over the servers), or through ``triton-proxy serve`` (``proxy``: round
robin, no classes, the client's priority passed on: the benchmark's ``proxy_rr_priority``;
``--no-feedback`` adds an arm with instance feedback off, ``--classes`` one with `case.yaml`'s
classes: its class gate, each kind's priority set by the proxy, ``--wake-ms`` one whose
``routing.wake`` floor is that many milliseconds, ``--nudge-ms`` one that also nudges quiet
instances: ``routing.wake.nudge``, margin 1.5; a nudge's copy carries its request's id, so
Triton's timestamps of a nudged request, about 1 % of them, mix the two, while the latency the
client measured does not; the proxies' wake and nudge counts are printed). Triton traces
every request (``--trace-config level=TIMESTAMPS``), on the same monotonic clock as the
sender, so each request's time splits into: send -> Triton's HTTP frontend starts reading it
(``HTTP_RECV_START``) -> it enters the batcher's queue (``QUEUE_START``) -> its batch starts
(``COMPUTE_START``) -> ends -> the client has the answer. A request *stalled* when it waited in
the queue over ``--stall-ms`` with no batch running.

Why: issue 10's request log showed requests through the proxy waiting on an idle Triton 2-4x as
often as the same round robin sent directly (docs/benchmarks.md, seventeenth and eighteenth
rounds), and could not say whether they waited before Triton had read them or in its batcher.
Triton's own timestamps can.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import glob
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import numpy as np
import tritonclient.http as httpclient
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_ab import proxy_target, spawn_proxy  # noqa: E402

from proxy.bench.arms import NUDGE_WAKE, scheduling_section  # noqa: E402
from proxy.bench.fleet import bench_repository  # noqa: E402
from proxy.bench.scenario import load_scenario  # noqa: E402
from proxy.local.fleet import LocalFleet  # noqa: E402

PARAMETERS = {"accel_sim": {"base_ms": 5, "per_token_us": 10}}
QUEUE_DELAY_NS = 2_000_000  # accel_sim's max_queue_delay_microseconds
# (kind, req/s per server, priority, rows, then its sizes: ((fewest, most tokens), weight)...)
MIX = (
    ("realtime", 19.0, 1, 1, ((8, 64), 1.0)),
    ("online", 13.0, 2, 1, ((8, 64), 0.9), ((512, 512), 0.1)),
    ("offline", 4.3, 3, 4, ((512, 512), 1.0)),
)


@dataclass
class Sent:
    rid: str
    kind: str
    sent_ns: int
    done_ns: int = 0
    error: str = ""


@dataclass
class Arm:
    name: str
    sent: list[Sent] = field(default_factory=list)


def schedule(
    seconds: float, rng: random.Random, servers: int
) -> list[tuple[float, str, int, int, int]]:
    """(time, kind, priority, rows, tokens) of every request, Poisson per kind, at each
    kind's rate per server times ``servers``."""
    out = []
    for kind, rate, priority, rows, *sizes in MIX:
        t = rng.expovariate(rate * servers)
        while t < seconds:
            (low, high), _ = rng.choices(sizes, weights=[w for _, w in sizes])[0]
            out.append((t, kind, priority, rows, rng.randint(low, high)))
            t += rng.expovariate(rate * servers)
    return sorted(out)


def send(url: str, item: Sent, priority: int, rows: int, tokens: int) -> None:
    try:
        client = httpclient.InferenceServerClient(url, connection_timeout=30, network_timeout=30)
        tensor = httpclient.InferInput("INPUT_IDS", [rows, tokens], "INT64")
        tensor.set_data_from_numpy(np.ones((rows, tokens), dtype=np.int64), binary_data=True)
        item.sent_ns = time.monotonic_ns()
        client.infer(
            "accel_sim",
            [tensor],
            priority=priority,
            request_id=item.rid,
            headers={"Authorization": f"Bearer bench-{item.kind}"},
        )
        item.done_ns = time.monotonic_ns()
        client.close()
    except Exception as exc:  # reported per arm
        item.error = str(exc)[:200]
    finally:
        # tritonclient's HTTP client runs a gevent hub in each thread; a thread that ends
        # leaves its hub's file descriptors open unless it is destroyed.
        gevent.get_hub().destroy(destroy_loop=True)


def drive(urls: list[str], arm: Arm, seconds: float, rng: random.Random, servers: int) -> None:
    """Send the schedule for ``servers``, round robin over ``urls`` (one URL: all to it)."""
    threads = []
    start = time.monotonic()
    for n, (at, kind, priority, rows, tokens) in enumerate(schedule(seconds, rng, servers)):
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        item = Sent(f"{arm.name}-{len(arm.sent)}-{n}", kind, 0)
        arm.sent.append(item)
        url = urls[n % len(urls)]
        t = threading.Thread(target=send, args=(url, item, priority, rows, tokens))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def start_proxy(
    http_urls: list[str], workdir: Path, name: str, sections: dict[str, Any]
) -> tuple[subprocess.Popen[bytes], str]:
    """A proxy doing round robin over ``http_urls``; ``sections`` adds to its policy."""
    policy = workdir / f"{name}.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "instances": [{"name": f"t{i}", "http": u} for i, u in enumerate(http_urls)],
                "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
                **sections,
                "routing": {"policy": {"name": "round_robin"}, **sections.get("routing", {})},
            }
        )
    )
    log = workdir / f"{name}.log"
    proc = spawn_proxy(ROOT, policy, log)
    try:
        target = asyncio.run(proxy_target(proc, log, "http"))
    except BaseException:
        proc.kill()
        raise
    return proc, target.addresses[0].removeprefix("http://")


def read_traces(prefix: Path, server: int) -> dict[str, dict[str, int]]:
    """Triton's timestamps by request id (with the server's index as ``server``)."""
    by_trace: dict[int, dict[str, int]] = {}
    ids: dict[int, str] = {}
    for path in sorted(glob.glob(f"{prefix}*")):
        for entry in json.loads(Path(path).read_text() or "[]"):
            tid = entry["id"]
            if "request_id" in entry:
                ids[tid] = entry["request_id"]
            for stamp in entry.get("timestamps", ()):
                by_trace.setdefault(tid, {})[stamp["name"]] = stamp["ns"]
    return {
        ids[tid]: {**stamps, "server": server} for tid, stamps in by_trace.items() if tid in ids
    }


def busy_union(traces: dict[str, dict[str, int]], server: int) -> list[tuple[int, int]]:
    """When ``server`` ran a batch: its requests' compute spans, merged."""
    spans = sorted(
        (t["COMPUTE_START"], t["COMPUTE_END"])
        for t in traces.values()
        if t["server"] == server and "COMPUTE_START" in t and "COMPUTE_END" in t
    )
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def idle_within(busy: list[tuple[int, int]], ends: list[int], a: int, b: int) -> int:
    """Nanoseconds of [a, b] with no batch running (``busy``: sorted, disjoint spans;
    ``ends``: their ends)."""
    covered = 0
    for x, y in busy[bisect.bisect_right(ends, a) :]:
        if x >= b:
            break
        covered += min(b, y) - max(a, x)
    return max(0, b - a - covered)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


_NEEDED = {"HTTP_RECV_START", "QUEUE_START", "COMPUTE_START"}


def report(arm: Arm, traces: dict[str, dict[str, int]], stall_ms: float, servers: int) -> list[str]:
    busy = [busy_union(traces, i) for i in range(servers)]
    ends = [[b for _, b in spans] for spans in busy]
    arrivals = [
        sorted(t["QUEUE_START"] for t in traces.values() if t["server"] == i and "QUEUE_START" in t)
        for i in range(servers)
    ]
    rows: list[dict[str, float]] = []
    kinds: list[str] = []
    errors = [s for s in arm.sent if s.error]
    for s in arm.sent:
        t = traces.get(s.rid)
        if s.error or t is None or not t.keys() >= _NEEDED:
            continue
        q, c, server = t["QUEUE_START"], t["COMPUTE_START"], t["server"]
        idle = idle_within(busy[server], ends[server], q + QUEUE_DELAY_NS, c)
        # The next request to enter its server's queue after this one: what woke the batcher?
        queue = arrivals[server]
        after = bisect.bisect_right(queue, q)
        # When the server's last batch before it ended: a request queued just after a batch
        # ends, before the model instance waits again, is the one Triton's batcher can miss.
        before = bisect.bisect_right(ends[server], q) - 1
        kinds.append(s.kind)
        rows.append(
            {
                "latency": (s.done_ns - s.sent_ns) / 1e6,
                "to_triton": (t["HTTP_RECV_START"] - s.sent_ns) / 1e6,
                "read": (q - t["HTTP_RECV_START"]) / 1e6,
                "queue": (c - q) / 1e6,
                "idle": idle / 1e6,
                "batch": (t.get("COMPUTE_END", c) - c) / 1e6,
                "back": (s.done_ns - t.get("COMPUTE_END", c)) / 1e6,
                "since_batch_end": (q - ends[server][before]) / 1e6
                if before >= 0
                else float("nan"),
                "next_arrival_to_start": (c - queue[after]) / 1e6
                if after < len(queue)
                else float("nan"),
            }
        )
    lines = [f"{arm.name}: {len(arm.sent)} sent, {len(rows)} traced, {len(errors)} errors"]
    for kind in ("realtime", "online", "offline"):
        r = [x for x, k in zip(rows, kinds, strict=True) if k == kind]
        if not r:
            continue
        stalled = [x for x in r if x["idle"] > stall_ms]
        lat = [x["latency"] for x in r]
        lines.append(
            f"  {kind:9s} P50 {pct(lat, 50):6.1f}  P99 {pct(lat, 99):6.1f} ms   "
            f"stalled (idle > {stall_ms:g} ms in the queue) {len(stalled)}/{len(r)} "
            f"({100 * len(stalled) / len(r):.1f} %)"
        )
    stalled = [x for x in rows if x["idle"] > stall_ms]
    for label, group in (("all", rows), ("stalled", stalled)):
        if not group:
            continue
        cells = "  ".join(
            f"{k} {pct([x[k] for x in group], 50):.2f}/{pct([x[k] for x in group], 99):.2f}"
            for k in ("to_triton", "read", "queue", "idle", "batch", "back")
        )
        lines.append(f"  {label:8s} P50/P99 ms: {cells}")
    for label, group in (("all", rows), ("stalled", stalled)):
        gaps = [x["since_batch_end"] for x in group if not math.isnan(x["since_batch_end"])]
        if gaps:
            near = sum(1 for g in gaps if g < 1.0) / len(gaps)
            lines.append(
                f"  {label:8s} queued after its server's last batch ended: P10 "
                f"{pct(gaps, 10):.2f}, P50 {pct(gaps, 50):.2f} ms; within 1 ms: {100 * near:.0f} %"
            )
    if stalled:
        woke = [x["next_arrival_to_start"] for x in stalled]
        lines.append(
            f"  stalled: batch began {pct(woke, 50):.2f} ms (median) after the next request "
            f"entered the queue (P10 {pct(woke, 10):.2f}, P90 {pct(woke, 90):.2f})"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--seconds", type=float, default=20.0, help="per block")
    p.add_argument("--rounds", type=int, default=3, help="alternated blocks of each arm")
    p.add_argument("--stall-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-feedback", action="store_true", help="also a proxy arm without feedback")
    p.add_argument(
        "--classes", action="store_true", help="also a proxy arm with case.yaml's classes"
    )
    p.add_argument(
        "--wake-ms",
        type=float,
        help="also a proxy arm whose routing.wake judges an instance quiet after this long",
    )
    p.add_argument(
        "--nudge-ms",
        type=float,
        help="also a proxy arm with the benchmark's +nudge wake (NUDGE_WAKE) but this floor: it "
        "sends a quiet instance a copy of a short request it holds",
    )
    args = p.parse_args()
    rng = random.Random(args.seed)
    routings: dict[str, dict[str, Any]] = {"proxy": {}}
    if args.no_feedback:
        routings["proxy_no_feedback"] = {"routing": {"feedback": {"enabled": False}}}
    if args.wake_ms is not None:
        # routing.wake sooner: an instance counts as quiet after this long without a send or
        # an answer, looked for twice as often.
        wake = {"min_quiet_ms": args.wake_ms, "scan_ms": args.wake_ms / 2}
        routings[f"proxy_wake{args.wake_ms:g}"] = {"routing": {"wake": wake}}
    if args.nudge_ms is not None:
        # The benchmark's +nudge arms, with this floor, scanned twice as often.
        wake = {**NUDGE_WAKE, "min_quiet_ms": args.nudge_ms, "scan_ms": args.nudge_ms / 2}
        routings[f"proxy_nudge{args.nudge_ms:g}"] = {"routing": {"wake": wake}}
    if args.classes:
        # case.yaml's classes as the benchmark's class arms set them: each kind's API key
        # (sent by every arm; Triton ignores it) picks its class, whose priority the proxy sets.
        scenario = load_scenario(ROOT / "benchmarks" / "issue10" / "case.yaml")
        routings["proxy_classes"] = {"scheduling": scheduling_section(scenario)}
    names = ["direct", *routings]
    arms = {name: Arm(name) for name in names}
    with tempfile.TemporaryDirectory() as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        repo = bench_repository(
            ROOT / "model_repository", tmp / "repository", ["accel_sim"], PARAMETERS
        )
        traces_at = [tmp / f"trace-{i}.json" for i in range(args.servers)]
        fleets = [
            stack.enter_context(
                LocalFleet(1, repo, ["accel_sim"], tmp / f"logs-{i}", extra_args=_trace_args(trace))
            )
            for i, trace in enumerate(traces_at)
        ]
        http_urls = [fleet.servers[0].http_url for fleet in fleets]
        urls = {"direct": [u.removeprefix("http://") for u in http_urls]}
        proxies = []
        logs = []
        try:
            for name, routing in routings.items():
                proc, url = start_proxy(http_urls, tmp, name, routing)
                proxies.append(proc)
                logs.append(tmp / f"{name}.log")
                urls[name] = [url]
                drive(urls[name], Arm("warm"), 2.0, rng, args.servers)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    drive(urls[name], arms[name], args.seconds, rng, args.servers)
                    print(f"round {r + 1} {name}: {len(arms[name].sent)} sent", flush=True)
                    time.sleep(1.0)
            # Triton writes its traces 100 at a time and drops what is left at exit: over 100
            # more requests per server push the last block's out.
            drive(urls["direct"], Arm("flush"), 4.0, rng, args.servers)
            for name, log in zip(routings, logs, strict=True):
                print(f"{name}: {_wake_counts(log)}", flush=True)
        finally:
            for proc in proxies:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        time.sleep(1.0)
        traces: dict[str, dict[str, int]] = {}
        for i, trace in enumerate(traces_at):
            traces.update(read_traces(trace, i))
    print(f"\n{len(traces)} requests traced by Triton ({args.servers} servers)")
    for arm in arms.values():
        print("\n".join(report(arm, traces, args.stall_ms, args.servers)))
    print(
        "\nto_triton: send -> HTTP_RECV_START; read: -> QUEUE_START; queue: -> COMPUTE_START"
        f" (idle: of it, past the {QUEUE_DELAY_NS / 1e6:g} ms queue delay, with no batch"
        " running); batch: -> COMPUTE_END; back: -> the client has the answer"
    )
    return 0


def _wake_counts(log: Path) -> str:
    """The proxy's routing.wake counters (redirected requests, nudges), from its /metrics."""
    url = next(
        line.split()[-1] for line in log.read_text().splitlines() if "/metrics" in line
    ).replace("localhost", "127.0.0.1")
    with urllib.request.urlopen(url, timeout=10) as answer:
        page = answer.read().decode()
    totals: dict[str, float] = {}
    for line in page.splitlines():
        for name in ("triton_proxy_quiet_wakes_total", "triton_proxy_quiet_nudges_total"):
            if line.startswith(name + "{"):
                totals[name] = totals.get(name, 0.0) + float(line.split()[-1])
    return ", ".join(f"{k.removeprefix('triton_proxy_quiet_')} {v:g}" for k, v in totals.items())


def _trace_args(trace: Path) -> list[str]:
    """Every request traced, its timestamps written every 100 requests (Triton's exit
    timeout cuts the last ones off)."""
    return [
        *("--trace-config", f"triton,file={trace}", "--trace-config", "level=TIMESTAMPS"),
        *("--trace-config", "rate=1", "--trace-config", "count=-1"),
        *("--trace-config", "triton,log-frequency=100"),
    ]


if __name__ == "__main__":
    sys.exit(main())
