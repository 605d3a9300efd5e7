"""Consistent hashing with bounded loads, for session affinity (prefix/KV-cache reuse)."""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest, keep_none
from proxy.routing.least_requests import LeastRequests, LeastRequestsParams
from proxy.routing.select import load_params, pick_min
from proxy.routing.view import GONE, LEVELS, Member, ModelView


@dataclass(frozen=True)
class ConsistentHashParams:
    virtual_nodes: int = 160
    """Points per instance on the ring; more points, more even key spread."""
    load_factor: float = 1.25
    """``c`` in the bound ``ceil(c * (total_in_flight + 1) / n)``; must be > 1."""
    reenter_below: float = 0.8
    """An instance that hit its bound takes new keys again once its load is below this
    fraction of the bound (hysteresis, so it does not flap on every completion)."""

    def __post_init__(self) -> None:
        if self.virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        if self.load_factor <= 1.0:
            raise ValueError("load_factor must be > 1 (1 would allow no slack at all)")
        if not 0.0 < self.reenter_below <= 1.0:
            raise ValueError("reenter_below must be in (0, 1]")


def ring_hash(key: str) -> int:
    """Stable across processes (unlike ``hash()``), so every proxy builds the same ring."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    """Hash ring with virtual nodes keyed by ``RouteRequest.session_key``, with bounded loads.

    Formula: with ``n`` candidates and ``m = Σ in_flight``, each instance may hold at most
    ``bound = ceil(load_factor * (m + 1) / n)`` requests. A key goes to the first instance
    clockwise from ``hash(key)`` that is "in"; an instance whose ``in_flight ≥ bound`` goes
    "out" (skipped for new keys) until ``in_flight < reenter_below * bound``, then its keys
    come back to it. Because ``load_factor > 1``, some instance is always below its bound; if
    hysteresis has every one "out", the first one below its bound on the walk is used. So no
    placement ever takes an instance above ``ceil(load_factor * average)``.

    A request without a session key goes to :class:`~.least_requests.LeastRequests`.
    Reads ``name``, ``in_flight`` (and, for the fallback, ``model_in_flight``, ``weight``);
    weights do not move ring points (they would remap keys every time feedback moved).

    The ring is rebuilt only when a candidate not on it appears; instances missing from the
    candidate list are skipped on the walk, which gives the same owner as removing them.

    Parameters: :class:`ConsistentHashParams`.

    Source: V. Mirrokni, M. Thorup, M. Zadimoghaddam, "Consistent Hashing with Bounded
    Loads", SODA 2018 (arXiv:1608.01350); D. Karger et al., STOC 1997 for the ring itself.
    """

    reads_ahead = False
    keeps_sessions = True
    packs_long = False
    keep_off = keep_none

    def __init__(self, params: ConsistentHashParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self._fallback = LeastRequests(LeastRequestsParams(), rng)
        self._ring_names: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._out: set[str] = set()
        self.ring_builds = 0
        """How many times the ring was (re)built; for tests and debugging."""

    @property
    def out(self) -> frozenset[str]:
        """Instances currently taking no new keys (over their bound, not yet re-entered)."""
        return frozenset(self._out)

    def _build(self, names: frozenset[str]) -> None:
        self._points, self._owners = ring_points(names, self.params.virtual_nodes)
        self._ring_names = names
        self.ring_builds += 1

    def bound(self, candidates: Sequence[Candidate]) -> int:
        total = sum(c.in_flight for c in candidates)
        # The epsilon keeps float noise (1.1 * 50 / 5 = 11.000000000000002) from adding one.
        return math.ceil(self.params.load_factor * (total + 1) / len(candidates) - 1e-9)

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        if request.session_key is None:
            return self._fallback.choose(candidates, request)
        if not candidates:
            raise ValueError("no candidates")
        by_name = {c.name: c for c in candidates}
        if not by_name.keys() <= self._ring_names:
            self._build(frozenset(by_name))
        bound = self.bound(candidates)
        reenter = self.params.reenter_below * bound
        self._out &= by_name.keys()
        for c in candidates:
            if c.in_flight >= bound:
                self._out.add(c.name)
            elif c.name in self._out and c.in_flight < reenter:
                self._out.discard(c.name)
        chosen = first_on_ring(
            self._points,
            self._owners,
            request.session_key,
            by_name.get,
            len(by_name),
            self._out,
            bound,
        )
        if chosen is not None:
            return chosen
        # Unreachable while load_factor > 1; kept so a bad invariant degrades, not crashes.
        return pick_min(candidates, lambda c: (float(c.in_flight),), self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """Same decision from state kept between requests (:class:`HashLoads`): the bound
        from a running sum, "out" changes from two heaps per filter level, the ring walked
        from ``bisect``; O(log n) plus the walk. One ring and "out" set per view."""
        if request.session_key is None:
            return self._fallback.choose_view(view, request)
        loads = view.index(("consistent_hash", id(self)), lambda: HashLoads(view, self.params))
        level = loads.settle()
        members = view.members

        def present(name: str) -> Candidate | None:
            m = members.get(name)
            return m.cand if m is not None and m.level == level else None

        chosen = first_on_ring(
            loads.points,
            loads.owners,
            request.session_key,
            present,
            view.count[level],
            loads.out,
            loads.bound,
        )
        if chosen is not None:
            return chosen
        return pick_min(view.in_order(), lambda c: (float(c.in_flight),), self._rng)


def first_on_ring(
    points: Sequence[int],
    owners: Sequence[str],
    key: str,
    present: Callable[[str], Candidate | None],
    count: int,
    out: AbstractSet[str],
    bound: int,
) -> Candidate | None:
    """The first ``present`` instance clockwise from ``hash(key)`` that is not ``out``; else
    the first one on the walk below ``bound``; else None. Each of the ``count`` present
    instances is visited once at most."""
    start = bisect.bisect_left(points, ring_hash(key))
    seen: set[str] = set()
    size = len(owners)
    first_open: Candidate | None = None
    for i in range(size):
        owner = owners[(start + i) % size]
        if owner in seen:
            continue
        c = present(owner)
        if c is None:
            continue
        if owner not in out:
            return c
        if first_open is None and c.in_flight < bound:
            first_open = c
        seen.add(owner)
        if len(seen) == count:
            break
    return first_open


def ring_points(names: AbstractSet[str], virtual_nodes: int) -> tuple[list[int], list[str]]:
    """Ring positions and their owners, sorted."""
    points = sorted(
        (ring_hash(f"{name}#{i}"), name) for name in names for i in range(virtual_nodes)
    )
    return [p for p, _ in points], [o for _, o in points]


class HashLoads:
    """What :class:`ConsistentHash` needs per decision, kept up to date by a view.

    Per filter level: the sum of ``in_flight`` (the bound), a max-heap of "in" members by
    ``in_flight`` (those at the bound go out) and a min-heap of "out" members (those below
    ``reenter_below * bound`` come back); heap entries carry a version and are dropped when
    stale. A decision moves only the members that cross, as the linear form's full loop
    would. Members of other levels are absent from the decision: their "out" mark is dropped,
    as the linear form drops it for instances not in the candidate list.
    """

    def __init__(self, view: ModelView, params: ConsistentHashParams) -> None:
        self._view = view
        self._params = params
        self.out: set[str] = set()
        self.bound = 0
        self.points: list[int] = []
        self.owners: list[str] = []
        self._ring: frozenset[str] = frozenset()
        self.ring_builds = 0
        self._sum = [0] * LEVELS
        self._out_at: list[set[str]] = [set() for _ in range(LEVELS + 1)]
        self._off_ring: list[set[str]] = [set() for _ in range(LEVELS)]
        self._in_heap: list[list[tuple[int, int, str]]] = [[] for _ in range(LEVELS)]
        self._out_heap: list[list[tuple[int, int, str]]] = [[] for _ in range(LEVELS)]
        self._version: dict[str, int] = {}
        self._stamp = 0

    def _push(self, m: Member) -> None:
        self._stamp += 1
        self._version[m.name] = self._stamp
        flight = m.cand.in_flight
        if m.name in self.out:
            heapq.heappush(self._out_heap[m.level], (flight, self._stamp, m.name))
        else:
            heapq.heappush(self._in_heap[m.level], (-flight, self._stamp, m.name))

    def add(self, m: Member) -> None:
        self._sum[m.level] += m.cand.in_flight
        if m.name not in self._ring:
            self._off_ring[m.level].add(m.name)
        if m.name in self._out_at[GONE]:
            self._out_at[GONE].discard(m.name)
            self._out_at[m.level].add(m.name)
        self._push(m)

    def remove(self, m: Member) -> None:
        self._sum[m.level] -= m.cand.in_flight
        self._off_ring[m.level].discard(m.name)
        if m.name in self._out_at[m.level]:
            # Its mark goes at the next decision, unless it is back by then (see GONE).
            self._out_at[m.level].discard(m.name)
            self._out_at[GONE].add(m.name)
        del self._version[m.name]

    def change(self, m: Member, old_level: int, old: Candidate) -> None:
        self._sum[old_level] -= old.in_flight
        self._sum[m.level] += m.cand.in_flight
        if old_level != m.level:
            if m.name in self._off_ring[old_level]:
                self._off_ring[old_level].discard(m.name)
                self._off_ring[m.level].add(m.name)
            if m.name in self._out_at[old_level]:
                self._out_at[old_level].discard(m.name)
                self._out_at[m.level].add(m.name)
        if old_level != m.level or old.in_flight != m.cand.in_flight:
            self._push(m)

    def _valid(self, level: int, stamp: int, name: str) -> bool:
        m = self._view.members.get(name)
        return m is not None and m.level == level and self._version.get(name) == stamp

    def settle(self) -> int:
        """Apply this decision's "out" changes; the decision's filter level."""
        view = self._view
        level = view.min_level()
        for other in range(LEVELS + 1):
            if other != level and self._out_at[other]:
                for name in self._out_at[other]:
                    self.out.discard(name)
                    if other != GONE:
                        self._push(view.members[name])
                self._out_at[other].clear()
        if self._off_ring[level]:
            names = frozenset(m.name for m in view.members.values() if m.level == level)
            self.points, self.owners = ring_points(names, self._params.virtual_nodes)
            self._ring = names
            self.ring_builds += 1
            for lv in range(LEVELS):
                self._off_ring[lv] = {
                    m.name for m in view.members.values() if m.level == lv and m.name not in names
                }
        count = view.count[level]
        bound = math.ceil(self._params.load_factor * (self._sum[level] + 1) / count - 1e-9)
        self.bound = bound
        reenter = self._params.reenter_below * bound
        heap = self._in_heap[level]
        while heap:
            neg, stamp, name = heap[0]
            if not self._valid(level, stamp, name) or name in self.out:
                heapq.heappop(heap)
            elif -neg >= bound:
                heapq.heappop(heap)
                self.out.add(name)
                self._out_at[level].add(name)
                heapq.heappush(self._out_heap[level], (-neg, stamp, name))
            else:
                break
        heap = self._out_heap[level]
        while heap:
            flight, stamp, name = heap[0]
            if not self._valid(level, stamp, name) or name not in self.out:
                heapq.heappop(heap)
            elif flight < reenter:
                heapq.heappop(heap)
                self.out.discard(name)
                self._out_at[level].discard(name)
                heapq.heappush(self._in_heap[level], (-flight, stamp, name))
            else:
                break
        for heaps in (self._in_heap, self._out_heap):
            if len(heaps[level]) > 4 * count + 64:
                self._compact(heaps, level)
        return level

    def _compact(self, heaps: list[list[tuple[int, int, str]]], level: int) -> None:
        heaps[level] = [e for e in heaps[level] if self._valid(level, e[1], e[2])]
        heapq.heapify(heaps[level])


def factory(params: Mapping[str, Any], rng: random.Random) -> ConsistentHash:
    return ConsistentHash(load_params(ConsistentHashParams, params), rng)
