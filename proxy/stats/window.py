"""Quantiles over a sliding time window, for the control loops.

The window of ``window_s`` seconds is cut into ``slices`` equal slices, each an HDR histogram
(:class:`proxy.stats.histogram.Histogram`, 2 significant digits, microseconds). A value is
recorded into the slice its time falls in; a quantile merges the slices that overlap
``(now - window_s, now]``. The window therefore slides in steps of ``window_s / slices``: a
value is forgotten between ``window_s - window_s / slices`` and ``window_s`` after it was
recorded. Memory is bounded by ``slices`` histograms whatever the rate. Pure: every call takes
``now`` (clock seconds).
"""

from __future__ import annotations

import math

from proxy.stats.histogram import Histogram

_DIGITS = 2


class WindowedQuantiles:
    def __init__(self, window_s: float, slices: int = 10) -> None:
        if window_s <= 0 or slices < 1:
            raise ValueError("need window_s > 0 and slices >= 1")
        self.window_s = window_s
        self.slices = slices
        self._width = window_s / slices
        self._slots: list[tuple[int, Histogram] | None] = [None] * slices

    def _slot(self, now: float) -> int:
        return math.floor(now / self._width)

    def record(self, seconds: float, now: float) -> None:
        """Record one value (seconds, >= 0) observed at clock time ``now``."""
        slot = self._slot(now)
        i = slot % self.slices
        entry = self._slots[i]
        if entry is None or entry[0] != slot:
            entry = (slot, Histogram(_DIGITS))
            self._slots[i] = entry
        entry[1].record(max(0, round(seconds * 1e6)))

    def merged(self, now: float) -> Histogram:
        """Every value recorded in the window ending at ``now``."""
        newest = self._slot(now)
        out = Histogram(_DIGITS)
        for entry in self._slots:
            if entry is not None and newest - self.slices < entry[0] <= newest:
                out.merge(entry[1])
        return out

    def count(self, now: float) -> int:
        return self.merged(now).count

    def quantile(self, q: float, now: float) -> float | None:
        """The ``q`` quantile (0..1) in seconds over the window, or None when it is empty."""
        value = self.merged(now).quantile(q)
        return None if value is None else value / 1e6
