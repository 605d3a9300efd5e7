"""``triton-proxy bench --routing``: the cost of one routing decision, per policy and fleet size.

A microbenchmark, no servers: for every policy in :data:`proxy.routing.registry.POLICIES` and
each fleet size, it builds simulated fleet snapshots (random in-flight counts, scraped queue
depths and times, a share of stale snapshots, a session key on half of the requests) and times

- ``decide``: :meth:`proxy.routing.engine.Router.choose` on a ready candidate list: the engine's
  rules (staleness, feedback weights, fallback) plus the policy. This is "a routing decision".
- ``place``: what a request pays in the proxy: :class:`proxy.placement.FleetPlacement` builds
  the candidate list from the fleet's live state, then the router decides.

Each call is timed on its own (``perf_counter_ns``, whose own cost, about 0.1 µs, is included);
snapshots rotate between calls so no call sees the previous one's cache. Figures are CPU time
of one Python thread and move with the machine's load: compare sizes and policies within one
run.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.placement import FleetPlacement
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.config import PolicySpec, RoutingConfig
from proxy.routing.engine import Router
from proxy.routing.registry import POLICIES

MODEL = "m"
SIZES = (3, 10, 100, 1000)
TARGET_US = 20.0
"""The decision budget at 1,000 instances (issue 13)."""


@dataclass(frozen=True)
class RoutingPoint:
    policy: str
    instances: int
    kind: str
    """``decide`` (router on a candidate list) or ``place`` (candidates built + decide)."""
    calls: int
    p50_us: float
    p99_us: float
    mean_us: float

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


def simulated_fleets(
    n: int, variants: int, rng: random.Random, now: float, stale_fraction: float = 0.1
) -> list[list[Candidate]]:
    """``variants`` candidate lists of ``n`` instances, each a different moment of the fleet."""
    out = []
    for _ in range(variants):
        fleet = []
        for i in range(n):
            in_flight = rng.randint(0, 40)
            fleet.append(
                Candidate(
                    name=f"triton-{i}",
                    in_flight=in_flight,
                    model_in_flight=rng.randint(0, in_flight),
                    connections=rng.randint(0, 64),
                    snapshot=simulated_snapshot(rng, now, rng.random() < stale_fraction),
                    stale=False,
                )
            )
        out.append(fleet)
    return out


def _requests(count: int, rng: random.Random) -> list[RouteRequest]:
    return [
        RouteRequest(
            model=MODEL,
            session_key=f"session-{rng.randint(0, 10_000)}" if rng.random() < 0.5 else None,
            cost=float(rng.randint(8, 512)),
        )
        for _ in range(count)
    ]


def _time_calls(fn: Callable[[int], object], calls: int) -> list[float]:
    """Microseconds of each ``fn(i)``."""
    clock = time.perf_counter_ns
    out = [0.0] * calls
    for i in range(calls):
        began = clock()
        fn(i)
        out[i] = (clock() - began) / 1000.0
    return out


def _point(policy: str, n: int, kind: str, us: Sequence[float]) -> RoutingPoint:
    ordered = sorted(us)
    return RoutingPoint(
        policy=policy,
        instances=n,
        kind=kind,
        calls=len(ordered),
        p50_us=ordered[len(ordered) // 2],
        p99_us=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        mean_us=statistics.fmean(ordered),
    )


def measure_policy(
    policy: str,
    n: int,
    *,
    calls: int = 2000,
    variants: int = 16,
    seed: int = 0,
    warmup: int = 200,
) -> list[RoutingPoint]:
    """``decide`` and ``place`` timings of ``policy`` over ``n`` simulated instances."""
    rng = random.Random(seed)
    clock = FakeClock(1000.0)
    fleets = simulated_fleets(n, variants, rng, clock.now())
    requests = _requests(variants * 7 + 1, rng)
    router = Router(RoutingConfig(policy=PolicySpec(name=policy)), clock, random.Random(seed))

    def decide(i: int) -> object:
        return router.choose(requests[i % len(requests)], fleets[i % variants])

    specs = tuple(
        InstanceSpec(name=c.name, http=f"http://10.0.0.{i}:8000") for i, c in enumerate(fleets[0])
    )
    fleet = Fleet(specs, HealthConfig(), clock)
    for c in fleets[0]:
        inst = fleet.get(c.name)
        inst.in_flight = c.in_flight
        if c.model_in_flight:
            inst.model_in_flight[MODEL] = c.model_in_flight
    snapshots = [{c.name: c.snapshot for c in f} for f in fleets]
    current = [0]

    class _NoConnections:
        def open_connections(self, instance: object) -> int:
            return 0

    placement = FleetPlacement(
        fleet,
        _NoConnections(),  # type: ignore[arg-type]
        lambda cands, req: router.choose(req, cands),
        lambda name: snapshots[current[0]].get(name),
    )
    none: frozenset[str] = frozenset()

    def place(i: int) -> object:
        current[0] = i % variants
        return placement.pick(requests[i % len(requests)], none)

    out = []
    for kind, fn in (("decide", decide), ("place", place)):
        _time_calls(fn, warmup)
        out.append(_point(policy, n, kind, _time_calls(fn, calls)))
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
            # Fewer calls at large sizes keep the run short; 500 still gives a P99.
            k = calls if n <= 100 else max(500, calls // 4)
            points += measure_policy(name, n, calls=k, seed=seed)
    return points


def render(points: Sequence[RoutingPoint]) -> str:
    sizes = sorted({p.instances for p in points})
    policies = list(dict.fromkeys(p.policy for p in points))
    lines = [
        "Routing decision cost, µs: P50 / P99 per call (decide = Router.choose on a candidate "
        "list; place = candidates built from the fleet + decide)",
        f"{'policy':<20} {'kind':<7}" + "".join(f"{f'n={n}':>18}" for n in sizes),
    ]
    for policy in policies:
        for kind in ("decide", "place"):
            cells = []
            for n in sizes:
                p = next(
                    (q for q in points if (q.policy, q.instances, q.kind) == (policy, n, kind)),
                    None,
                )
                cells.append(f"{'-':>18}" if p is None else f"{p.p50_us:>8.1f} /{p.p99_us:>8.1f}")
            lines.append(f"{policy:<20} {kind:<7}" + "".join(cells))
    big = [p for p in points if p.kind == "decide" and p.instances == max(sizes)]
    if big:
        within = [p.policy for p in big if p.p50_us <= TARGET_US]
        lines.append(
            f"decide P50 <= {TARGET_US:g} µs at n={max(sizes)}: "
            + (", ".join(within) if within else "none")
        )
    return "\n".join(lines)
