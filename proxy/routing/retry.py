"""Retry budget: retries may add at most a fixed fraction of load, plus a small floor."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from proxy.clock import Clock


@dataclass(frozen=True)
class RetryParams:
    max_retries: int = 1
    """Retries of one request (each to another instance); 0 disables retries."""
    budget_ratio: float = 0.2
    """Retries allowed per original request over the last ``ttl_s`` (0.2 = 20 % extra load)."""
    min_retries_per_s: float = 10.0
    """Retries always allowed per second, so a quiet proxy can still retry."""
    ttl_s: float = 10.0
    """How long a request (or retry) counts toward the budget."""

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.budget_ratio < 0:
            raise ValueError("budget_ratio must be >= 0")
        if self.min_retries_per_s < 0:
            raise ValueError("min_retries_per_s must be >= 0")
        if self.ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")


_BUCKETS = 10


class RetryBudget:
    """Finagle-style retry budget over a sliding window of ``ttl_s``.

    Formula: a retry is allowed when
    ``retries_in_window + 1 ≤ min_retries_per_s * ttl_s + budget_ratio * requests_in_window``
    (a retry needs a whole token); an allowed retry is counted at once. Requests and retries
    are counted in ``10`` time buckets of ``ttl_s / 10``, so memory is constant and the window
    slides in steps of one bucket. Original requests only deposit (call
    :meth:`record_request` once per request); retries only withdraw.

    Source: Finagle ``RetryBudget(ttl, minRetriesPerSec, percentCanRetry)``; the SRE book,
    "Handling Overload", on per-client retry budgets.
    """

    def __init__(self, params: RetryParams, clock: Clock) -> None:
        self.params = params
        self._clock = clock
        self._width = params.ttl_s / _BUCKETS
        self._buckets: deque[list[int]] = deque()
        """``[bucket index, requests, retries]``, oldest first."""

    def _current(self) -> list[int]:
        idx = math.floor(self._clock.now() / self._width)
        while self._buckets and self._buckets[0][0] <= idx - _BUCKETS:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != idx:
            self._buckets.append([idx, 0, 0])
        return self._buckets[-1]

    def record_request(self) -> None:
        self._current()[1] += 1

    def balance(self) -> float:
        """Retries still allowed right now (may be fractional)."""
        self._current()
        requests = sum(b[1] for b in self._buckets)
        retries = sum(b[2] for b in self._buckets)
        p = self.params
        return p.min_retries_per_s * p.ttl_s + p.budget_ratio * requests - retries

    def try_retry(self) -> bool:
        """Withdraw one retry if the budget allows it."""
        if self.params.max_retries == 0 or self.balance() < 1.0:
            return False
        self._current()[2] += 1
        return True
