"""Real-time's slowest 1 % in a request log (``bench --request-log``): what padded its batch.

For each of those requests: the class of the longest request in its batch (``short``: no
request over 64 tokens, so it waited behind another batch rather than being padded) and
whether that request was sent before or after the real-time one; and what its server was
running when it was sent. Then, over every real-time request, the share whose batch was
padded by each class. Session 45 (docs/benchmarks.md, issue 10, forty-fifth round).

    python docs/bench/issue10/round45-long_share-x1.5-request-log/rt_pad.py FOLDER...
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np

from proxy.bench.request_log import RequestLog

Batch = tuple[int, float]


def padder(log: RequestLog, members: list[int], me: int) -> str:
    """The class of the batch's longest request, and whether it was sent before ``me``."""
    j = max(members, key=lambda m: int(log.tokens[m]))
    if log.tokens[j] <= 64:
        return "short"
    when = "before" if log.started[j] <= log.started[me] else "after"
    return f"{log.classes[log.cls[j]]} {when}"


def analyse(path: Path) -> str:
    log = RequestLog.load(path)
    ok = (log.outcome == 0) & ~log.warmup & (log.batch_start > 0)
    latency = (log.finished - log.started) * 1e3
    realtime = ok & (log.cls == log.classes.index("realtime"))
    p99 = float(np.quantile(latency[realtime], 0.99))
    batches: dict[Batch, list[int]] = collections.defaultdict(list)
    for i in np.where(ok)[0]:
        batches[(int(log.batch_server[i]), round(float(log.batch_start[i]), 6))].append(int(i))
    spans: dict[int, list[tuple[float, float, list[int]]]] = collections.defaultdict(list)
    for (server, start), members in batches.items():
        spans[server].append((start, start + log.batch[members[0]][2] / 1e6, members))

    def batch_of(i: int) -> list[int]:
        return batches[(int(log.batch_server[i]), round(float(log.batch_start[i]), 6))]

    padded: collections.Counter[str] = collections.Counter()
    running: collections.Counter[str] = collections.Counter()
    for i in np.where(realtime & (latency >= p99))[0]:
        padded[padder(log, batch_of(int(i)), int(i))] += 1
        sent = log.started[i]
        busy = [s for s in spans[int(log.batch_server[i])] if s[0] <= sent < s[1]]
        running[padder(log, busy[0][2], int(i)).split()[0] if busy else "idle"] += 1
    every = collections.Counter(
        padder(log, batch_of(int(i)), int(i)).split()[0] for i in np.where(realtime)[0]
    )
    total = int(realtime.sum())
    shares = {k: round(v / total, 3) for k, v in every.items()}
    return (
        f"{log.arm} #{log.repetition + 1}: P99 {p99:.1f} ms; slowest 1 % padded by "
        f"{dict(padded)}; running when sent: {dict(running)}; every real-time batch padded "
        f"by {shares}"
    )


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        for path in sorted(Path(folder).rglob("*.npz")):
            print(analyse(path))
