"""Microbenchmarks of the class path (session 18): ``python classes-micro.py TREE [INSTANCES]``.

Per request, in µs: the class gate's admission and release through ModelGates (a fleet of
INSTANCES serving instances, default 3, cpu_ab.py's classes, nothing queued: C = 1), the
gate's capacity alone, classification from the headers, the class's SLO lookup and
observe_inside (with the full-batch time computed as the dispatcher passes it in TREE).
"""

import sys
import time
import timeit
from pathlib import Path

import uvloop

sys.path.insert(0, sys.argv[1])
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.clock import MonotonicClock
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec
from proxy.runtime import _GateTelemetry
from proxy.scheduling import Classifier
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.cost import CostModel
from proxy.scheduling.models import FanOutObserver, ModelGates
from proxy.telemetry import Telemetry

n = 100000
instances = int(sys.argv[2]) if len(sys.argv) > 2 else 3
res = {}
cfg = load_scheduling(
    {
        "classes": {
            "rt": {"rank": 0, "triton_priority": 1},
            "bulk": {"rank": 1, "triton_priority": 2},
        },
        "default_class": "bulk",
        "api_keys": {"ab-key": {"class_name": "rt"}},
    }
)
clock = MonotonicClock()
fleet = Fleet(
    tuple(InstanceSpec(f"t{i}", f"http://x:{i + 1}") for i in range(instances)),
    HealthConfig(),
    clock,
)
telemetry = Telemetry()
gates = ModelGates(cfg, fleet, clock, FanOutObserver([_GateTelemetry(telemetry)]))
info = ModelInfo(max_batch_size=8, priority_levels=3, model_instances=1, decoupled=False)
headers = CIMultiDictProxy(
    CIMultiDict(
        {
            "Host": "127.0.0.1:8000",
            "User-Agent": "Python-urllib",
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": "308",
            "Content-Length": "436",
            "Authorization": "Bearer ab-key",
        }
    )
)
classifier = Classifier(cfg)
res["classify"] = timeit.timeit(lambda: classifier.classify(headers), number=n) / n * 1e6
res["slo_s"] = timeit.timeit(lambda: classifier.slo_s("rt"), number=n) / n * 1e6
costs = CostModel()
costs.observe_cost("simple", 16.0)
gates.gate("simple", info)
for _ in range(50):
    costs.observe_batch("simple", 16.0, 0.0002)
lazy = "if gates.adaptive is not None" in Path(sys.argv[1], "proxy/dispatch.py").read_text()


def observe() -> None:
    batch_s = None if lazy and gates.adaptive is None else costs.batch_seconds("simple", 8)
    gates.observe_inside("t0", "simple", "rt", 0.0002, 1, batch_s)


res["observe_inside"] = timeit.timeit(observe, number=n) / n * 1e6
res["capacity"] = timeit.timeit(gates.gates["simple"]._capacity, number=n) / n * 1e6


async def g():
    m = n
    t0 = time.perf_counter()
    for _ in range(m):
        admitted = gates.admit("simple", info, "rt", None)
        await admitted.__aenter__()
        admitted.depth  # noqa: B018
        admitted.release()
    res["admit+release"] = (time.perf_counter() - t0) / m * 1e6


uvloop.run(g())
print(f"instances={instances} " + " ".join(f"{k}={v:.2f}" for k, v in res.items()))
