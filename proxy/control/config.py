"""The policy file's ``control:`` section: the SLO feedback loops (all off by default).

::

    control:
      dry_run: false          # true: log and export what the loops would do, change nothing
      tick_s: 1.0             # how often the loops look at their inputs
      window_s: 30.0          # sliding window of the class P99s the loops read
      min_samples: 50         # fewer requests of a class in the window: its P99 is not used
      class_limits:           # AIMD on the lower classes' share of the slots (~10 s)
        enabled: true
        interval_s: 10.0
        limit_ratio: 0.9      # top class P99 >= 0.9 x SLO: cut the lowest class's share
        release_ratio: 0.7    # top class P99 <= 0.7 x SLO: give share back
        decrease_factor: 0.5
        increase_step: 0.1
        min_factor: 0.1
      batching:               # Triton's max_queue_delay_microseconds per model (>= 1 min)
        enabled: true
        models: []            # empty: every model with a dynamic batcher
        min_us: 100
        max_us: 20000
        decrease_factor: 0.5
        increase_factor: 2.0
        min_step_us: 500
        dwell_s: 60.0
        shorten_ratio: 0.9    # top class P99 >= 0.9 x SLO: shorten
        lengthen_ratio: 0.6   # every SLO class P99 <= 0.6 x SLO (and a backlog): lengthen
        triton_queue_ratio: 0.5
        fill_ratio: 0.5
        backlog_min: 1.0
        headroom: true        # drain an instance only when the others can carry the load
        headroom_ratio: 0.8   # ... at this fraction of their slots and time
        drain_timeout_s: 10.0
        ready_timeout_s: 60.0

Every field is reloadable; the loops pick a reloaded section up at their next tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClassLimitsConfig:
    enabled: bool = False
    interval_s: float = 10.0
    """Time between two evaluations (and so between two changes) per model."""
    limit_ratio: float = 0.9
    release_ratio: float = 0.7
    decrease_factor: float = 0.5
    """Multiplicative decrease of one class's share factor per violating interval."""
    increase_step: float = 0.1
    """Additive increase of one class's share factor per recovered interval."""
    min_factor: float = 0.1
    """A class's share factor never goes below this (its ``min_share`` always holds)."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if not 0 < self.release_ratio < self.limit_ratio:
            raise ValueError("need 0 < release_ratio < limit_ratio (the gap is the hysteresis)")
        if not 0 < self.decrease_factor < 1:
            raise ValueError("decrease_factor must be in (0, 1)")
        if not 0 < self.increase_step <= 1:
            raise ValueError("increase_step must be in (0, 1]")
        if not 0 < self.min_factor <= 1:
            raise ValueError("min_factor must be in (0, 1]")


@dataclass(frozen=True)
class BatchingConfig:
    enabled: bool = False
    models: tuple[str, ...] = ()
    """Models whose window the loop may change; empty means every model with a dynamic batcher."""
    min_us: int = 100
    max_us: int = 20_000
    decrease_factor: float = 0.5
    increase_factor: float = 2.0
    min_step_us: int = 500
    """Every change moves the window by at least this much (unless a bound stops it)."""
    dwell_s: float = 60.0
    """Least time between two changes of one model's window (each one is a reload)."""
    shorten_ratio: float = 0.9
    lengthen_ratio: float = 0.6
    triton_queue_ratio: float = 0.5
    """Without a backlog, shorten when Triton's mean queue time reaches this fraction of the
    top SLO."""
    fill_ratio: float = 0.5
    """Lengthen only while Triton's mean queue time is at least this fraction of the window
    (below it, batches fill before the window expires)."""
    backlog_min: float = 1.0
    """Mean throughput backlog (requests) over the window needed to lengthen."""
    headroom: bool = True
    """Defer a change while the other instances cannot carry the model's load without the one
    to drain (:mod:`proxy.control.headroom`)."""
    headroom_ratio: float = 0.8
    """The others must carry the load within this fraction of their slots and of their time."""
    drain_timeout_s: float = 10.0
    """Longest wait for an instance's requests of the model to finish before its reload; past
    it, that instance's change is called off (and retried after the dwell)."""
    ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_us <= self.max_us:
            raise ValueError("need 0 <= min_us <= max_us")
        if not 0 < self.decrease_factor < 1:
            raise ValueError("decrease_factor must be in (0, 1)")
        if self.increase_factor <= 1:
            raise ValueError("increase_factor must be > 1")
        if self.min_step_us < 1:
            raise ValueError("min_step_us must be >= 1")
        if self.dwell_s < 0:
            raise ValueError("dwell_s must be >= 0")
        if not 0 < self.lengthen_ratio < self.shorten_ratio:
            raise ValueError("need 0 < lengthen_ratio < shorten_ratio (the gap is the hysteresis)")
        if self.triton_queue_ratio <= 0 or self.fill_ratio < 0:
            raise ValueError("need triton_queue_ratio > 0 and fill_ratio >= 0")
        if self.backlog_min <= 0:
            raise ValueError("backlog_min must be > 0")
        if self.headroom_ratio <= 0:
            raise ValueError("headroom_ratio must be > 0")
        if self.drain_timeout_s <= 0 or self.ready_timeout_s <= 0:
            raise ValueError("drain_timeout_s and ready_timeout_s must be > 0")


@dataclass(frozen=True)
class ControlConfig:
    dry_run: bool = False
    tick_s: float = 1.0
    window_s: float = 30.0
    min_samples: int = 50
    class_limits: ClassLimitsConfig = field(default_factory=ClassLimitsConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)

    def __post_init__(self) -> None:
        if self.tick_s <= 0:
            raise ValueError("tick_s must be > 0")
        if self.window_s < self.tick_s:
            raise ValueError("window_s must be >= tick_s")
        if self.min_samples < 1:
            raise ValueError("min_samples must be >= 1")

    @property
    def any_enabled(self) -> bool:
        return self.class_limits.enabled or self.batching.enabled
