"""CPU time of one ``expected_finish`` decision from several checkouts, alternated.

    .venv/bin/python benchmarks/decision_ab.py OLD_TREE . --rounds 5

``expected_finish`` (the routing policy of the class default) replays Triton's dynamic batcher
on each shortlisted instance per decision (``proxy.routing.batcher``), twice with
``count_delays`` (the class default's setting). ``bench --routing`` times it over a fleet whose
requests carry no work (cost 0, one row); this times the decision over 3 instances holding
``--flights`` requests each of a mixed class load as the benchmark's ``accel_sim`` sees it:
levels 1-3 (real-time, online, offline), one row of 8-64 tokens or, one in ten, of 512;
offline four rows of 512; sent 0.7 ms apart; the last answer 4 ms ago. Each round runs, for
every checkout in turn, a fresh interpreter with that checkout first on ``sys.path`` and times
the decision with ``timeit`` (best of 5 x 500 calls), for each flights count, with the
policy's defaults (``plain``) and the class default's parameters less the lane
(``count_delays``). Prints the median over rounds per (checkout, parameters, flights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, random, sys, timeit
from proxy.fleet.instances import Work
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.batcher import BatcherModel
from proxy.routing.registry import build_policy

rng = random.Random(0)
B = BatcherModel(max_batch=16, delay_s=0.002, base_s=0.005, per_unit_s=20e-6, default_level=2)
NOW = 100.0


def candidate(name, n):
    flights = {}
    for k in range(n):
        level = rng.choice([1, 2, 2, 3])
        rows = 4 if level == 3 else 1
        tokens = 512 if level == 3 or rng.random() < 0.1 else rng.randint(8, 64)
        work = Work(level=level, rows=rows, cost=float(rows * tokens))
        flights[k] = (NOW - (n - k) * 0.0007, work)
    return Candidate(
        name=name, in_flight=n, model_in_flight=n, connections=0, snapshot=None,
        stale=False, flights=flights, answered_at=NOW - 0.004,
    )


out = {}
request = RouteRequest(model="m", level=2, rows=1, cost=32.0, batcher=B, now=NOW)
for n in json.loads(sys.argv[1]):
    candidates = [candidate(f"t{i}", n) for i in range(3)]
    for label, params in (("plain", {}), ("count_delays", {"count_delays": True})):
        policy = build_policy("expected_finish", params, random.Random(0))
        best = min(timeit.repeat(lambda: policy.choose(candidates, request), number=500, repeat=5))
        out[f"{label} {n}"] = best / 500 * 1e6
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trees", nargs="+", type=Path, help="checkouts to compare")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flights", default="4,12,24,32", help="requests in flight per instance")
    args = ap.parse_args()
    flights = [int(x) for x in args.flights.split(",")]
    results: dict[str, dict[str, list[float]]] = {str(t): {} for t in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
            done = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(flights)],
                env=env,
                cwd=tree,
                check=True,
                capture_output=True,
                text=True,
            )
            for key, us in json.loads(done.stdout).items():
                results[str(tree)].setdefault(key, []).append(us)
    keys = list(results[str(args.trees[0])])
    print(f"µs per decision, median of {args.rounds} alternated rounds (3 instances)")
    print(f"{'parameters, flights per instance':34}" + "".join(f"{t!s:>22}" for t in args.trees))
    for key in keys:
        row = "".join(f"{statistics.median(results[str(t)][key]):>22.1f}" for t in args.trees)
        print(f"{key:34}{row}")


if __name__ == "__main__":
    main()
