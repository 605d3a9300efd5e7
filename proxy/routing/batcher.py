"""When a request would finish on an instance: a replay of Triton's dynamic batcher over what
the proxy has in flight there.

The proxy knows, for each instance and model, every request it has in flight (when it was
sent, its priority level, its rows and longest dimension: :class:`~proxy.fleet.instances.Work`)
and when the last one answered. It does not know which of them Triton is running and which
are queued, but Triton's batcher is deterministic enough to reconstruct it:

- the model instance is free from the last answer (``since``): a batch ends with its answers;
- a batch starts when the instance is free and either its queued rows reach
  ``max_batch_size`` or the oldest queued request has waited ``max_queue_delay``;
- it takes queued requests by priority level (most important first), oldest first within a
  level, while their rows fit in ``max_batch_size``;
- it runs ``base + per_unit x rows x longest``: the learned cost curve of
  :mod:`proxy.scheduling.cost` (less the queue delay the curve's base includes, since requests
  that ran alone waited it), over the batch padded to its longest request;
- a batch the replay ends before ``now`` is still running (its requests have not answered):
  it ends ``overrun_s`` from now.

Replayed with the new request added (sent now), the end of the batch it joins is its
predicted finish. What it leaves out: requests other clients (or other proxy replicas) send
to the same Triton, other models sharing the device, several model instances per server
(``instance_group`` count > 1: one executor is replayed), and Triton's batcher stall
(proxy.routing.wake), and requests sent after this one: Triton fills a batch with whatever
lower-priority rows have arrived by the time it forms. In a discrete-event model of three
servers (``benchmarks/batcher_sim.py``; docs/benchmarks.md, issue 10, twenty-first round),
placing each request where this replay finishes it soonest came within a few percent of
placing it with the servers' true state below capacity (not past it: real-time P99 70
against 60 ms at 1.5x).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class InFlight(Protocol):
    """What the replay reads of one request in flight (:class:`~proxy.fleet.instances.Work`)."""

    @property
    def level(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def cost(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Job:
    """A request not yet sent, as the replay reads it."""

    level: int
    rows: int
    cost: float


@dataclass(frozen=True, slots=True)
class BatcherModel:
    """One model's Triton dynamic batcher and cost curve, as the replay needs them."""

    max_batch: int
    """``max_batch_size`` (rows per batch; at least 1)."""
    delay_s: float
    """``dynamic_batching.max_queue_delay_microseconds``, in seconds."""
    base_s: float
    """Fixed time of one batch (the learned curve's base less ``delay_s``)."""
    per_unit_s: float
    """Time per padded unit (row x longest dimension) of a batch."""
    default_level: int = 0
    """``dynamic_batching.default_priority_level``: the level of a request sent without one."""
    overrun_s: float = 0.001
    """How much longer a batch the replay has ended before now (its answers not in) is
    expected to run."""

    def rank(self, level: int) -> int:
        return level if level > 0 else self.default_level

    def finish(
        self,
        flights: Iterable[tuple[float, InFlight]],
        since: float,
        now: float,
        new: InFlight,
    ) -> float:
        """Predicted clock time at which ``new``, sent at ``now``, finishes on an instance
        holding ``flights`` (``(sent_at, work)`` of the requests in flight there) whose last
        answer came at ``since``."""
        arrivals, last = _arrivals(flights, now, new)
        return self._replay(arrivals, since, now, last)[id(last)]

    def ends(
        self,
        flights: Iterable[tuple[float, InFlight]],
        since: float,
        now: float,
        new: InFlight | None = None,
    ) -> tuple[dict[int, float], float | None]:
        """Predicted end of every request in flight, by ``id`` of its ``(sent_at, work)``
        tuple, and of ``new`` (sent at ``now``; None without it)."""
        if new is None:
            return self._replay(sorted(flights, key=_sent), since, now, None), None
        arrivals, last = _arrivals(flights, now, new)
        out = self._replay(arrivals, since, now, None)
        return out, out[id(last)]

    def _replay(
        self,
        arrivals: list[tuple[float, InFlight]],
        since: float,
        now: float,
        until: tuple[float, InFlight] | None,
    ) -> dict[int, float]:
        """Ends by ``id`` of each arrival, up to the batch holding ``until`` (all: None)."""
        out: dict[int, float] = {}
        count = len(arrivals)
        if not count:
            return out
        max_batch, delay = self.max_batch, self.delay_s
        t = since if since > float("-inf") else arrivals[0][0]
        pending: list[tuple[float, InFlight]] = []
        i = 0
        while i < count or pending:
            while i < count and arrivals[i][0] <= t:
                pending.append(arrivals[i])
                i += 1
            if not pending:  # idle until the next request arrives
                t = arrivals[i][0]
                continue
            oldest = min(sent for sent, _ in pending)
            if sum(w.rows for _, w in pending) < max_batch and t < oldest + delay:
                # Waiting for the delay to run out or for the next arrival, whichever first.
                t = min(oldest + delay, arrivals[i][0]) if i < count else oldest + delay
                continue
            pending.sort(key=lambda p: (self.rank(p[1].level), p[0]))
            rows = longest = 0.0
            taken = 0
            for _, w in pending:
                if taken and rows + w.rows > max_batch:
                    break
                rows += w.rows
                longest = max(longest, w.cost / max(1, w.rows))
                taken += 1
            end = t + self.base_s + self.per_unit_s * rows * longest
            if t <= now and end < now + self.overrun_s:
                end = now + self.overrun_s  # its answers are not in: still running
            done = False
            for arrival in pending[:taken]:
                out[id(arrival)] = end
                done = done or arrival is until
            if done:
                return out
            del pending[:taken]
            t = end
        return out


def _sent(flight: tuple[float, InFlight]) -> float:
    return flight[0]


def _arrivals(
    flights: Iterable[tuple[float, InFlight]], now: float, new: InFlight
) -> tuple[list[tuple[float, InFlight]], tuple[float, InFlight]]:
    """The flights in order of sending, then ``new`` sent at ``now`` (and that last entry)."""
    arrivals = sorted(flights, key=_sent)
    last = (now, new)
    arrivals.append(last)
    return arrivals, last
