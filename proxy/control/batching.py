"""Batching-window controller: Triton's ``max_queue_delay_microseconds`` for one model.

Pure: :meth:`BatchingController.observe` takes a :class:`BatchingSample` and the clock time and
returns a :class:`Decision` or None; applying it (a drained reload per instance) is
:mod:`proxy.control.apply`'s job.

Inputs, over the loops' sliding window (``control.window_s``):

- ``p99[c]`` and ``slo[c]`` for every class ``c`` with ``slo_p99_ms``; ``top`` is the most
  important of them (lowest rank). A class with fewer than ``min_samples`` requests in the
  window has no P99 (None) and counts as holding.
- ``q``: Triton's mean queue time per request for the model (``nv_inference_queue_duration_us``
  rate over the scraper's window, averaged over instances).
- ``b``: the throughput backlog, the mean over the window of (requests of classes without an
  SLO waiting in the proxy's queue + requests pending in Triton's queues); ``b_now``: the same
  at this tick (None: not known).

With ``w`` the current window, rules are tried in order (the first that matches decides):

1. dwell: ``now - last_change < dwell_s`` -> nothing.
2. ``p99[top] >= shorten_ratio * slo[top]`` -> **shorten** (``slo_violation`` when
   ``p99[top] > slo[top]``, else ``slo_approach``).
3. ``b < backlog_min`` and ``q >= triton_queue_ratio * slo[top]`` -> **shorten**
   (``triton_queue``): without a backlog, Triton's queue time is the window's doing, and it
   eats a large part of the top class's budget.
4. every SLO class has ``p99[c] <= lengthen_ratio * slo[c]``, ``b >= backlog_min``, ``b_now``
   unknown or ``>= backlog_min``, and ``q`` is unknown or ``q >= fill_ratio * w`` ->
   **lengthen** (``backlog``): every SLO holds with margin and there is work to batch, over the
   window and still now (the mean lags: benchmark run 3 lengthened ~8 s after a surge ended, a
   pair of wasted reloads). When Triton's mean queue time stays well under the window, batches
   reach their preferred size before it expires and a longer one buys nothing.
5. ``b < backlog_min / 2`` and ``w > min_us`` -> **shorten** (``idle``): without a backlog a
   longer window only adds waiting.

shorten: ``w' = max(min_us, min(w * decrease_factor, w - min_step_us))``;
lengthen: ``w' = min(max_us, max(w * increase_factor, w + min_step_us))``. A rule whose ``w'``
equals ``w`` (at a bound) decides nothing. Hysteresis comes from the gap between
``lengthen_ratio`` and ``shorten_ratio`` (between them the window holds), from the gap between
``backlog_min`` and ``backlog_min / 2``, and from the dwell.

Multiplicative steps in both directions walk the range ``[min_us, max_us]`` (two decades by
default) in a handful of changes; with a minute's dwell, a phase change is followed in minutes,
which is the time scale the inner loops (class limits ~10 s, concurrency ~1 s) need to settle
in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.control.config import BatchingConfig
from proxy.control.decision import Decision

LOOP = "batching"


@dataclass(frozen=True)
class ClassP99:
    p99_s: float | None
    """None when the class had too few requests in the window."""
    slo_s: float


@dataclass(frozen=True)
class BatchingSample:
    model: str
    window_us: int
    top: str
    slo_classes: Mapping[str, ClassP99]
    triton_queue_us: float | None
    backlog: float
    backlog_now: float | None = None


class BatchingController:
    def __init__(self, config: BatchingConfig) -> None:
        self.config = config
        self.last_change: float | None = None

    def reconfigure(self, config: BatchingConfig) -> None:
        self.config = config

    def changed(self, now: float) -> None:
        """Start the dwell: the decision was applied (or, in dry run, would have been)."""
        self.last_change = now

    def observe(self, s: BatchingSample, now: float) -> Decision | None:
        c = self.config
        if self.last_change is not None and now - self.last_change < c.dwell_s:
            return None
        w = s.window_us
        top = s.slo_classes[s.top]
        if top.p99_s is not None and top.p99_s >= c.shorten_ratio * top.slo_s:
            reason = "slo_violation" if top.p99_s > top.slo_s else "slo_approach"
            return self._step(
                s, "down", reason, f"{s.top} p99 {top.p99_s * 1e3:.1f} ms vs slo "
                f"{top.slo_s * 1e3:.1f} ms",
            )  # fmt: skip
        q = s.triton_queue_us
        if (
            s.backlog < c.backlog_min
            and q is not None
            and q >= c.triton_queue_ratio * top.slo_s * 1e6
        ):
            return self._step(
                s, "down", "triton_queue",
                f"triton queue {q / 1e3:.1f} ms vs {s.top} slo {top.slo_s * 1e3:.1f} ms",
            )  # fmt: skip
        holding = all(
            k.p99_s is None or k.p99_s <= c.lengthen_ratio * k.slo_s for k in s.slo_classes.values()
        )
        filling = q is None or q >= c.fill_ratio * w
        present = s.backlog_now is None or s.backlog_now >= c.backlog_min
        if holding and filling and present and s.backlog >= c.backlog_min:
            return self._step(s, "up", "backlog", f"backlog {s.backlog:.1f}, every slo holds")
        if s.backlog < c.backlog_min / 2 and w > c.min_us:
            return self._step(s, "down", "idle", f"backlog {s.backlog:.1f}")
        return None

    def _step(self, s: BatchingSample, direction: str, reason: str, detail: str) -> Decision | None:
        c = self.config
        w = s.window_us
        if direction == "down":
            new = max(c.min_us, min(round(w * c.decrease_factor), w - c.min_step_us))
        else:
            new = min(c.max_us, max(round(w * c.increase_factor), w + c.min_step_us))
        if new == w:
            return None
        return Decision(LOOP, s.model, "*", w, new, direction, reason, detail)
