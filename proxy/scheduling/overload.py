"""The proxy's own overload: refuse the least important classes while its event loop lags.

Everything the class gates do happens once the proxy has read a request. When the proxy's
process is short of CPU, requests wait before that and after it: each step of every request
(reading it, placing it, reading Triton's answer, writing it back) waits for the turns of one
event loop that run every other request's steps first. No class queue sees that wait, so
neither class priority nor deadline admission acts on it. Measured on issue 10's benchmark
(docs/benchmarks.md, forty-eighth and forty-ninth rounds): six servers at their FIFO capacity
with one proxy process at its core, real-time's P99 was 4x ``rr_priority``'s although the
Tritons had room.

:class:`OverloadGuard` reads the loop's lag (how late a timer fires, sampled every
``LOOP_LAG_INTERVAL_S`` by :meth:`proxy.telemetry.Telemetry.watch_loop_lag`) and holds a
*pressure* ``p`` between 0 and the number of classes it may refuse: every class but the most
important (the lowest ``rank``; classes sharing it are all spared). Ordered from the least
important (highest rank; ties by name), the ``i``-th (from 0) is refused at arrival with
probability ``clamp(p - i, 0, 1)`` (429 / RESOURCE_EXHAUSTED with ``Retry-After``, shed reason
``busy``): the lowest class is refused wholly before the next is touched. Every ``step_s``,
from the mean lag of the samples of that step::

    mean lag >  lag_ms          p += up     (default 0.25: one class refused wholly in 2 s)
    mean lag <  lag_ms / 2      p -= down   (default 0.1: given back over 5 s)
    otherwise                   p unchanged

An integral controller with a dead band; it rises faster than it falls, because a loop that
lags delays every class at once and a refused request costs far less than a served one (its
head is parsed and answered; nothing is placed, sent or relayed). A class with a
``min_share`` is not refused while its share of the requests the guard admitted in the current
and the previous step is below that share: the proxy's CPU is spent per request, so a share of
requests is what the guard can keep for it. The guard acts on unary requests (HTTP, gRPC
``ModelInfer``); a gRPC stream's messages pass as before.

Measured there with ``lag_ms: 20`` (three runs of 3 repetitions): real-time 85-89 % within
its SLO against 15-52 % without the guard in the same runs (``rr_priority`` 31 %), online
43-89 % (``rr_priority`` 100 %), offline's floor held; ``lag_ms: 10`` 94 % (one run), ``40``
too loose (66 %). Off unless
``scheduling.overload`` is set: it trades the lower classes' requests for the top class's
latency, which is the operator's call; ``serve --workers N`` with a core each is the remedy
that loses nothing (README, "Workers").
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from proxy.clock import Clock
from proxy.scheduling.config import ClassConfig, OverloadConfig


class OverloadGuard:
    """The pressure and the refusals (module doc); pure but for its clock and random."""

    def __init__(
        self,
        config: OverloadConfig,
        classes: Mapping[str, ClassConfig],
        clock: Clock,
        rng: random.Random,
        retry_after_s: float = 1.0,
    ) -> None:
        self.config = config
        self.retry_after_s = retry_after_s
        """``Retry-After`` of a refusal (``scheduling.retry_after_s``)."""
        self._clock = clock
        self._rng = rng
        top = min(c.rank for c in classes.values())
        lowest_first = sorted(
            (n for n, c in classes.items() if c.rank > top),
            key=lambda n: (-classes[n].rank, n),
        )
        self._index = {name: i for i, name in enumerate(lowest_first)}
        """Class -> its place from the least important (0); the top class is not here."""
        self._min_share = {n: classes[n].min_share for n in lowest_first}
        self.pressure = 0.0
        self.last_lag_ms = 0.0
        """The mean lag of the last step that ended."""
        self._step_began = clock.now()
        self._lag_sum = 0.0
        self._lag_count = 0
        # Requests admitted by class in the current step and the previous one.
        self._admitted: dict[str, int] = {}
        self._admitted_before: dict[str, int] = {}

    @property
    def ceiling(self) -> float:
        """The highest pressure: every class but the top one refused."""
        return float(len(self._index))

    def observe_lag(self, lag_s: float) -> bool:
        """One sample of the loop's lag; returns True when a step ended and the pressure moved."""
        self._lag_sum += lag_s
        self._lag_count += 1
        now = self._clock.now()
        if now - self._step_began < self.config.step_s:
            return False
        mean_ms = self.last_lag_ms = 1000.0 * self._lag_sum / self._lag_count
        cfg = self.config
        before = self.pressure
        if mean_ms > cfg.lag_ms:
            self.pressure = min(self.ceiling, self.pressure + cfg.up)
        elif mean_ms < cfg.lag_ms / 2:
            self.pressure = max(0.0, self.pressure - cfg.down)
        self._step_began = now
        self._lag_sum = 0.0
        self._lag_count = 0
        self._admitted_before, self._admitted = self._admitted, {}
        return self.pressure != before

    def refuses(self, class_name: str) -> bool:
        """Whether to refuse this arriving request of ``class_name`` (counted if admitted)."""
        index = self._index.get(class_name)
        if index is not None and self.pressure > index:
            chance = min(1.0, self.pressure - index)
            if not self._below_share(class_name) and self._rng.random() < chance:
                return True
        self._admitted[class_name] = self._admitted.get(class_name, 0) + 1
        return False

    def _below_share(self, class_name: str) -> bool:
        share = self._min_share.get(class_name, 0.0)
        if share <= 0.0:
            return False
        total = sum(self._admitted.values()) + sum(self._admitted_before.values())
        mine = self._admitted.get(class_name, 0) + self._admitted_before.get(class_name, 0)
        return total == 0 or mine < share * total
