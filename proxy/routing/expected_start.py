"""Least expected start: where the request would begin executing soonest, by class."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.select import load_params, pick_min, weight_of
from proxy.routing.view import ModelView


@dataclass(frozen=True)
class ExpectedStartParams:
    long_weight: float = 3.0
    """How many full short batches one long request in flight is worth: roughly the time of a
    batch padded to a long request over that of a batch of short ones."""

    def __post_init__(self) -> None:
        if self.long_weight < 0:
            raise ValueError(f"long_weight must be >= 0, got {self.long_weight}")


class ExpectedStart:
    """Pick the instance where the request would start soonest, counting only the work that
    Triton's batcher serves before it.

    Formula, for a request of priority level ``p`` on a model with ``max_batch_size`` ``B``::

        short request:  score = ((ahead + 1) / B + long_weight * long_in_flight) / weight
        long request:   score = (long_weight * long_in_flight + (model_in_flight + 1) / B) / weight

    where ``ahead`` counts this proxy's requests of the model in flight on the instance at level
    ``<= p`` (with Triton priorities, work queued at lower levels waits behind this request, so it
    does not delay it), ``(ahead + 1) / B`` is the number of batches to wait for, and each long
    request in flight may hold the instance for a batch padded to its length. Ties at random.

    Why not least outstanding work: with batching, a short request's marginal cost on an instance
    already running short requests is small, and chasing the emptiest instance herds traffic
    (measured: worse than round robin). Counting batches rather than requests, and keeping short,
    important requests off instances running long work, is what pays.

    Reads ``ahead`` (falls back to ``model_in_flight``), ``long_in_flight``, ``weight`` and the
    request's ``long`` and ``batch``.

    Source: the "shortest expected delay" rule of queueing theory (Whitt, *Deciding which queue
    to join*, 1986) applied to priority batch servers; the long-work separation follows the
    size-interval task assignment idea (SITA, Harchol-Balter et al., 1999).
    """

    reads_ahead = True

    def __init__(self, params: ExpectedStartParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def key(self, request: RouteRequest) -> Callable[[Candidate], tuple[float, ...]]:
        """The score of the docstring for requests like ``request`` (its ``long``, ``batch``)."""
        batch = max(1, request.batch)
        long_weight = self.params.long_weight

        if request.long:

            def key(c: Candidate) -> tuple[float, ...]:
                score = long_weight * c.long_in_flight + (c.model_in_flight + 1) / batch
                return (score / weight_of(c),)

        else:

            def key(c: Candidate) -> tuple[float, ...]:
                ahead = c.model_in_flight if c.ahead is None else c.ahead
                score = (ahead + 1) / batch + long_weight * c.long_in_flight
                return (score / weight_of(c),)

        return key

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        return pick_min(candidates, self.key(request), self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The minimum of a sorted index (O(log n)), one per (long, batch); the view is per
        priority level already (``ahead`` depends on it)."""
        tag = ("expected_start", request.long, max(1, request.batch))
        return view.ordering(tag, self.key(request)).pick_min(self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> ExpectedStart:
    return ExpectedStart(load_params(ExpectedStartParams, params), rng)
