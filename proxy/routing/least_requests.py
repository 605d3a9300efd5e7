"""Least outstanding requests."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest, keep_none
from proxy.routing.select import load_params, pick_min, weight_of
from proxy.routing.view import ModelView


def least_requests_key(candidate: Candidate) -> tuple[float, float]:
    """``((model_in_flight + 1) / w, (in_flight + 1) / w)``, compared in that order."""
    w = weight_of(candidate)
    return ((candidate.model_in_flight + 1) / w, (candidate.in_flight + 1) / w)


@dataclass(frozen=True)
class LeastRequestsParams:
    """No parameters."""


class LeastRequests:
    """Pick the candidate with the fewest of this proxy's requests in flight.

    Formula: ``argmin ((model_in_flight + 1) / weight, (in_flight + 1) / weight)``
    lexicographically: first the request's model on that instance, then all models (they share
    the instance's compute); remaining ties at random. Reads ``model_in_flight``, ``in_flight``
    and ``weight``; never the scraped snapshot, so it is also the engine's fallback when every
    snapshot is stale.

    Parameters: none.

    Source: Envoy ``LEAST_REQUEST`` (full scan variant) and Linkerd's least-loaded balancing.
    """

    reads_ahead = False
    keeps_sessions = False
    packs_long = False
    keep_off = keep_none

    def __init__(self, params: LeastRequestsParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        return pick_min(candidates, least_requests_key, self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The minimum of a sorted index (O(log n)); same ties, same random draw."""
        return view.ordering("least_requests", least_requests_key).pick_min(self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> LeastRequests:
    return LeastRequests(load_params(LeastRequestsParams, params), rng)
