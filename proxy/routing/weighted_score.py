"""Weighted load score from Triton's metrics and the proxy's own in-flight counts."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from proxy.routing.base import Candidate, RouteRequest, keep_none
from proxy.routing.select import load_params, pick_min, weight_of
from proxy.routing.view import ModelView


@dataclass(frozen=True)
class WeightedScoreParams:
    """Coefficients of the score; every term is ``coefficient * signal``."""

    queue_depth: float = 10.0
    """Per request queued in Triton for this model (``nv_inference_pending_request_count``)."""
    active_requests: float = 5.0
    """Per request this proxy has in flight on the instance, any model (``Candidate.in_flight``)."""
    queue_wait: float = 0.0
    """Per millisecond of mean queue time per request over the scrape window."""
    gpu_memory: float = 0.0
    """Per percent (0-100) of GPU memory used."""
    kv_cache_usage: float = 0.1
    """Per percent (0-100) of TensorRT-LLM KV-cache blocks used (the model's, else the server's)."""
    stale_penalty: float = 10.0
    """Added when the snapshot is older than the staleness limit (it is still used)."""
    base: float = 1.0
    """Constant added before dividing by the weight, so weight also separates idle instances."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0")


def load_score(c: Candidate, request: RouteRequest, p: WeightedScoreParams) -> float:
    """Unweighted load score of ``c`` for ``request`` (lower is better); see WeightedScore."""
    score = p.base + p.active_requests * c.in_flight
    snap = c.snapshot
    if snap is None:
        return score
    load = snap.model(request.model)
    score += p.queue_depth * load.pending
    if p.queue_wait and load.queue_us is not None:
        score += p.queue_wait * load.queue_us / 1000.0
    if p.gpu_memory and snap.gpu_memory_fraction is not None:
        score += p.gpu_memory * 100.0 * snap.gpu_memory_fraction
    kv = load.kv_cache_fraction if load.kv_cache_fraction is not None else snap.kv_cache_fraction
    if p.kv_cache_usage and kv is not None:
        score += p.kv_cache_usage * 100.0 * kv
    if c.stale:
        score += p.stale_penalty
    return score


def weighted_score(c: Candidate, request: RouteRequest, p: WeightedScoreParams) -> float:
    return load_score(c, request, p) / weight_of(c)


class WeightedScore:
    """Pick the candidate with the lowest weighted load score (full scan).

    Formula::

        score = (base
                 + queue_depth     * pending            # Triton queue, this model
                 + active_requests * in_flight          # proxy in-flight, all models
                 + queue_wait      * queue_us / 1000    # mean queue ms per request
                 + gpu_memory      * 100 * gpu_memory_fraction
                 + kv_cache_usage  * 100 * kv_cache_fraction
                 + stale_penalty   * [snapshot stale]
                ) / weight

    With defaults: ``(1 + 10*pending + 5*in_flight + 0.1*kv%) / weight``. A term whose signal
    is not exported is 0. Without a snapshot only ``base + active_requests * in_flight``
    remains. Ties at random. Reads ``in_flight``, ``snapshot``, ``stale`` and ``weight``.

    Parameters: :class:`WeightedScoreParams`.

    Source: the additive "scorer" pattern of llm-d's inference scheduler / Gateway API
    Inference Extension (queue depth, KV-cache utilisation), with Triton's own metrics.
    """

    reads_ahead = False
    keeps_sessions = False
    packs_long = False
    keep_off = keep_none

    def __init__(self, params: WeightedScoreParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        return pick_min(candidates, lambda c: (weighted_score(c, request, self.params),), self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The minimum of a sorted index (O(log n)): an instance's score is recomputed when
        its counts change, a new snapshot arrives or it turns stale, not per request."""
        params, model = self.params, view.request

        def key(c: Candidate) -> tuple[float]:
            return (weighted_score(c, model, params),)

        return view.ordering(("weighted_score", params), key).pick_min(self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> WeightedScore:
    return WeightedScore(load_params(WeightedScoreParams, params), rng)
