"""Does a long lane stall in Triton's batcher, with no proxy in front?

    .venv/bin/python benchmarks/triton_lane_stall.py            # long_share x0.25's lane
    .venv/bin/python benchmarks/triton_lane_stall.py --online 21 --offline 7 --seconds 60

One local Triton (`nvidia-pytriton`'s), model `accel_sim` with
`benchmarks/issue10/long_share.yaml`'s parameters (5 ms + 20 us per token), fed only what the
shallow lane sends its lane instance there: online 512-token rows (priority 2) and offline
requests of 2 rows of 256-512 tokens (priority 3), Poisson, each on its own connection. Every
answer says which batch it ran in (`BATCH_SIZE`, `PADDED_LENGTH`, `BATCH_COST_US`), so a
request's wait is its latency less its batch's device time. Prints the wait's P50 / P99 and,
for every request that waited over `--slow-ms`, the requests sent around it: when they were
sent and answered, relative to it.

Why: `triton_quiet_stall.py` showed that a request queued while the model instance is busy
can wait for the batcher thread's 500 ms sleep until the next arrival. The proxy's wake
(`proxy/routing/wake.py`) only judged instances without long work; this shows a lane instance
stalls the same way (docs/benchmarks.md, issue 10, fourteenth round: two runs of 40 s at
these rates, 7 of 543 and 4 of 542 requests waited 84-300 ms before their batch, each
released within milliseconds of the next request sent).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.bench.fleet import bench_repository  # noqa: E402
from proxy.local.fleet import LocalFleet  # noqa: E402

PARAMETERS = {"accel_sim": {"base_ms": 5, "per_token_us": 20}}
BATCH = ("BATCH_SIZE", "PADDED_LENGTH", "BATCH_COST_US")
Answer = tuple[str, float, float, int, int, int]
"""(kind, sent, answered, batch rows, padded length, batch cost us)."""


def send(url: str, rows: int, tokens: int, priority: int, kind: str, out: list[Answer]) -> None:
    client = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput("INPUT_IDS", [rows, tokens], "INT64")
    tensor.set_data_from_numpy(np.ones((rows, tokens), dtype=np.int64), binary_data=True)
    wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in BATCH]
    began = time.perf_counter()
    result = client.infer("accel_sim", [tensor], priority=priority, outputs=wanted)
    ended = time.perf_counter()
    rows_, padded, cost = (int(result.as_numpy(n)[0, 0]) for n in BATCH)
    out.append((kind, began, ended, rows_, padded, cost))  # list.append is atomic
    client.close()


def schedule(rates: dict[str, float], seconds: float, seed: int) -> list[tuple[float, str]]:
    rng = np.random.default_rng(seed)
    arrivals = []
    for kind, rate in rates.items():
        t = 0.0
        while rate > 0:
            t += rng.exponential(1 / rate)
            if t > seconds:
                break
            arrivals.append((t, kind))
    return sorted(arrivals)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--online", type=float, default=10.5, help="online 512-token rows per s")
    p.add_argument("--offline", type=float, default=3.5, help="offline requests per s")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--slow-ms", type=float, default=80.0)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed + 1)
    answers: list[Answer] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(
            ROOT / "model_repository", Path(tmp) / "repository", ["accel_sim"], PARAMETERS
        )
        with LocalFleet(1, repo, ["accel_sim"], Path(tmp) / "logs") as fleet:
            url = fleet.servers[0].http_url.removeprefix("http://")
            send(url, 1, 8, 2, "warm-up", [])
            time.sleep(1.0)
            threads = []
            t0 = time.perf_counter()
            plan = schedule(
                {"online": args.online, "offline": args.offline}, args.seconds, args.seed
            )
            for t, kind in plan:
                delay = t0 + t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                shape = (1, 512, 2) if kind == "online" else (2, int(rng.integers(256, 513)), 3)
                th = threading.Thread(target=send, args=(url, *shape, kind, answers))
                th.start()
                threads.append(th)
            for th in threads:
                th.join()
    answers.sort(key=lambda a: a[1])
    waits = [(a[2] - a[1]) * 1e3 - a[5] / 1e3 for a in answers]
    print(
        f"{len(answers)} requests; wait before their batch P50 {np.percentile(waits, 50):.1f} ms, "
        f"P99 {np.percentile(waits, 99):.1f} ms, max {max(waits):.1f} ms"
    )
    start = answers[0][1]
    for a, wait in zip(answers, waits, strict=True):
        if wait <= args.slow_ms:
            continue
        kind, sent, done = a[0], a[1], a[2]
        around = [
            f"{b[0]} {(b[1] - sent) * 1e3:+.0f}/{(b[2] - sent) * 1e3:+.0f}"
            for b in answers
            if b is not a and sent - 0.1 < b[1] < done + 0.01
        ]
        print(
            f"{kind} sent at {(sent - start) * 1e3:.0f} ms waited {wait:.0f} ms "
            f"(batch {a[3]} x {a[4]}); around it, sent/answered ms: {', '.join(around)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
