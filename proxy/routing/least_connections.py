"""Least open connections."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.select import load_params, pick_min, weight_of


@dataclass(frozen=True)
class LeastConnectionsParams:
    """No parameters."""


class LeastConnections:
    """Pick the candidate with the fewest open upstream connections, scaled by weight.

    Formula: ``argmin (connections + 1) / weight``, ties broken at random. The ``+ 1`` lets
    weight separate idle instances. Reads ``Candidate.connections`` and ``Candidate.weight``.
    Equivalent to HAProxy ``balance leastconn`` with equal weights.

    Parameters: none.

    Source: HAProxy configuration manual, ``balance leastconn``.
    """

    def __init__(self, params: LeastConnectionsParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        return pick_min(candidates, lambda c: ((c.connections + 1) / weight_of(c),), self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> LeastConnections:
    return LeastConnections(load_params(LeastConnectionsParams, params), rng)
