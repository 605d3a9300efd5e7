"""Smooth weighted round robin."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest, keep_none
from proxy.routing.select import load_params, weight_of
from proxy.routing.view import ModelView, Rotation


@dataclass(frozen=True)
class RoundRobinParams:
    """No parameters."""


class RoundRobin:
    """Smooth weighted round robin, as in nginx's upstream module.

    Formula: each pick, every candidate ``i`` gains ``current_i += w_i``; the one with the
    largest ``current`` is chosen and pays ``current_chosen -= Σ w``. With equal weights this
    is exact round robin (each of ``n`` instances exactly once per ``n`` picks, in a fixed
    order); with unequal weights picks are proportional to weight and spread out, never in
    bursts. Ties go to a random rank drawn once per instance, so several proxies do not walk
    the fleet in lock-step. Reads ``Candidate.name`` and ``Candidate.weight`` only.

    Parameters: none.

    Source: nginx commit 52327e0627f4 "Upstream: smooth weighted round-robin balancing"
    (M. Dounin, 2012).
    """

    reads_ahead = False
    keeps_sessions = False
    packs_long = False
    keep_off = keep_none

    def __init__(self, params: RoundRobinParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self._current: dict[str, float] = {}
        self._rank: dict[str, float] = {}

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        total = 0.0
        best: Candidate | None = None
        best_key = (0.0, 0.0)
        for c in candidates:
            w = weight_of(c)
            total += w
            cur = self._current[c.name] = self._current.get(c.name, 0.0) + w
            rank = self._rank.get(c.name)
            if rank is None:
                rank = self._rank[c.name] = self._rng.random()
            key = (cur, rank)
            if best is None or key > best_key:
                best, best_key = c, key
        if best is None:
            raise ValueError("no candidates")
        self._current[best.name] -= total
        if len(self._current) > len(candidates):
            names = {c.name for c in candidates}
            self._current = {n: v for n, v in self._current.items() if n in names}
            self._rank = {n: v for n, v in self._rank.items() if n in names}
        return best

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """:class:`~proxy.routing.view.Rotation`: O(log n) per pick, one rotation per view."""
        return view.index(("round_robin", id(self)), lambda: Rotation(self._rng)).choose(view)


def factory(params: Mapping[str, Any], rng: random.Random) -> RoundRobin:
    return RoundRobin(load_params(RoundRobinParams, params), rng)
