"""A discrete-event model of the issue 10 benchmark, to try placement rules in seconds.

    .venv/bin/python benchmarks/batcher_sim.py benchmarks/issue10/long_share.yaml \
        --scale 0.5 --seconds 200 [--jitter 0.05] [--stall 0.015] [--rules rr,jsq,replay]

N servers, each one Triton dynamic batcher (priority levels, ``max_queue_delay``, ``max_batch``
rows; one model instance) running ``accel_sim``'s cost ``base_ms + per_token_us x rows x
longest`` plus a fixed 1 ms of Python-backend overhead, fed the scenario's own schedule
(:func:`proxy.bench.scenario.build_schedule`) with every request sent at its arrival. The
rules: ``rr`` (what ``rr_priority`` does), ``random``, ``jsq`` (fewest in flight),
``exact`` (the server where the request would finish soonest, from the servers' true
queues, no later arrivals), ``replay`` (the routing policy ``expected_finish`` itself, deciding
from what the proxy knows: the requests it has in flight on each server and that server's last
answer) and ``delays`` (the same with ``count_delays``: the delay it adds to the requests
already there counts too).

It prints P50 / P99 per class (ms). What it leaves out, and what ``--jitter`` / ``--stall``
stand in for: the network and the proxy's own latency; the batch time's variance (each batch
multiplied by a log-normal factor of sigma ``--jitter``); Triton's batcher stall (a share
``--stall`` of batches starts 20 ms late, docs/benchmarks.md rounds 14-19). The replay is
told the mean cost, never the noise. Absolute figures are optimistic against the real runs
(rr's real-time P99 at long_share x0.5: 27.7 ms here without noise, 34-44 ms measured);
compare rules within one run. Pure Python, a few seconds per rule.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.bench.scenario import build_schedule, load_scenario
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.batcher import BatcherModel, Job
from proxy.routing.registry import build_policy

OVERHEAD_S = 0.001
"""Per batch, on top of the cost curve: the Python backend's own time (measured P50 of a
short request alone: 8.8 ms = 2 ms delay + 5.7 ms curve + ~1 ms)."""
STALL_S = 0.020


@dataclass(eq=False)
class Req:
    cls: str
    level: int
    rows: int
    cost: float
    """rows x tokens"""
    arrived: float
    server: int = -1
    done: float = math.nan


@dataclass
class Server:
    queue: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    busy_until: float = 0.0
    last_done: float = float("-inf")
    timer_at: float | None = None


class Fleet:
    """The servers, their batchers, and the event loop."""

    def __init__(self, n: int, model: BatcherModel, rule: Rule, rng: random.Random) -> None:
        self.servers = [Server() for _ in range(n)]
        self.model = model
        self.rule = rule
        self.rng = rng
        self.noise = random.Random(99)
        self.jitter = 0.0
        self.stall = 0.0
        self.now = 0.0
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.rr = 0
        self.done: list[Req] = []

    def push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def batch_s(self, batch: list[Req]) -> float:
        m = self.model
        rows = sum(r.rows for r in batch)
        longest = max(r.cost / r.rows for r in batch)
        return m.base_s + m.per_unit_s * rows * longest

    def start(self, i: int) -> None:
        s, m = self.servers[i], self.model
        if s.running or not s.queue:
            return
        oldest = min(r.arrived for r in s.queue)
        if sum(r.rows for r in s.queue) < m.max_batch and self.now < oldest + m.delay_s - 1e-12:
            t = oldest + m.delay_s
            if s.timer_at is None or s.timer_at < self.now or s.timer_at > t:
                s.timer_at = t
                self.push(t, "timer", i)
            return
        s.queue.sort(key=lambda r: (m.rank(r.level), r.arrived))
        batch, rows = [], 0
        for r in s.queue:
            if batch and rows + r.rows > m.max_batch:
                break
            batch.append(r)
            rows += r.rows
        del s.queue[: len(batch)]
        took = self.batch_s(batch) + OVERHEAD_S
        if self.jitter:
            took *= self.noise.lognormvariate(0.0, self.jitter)
        if self.stall and self.noise.random() < self.stall:
            took += STALL_S
        s.running, s.busy_until = batch, self.now + took
        self.push(s.busy_until, "done", i)

    def run(self, arrivals: list[Req]) -> None:
        for r in arrivals:
            self.push(r.arrived, "arrive", r)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                assert isinstance(payload, Req)
                payload.server = i = self.rule(self, payload)
                self.servers[i].queue.append(payload)
                self.start(i)
            else:
                assert isinstance(payload, int)
                s = self.servers[payload]
                if kind == "done":
                    for r in s.running:
                        r.done = self.now
                    self.done += s.running
                    s.running, s.last_done = [], self.now
                self.start(payload)


Rule = Callable[[Fleet, Req], int]


def rule_rr(fleet: Fleet, r: Req) -> int:
    fleet.rr += 1
    return (fleet.rr - 1) % len(fleet.servers)


def rule_random(fleet: Fleet, r: Req) -> int:
    return fleet.rng.randrange(len(fleet.servers))


def _argmin(fleet: Fleet, key: Callable[[int], float]) -> int:
    return min(range(len(fleet.servers)), key=lambda i: (key(i), fleet.rng.random()))


def rule_jsq(fleet: Fleet, r: Req) -> int:
    return _argmin(fleet, lambda i: len(fleet.servers[i].queue) + len(fleet.servers[i].running))


def policy_rule(params: dict[str, object]) -> Rule:
    """The routing policy ``expected_finish`` itself, deciding from what the proxy knows: the
    requests in flight on each server (sent at, level, rows, cost) and its last answer."""
    policy = build_policy("expected_finish", params, random.Random(1))

    def rule(fleet: Fleet, r: Req) -> int:
        candidates = []
        for i, s in enumerate(fleet.servers):
            flights = {id(q): (q.arrived, q) for q in (*s.running, *s.queue)}
            candidates.append(
                Candidate(
                    name=str(i),
                    in_flight=len(flights),
                    model_in_flight=len(flights),
                    connections=0,
                    snapshot=None,
                    stale=False,
                    flights=flights,  # type: ignore[arg-type]
                    answered_at=s.last_done,
                )
            )
        request = RouteRequest(
            model="m",
            level=r.level,
            rows=r.rows,
            cost=r.cost,
            batch=fleet.model.max_batch,
            batcher=fleet.model,
            now=fleet.now,
        )
        return int(policy.choose(candidates, request).name)

    return rule


def rule_exact(fleet: Fleet, r: Req) -> int:
    """The same with each server's true state: what runs, until when, and what is queued."""
    job = Job(r.level, r.rows, r.cost)

    def finish(i: int) -> float:
        s = fleet.servers[i]
        # The running batch as one request that ends at busy_until, replayed from its start.
        flights = [(q.arrived, q) for q in s.queue]
        since = s.busy_until if s.running else s.last_done
        return fleet.model.finish(flights, max(since, fleet.now), fleet.now, job)  # type: ignore[arg-type]

    return _argmin(fleet, finish)


RULES: dict[str, Rule] = {
    "rr": rule_rr,
    "random": rule_random,
    "jsq": rule_jsq,
    "exact": rule_exact,
    "replay": policy_rule({}),
    "delays": policy_rule({"count_delays": True}),
}


def quantile(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(p * len(xs)) - 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=200.0)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("--stall", type=float, default=0.0)
    ap.add_argument("--rules", default="rr,jsq,exact,replay")
    args = ap.parse_args(argv)
    scenario = load_scenario(args.scenario).scaled(args.scale)
    params = scenario.model.parameters
    model = BatcherModel(
        max_batch=16,
        delay_s=0.002,
        base_s=params.get("base_ms", 3.0) / 1e3,
        per_unit_s=params.get("per_token_us", 2.0) / 1e6,
        default_level=2,
    )
    schedule = build_schedule(
        replace(scenario, duration_s=args.seconds, warmup_s=5.0), np.random.default_rng(1)
    )
    levels = {name: c.triton_priority for name, c in scenario.classes.items()}
    for name in args.rules.split(","):
        arrivals = [
            Req(a.cls, levels[a.cls], a.rows, float(a.rows * a.tokens), a.t)
            for a in schedule
            if not a.warmup
        ]
        fleet = Fleet(args.servers, model, RULES[name], random.Random(1))
        fleet.jitter, fleet.stall = args.jitter, args.stall
        fleet.run(arrivals)
        cells = []
        for cls in scenario.classes:
            ms = [(r.done - r.arrived) * 1e3 for r in fleet.done if r.cls == cls]
            cells.append(f"{cls} {quantile(ms, 0.5):6.1f} / {quantile(ms, 0.99):7.1f}")
        print(f"{name:7s} x{args.scale:<5g} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
