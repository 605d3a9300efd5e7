"""Consistent hashing with bounded loads, for session affinity (prefix/KV-cache reuse)."""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.least_requests import LeastRequests, LeastRequestsParams
from proxy.routing.select import load_params, pick_min


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
        points = sorted(
            (ring_hash(f"{name}#{i}"), name)
            for name in names
            for i in range(self.params.virtual_nodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [o for _, o in points]
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
        first_open: Candidate | None = None
        for name in self._walk(request.session_key, by_name):
            c = by_name[name]
            if name not in self._out:
                return c
            if first_open is None and c.in_flight < bound:
                first_open = c
        if first_open is not None:
            return first_open
        # Unreachable while load_factor > 1; kept so a bad invariant degrades, not crashes.
        return pick_min(candidates, lambda c: (float(c.in_flight),), self._rng)

    def _walk(self, key: str, present: Mapping[str, Candidate]) -> Iterator[str]:
        """Distinct present instances in ring order, clockwise from ``hash(key)``."""
        start = bisect.bisect_left(self._points, ring_hash(key))
        seen: set[str] = set()
        size = len(self._owners)
        for i in range(size):
            owner = self._owners[(start + i) % size]
            if owner in present and owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(present):
                    return


def factory(params: Mapping[str, Any], rng: random.Random) -> ConsistentHash:
    return ConsistentHash(load_params(ConsistentHashParams, params), rng)
