"""The pure core of class scheduling: per-class FIFO queues and the dispatch decision.

No I/O, no clock, no asyncio: every call takes ``now`` and :meth:`ClassQueues.pop` takes the
current capacity (total dispatch slots). The core counts requests in flight per class itself:
``pop`` takes a slot, ``release`` gives it back. :mod:`proxy.scheduling.gate` wraps it for
asyncio.

Order of one ``pop``:

1. ``slot_sharing: shared``: nothing when every slot is taken (in flight >= capacity).
2. Eligible classes: those with work queued, below their own cap
   (:meth:`ClassConfig.share_limit`: ``max_share`` and ``max_concurrency``), and either still
   short of their own ``min_share`` reservation, or finding a free slot beyond what the *other*
   waiting classes have reserved. A reservation is ``floor(min_share * capacity)`` less what
   the class holds, at most what it has queued and what its cap allows; it only exists while
   the class has work waiting, so idle reservations never waste capacity.
   ``slot_sharing: by_rank``: a class's free slots are ``capacity`` less what the classes at
   least as important as itself (rank <= its own) hold; it is eligible when it has one, or
   when it is short of its own reservation (whatever the others hold). The classes above it
   never wait for its slots, so it need not keep their reservations free.
3. Among the eligible, ``strict_aging`` takes the head with the best (effective rank, arrival
   time), see :class:`AgingConfig` for the bound on waiting; ``weighted_round_robin`` takes
   the class picked by smooth weighted round robin (nginx's: each eligible class gains its
   weight, the largest current value wins and loses the eligible total), which spreads a
   4:1 ratio as 4 and 1 in every 5 dispatches while both are backlogged.

Before all of this, the floor boost (``starved_after_s``): a class with a ``min_share``
below the top class is owed device time while it has requests queued or in flight, at its
share of the fleet and a margin (:data:`FLOOR_AIM`), and pays it back with each answer
(:class:`_Floor`). Once it is behind by ``starved_after_s`` of that, with requests of it
stuck in flight and more queued, it dispatches its head whatever the slots, its limit and
the others hold: *boosted*, as many at once as pay the debt; the gate sends those at the top
class's Triton priority (:attr:`Entry.boosted`). Under a sustained overload of the classes
above it, Triton's priority queue would otherwise never start the class's requests, however
many slots the proxy reserved for them (``surge.yaml`` at 2x: 0-5 offline completions per
10-s window against a floor of 36).

Shedding happens at ``push``: a full class queue sheds the newcomer (``queue_full``); a full
global queue (``max_queued_total``) evicts the newest request of the least important class
that is strictly less important than the newcomer, else sheds the newcomer (``overload``).
The newest is evicted because the oldest are closest to dispatch, and, with aging, soonest.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from proxy.scheduling.config import ClassConfig, SchedulingConfig

T = TypeVar("T")

_EPS = 1e-9  # keeps 0.3 / 0.1 from flooring to 2
_MEAN_WEIGHT = 0.2
"""Weight of the newest answer in a floored class's mean device time (:class:`_Floor`)."""
FLOOR_AIM = 1.3
"""How far above its share the floor boost holds a floored class (:class:`_Floor`). A class
held at its share exactly is one threshold (``starved_after_s`` of its share) behind it, and
loses that again each time a stall begins: at ``surge.yaml`` x2, one surge per 10-s window,
a fifth of the window's share (2 s of 10), and the worst window fell below the floor in 8
of 39 repetitions (forty-first and forty-sixth rounds). Aimed at 10 / 8 of the share and a
little more, the worst window held the floor in all 12 repetitions of two runs (39-50
against 36; aimed 15 % above, 11 of 12), for online's share within its SLO at x2 about what
the runs' spread is, and nothing measurable at x1 (docs/benchmarks.md, forty-sixth
round)."""


class ShedReason(enum.StrEnum):
    """Why a request was turned away; also its metric label."""

    QUEUE_FULL = "queue_full"
    OVERLOAD = "overload"
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    LATE = "late"
    """Predicted (or already certain) to be answered after its class's SLO."""
    BUSY = "busy"
    """Refused at arrival while the proxy's own event loop lags (``scheduling.overload``)."""


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """A queued request: the handle for :meth:`ClassQueues.remove`.

    ``class_name`` changes only when a reconfiguration drops the class (it moves to the
    default class).
    """

    item: T
    class_name: str
    enqueued_at: float
    seq: int
    budget_s: float | None = None
    """How long after ``enqueued_at`` the request stops being worth serving (its deadline
    budget, :class:`proxy.scheduling.deadline.Budget`), when the gate holds it to that at the
    head of its queue; None: it does not."""
    budget_hard: bool = False
    """The budget is a client deadline (:attr:`proxy.scheduling.deadline.Budget.hard`)."""
    boosted: bool = False
    """Dispatched by the floor boost (module doc): send it at the top class's priority, and
    give its slot back with ``release(..., boosted=True)``."""


@dataclass(frozen=True, slots=True)
class PushResult(Generic[T]):
    entry: Entry[T] | None
    """The queued entry, or None when the new request was shed."""
    shed: ShedReason | None = None
    """Why the new request was shed (when ``entry`` is None)."""
    evicted: tuple[Entry[T], ...] = ()
    """Other, less important requests dropped to make room (reason ``overload``)."""


@dataclass(slots=True)
class _Floor:
    """A floored class's account of the device time it is owed (module doc).

    While the class has requests queued or in flight it is owed ``rate`` device-seconds per
    second, ``FLOOR_AIM x min_share x instances``: its share of the fleet, each instance
    counted as one device (times ``fleet_part``: one worker's, one canary arm's part), and a
    margin. Each answer pays back its request's device time (``served_s``: its share of a
    full batch by the model's learned cost curve, ``BatcherModel.share_s``). Nothing is owed
    while the class has nothing queued or in flight, and nothing is banked (an answer beyond
    the debt is no credit for later), so a class served at its own pace owes nothing. Once
    the debt reaches ``rate x starved_after_s``, the boost sends as many requests as pay it
    (the debt over the class's mean device time per answer, at most its reservation in
    flight); their answers pay it back, and the next ones go when it has grown again, so a
    class starved for good is served at ``rate``, one threshold behind. The debt is held to
    twice the threshold: an outage is not repaid in a flood. An answer whose device time is
    unknown (no learned curve yet, or an error) pays the whole debt: no answer for
    ``starved_after_s``, the rule before session 41.

    Why a debt and not a clock (docs/benchmarks.md, forty-first round): until session 40 the
    boost waited for ``starved_after_s`` without any answer, then sent rounds of the
    reservation with rests between them. At ``surge.yaml`` x2 each surge stopped offline for
    about 4 s every 10 s, and a few answers between surges reset the clock: the boost fired
    in some repetitions only, and offline's worst 10-s window fell to 17-38 against a floor
    of 36. Rounds after 2 s fired in x1's surges too, where offline catches up by itself,
    and cost online there; the debt after 2 s fires there in rounds of a few requests and
    cost nothing measurable. Tried and not kept: paying one threshold ahead (4 repetitions:
    no better at x2, online 8 points less within its SLO); a debt over a sliding 10-s window
    (in a simulation of a class starved for good, surplus leaving the window came back as
    bursts of debt: 21-35 answers per window against 30)."""

    owed_s: float = 0.0
    at: float = 0.0
    """When ``owed_s`` was brought up to date."""
    in_flight: int = 0
    """Boosted requests in flight (counted in the class's in-flight count too)."""
    mean_s: float | None = None
    """Mean device time of the class's answers (exponentially weighted; None: none known)."""

    def owed(self, now: float, active: bool, rate: float, cap: float) -> float:
        """The debt at ``now`` (not recorded), the class active since :attr:`at` or not."""
        if not active:
            return 0.0
        return min(cap, self.owed_s + rate * max(0.0, now - self.at))

    def accrue(self, now: float, active: bool, rate: float, cap: float) -> None:
        self.owed_s = self.owed(now, active, rate, cap)
        self.at = max(self.at, now)

    def pay(self, served_s: float | None) -> None:
        if served_s is None:
            self.owed_s = 0.0
            return
        self.owed_s = max(0.0, self.owed_s - served_s)
        mean = self.mean_s
        self.mean_s = served_s if mean is None else mean + _MEAN_WEIGHT * (served_s - mean)

    def wanted(self, owed_s: float, reservation: int) -> int:
        """Boosted requests in flight that would pay ``owed_s``, at most ``reservation``."""
        if self.mean_s is None or self.mean_s <= 0.0:
            return reservation
        return min(reservation, math.ceil(owed_s / self.mean_s - _EPS))


class ClassQueues(Generic[T]):
    """Per-class FIFO queues with priority/aging or WRR dispatch, quotas and shedding."""

    def __init__(self, config: SchedulingConfig, fleet_part: float = 1.0) -> None:
        self._config = config
        self.fleet_part = fleet_part
        """The part of the fleet's traffic this gate sees (``1 / N`` with ``serve --workers
        N``, times a canary arm's share): a floored class is owed that part of its share."""
        self._queues: dict[str, OrderedDict[int, Entry[T]]] = {
            n: OrderedDict() for n in config.classes
        }
        self._wrr: dict[str, int] = dict.fromkeys(config.classes, 0)
        self._in_flight: dict[str, int] = {}
        self._total_in_flight = 0
        self._total_queued = 0
        self._seq = 0
        self._top_rank = min(c.rank for c in config.classes.values())
        self._scale: dict[str, float] = {}
        self._arrived_at: dict[str, float] = {}
        self._floored = config.boosted_classes()
        """The classes the floor boost may lift (none while ``starved_after_s`` is null)."""
        self._floors: dict[str, _Floor] = {name: _Floor() for name in self._floored}
        """Per floored class: the device time it is owed, its boosted requests in flight."""
        self._starved_after = config.starved_after_s or 0.0
        self._instances = 1
        """Healthy instances at the last ``pop`` or ``take``: the floors' rate."""

    def set_share_scale(self, class_name: str, factor: float) -> None:
        """Multiply ``class_name``'s ``max_share`` by ``factor`` in (0, 1] (class-limit loop)."""
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"share scale must be in (0, 1], got {factor}")
        self._scale[class_name] = factor

    def share_scale(self, class_name: str) -> float:
        return self._scale.get(class_name, 1.0)

    def floor_debt(self, class_name: str) -> float | None:
        """The device-seconds a floored class was owed when last brought up to date
        (:class:`_Floor`); None: the floor boost does not lift it."""
        floor = self._floors.get(class_name)
        return floor.owed_s if floor is not None else None

    def _limit(self, name: str, capacity: int, instances: int, now: float) -> int:
        return self._config.classes[name].share_limit(
            capacity,
            instances,
            self._scale.get(name, 1.0),
            self._keeps_spare(name, now),
            self._head_wait(name, now),
        )

    def _head_wait(self, name: str, now: float) -> float | None:
        """How long the class's oldest queued request has waited (None: none queued)."""
        queue = self._queues[name]
        return now - next(iter(queue.values())).enqueued_at if queue else None

    def _keeps_spare(self, name: str, now: float) -> bool:
        """Whether ``name``'s spare instances are kept for the more important classes: one
        of them has work queued or in flight, or had an arrival within ``spare_idle_s``."""
        cls = self._config.classes[name]
        if not (cls.spare_instances or cls.spare_fraction):
            return True
        for other, ocls in self._config.classes.items():
            if ocls.rank >= cls.rank:
                continue
            if self._queues[other] or self._in_flight.get(other, 0):
                return True
            arrived = self._arrived_at.get(other)
            if arrived is not None and now - arrived < cls.spare_idle_s:
                return True
        return False

    @property
    def config(self) -> SchedulingConfig:
        return self._config

    def queued(self, class_name: str | None = None) -> int:
        """Requests waiting, in one class or (None) in all."""
        if class_name is None:
            return self._total_queued
        q = self._queues.get(class_name)
        return len(q) if q is not None else 0

    def queued_uncapped(self) -> int:
        """Requests waiting in classes without ``max_per_instance``: such a request waits
        only when the model's slots are taken (or its class's share or cap is), not for a
        per-instance cap of its own."""
        classes = self._config.classes
        return sum(len(q) for n, q in self._queues.items() if classes[n].max_per_instance is None)

    def queued_ahead(self, class_name: str) -> int:
        """Requests queued in ``class_name`` and in more important classes (lower rank)."""
        rank = self._config.classes[class_name].rank
        return sum(
            len(q) for name, q in self._queues.items() if self._config.classes[name].rank <= rank
        )

    def in_flight(self, class_name: str | None = None) -> int:
        """Requests dispatched and not yet released, in one class or (None) in all."""
        if class_name is None:
            return self._total_in_flight
        return self._in_flight.get(class_name, 0)

    def push(
        self,
        item: T,
        class_name: str,
        now: float,
        budget_s: float | None = None,
        *,
        hard: bool = False,
    ) -> PushResult[T]:
        """Queue ``item`` in ``class_name`` (a configured class, else KeyError), or shed it."""
        queue = self._queues[class_name]
        cls = self._config.classes[class_name]
        self._arrived_at[class_name] = now
        if class_name in self._floors:
            self._accrue(class_name, now)
        if len(queue) >= cls.max_queue:
            return PushResult(None, ShedReason.QUEUE_FULL)
        evicted: tuple[Entry[T], ...] = ()
        bound = self._config.max_queued_total
        if bound is not None and self._total_queued >= bound:
            victim = self._least_important_queued()
            if victim is None or self._config.classes[victim].rank <= cls.rank:
                return PushResult(None, ShedReason.OVERLOAD)
            _, dropped = self._queues[victim].popitem(last=True)
            self._total_queued -= 1
            evicted = (dropped,)
        self._seq += 1
        entry = Entry(item, class_name, now, self._seq, budget_s, hard)
        queue[entry.seq] = entry
        self._total_queued += 1
        return PushResult(entry, None, evicted)

    def remove(self, entry: Entry[T]) -> bool:
        """Take a queued entry out (its client went away); False if it is no longer queued."""
        queue = self._queues.get(entry.class_name)
        if queue is None or queue.pop(entry.seq, None) is None:
            return False
        self._total_queued -= 1
        return True

    def expire(self, now: float) -> list[Entry[T]]:
        """Remove and return the entries that have waited ``queue_timeout_s`` or longer."""
        if self._floored:
            self._accrue_all(now)
        expired: list[Entry[T]] = []
        for name, queue in self._queues.items():
            timeout = self._config.classes[name].queue_timeout_s
            if timeout is None:
                continue
            # Arrival order is queue order, and one class has one timeout: expiry is at the head.
            while queue:
                head = next(iter(queue.values()))
                if now < head.enqueued_at + timeout:
                    break
                queue.popitem(last=False)
                expired.append(head)
        self._total_queued -= len(expired)
        return expired

    def next_expiry(self, now: float | None = None) -> float | None:
        """When :meth:`expire` will next have something to return, or (given ``now``) a
        class with requests queued and stuck in flight turns starved (its debt reaches the
        floor boost's threshold, :class:`_Floor`), if that is later than ``now``; None:
        neither."""
        soonest: float | None = None
        if now is not None:
            for name in self._floored:
                if self._queues[name] and self._unboosted(name):
                    rate, threshold, cap = self._floor_terms(name)
                    owed = self._floors[name].owed(now, True, rate, cap)
                    at = now + (threshold - owed) / rate
                    if at > now and (soonest is None or at < soonest):
                        soonest = at
        for name, queue in self._queues.items():
            timeout = self._config.classes[name].queue_timeout_s
            if timeout is None or not queue:
                continue
            at = next(iter(queue.values())).enqueued_at + timeout
            if soonest is None or at < soonest:
                soonest = at
        return soonest

    def take(self, class_name: str, now: float, capacity: int, instances: int = 1) -> bool:
        """Dispatch a request of ``class_name`` (a configured class) at once, unqueued, when
        nothing is queued and a slot is free for it; take that slot. False: only its arrival
        was recorded; :meth:`push` it.

        What :meth:`push` then :meth:`pop` would decide, without the entry: with nothing else
        queued, the request is the only candidate, no other class holds a reservation, and its
        oldest queued request would have waited 0 s (so :meth:`ClassConfig.depth` is the
        shallow one either way). ``shared``: it goes when a slot is free and its class is under
        its limit; ``by_rank``: when its class is under its limit and either short of its
        reservation or finds a slot the classes at least as important do not hold. (A single
        eligible class leaves the weighted round robin's counters as they were.) A class the
        floor boost would lift is left to the pop, which boosts it.
        """
        if self._total_queued:
            return False
        self._arrived_at[class_name] = now
        if class_name in self._floors:
            # As push (the debt so far, at the last rate) then pop (the new rate and cap).
            self._accrue(class_name, now)
            self._instances = instances
            self._accrue(class_name, now)
            if self._may_boost(class_name, capacity):
                return False  # the pop boosts it
        cls = self._config.classes[class_name]
        held = self._in_flight.get(class_name, 0)
        limit = cls.share_limit(
            capacity,
            instances,
            self._scale.get(class_name, 1.0),
            self._keeps_spare(class_name, now),
            0.0,
        )
        if held >= limit:
            return False
        if self._config.slot_sharing == "by_rank":
            if (
                cls.reserved(capacity, instances, 0.0) <= held
                and self._held_at_or_above(class_name) >= capacity
            ):
                return False
        elif capacity <= self._total_in_flight:
            return False
        self._take_slot(class_name)
        return True

    def pop(self, now: float, capacity: int, instances: int = 1) -> Entry[T] | None:
        """Dispatch the next entry if a slot out of ``capacity`` may be used; take that slot.

        ``instances`` (healthy instances) bounds classes with ``max_per_instance`` (less
        their ``spare_instances`` while a more important class is active).

        Call :meth:`expire` first; ``pop`` does not look at timeouts.
        """
        if self._total_queued == 0:
            return None
        if self._floored:
            self._instances = instances
            self._accrue_all(now)
            if (starved := self._starved(capacity)) is not None:
                return self._boost(starved)
        free = capacity - self._total_in_flight
        by_rank = self._config.slot_sharing == "by_rank"
        if free <= 0 and not by_rank:
            return None
        reserved: dict[str, int] = {}
        for name, queue in self._queues.items():
            if not queue:
                continue
            cls = self._config.classes[name]
            held = self._in_flight.get(name, 0)
            limit = self._limit(name, capacity, instances, now)
            short = min(
                cls.reserved(capacity, instances, self._head_wait(name, now)) - held,
                len(queue),
                limit - held,
            )
            if short > 0:
                reserved[name] = short
        total_reserved = sum(reserved.values())

        def has_room(name: str) -> bool:
            if by_rank:
                return self._held_at_or_above(name) < capacity
            return free > total_reserved

        eligible = [
            name
            for name, queue in self._queues.items()
            if queue
            and self._in_flight.get(name, 0) < self._limit(name, capacity, instances, now)
            and (name in reserved or has_room(name))
        ]
        if not eligible:
            return None
        if self._config.dispatch == "weighted_round_robin":
            chosen = self._pick_wrr(eligible)
        else:
            chosen = self._pick_aged(eligible, now)
        return self._dispatch(chosen)

    def _dispatch(self, name: str) -> Entry[T]:
        """Take ``name``'s head out of its queue and its slot."""
        entry = self._head(name)
        self._take_slot(name)
        return entry

    def _boost(self, name: str) -> Entry[T]:
        """Take ``name``'s head out of its queue, boosted (module doc), beyond every limit."""
        entry = self._dispatch(name)
        entry.boosted = True
        self._floors[name].in_flight += 1
        return entry

    def _head(self, name: str) -> Entry[T]:
        _, entry = self._queues[name].popitem(last=False)
        self._total_queued -= 1
        return entry

    def _take_slot(self, name: str) -> None:
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        self._total_in_flight += 1

    def _unboosted(self, name: str) -> int:
        """Requests of ``name`` in flight that the floor boost did not send."""
        floor = self._floors.get(name)
        return self._in_flight.get(name, 0) - (floor.in_flight if floor is not None else 0)

    def _floor_terms(self, name: str) -> tuple[float, float, float]:
        """A floored class's rate (device-seconds owed per second), the debt at which it is
        starved and the most it may owe (:class:`_Floor`)."""
        share = self._config.classes[name].min_share * self._instances * self.fleet_part
        rate = FLOOR_AIM * share
        threshold = rate * self._starved_after
        return rate, threshold, 2.0 * threshold

    def _accrue(self, name: str, now: float) -> None:
        """Bring a floored class's debt up to ``now``."""
        rate, _, cap = self._floor_terms(name)
        active = bool(self._queues[name]) or self._in_flight.get(name, 0) > 0
        self._floors[name].accrue(now, active, rate, cap)

    def _accrue_all(self, now: float) -> None:
        for name in self._floored:
            self._accrue(name, now)

    def _starved(self, capacity: int) -> str | None:
        """The class the floor boost dispatches next (module doc), or None: of those with
        work queued that :meth:`_may_boost`, the one furthest behind its share (debts brought
        up to date by the caller)."""
        chosen: str | None = None
        behind = 0.0
        for name in self._floored:
            if self._queues[name] and self._may_boost(name, capacity):
                rate = self._floor_terms(name)[0]
                owed = self._floors[name].owed_s / rate
                if chosen is None or owed > behind:
                    chosen, behind = name, owed
        return chosen

    def _may_boost(self, name: str, capacity: int) -> bool:
        """``name`` has requests in flight that were not boosted, owes at least the
        threshold (:class:`_Floor`; brought up to date by the caller), and has fewer boosted
        requests in flight than would pay it (at most its reservation,
        ``floor(min_share x capacity)``, at least one). Whether it has any queued is the
        caller's to check."""
        if not self._unboosted(name):
            return False  # none stuck: its reservation dispatches it as usual
        floor = self._floors[name]
        _, threshold, _ = self._floor_terms(name)
        if floor.owed_s < threshold - _EPS:
            return False
        share = self._config.classes[name].min_share
        reservation = max(1, math.floor(share * capacity + _EPS))
        return floor.in_flight < floor.wanted(floor.owed_s, reservation)

    def _held_at_or_above(self, name: str) -> int:
        """Requests in flight of the classes at least as important as ``name``."""
        classes = self._config.classes
        rank = classes[name].rank
        # A class a reload dropped counts as the default class, where its queue went.
        dropped = classes[self._config.default_class].rank
        return sum(
            held
            for other, held in self._in_flight.items()
            if (classes[other].rank if other in classes else dropped) <= rank
        )

    def release(
        self,
        class_name: str,
        answered_at: float | None = None,
        *,
        boosted: bool = False,
        served_s: float | None = None,
    ) -> None:
        """Give back a slot taken by :meth:`pop` for ``class_name``. ``answered_at``: when
        its request left the proxy's hands (None: it was never sent); ``boosted``: the entry
        was (:attr:`Entry.boosted`); ``served_s``: the device time its answer took, which
        pays a floored class's debt (:class:`_Floor`). The gate cannot tell an answer from a
        client that gave up or an error: a sent request released without ``served_s`` pays
        the whole debt, which errs towards not boosting."""
        held = self._in_flight.get(class_name, 0)
        if held <= 0:
            raise RuntimeError(f"release of class {class_name!r} with nothing in flight")
        floor = self._floors.get(class_name)
        if floor is not None:
            if answered_at is not None:
                self._accrue(class_name, answered_at)
                floor.pay(served_s)
            if boosted:
                floor.in_flight = max(0, floor.in_flight - 1)
        if held == 1 and class_name not in self._queues:
            del self._in_flight[class_name]  # a class dropped by reconfigure, now drained
        else:
            self._in_flight[class_name] = held - 1
        self._total_in_flight -= 1

    def drain(self) -> list[Entry[T]]:
        """Remove and return every queued entry (shutdown)."""
        drained = [e for queue in self._queues.values() for e in queue.values()]
        for queue in self._queues.values():
            queue.clear()
        self._total_queued = 0
        return drained

    def reconfigure(self, config: SchedulingConfig) -> None:
        """Adopt a new section without losing anyone.

        Queued requests of a class that no longer exists move to the new default class, in
        arrival order; in-flight counts of such a class are kept until released. Lowered
        ``max_queue`` / ``max_queued_total`` bounds are reached by draining, not by shedding.
        """
        queues: dict[str, OrderedDict[int, Entry[T]]] = {}
        orphans: list[Entry[T]] = []
        for name, queue in self._queues.items():
            if name in config.classes:
                queues[name] = queue
            else:
                orphans.extend(queue.values())
        for name in config.classes:
            queues.setdefault(name, OrderedDict())
        if orphans:
            default = config.default_class
            merged = sorted(
                [*queues[default].values(), *orphans], key=lambda e: (e.enqueued_at, e.seq)
            )
            for e in orphans:
                e.class_name = default
            queues[default] = OrderedDict((e.seq, e) for e in merged)
        self._queues = queues
        self._wrr = {n: self._wrr.get(n, 0) for n in config.classes}
        self._config = config
        self._top_rank = min(c.rank for c in config.classes.values())
        self._floored = config.boosted_classes()
        self._floors = {name: self._floors.get(name) or _Floor() for name in self._floored}
        self._starved_after = config.starved_after_s or 0.0

    def _least_important_queued(self) -> str | None:
        candidates = [n for n, q in self._queues.items() if q]
        if not candidates:
            return None
        return max(candidates, key=lambda n: (self._config.classes[n].rank, len(self._queues[n])))

    def _effective_rank(self, cls: ClassConfig, waited: float) -> int:
        gained = math.floor(max(0.0, waited) / self._config.aging.step_s + _EPS)
        # Aging never lifts a class above the most important one (see AgingConfig).
        floor_rank = min(cls.rank, self._top_rank + 1)
        return max(floor_rank, cls.rank - gained)

    def _pick_aged(self, eligible: list[str], now: float) -> str:
        def key(name: str) -> tuple[int, float, int, int]:
            cls = self._config.classes[name]
            head = next(iter(self._queues[name].values()))
            return (
                self._effective_rank(cls, now - head.enqueued_at),
                head.enqueued_at,
                cls.rank,
                head.seq,
            )

        return min(eligible, key=key)

    def _pick_wrr(self, eligible: list[str]) -> str:
        classes = self._config.classes
        total = 0
        for name in eligible:
            self._wrr[name] += classes[name].weight
            total += classes[name].weight
        chosen = max(eligible, key=lambda n: (self._wrr[n], -classes[n].rank))
        self._wrr[chosen] -= total
        return chosen
