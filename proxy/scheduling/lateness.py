"""Deadline admission for latency classes: shed now what would be served after its SLO.

A request has a budget from its arrival: its class's ``slo_p99_ms``, or its client's deadline
when that is earlier (one deadline per request: :class:`proxy.scheduling.deadline.Budget`,
computed by the gate). Serving it
after the budget spends capacity on an answer that already missed its objective, while the
requests behind it wait longer still; shedding it at once (429 + ``Retry-After``, gRPC
``RESOURCE_EXHAUSTED``) lets its client retry elsewhere or degrade, and keeps the rest on time.
Classes without a latency SLO (throughput classes) are never shed for a latency target, only by
their quotas and queue limits, and for a client deadline their request carries.

**Prediction** (per model gate), at arrival::

    predicted = ahead / drain_rate + inside(class)
    drain_rate = max(dispatches per second over the last window_s, capacity / hold)

``ahead`` counts requests queued in the same or more important classes (they leave first),
``capacity`` is the gate's slots, ``hold`` an exponentially weighted mean of how long a slot
is held (dispatch to release, every class), and ``inside(class)`` one of the class's time
inside Triton. The dispatch rate alone is what the queue drains at only while the gate is
saturated; on a lightly used gate it is the arrival rate, far below what the slots serve, and
a burst after a quiet spell was then predicted to wait many times too long and shed (found in
CI, session 35: 12 stream messages at once over 3 slots of a 1 ms model, one shed as late
against a 500 ms SLO). ``capacity / hold`` is the slots' own rate (Little's law at
saturation, where it meets the dispatch rate). The
request is shed when ``predicted > budget``. Before ``min_dispatches`` dispatches in the window
(a cold or idle gate) nothing is predicted and nothing shed. At dispatch, the wait is known:

- a **class budget** (the SLO, soft) sheds a request whose wait plus ``inside(class)`` is past
  it: the issue's "queue wait plus expected service". A late answer still reaches its client,
  so a request is not shed for the chance of a slow answer alone (``scheduling.late_by:
  tail`` holds a request that has waited to the slow answer below instead, opt-in);
- a **client deadline** (hard: the client is gone then, and an answer after it is abandoned
  work in Triton) sheds a request that has already waited ``budget - slow(class)``. ``slow``
  is the mean plus ``spread`` mean deviations of the class's time inside Triton (Jacobson's
  estimator, as TCP's retransmission timeout): sending a request with only the mean time left
  gets about half of them answered late (measured: up to 31 % of Triton's work at 2x load was
  then abandoned over gRPC, docs/benchmarks.md).

A client deadline's estimate must stay fresh: if every request of a class is shed by the
slow-answer rule, none is answered to correct it, and a class slow for a moment would be shed
for good. So the spread counts only while the class's last answer is at most ``window_s`` old;
after that the mean alone decides (as for a class budget), the next request that has not
waited is sent, and its answer refreshes the estimate: one request per ``window_s`` at most.

Only waiting is ever blamed: when ``inside(class)`` alone exceeds the budget (the model is slower
than the objective, whatever the queue), nothing is shed, since shedding could not help. Before
session 30 a class budget was held to the slow-answer rule too, and a request that had not
waited at all was shed whenever the class's mean plus two deviations passed its SLO, and a
whole class could stay shed (docs/benchmarks.md, twenty-ninth round; most likely also round
28's 88 % of real-time shed at ``burst.yaml`` x0.5).

Both checks are deadline admission (``scheduling.shed_late``). With it off, the gate still holds
a request with a *client* deadline to it at the head of its queue: its client will be gone
before the answer, so sending it would only be abandoned work in Triton (issue 14).

Pure: no clock of its own, every call takes ``now``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class LatenessPredictor:
    window_s: float = 2.0
    min_dispatches: int = 20
    alpha: float = 0.1
    """Weight of each new sample in the inside-time means."""
    beta: float = 0.25
    """Weight of each new sample in the inside-time mean deviations."""
    spread: float = 2.0
    """How many mean deviations above the mean :meth:`late` allows for."""
    _dispatches: deque[float] = field(default_factory=deque)
    _inside: dict[str, float] = field(default_factory=dict)
    _deviation: dict[str, float] = field(default_factory=dict)
    _seen_at: dict[str, float] = field(default_factory=dict)
    _hold: float | None = None
    """Mean time a slot is held, dispatch to release (every class)."""

    def on_dispatch(self, now: float) -> None:
        self._dispatches.append(now)
        self._trim(now)

    def observe_inside(self, class_name: str, seconds: float, now: float) -> None:
        self._seen_at[class_name] = now
        old = self._inside.get(class_name)
        if old is None:
            self._inside[class_name] = seconds
            self._deviation[class_name] = seconds / 2
            return
        dev = self._deviation[class_name]
        self._deviation[class_name] = dev + self.beta * (abs(seconds - old) - dev)
        self._inside[class_name] = old + self.alpha * (seconds - old)

    def on_release(self, held_s: float) -> None:
        """A slot held ``held_s`` (dispatch to release) is free again."""
        old = self._hold
        self._hold = held_s if old is None else old + self.alpha * (held_s - old)

    def inside(self, class_name: str) -> float:
        return self._inside.get(class_name, 0.0)

    def rate(self, now: float) -> float | None:
        """Dispatches per second over the window, or None while too few to trust."""
        self._trim(now)
        if len(self._dispatches) < self.min_dispatches:
            return None
        return len(self._dispatches) / self.window_s

    def drain_rate(self, now: float, capacity: int) -> float | None:
        """Requests per second a queue in front of ``capacity`` slots drains at (the
        module's docstring), or None while too few dispatches to trust."""
        rate = self.rate(now)
        if rate is None:
            return None
        hold = self._hold
        if hold and capacity > 0:
            rate = max(rate, capacity / hold)
        return rate

    def predicted_s(
        self, ahead: int, class_name: str, now: float, capacity: int = 0
    ) -> float | None:
        """Predicted arrival-to-answer time of a request with ``ahead`` queued before it, at
        a gate of ``capacity`` slots."""
        rate = self.drain_rate(now, capacity)
        if rate is None:
            return None
        return ahead / rate + self.inside(class_name)

    def shed_at_arrival(
        self, ahead: int, class_name: str, budget_s: float, now: float, capacity: int = 0
    ) -> bool:
        """Whether a request arriving with ``ahead`` queued before it, at a gate of
        ``capacity`` slots, should be shed now."""
        if self.inside(class_name) >= budget_s:
            return False
        predicted = self.predicted_s(ahead, class_name, now, capacity)
        return predicted is not None and predicted > budget_s

    def late(
        self,
        waited_s: float,
        class_name: str,
        budget_s: float,
        *,
        hard: bool,
        now: float,
        tail: bool = False,
    ) -> bool:
        """Whether a request that waited ``waited_s`` would be answered after ``budget_s``
        because of that wait, while the mean time inside alone fits in the budget. For a soft
        budget (a class SLO): the wait plus the mean time inside is past it. For a hard one (a
        client deadline): there is no longer time for a slow answer, the mean plus ``spread``
        mean deviations (Jacobson's estimator, as TCP sets its retransmission timeout), while
        the class's last answer is at most ``window_s`` old (the module's docstring).
        ``tail``: a soft budget is held to the slow answer too, once the request has waited
        (``scheduling.late_by: tail``; a request that has not waited is never shed, so a class
        is always answered and its estimate refreshed)."""
        inside = self.inside(class_name)
        if not inside < budget_s:
            return False
        slow = hard or (tail and waited_s > 0)
        if slow and now - self._seen_at.get(class_name, now) <= self.window_s:
            inside += self.spread * self._deviation.get(class_name, 0.0)
        return budget_s < waited_s + inside

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._dispatches and self._dispatches[0] < horizon:
            self._dispatches.popleft()
