"""Weighted random choice."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest, keep_none
from proxy.routing.select import load_params, weight_of
from proxy.routing.view import ModelView, WeightTree


@dataclass(frozen=True)
class RandomParams:
    """No parameters."""


class RandomChoice:
    """Pick a candidate at random with probability ``w_i / Σ w`` (uniform when weights match).

    Stateless and load-blind: a baseline, and what a Kubernetes Service with many clients
    amounts to. Reads ``Candidate.weight`` only.

    Parameters: none.
    """

    reads_ahead = False
    keeps_sessions = False
    packs_long = False
    keep_off = keep_none

    def __init__(self, params: RandomParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        if not candidates:
            raise ValueError("no candidates")
        weights = [weight_of(c) for c in candidates]
        return self._rng.choices(candidates, weights=weights)[0]

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """A sum tree over the weights (O(log n)): the same draw as ``choose``, exactly when
        the weights' sums are exact (see :meth:`~proxy.routing.view.WeightTree.pick`)."""
        return view.index("weights", lambda: WeightTree(view)).pick(self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> RandomChoice:
    return RandomChoice(load_params(RandomParams, params), rng)
