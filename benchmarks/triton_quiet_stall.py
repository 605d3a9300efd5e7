"""Does Triton leave a queued request waiting until another request arrives?

    .venv/bin/python benchmarks/triton_quiet_stall.py --trials 30
    .venv/bin/python benchmarks/triton_quiet_stall.py --trials 60 --only alone --variant delay0

One local Triton (the one this project runs, `nvidia-pytriton`'s), model `accel_sim` with
`benchmarks/issue10/case.yaml`'s parameters (5 ms + 10 µs per token; dynamic batching, 2 ms
queue delay, 3 priority levels). Each trial sends three requests on their own connections: X
(64 tokens), A 4 ms later (priority 1, while X runs) and B 4 ms after A (priority 2); then
nothing for 1.5 s (``alone``), or a fourth request 50 ms after X (``nudge``). Prints each
trial's latencies and how many requests took over 100 ms (none should: each batch here takes
5-6 ms).

Why: in issue 10's benchmark the proxy's slowest real-time requests at light load spent 0.36-0.51
s inside Triton on instances where nothing else ran (docs/benchmarks.md, issue 10, fifth round).
Triton's dynamic batcher thread sleeps up to 500 ms (``default_wait_microseconds`` in
``dynamic_batch_scheduler.cc``) when it finds nothing to do; a request that reaches the queue
while the instance is busy can then wait for that sleep, or for the next arrival, which
wakes it. Direct round robin sends every instance a steady share of the traffic; a load-aware
proxy stops sending to an instance whose requests look slow, so nothing wakes it.

``--variant`` edits the model's ``dynamic_batching`` block first, to see whether a setting a
Triton user controls avoids the stall (session 6, 60 trials each, ``--only alone``: none did;
stalled requests: as configured 4, no priority levels 10, no queue delay 17, preferred size
16 9, preferred sizes 1-16 14).
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

PARAMETERS = {"accel_sim": {"base_ms": 5, "per_token_us": 10}}
SLOW_MS = 100.0
DEFAULTS = "  priority_levels: 3\n  default_priority_level: 2\n"
DELAY = "max_queue_delay_microseconds: 2000"
VARIANTS = {
    "as_configured": ("", ""),
    "no_priority": (DEFAULTS, ""),
    "delay0": (DELAY, "max_queue_delay_microseconds: 0"),
    "preferred16": (DELAY, DELAY + "\n  preferred_batch_size: [ 16 ]"),
    "preferred_all": (DELAY, DELAY + "\n  preferred_batch_size: [ 1, 2, 4, 8, 16 ]"),
}
"""Edits of accel_sim's ``dynamic_batching`` block: (text replaced, replacement)."""


def apply_variant(config: Path, variant: str) -> None:
    old, new = VARIANTS[variant]
    if old:
        text = config.read_text()
        if old not in text:
            raise SystemExit(f"{config}: no {old.strip()!r} to edit for --variant {variant}")
        config.write_text(text.replace(old, new))


def send(url: str, tokens: int, priority: int, out: dict[str, float], key: str) -> None:
    client = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput("INPUT_IDS", [1, tokens], "INT64")
    tensor.set_data_from_numpy(np.ones((1, tokens), dtype=np.int64), binary_data=True)
    began = time.perf_counter()
    client.infer("accel_sim", [tensor], priority=priority)
    out[key] = (time.perf_counter() - began) * 1e3
    client.close()


def trial(url: str, nudge: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    threads = []
    for key, gap_s, tokens, priority in (
        ("X", 0.0, 64, 2),
        ("A", 0.004, 40, 1),
        ("B", 0.004, 40, 2),
    ):
        time.sleep(gap_s)
        t = threading.Thread(target=send, args=(url, tokens, priority, out, key))
        t.start()
        threads.append(t)
    if nudge:
        time.sleep(0.05)
        t = threading.Thread(target=send, args=(url, 8, 1, out, "N"))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=30, help="trials of each pattern")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="as_configured")
    p.add_argument("--only", choices=("alone", "nudge"), help="run one pattern only")
    args = p.parse_args()
    patterns = (args.only,) if args.only else ("alone", "nudge")
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(
            ROOT / "model_repository", Path(tmp) / "repository", ["accel_sim"], PARAMETERS
        )
        apply_variant(repo / "accel_sim" / "config.pbtxt", args.variant)
        with LocalFleet(1, repo, ["accel_sim"], Path(tmp) / "logs") as fleet:
            url = fleet.servers[0].http_url.removeprefix("http://")
            trial(url, nudge=False)  # warm-up
            time.sleep(1.5)
            slow = dict.fromkeys(patterns, 0)
            worst = dict.fromkeys(patterns, 0.0)
            for i in range(args.trials):
                for pattern in patterns:
                    out = trial(url, nudge=pattern == "nudge")
                    slow[pattern] += sum(1 for v in out.values() if v > SLOW_MS)
                    worst[pattern] = max(worst[pattern], *out.values())
                    cells = "  ".join(f"{k} {v:6.1f}" for k, v in sorted(out.items()))
                    print(f"trial {i + 1:3d} {pattern}: {cells} ms", flush=True)
                    time.sleep(1.5)
    for pattern in patterns:
        print(
            f"{args.variant}, {pattern}: {slow[pattern]} requests over {SLOW_MS:g} ms "
            f"in {args.trials} trials, slowest {worst[pattern]:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
