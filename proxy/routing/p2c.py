"""Power of two choices over the weighted load score."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.select import load_params, pick_min
from proxy.routing.view import ModelView
from proxy.routing.weighted_score import WeightedScoreParams, weighted_score


class PowerOfTwoChoices:
    """Sample two distinct candidates uniformly; send to the one with the lower score.

    Formula: ``a, b = sample(candidates, 2)``; ``argmin(score(a), score(b))`` with the score of
    :class:`~proxy.routing.weighted_score.WeightedScore` (ties at random). One candidate: it.
    Sampling keeps several proxies (or a burst between scrapes) from all herding onto the
    single least-loaded instance, while still avoiding the busy ones.

    Parameters: :class:`~proxy.routing.weighted_score.WeightedScoreParams` (same keys).

    Source: M. Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing",
    IEEE TPDS 12(10), 2001; Envoy ``LEAST_REQUEST`` with ``choice_count: 2``.
    """

    reads_ahead = False

    def __init__(self, params: WeightedScoreParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        if len(candidates) <= 2:
            pair: Sequence[Candidate] = candidates
        else:
            pair = self._rng.sample(candidates, 2)
        return pick_min(pair, lambda c: (weighted_score(c, request, self.params),), self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The same two draws over the candidates in fleet order, read by index (O(1) each;
        ``random.sample`` copies the population only when it has at most 21 items)."""
        return self.choose(view.in_order(), request)


def factory(params: Mapping[str, Any], rng: random.Random) -> PowerOfTwoChoices:
    return PowerOfTwoChoices(load_params(WeightedScoreParams, params), rng)
