"""Per-cut microbenchmarks of docs/benchmarks.md, session 17: ``python micro.py TREE``."""

import asyncio
import contextlib
import sys
import time
import timeit

import uvloop

sys.path.insert(0, sys.argv[1])
from proxy.clock import MonotonicClock
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec, Work
from proxy.observer import RequestRecord
from proxy.scheduling import cost
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.gate import Gate

n = 100000
res = {}
header = (
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32",'
    b'"parameters":{"binary_data_size":64}},{"name":"INPUT1","shape":[1,16],'
    b'"datatype":"INT32","parameters":{"binary_data_size":64}}],"outputs":['
    b'{"name":"OUTPUT0","parameters":{"binary_data":true}},'
    b'{"name":"OUTPUT1","parameters":{"binary_data":true}}]}'
)


def c():
    s = cost.http_shapes(header)
    cost.check_shapes(s, 436)
    return cost.cost_of(s)


res["shapes+cost"] = timeit.timeit(c, number=n) / n * 1e6
cm = cost.CostModel()
res["observe_cost"] = timeit.timeit(lambda: cm.observe_cost("simple", 16.0), number=n) / n * 1e6
fleet = Fleet((InstanceSpec("t0", "http://x:1"),), HealthConfig(), MonotonicClock())
inst = fleet.get("t0")
w = Work(class_name="default")


def tr():
    with fleet.track(inst, "simple", work=w):
        pass


res["track"] = timeit.timeit(tr, number=n) / n * 1e6
res["RequestRecord"] = (
    timeit.timeit(
        lambda: RequestRecord(
            model="simple",
            class_name="default",
            instance="t0",
            outcome="200",
            latency_s=0.0003,
            queue_wait_s=0.0,
            cost=16.0,
            ran_alone=True,
            at=1.0,
            arm="main",
            slo_s=None,
        ),
        number=n,
    )
    / n
    * 1e6
)
cfg = load_scheduling(
    {
        "classes": {
            "rt": {"rank": 0, "triton_priority": 1},
            "bulk": {"rank": 1, "triton_priority": 2},
        },
        "default_class": "bulk",
    }
)


async def g():
    gate = Gate(cfg, capacity=lambda: 16, clock=MonotonicClock(), instances=lambda: 1)
    m = n // 2
    t0 = time.perf_counter()
    for _ in range(m):
        async with gate.admit("rt"):
            pass
    t1 = time.perf_counter()
    for _ in range(m):
        held = contextlib.AsyncExitStack()
        await held.enter_async_context(gate.admit("rt"))
        async with held:
            pass
    t2 = time.perf_counter()
    res["gate admit+release"] = (t1 - t0) / m * 1e6
    res["AsyncExitStack extra"] = (t2 - t1) / m * 1e6 - res["gate admit+release"]
    sem = asyncio.Semaphore(8)
    t0 = time.perf_counter()
    for _ in range(n):
        async with sem:
            pass
    res["asyncio.Semaphore"] = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        async with asyncio.timeout(120):
            pass
    res["asyncio.timeout"] = (time.perf_counter() - t0) / n * 1e6
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    for _ in range(n):
        loop.call_later(120, int).cancel()
    res["call_later+cancel"] = (time.perf_counter() - t0) / n * 1e6

    async def nothing():
        pass

    t0 = time.perf_counter()
    for _ in range(n):
        await nothing()
    res["one coroutine layer"] = (time.perf_counter() - t0) / n * 1e6


uvloop.run(g())
print(" ".join(f"{k}={v:.2f}" for k, v in res.items()))
