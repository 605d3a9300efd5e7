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

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol

from proxy.routing.base import NEVER


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

    def share_s(self, rows: int, cost: float) -> float:
        """A request's share of full batches' device time: its rows' part of the fixed
        time plus its own padded units (``proxy.routing.occupancy.LongLoad``, the floor
        boost's debt)."""
        return self.base_s * rows / self.max_batch + self.per_unit_s * cost

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
        if len(arrivals) == 1:
            return self._alone(since, now, new)
        return self._replay(arrivals, since, now, last)[id(last)]

    def with_and_without(
        self,
        flights: Iterable[tuple[float, InFlight]],
        since: float,
        now: float,
        new: InFlight,
    ) -> tuple[dict[int, float], dict[int, float], float]:
        """Predicted end of every request in flight, by ``id`` of its ``(sent_at, work)``
        tuple, without ``new`` and with it (sent at ``now``), and ``new``'s end: the flights
        sorted once for both replays (``expected_finish``'s ``count_delays``)."""
        arrivals, last = _arrivals(flights, now, new)
        if len(arrivals) == 1:
            end = self._alone(since, now, new)
            return {}, {id(last): end}, end
        after = self._replay(arrivals, since, now, None)
        before = self._replay(arrivals[:-1], since, now, None)
        return before, after, after[id(last)]

    def _alone(self, since: float, now: float, new: InFlight) -> float:
        """:meth:`_replay`'s end of ``new``, sent at ``now`` to an instance with nothing in
        flight, in closed form and to the bit (the same operations in the same order;
        ``tests/unit/test_routing_batcher.py`` checks it). The replay's setup alone cost
        3.4 µs (0.6 µs this way), paid for every idle instance of ``expected_finish``'s
        shortlist: in a large fleet those with the fewest requests in flight are often idle
        (docs/benchmarks.md, Speed, session 45)."""
        # Idle until it arrives (or the last answer, if that came later).
        t = since if since > now else now
        rows = new.rows
        if rows < self.max_batch and t < now + self.delay_s:
            t = now + self.delay_s  # nothing else arrives to fill its batch
        unit = new.cost / rows if rows > 1 else new.cost
        end = t + self.base_s + self.per_unit_s * float(rows) * unit  # a cost is never negative
        if t <= now and end < now + self.overrun_s:
            end = now + self.overrun_s  # its answer is not in: still running
        return end

    def _replay(
        self,
        arrivals: list[tuple[float, InFlight]],
        since: float,
        now: float,
        until: tuple[float, InFlight] | None,
    ) -> dict[int, float]:
        """Ends by ``id`` of each arrival (in order of sending), up to the batch holding
        ``until`` (all: None).

        Written for speed: ``expected_finish`` replays up to 8 instances per decision, twice
        each with ``count_delays``. The queue is one list of arrival indices per priority
        rank, in order of sending, each with a pointer to its first request not yet batched:
        a batch takes from the most important rank's pointer on, which is the order of a
        stable sort of the queue by ``(rank, sent)``, and no request is moved or compared.
        Its rows are counted as they come and go; its oldest request is the first arrival not
        yet batched. ``tests/unit/test_routing_batcher.py`` holds the replay as first written
        and checks both agree, to the bit, on random queues."""
        out: dict[int, float] = {}
        count = len(arrivals)
        if not count:
            return out
        max_batch, delay, default = self.max_batch, self.delay_s, self.default_level
        sents = [sent for sent, _ in arrivals]
        works = [w for _, w in arrivals]
        rows_of = [w.rows for w in works]
        # The length a batch is padded to by each request (``cost / max(1, rows)``).
        units = [w.cost / r if (r := w.rows) > 1 else w.cost for w in works]
        ranks = [level if (level := w.level) > 0 else default for w in works]
        if ranks.count(ranks[0]) == count:  # one level (a model without classes): one queue
            ranked = [list(range(count))]
        else:
            queues: dict[int, list[int]] = {}
            for k, rank in enumerate(ranks):
                queue = queues.get(rank)
                if queue is None:
                    queues[rank] = [k]
                else:
                    queue.append(k)
            ranked = [queues[rank] for rank in sorted(queues)]
        heads = [0] * len(ranked)
        batched = bytearray(count)
        last = -1
        if until is not None:
            last = count - 1 if arrivals[-1] is until else arrivals.index(until)
        t = since if since > NEVER else sents[0]
        queued = queued_rows = 0
        oldest = 0  # the first arrival not yet batched
        i = 0
        while i < count or queued:
            if i < count and sents[i] <= t:
                j = bisect_right(sents, t, i)
                queued += j - i
                queued_rows += sum(rows_of[i:j])
                i = j
            if not queued:  # idle until the next request arrives
                t = sents[i]
                continue
            while batched[oldest]:
                oldest += 1
            expires = sents[oldest] + delay
            if queued_rows < max_batch and t < expires:
                # Waiting: the batch forms when an arrival fills it or the delay runs out,
                # whichever first (the first form stepped arrival by arrival to find it).
                t = expires
                rows_then = queued_rows
                for j in range(i, bisect_right(sents, expires, i)):
                    rows_then += rows_of[j]
                    if rows_then >= max_batch:
                        t = sents[j]
                        break
                continue
            rows = longest = 0.0
            batch: list[int] = []
            for r_i, queue in enumerate(ranked):
                j = heads[r_i]
                size = len(queue)
                while j < size:
                    k = queue[j]
                    if k >= i:
                        break  # not arrived yet
                    r = rows_of[k]
                    if batch and rows + r > max_batch:
                        break
                    rows += r
                    unit = units[k]
                    if unit > longest:
                        longest = unit
                    batch.append(k)
                    j += 1
                heads[r_i] = j
                if j < size and queue[j] < i:
                    break  # full: the next request in line does not fit
            end = t + self.base_s + self.per_unit_s * rows * longest
            if t <= now and end < now + self.overrun_s:
                end = now + self.overrun_s  # its answers are not in: still running
            for k in batch:
                out[id(arrivals[k])] = end
                batched[k] = 1
            if last >= 0 and batched[last]:
                return out
            queued -= len(batch)
            queued_rows -= int(rows)
            t = end
        return out


_sent = itemgetter(0)
"""A flight's sending time (the sort key of a replay's arrivals)."""


def _arrivals(
    flights: Iterable[tuple[float, InFlight]], now: float, new: InFlight
) -> tuple[list[tuple[float, InFlight]], tuple[float, InFlight]]:
    """The flights in order of sending, then ``new`` sent at ``now`` (and that last entry).
    ``new`` is sent after every flight: when one of them read the clock after this decision
    did (``now`` is read before the decision), ``new`` is sent when that one was."""
    arrivals = sorted(flights, key=_sent)
    last = (max(now, arrivals[-1][0]) if arrivals else now, new)
    arrivals.append(last)
    return arrivals, last
