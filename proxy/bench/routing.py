"""``triton-proxy bench --routing``: the cost of one routing decision, per policy and fleet size.

A microbenchmark, no servers. For every policy in :data:`proxy.routing.registry.POLICIES` and
each fleet size it builds a real :class:`~proxy.fleet.instances.Fleet` with simulated state
(0-40 requests in flight per instance, scraped queue depths and times, 10 % of snapshots stale,
busy connections, half the requests with a session key) and keeps it moving the way a busy
proxy's fleet moves: before each decision one request in flight finishes, one instance gets a
new scraped snapshot (a 1 s scrape interval at 1,000 requests/s over 1,000 instances) and the
clock moves 1 ms; after it the chosen instance takes the new request. It times two paths to the
same decision (``tests/unit/test_routing_view.py`` checks they agree):

- ``linear``: :meth:`proxy.placement.FleetPlacement.filtered` builds every candidate and
  :meth:`proxy.routing.engine.Router.choose` prepares and scans them (the path before issue 13);
- ``view``: :meth:`proxy.placement.FleetPlacement.pick`, i.e. :meth:`Router.place` on views
  kept up to date by the fleet's change journal. Its time includes refreshing what changed
  since the previous decision (the finished request, the new one, the new snapshot);
- ``idle``: the same with nothing changed since the previous decision: the decision alone
  (what a burst of requests pays, or the view path less its upkeep).

Each call is timed on its own (``perf_counter_ns``, whose own cost, about 0.1 µs, is
included); the events between calls are not. ``first_view_us`` is the first decision of a new
view (it builds its indexes over the whole fleet; again after a reload of the instance list).
Figures are CPU time of one Python thread and move with the machine's load: compare sizes and
policies within one run.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, Instance, InstanceSpec
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.placement import FleetPlacement, Placer
from proxy.routing.base import RouteRequest
from proxy.routing.batcher import BatcherModel
from proxy.routing.config import PolicySpec, RoutingConfig
from proxy.routing.engine import Router
from proxy.routing.registry import POLICIES

MODEL = "m"
SIZES = (3, 10, 100, 1000, 10000)
LINEAR_UP_TO = 1000
"""The linear path is not timed above this size (about 0.1 s a call at 10,000)."""
TARGET_US = 20.0
"""The decision budget at 1,000 instances (issue 13)."""
KINDS = ("linear", "view", "idle")


@dataclass(frozen=True)
class RoutingPoint:
    policy: str
    instances: int
    kind: str
    """``linear`` (every candidate built and scanned), ``view`` (``Router.place``, upkeep
    included) or ``idle`` (``Router.place`` with nothing to refresh)."""
    calls: int
    p50_us: float
    p99_us: float
    mean_us: float
    first_view_us: float | None = None
    """``view`` only: the first decision, which builds the view's indexes."""

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def simulated_snapshot(rng: random.Random, now: float, stale: bool) -> InstanceSnapshot:
    pending = float(rng.randint(0, 20))
    load = ModelLoad(
        pending=pending,
        queue_us=rng.uniform(0, 50_000),
        compute_us=rng.uniform(1_000, 30_000),
        queue_us_p95=rng.uniform(0, 200_000),
        exec_rate=rng.uniform(0, 100),
        request_rate=rng.uniform(0, 800),
        mean_batch=rng.uniform(1, 16),
    )
    age = 30.0 if stale else rng.uniform(0, 1.0)
    return InstanceSnapshot(
        taken_at=now - age,
        models={MODEL: load},
        gpu_memory_fraction=rng.uniform(0, 1),
        kv_cache_fraction=rng.uniform(0, 1),
    )


class _Connections:
    """Busy upstream connections per instance (what ``HttpUpstreams.open_connections`` says)."""

    def __init__(self) -> None:
        self.busy: dict[str, int] = {}

    def open_connections(self, instance: Instance) -> int:
        return self.busy.get(instance.name, 0)


class SimulatedFleet:
    """A fleet of ``n`` instances with simulated load that moves between decisions."""

    def __init__(self, n: int, seed: int, stale_fraction: float = 0.1) -> None:
        self.rng = random.Random(seed)
        self.clock = FakeClock(1000.0)
        self.stale_fraction = stale_fraction
        specs = tuple(
            InstanceSpec(name=f"triton-{i}", http=f"http://10.0.{i // 250}.{i % 250}:8000")
            for i in range(n)
        )
        self.fleet = Fleet(specs, HealthConfig(), self.clock)
        self.connections = _Connections()
        self.snapshots: dict[str, InstanceSnapshot] = {}
        self._open: list[contextlib.ExitStack] = []
        rng = self.rng
        for inst in self.fleet.all():
            for _ in range(rng.randint(0, 40)):
                self.start(inst)
            self.connections.busy[inst.name] = rng.randint(0, 64)
            self.scrape(inst.name)

    def start(self, inst: Instance) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.fleet.track(inst, MODEL))
        self._open.append(stack)

    def scrape(self, name: str) -> None:
        stale = self.rng.random() < self.stale_fraction
        self.snapshots[name] = simulated_snapshot(self.rng, self.clock.now(), stale)
        self.fleet.touch(name)

    def between(self) -> None:
        """What happens in the fleet between two decisions (see the module docstring)."""
        rng = self.rng
        if self._open:
            i = rng.randrange(len(self._open))
            self._open[i], self._open[-1] = self._open[-1], self._open[i]
            self._open.pop().close()
        self.scrape(rng.choice(list(self.fleet.instances)))
        self.clock.advance(0.001)

    def placement(self, place: Placer) -> FleetPlacement:
        return FleetPlacement(
            self.fleet,
            self.connections,  # type: ignore[arg-type]
            place,
            self.snapshots.get,
        )

    def close(self) -> None:
        while self._open:
            self._open.pop().close()


def _requests(count: int, rng: random.Random) -> list[RouteRequest]:
    return [
        RouteRequest(
            model=MODEL,
            session_key=f"session-{rng.randint(0, 10_000)}" if rng.random() < 0.5 else None,
            cost=float(rng.randint(8, 512)),
            # Read by expected_finish only: its replay runs (other policies ignore it).
            batcher=REPLAYED,
        )
        for _ in range(count)
    ]


REPLAYED = BatcherModel(max_batch=16, delay_s=0.002, base_s=0.005, per_unit_s=20e-6)
"""The batcher the decisions' requests carry (``accel_sim``'s curve in benchmarks/issue10)."""


def _point(
    policy: str, n: int, kind: str, us: Sequence[float], first: float | None = None
) -> RoutingPoint:
    ordered = sorted(us)
    return RoutingPoint(
        policy=policy,
        instances=n,
        kind=kind,
        calls=len(ordered),
        p50_us=ordered[len(ordered) // 2],
        p99_us=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        mean_us=statistics.fmean(ordered),
        first_view_us=first,
    )


def _placer(kind: str, router: Router) -> Placer:
    if kind != "linear":
        return lambda request, source, exclude: router.place(request, source, exclude)

    return lambda request, source, exclude: router.place_linear(request, source, exclude)


def measure_policy(
    policy: str,
    n: int,
    *,
    calls: int = 2000,
    seed: int = 0,
    warmup: int = 200,
    kinds: Sequence[str] = KINDS,
) -> list[RoutingPoint]:
    """``linear`` and ``view`` timings of ``policy`` over ``n`` simulated instances."""
    out = []
    for kind in kinds:
        sim = SimulatedFleet(n, seed)
        requests = _requests(97, random.Random(seed))
        router = Router(RoutingConfig(policy=PolicySpec(name=policy)), sim.clock, random.Random(1))
        none: frozenset[str] = frozenset()
        placement = sim.placement(_placer(kind, router))
        clock = time.perf_counter_ns
        first: float | None = None
        timed: list[float] = []
        moving = kind != "idle"
        for i in range(warmup + calls):
            if moving:
                sim.between()
            # The decision's clock time, set outside the timed call as the dispatcher sets it.
            request = replace(requests[i % len(requests)], now=sim.clock.now())
            began = clock()
            chosen = placement.pick(request, none)
            spent = (clock() - began) / 1000.0
            if i == 0 and kind == "view":
                first = spent
            if i >= warmup:
                timed.append(spent)
            if chosen is not None and moving:
                sim.start(chosen)
        sim.close()
        out.append(_point(policy, n, kind, timed, first))
    return out


def measure_all(
    sizes: Sequence[int] = SIZES,
    policies: Sequence[str] | None = None,
    *,
    calls: int = 2000,
    seed: int = 0,
) -> list[RoutingPoint]:
    names = list(policies) if policies is not None else list(POLICIES)
    points: list[RoutingPoint] = []
    for name in names:
        for n in sizes:
            # The linear path at large sizes is slow: fewer calls keep the run short; 500
            # still gives a P99.
            k = calls if n <= 100 else max(500, calls // 4)
            kinds = KINDS if n <= LINEAR_UP_TO else tuple(k for k in KINDS if k != "linear")
            points += measure_policy(
                name, n, calls=k, seed=seed, warmup=200 if n <= 100 else 50, kinds=kinds
            )
    return points


def render(points: Sequence[RoutingPoint]) -> str:
    sizes = sorted({p.instances for p in points})
    policies = list(dict.fromkeys(p.policy for p in points))
    lines = [
        "Routing decision cost, µs: P50 / P99 per call (linear = every candidate built and "
        "scanned; view = Router.place on views kept up to date, refresh included)",
        f"{'policy':<20} {'kind':<7}"
        + "".join(f"{f'n={n}':>18}" for n in sizes)
        + f"{'first view':>14}",
    ]
    for policy in policies:
        for kind in KINDS:
            cells = []
            first = None
            for n in sizes:
                p = next(
                    (q for q in points if (q.policy, q.instances, q.kind) == (policy, n, kind)),
                    None,
                )
                cells.append(f"{'-':>18}" if p is None else f"{p.p50_us:>8.1f} /{p.p99_us:>8.1f}")
                if p is not None and p.first_view_us is not None:
                    first = p.first_view_us
            tail = f"{first:>14.0f}" if first is not None else f"{'':>14}"
            lines.append(f"{policy:<20} {kind:<7}" + "".join(cells) + tail)
    for kind in ("view", "idle"):
        big = [p for p in points if p.kind == kind and p.instances == 1000]
        if big:
            within = [p.policy for p in big if p.p50_us <= TARGET_US]
            lines.append(
                f"{kind} P50 <= {TARGET_US:g} µs at n=1000: "
                + (", ".join(within) if within else "none")
            )
    return "\n".join(lines)
