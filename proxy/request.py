"""What the proxy knows about one inference request, whatever its protocol.

Frontends build a :class:`Call` from the little they read (model, headers, a few parameters,
an estimated cost, a deadline); the dispatcher, admission and placement read only this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class InferParams:
    """Request parameters that steer routing and scheduling."""

    sequence_id: int | str | None = None
    sequence_start: bool = False
    sequence_end: bool = False
    priority: int | None = None
    timeout_us: int | None = None
    """KServe ``timeout`` parameter (microseconds), the client's deadline for this request."""


NO_PARAMS = InferParams()


def params_from_mapping(params: Mapping[str, Any]) -> InferParams:
    """The routing parameters among a request's decoded ``parameters``."""
    seq = params.get("sequence_id")
    if isinstance(seq, bool) or not isinstance(seq, int | str) or seq in (0, ""):
        seq = None
    prio = params.get("priority")
    timeout = params.get("timeout")
    return InferParams(
        sequence_id=seq,
        sequence_start=params.get("sequence_start") is True,
        sequence_end=params.get("sequence_end") is True,
        priority=prio if isinstance(prio, int) and not isinstance(prio, bool) else None,
        timeout_us=timeout
        if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0
        else None,
    )


@dataclass(frozen=True, slots=True)
class Forward:
    """Request parameters the proxy sets on the request it forwards (None: left as sent)."""

    priority: int | None = None
    """The class's Triton priority level."""
    timeout_us: int | None = None
    """What is left of the client's deadline, as Triton's ``timeout`` parameter."""

    def parameters(self) -> dict[str, int]:
        """The parameters to set, by their KServe names."""
        out: dict[str, int] = {}
        if self.priority is not None:
            out["priority"] = self.priority
        if self.timeout_us is not None:
            out["timeout"] = self.timeout_us
        return out


NO_FORWARD = Forward()


@dataclass(frozen=True)
class Call:
    """What a frontend learned about one request: enough to place it, nothing more."""

    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    """Request headers (a case-insensitive ``CIMultiDictProxy``) or gRPC metadata (lower-case)."""
    params: InferParams = NO_PARAMS
    session_key: str | None = None
    cost: float = 1.0
    """Estimated work: rows x longest dimension of the batched inputs (1 when unknown)."""
    rows: int = 1
    """Rows of the costliest input (``proxy.scheduling.cost.rows_of``)."""
    deadline: float | None = None
    """Clock time after which the client no longer waits (gRPC deadline, KServe ``timeout``,
    or the HTTP deadline header), or None."""
