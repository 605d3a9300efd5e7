"""One notion of a deadline per request (docs/scheduling.md, "One notion of a deadline").

A request has at most one **client deadline** (``Call.deadline``, a clock time): the earliest of
the gRPC deadline, the KServe ``timeout`` parameter (microseconds) and the HTTP header
``Triton-Timeout-Ms``. Past it nobody waits for the answer, so the proxy

- sheds the request before dispatch (when it arrives, and when it leaves its class queue):
  HTTP 429 / gRPC ``DEADLINE_EXCEEDED``;
- stops waiting for it in the class queue, and cancels it in flight, once the deadline passes;
- hands the remaining budget to Triton as the request's ``timeout`` parameter (µs) when the
  model's queue policy has ``allow_timeout_override`` for the request's priority level, so
  Triton drops it from its own queue too.

A latency class's SLO adds a soft **class budget** (arrival + SLO): nobody said they stop
waiting, so it is never handed to Triton; deadline admission (issue 10) reads it through the
same :class:`Budget`. Everything here is pure: times come from the caller's injected clock.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from proxy.clock import Clock
from proxy.errors import Code, ProxyError

T = TypeVar("T")

TIMEOUT_HEADER = "triton-timeout-ms"
"""HTTP request header: the client's deadline in milliseconds from when the proxy receives it."""
MAX_TIMEOUT_S = 365 * 24 * 3600.0
"""Longer deadlines are treated as none (and keep the arithmetic finite)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """When a request stops being worth serving: ``at`` (clock time, None = never).

    ``hard`` means a client deadline: a client stops waiting then, so the budget may be handed
    to Triton and the request cancelled once it passes. A soft budget (a class SLO) is only a
    target for admission.
    """

    at: float | None = None
    hard: bool = False

    @staticmethod
    def of(client_deadline: float | None, class_budget: float | None = None) -> Budget:
        """The earlier of a client deadline (hard) and a class budget (soft)."""
        if client_deadline is None:
            return Budget(class_budget, False)
        if class_budget is not None and class_budget < client_deadline:
            return Budget(class_budget, False)
        return Budget(client_deadline, True)

    def remaining_s(self, now: float) -> float | None:
        """Seconds left (negative once past), None without a budget."""
        return None if self.at is None else self.at - now

    def expired(self, now: float) -> bool:
        return self.at is not None and now >= self.at

    def triton_timeout_us(self, now: float) -> int | None:
        """Triton's ``timeout`` parameter for what is left of a hard budget (at least 1 µs)."""
        if not self.hard or self.at is None:
            return None
        return max(1, math.ceil((self.at - now) * 1e6))


def parse_timeout_ms(value: str | None) -> float | None:
    """Seconds given by a ``Triton-Timeout-Ms`` header value, or None when absent.

    Raises :class:`ProxyError` (400) for a value that is not a positive number of milliseconds.
    """
    if value is None:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise ProxyError(
            Code.INVALID_ARG,
            f"invalid Triton-Timeout-Ms header {value[:32]!r}: give the deadline as a positive "
            "number of milliseconds",
        )
    return ms / 1e3


def client_deadline(
    now: float,
    *,
    grpc_remaining_s: float | None = None,
    timeout_us: int | None = None,
    header_s: float | None = None,
) -> float | None:
    """The request's client deadline: the earliest of those given, as a clock time."""
    budgets = [
        s
        for s in (grpc_remaining_s, None if timeout_us is None else timeout_us / 1e6, header_s)
        if s is not None and s < MAX_TIMEOUT_S
    ]
    return now + max(0.0, min(budgets)) if budgets else None


def exceeded(model: str, waited: str) -> ProxyError:
    """The answer for a request whose client deadline passed before it was served."""
    return ProxyError(
        Code.CLIENT_DEADLINE,
        f"request for model '{model}' was not served: its deadline passed {waited}",
    )


def passed(deadline: float | None, now: float) -> bool:
    """Whether ``deadline`` (None: none) has passed at ``now``."""
    return deadline is not None and now >= deadline


def check(deadline: float | None, now: float, model: str) -> None:
    """Raise the deadline error when ``deadline`` has passed (the request is not dispatched)."""
    if passed(deadline, now):
        raise exceeded(model, "before it was dispatched")


async def before(deadline: float | None, clock: Clock, model: str, work: Awaitable[T]) -> T:
    """Await ``work`` until ``deadline``; past it, cancel ``work`` and raise the deadline error.

    Cancelling runs every exit path of ``work`` (a queued request leaves its queue, an upstream
    call is cancelled, tokens and slots are released once, by their own ``async with``).
    """
    if deadline is None:
        return await work
    remaining = deadline - clock.now()
    if remaining <= 0:
        if asyncio.iscoroutine(work):
            work.close()  # never started: nothing to unwind
        raise exceeded(model, "before it was dispatched")
    scope = asyncio.timeout(remaining)
    try:
        async with scope:
            return await work
    except TimeoutError:
        if not scope.expired():
            raise  # the work's own timeout, not ours
        raise exceeded(model, "while it waited or ran") from None


async def detached(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled (``limits.cancel_upstream:
    false``): a client that leaves stops waiting, but its request still takes its place in the
    queue and its time in Triton, as behind a proxy that does not propagate cancellation."""
    return await apart(work, keep=lambda: True)


async def apart(work: Coroutine[Any, Any, T], keep: Callable[[], bool]) -> T:
    """Run ``work`` in a task of its own. Cancelling the caller cancels ``work`` too, unless
    ``keep()`` says it is unwinding on purpose (a request that keeps its slot while Triton may
    still be running it), and never waits for it: the caller's client is answered at once."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_retrieve)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not keep():
            task.cancel()
        raise


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # nobody may be waiting any more: no "never retrieved" warning
