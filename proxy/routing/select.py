"""Small helpers shared by the policies: weight guard, random tie-breaking, parameter loading."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from proxy import strict
from proxy.routing.base import Candidate

MIN_WEIGHT = 1e-6
"""Weights at or below zero are treated as this, so dividing by a weight is always safe."""

P = TypeVar("P")


def weight_of(candidate: Candidate) -> float:
    return max(candidate.weight, MIN_WEIGHT)


def pick_min(
    candidates: Sequence[Candidate],
    key: Callable[[Candidate], tuple[float, ...]],
    rng: random.Random,
) -> Candidate:
    """The candidate with the smallest ``key``; equal keys are broken uniformly at random."""
    best_key: tuple[float, ...] | None = None
    best: list[Candidate] = []
    for c in candidates:
        k = key(c)
        if best_key is None or k < best_key:
            best_key, best = k, [c]
        elif k == best_key:
            best.append(c)
    if not best:
        raise ValueError("no candidates")
    return best[0] if len(best) == 1 else rng.choice(best)


def load_params(cls: type[P], params: Mapping[str, Any] | None) -> P:
    """Strictly load a policy's parameters; the registry prefixes errors with the config path."""
    return strict.load(cls, dict(params) if params is not None else {}, "")
