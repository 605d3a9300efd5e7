import sys

from proxy.bench.routing import measure_policy
from proxy.routing.registry import POLICIES

pols = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else list(POLICIES)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["view", "idle"]
for p in pols:
    pts = measure_policy(p, n, calls=500, warmup=50, kinds=kinds)
    print(p, n, " ".join(f"{q.kind}={q.p50_us:.1f}/{q.p99_us:.1f}" for q in pts), flush=True)
