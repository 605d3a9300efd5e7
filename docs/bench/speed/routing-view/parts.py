"""Per-part costs of a view decision (best of 20 loops of 500): ``python parts.py POLICY N``."""

import random
import sys
import time

from proxy.bench.routing import SimulatedFleet
from proxy.routing.base import RouteRequest
from proxy.routing.config import PolicySpec, RoutingConfig
from proxy.routing.engine import Router

pol = sys.argv[1]
n = int(sys.argv[2])
sim = SimulatedFleet(n, 0)
router = Router(RoutingConfig(policy=PolicySpec(name=pol)), sim.clock, random.Random(1))
pl = sim.placement(lambda r, s, e: router.place(r, s, e))
req = RouteRequest(model="m", session_key="abc")
none = frozenset()
pl.pick(req, none)


def t(fn, k=500, rep=20):
    best = 1e9
    for _ in range(rep):
        b = time.perf_counter()
        for _ in range(k):
            fn()
        best = min(best, (time.perf_counter() - b) / k * 1e6)
    return round(best, 2)


names = list(sim.fleet.instances)
view = next(iter(router._views.values()))
m = view.members[names[5]]
now = sim.clock.now()
inst = sim.fleet.get(names[5])
ordering = next(iter(view.indexes.values()))
res = {}
res["perf_counter"] = t(time.perf_counter)
res["idle"] = t(lambda: pl.pick(req, none))
res["touch"] = t(lambda: sim.fleet.touch(names[5]))
res["touch+pick"] = t(lambda: (sim.fleet.touch(names[5]), pl.pick(req, none)))
res["build"] = t(lambda: pl.build(names[5], req))
res["candidate"] = t(lambda: pl.candidate(inst, req))
res["prepare_one"] = t(lambda: router.prepare_one(m.raw, "m", now, False))
res["fb.weight"] = t(lambda: router.feedback.weight(m.name, "m", m.raw.snapshot, now))
res["fb.due_at"] = t(lambda: router.feedback.due_at(m.name, "m", m.raw.snapshot))
res["ordering.change"] = t(lambda: ordering.change(m, m.level, m.cand))
res["refresh"] = t(lambda: view._refresh(names[5], now, False))
print(pol, n, res)
