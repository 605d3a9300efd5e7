"""Class-limit loop: AIMD on the lower classes' share of one model's dispatch slots.

Pure: :meth:`ClassLimitController.observe` takes the top class's windowed P99 and returns the
decisions (one class's factor each); the gate applies a factor as a multiplier on that class's
``max_share`` (:meth:`proxy.scheduling.queues.ClassQueues.set_share_scale`).

It only splits slots: the gate's capacity (``healthy instances x per-instance concurrency``,
sized by the adaptive-concurrency loop) is never changed here. A lower class's cap becomes
``max(floor(min_share x capacity), max(1, floor(max_share x factor x capacity)))``, so its
guaranteed share holds whatever the factor.

Every ``interval_s`` per model, with ``p`` the top class's P99 over the window and ``S`` its SLO
(no decision while ``p`` is unknown, i.e. fewer than ``min_samples`` requests):

- ``p >= limit_ratio * S``: multiplicative decrease of the **least important** class whose
  factor is above ``min_factor``: ``f' = max(min_factor, f * decrease_factor)``
  (``slo_violation`` when ``p > S``, else ``slo_approach``);
- ``p <= release_ratio * S``: additive increase of the **most important** limited class:
  ``f' = min(1, f + increase_step)`` (``slo_recovered``);
- in between: hold (the gap is the hysteresis).

Limiting the least important class first and releasing the most important first keeps the
order of classes: online is only limited once offline is at its floor.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.control.config import ClassLimitsConfig
from proxy.control.decision import Decision

LOOP = "class_limits"


class ClassLimitController:
    def __init__(self, model: str, config: ClassLimitsConfig) -> None:
        self.model = model
        self.config = config
        self.factors: dict[str, float] = {}
        self._last: float | None = None

    def reconfigure(self, config: ClassLimitsConfig) -> None:
        self.config = config

    def factor(self, class_name: str) -> float:
        return self.factors.get(class_name, 1.0)

    def observe(
        self,
        top: str,
        p99_s: float | None,
        slo_s: float,
        lower: Sequence[str],
        now: float,
    ) -> Decision | None:
        """``lower``: the classes below ``top``, most important first."""
        c = self.config
        if self._last is not None and now - self._last < c.interval_s:
            return None
        if p99_s is None or not lower:
            return None
        self._last = now
        figures = f"{top} p99 {p99_s * 1e3:.1f} ms vs slo {slo_s * 1e3:.1f} ms"
        if p99_s >= c.limit_ratio * slo_s:
            for name in reversed(lower):
                f = self.factor(name)
                if f > c.min_factor:
                    new = max(c.min_factor, f * c.decrease_factor)
                    reason = "slo_violation" if p99_s > slo_s else "slo_approach"
                    return self._set(name, f, new, "down", reason, figures)
            return None
        if p99_s <= c.release_ratio * slo_s:
            for name in lower:
                f = self.factor(name)
                if f < 1.0:
                    new = min(1.0, f + c.increase_step)
                    return self._set(name, f, new, "up", "slo_recovered", figures)
        return None

    def _set(
        self, name: str, old: float, new: float, direction: str, reason: str, figures: str
    ) -> Decision:
        self.factors[name] = new
        return Decision(LOOP, self.model, name, old, new, direction, reason, figures)
