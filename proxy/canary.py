"""Canary (gray) rollout: a second routing and scheduling configuration beside the main one.

The policy file's ``canary:`` section names the canary arm's ``routing`` and/or ``scheduling``
(whole sections, same keys as the main ones; a section left out is the main one) and its
``share`` of the traffic. Each request is served by one arm:

- ``split: request``: each request independently, canary with probability ``share``;
- ``split: session``: by the session key (``routing.session_header``, gRPC
  ``routing.session_metadata``): ``sha256(key)`` mapped to [0, 1) and compared with ``share``,
  so a session stays in one arm, the same in every proxy replica and across restarts, and
  raising the share only moves sessions from main to canary. Requests without a session key
  are split per request.

Metrics carry an ``arm`` label (``main`` or ``canary``); ``triton-proxy canary`` compares the
arms' per-class tails with a confidence interval. Promotion is an edit: copy the canary's
sections to the top level and delete ``canary:``; rollback is deleting ``canary:``. Both reload
without dropping requests (requests queued in a removed arm's gates drain through them).

When the canary has its own ``scheduling``, the arms have separate class gates, and each gets
its share of the dispatch slots (main ``1 - share``, canary ``share``, at least one each), so the
fleet's total concurrency stays what the main policy allows. Without its own ``scheduling`` the
canary's requests queue in the main arm's gates.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

from proxy.routing.config import RoutingConfig
from proxy.scheduling.config import SchedulingConfig

MAIN = "main"
CANARY = "canary"
ARMS = (MAIN, CANARY)


@dataclass(frozen=True)
class CanaryConfig:
    share: float
    """Fraction of requests (``split: request``) or of sessions (``split: session``) that the
    canary arm serves, in [0, 1]."""
    split: Literal["request", "session"] = "request"
    routing: RoutingConfig | None = None
    """The canary arm's routing section; None: the main one."""
    scheduling: SchedulingConfig | None = None
    """The canary arm's scheduling section; None: the main arm's classes and gates."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if self.routing is None and self.scheduling is None:
            raise ValueError("a canary needs its own routing or scheduling section (or both)")


def session_point(key: str) -> float:
    """A session key's fixed position in [0, 1): the first 8 bytes of its SHA-256."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


class Splitter:
    """Pure: which arm serves a request. The random generator is injected (tests seed it)."""

    def __init__(self, share: float, split: str, rng: random.Random) -> None:
        self.share = share
        self.split = split
        self.rng = rng

    def arm(self, session_key: str | None) -> str:
        if self.split == "session" and session_key:
            return CANARY if session_point(session_key) < self.share else MAIN
        return CANARY if self.rng.random() < self.share else MAIN
