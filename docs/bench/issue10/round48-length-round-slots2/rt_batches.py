"""Real-time's batches in a request log (``bench --request-log``): how far they were padded.

For every batch of real-time requests only with at least 12 rows (the surge's batches), the
mean padded length (its longest request), the mean length of its requests and the spread
of lengths within it; and real-time's wait from its send to its batch's start. One line per
arm and repetition. Session 48 (docs/benchmarks.md, issue 10, forty-eighth round).

    python rt_batches.py FOLDER/requests/*.npz
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np

from proxy.bench.request_log import RequestLog


def analyse(path: Path) -> str:
    log = RequestLog.load(path)
    ok = (log.outcome == 0) & ~log.warmup & (log.batch_start > 0)
    rt = log.classes.index("realtime")
    batches: dict[tuple[int, float], list[int]] = collections.defaultdict(list)
    for i in np.where(ok)[0]:
        batches[(int(log.batch_server[i]), round(float(log.batch_start[i]), 6))].append(int(i))
    big = [m for m in batches.values() if len(m) >= 12 and all(log.cls[j] == rt for j in m)]
    tokens = [[int(log.tokens[j]) for j in m] for m in big]
    padded = np.mean([max(t) for t in tokens]) if tokens else float("nan")
    mean = np.mean([np.mean(t) for t in tokens]) if tokens else float("nan")
    spread = np.mean([max(t) - min(t) for t in tokens]) if tokens else float("nan")
    mine = ok & (log.cls == rt)
    wait = (log.batch_start[mine] - log.started[mine]) * 1e3
    name = path.stem
    return (
        f"{name}: {len(big)} real-time batches of >= 12 rows, padded to {padded:.0f} tokens "
        f"(requests {mean:.0f}, spread {spread:.0f}); real-time send -> batch start P50 / P99 "
        f"{np.quantile(wait, 0.5):.0f} / {np.quantile(wait, 0.99):.0f} ms"
    )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(analyse(Path(arg)))
