"""Least open connections."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest, keep_none
from proxy.routing.select import load_params, pick_min, weight_of
from proxy.routing.view import ModelView


def connections_key(candidate: Candidate) -> tuple[float]:
    return ((candidate.connections + 1) / weight_of(candidate),)


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

    reads_ahead = False
    keeps_sessions = False
    packs_long = False
    keep_off = keep_none

    def __init__(self, params: LeastConnectionsParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        return pick_min(candidates, connections_key, self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The minimum of a sorted index (O(log n)); same ties, same random draw. Busy HTTP
        connections and streams reach the view when they change; connections held by the
        aiohttp client (streaming HTTP, https) are read when the instance's next request
        starts or finishes."""
        return view.ordering("least_connections", connections_key).pick_min(self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> LeastConnections:
    return LeastConnections(load_params(LeastConnectionsParams, params), rng)
