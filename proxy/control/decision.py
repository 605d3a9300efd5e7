"""What a control loop decided: one value of one knob, with the direction and the reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    loop: str
    """``batching`` or ``class_limits``."""
    model: str
    target: str
    """What the knob belongs to: ``*`` (every instance) for a batching window, a class name for
    a class limit."""
    old: float
    new: float
    direction: str
    """``up`` or ``down``."""
    reason: str
    """A short metric label (``slo_violation``, ``backlog``...)."""
    detail: str
    """The figures behind it, for the log line."""
