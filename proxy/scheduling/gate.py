"""The asyncio face of the class queues, used by the frontends.

::

    gate = Gate(config, capacity=lambda: fleet_slots(), clock=MonotonicClock())
    try:
        async with gate.admit(class_name) as ticket:
            ...  # forward the request; ticket.class_name, ticket.waited_s
    except Shed as shed:
        ...  # 429 / RESOURCE_EXHAUSTED, Retry-After: shed.retry_after_s

``admit`` waits in the class's queue until :class:`ClassQueues` dispatches it. Leaving the
``async with`` block, by any path, releases the slot exactly once and dispatches the next
waiter. A waiter whose task is cancelled (client went away) leaves the queue at once.
Queue timeouts fire from a loop timer armed for the earliest deadline; with a fake clock, call
:meth:`Gate.poke` after advancing it. Call ``poke`` too whenever capacity may have grown
(an instance joined, a limit was raised): the gate reads ``capacity()`` on every release and
poke, and on an arrival that finds nothing queued (which may then go at once), never in
between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from proxy.clock import Clock
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.deadline import Budget
from proxy.scheduling.lateness import LatenessPredictor
from proxy.scheduling.queues import ClassQueues, Entry, ShedReason

_MIN_TIMER_S = 0.001  # a fake clock that never reaches a deadline must not spin the loop


class Shed(Exception):
    """The request was turned away: answer 429 / RESOURCE_EXHAUSTED with ``Retry-After``.

    ``reason`` ``shutdown`` means the gate is closing; answer 503 / UNAVAILABLE for that one.
    """

    def __init__(self, reason: ShedReason, retry_after_s: float, class_name: str) -> None:
        super().__init__(f"request of class {class_name!r} shed: {reason.value}")
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.class_name = class_name


class GateObserver:
    """Hooks called on every scheduling event; the base class ignores them all.

    Calls happen synchronously inside the gate; keep them cheap and do not raise.
    """

    def on_dispatch(self, class_name: str, waited_s: float, order: int) -> None:
        """A request left its queue after ``waited_s``; ``order`` counts dispatches from 0."""

    def on_shed(self, class_name: str, reason: ShedReason) -> None:
        """A request was turned away (at arrival, or later by timeout / eviction / shutdown)."""

    def on_cancel(self, class_name: str) -> None:
        """A queued request's client went away before it was dispatched."""

    def on_complete(self, class_name: str) -> None:
        """A dispatched request released its slot."""

    def on_boost(self, class_name: str) -> None:
        """A request of a starved class was dispatched by the floor boost (also
        :meth:`on_dispatch`): it goes at the top class's Triton priority."""


@dataclass(frozen=True)
class DispatchRecord:
    class_name: str
    waited_s: float
    order: int


@dataclass
class RecordingObserver(GateObserver):
    """Keeps every event in lists, for tests that assert dispatch order."""

    dispatches: list[DispatchRecord] = field(default_factory=list)
    sheds: list[tuple[str, ShedReason]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    completes: list[str] = field(default_factory=list)
    boosts: list[str] = field(default_factory=list)

    def on_dispatch(self, class_name: str, waited_s: float, order: int) -> None:
        self.dispatches.append(DispatchRecord(class_name, waited_s, order))

    def on_shed(self, class_name: str, reason: ShedReason) -> None:
        self.sheds.append((class_name, reason))

    def on_cancel(self, class_name: str) -> None:
        self.cancels.append(class_name)

    def on_complete(self, class_name: str) -> None:
        self.completes.append(class_name)

    def on_boost(self, class_name: str) -> None:
        self.boosts.append(class_name)

    def order(self) -> list[str]:
        """Class names in dispatch order."""
        return [d.class_name for d in self.dispatches]


class Ticket:
    """A dispatched request's slot; released once, by the ``async with`` or by :meth:`release`."""

    __slots__ = (
        "_gate",
        "_released",
        "boosted",
        "class_name",
        "depth",
        "dispatched_at",
        "order",
        "served_s",
        "waited_s",
    )

    def __init__(
        self,
        gate: Gate,
        class_name: str,
        waited_s: float,
        order: int,
        dispatched_at: float,
        depth: int | None = None,
        boosted: bool = False,
    ) -> None:
        self._gate = gate
        self._released = False
        self.class_name = class_name
        self.waited_s = waited_s
        self.order = order
        self.dispatched_at = dispatched_at
        """When the slot was given (the gate's clock): its hold time feeds deadline
        admission's drain rate."""
        self.depth = depth
        """The class's per-instance cap when this slot was given (``max_per_instance``, or
        ``shallow_per_instance`` while the class keeps up); placement must use this one, the
        depth the gate's limit had, not the depth of a later moment: a lane that turned
        shallow while its instances still ran a deep round would have no instance under the
        cap but the spare."""
        self.boosted = boosted
        """Dispatched by the floor boost (``SchedulingConfig.starved_after_s``): send it at
        the top class's Triton priority."""
        self.served_s: float | None = None
        """The device time its answer took, when known (set before the release): it pays
        its class's floor debt (``proxy.scheduling.queues._Floor``)."""

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Free the slot now (idempotent), e.g. when a stream ends before the block does."""
        if self._released:
            return
        self._released = True
        self._gate._release(self)


class AdmissionBase:
    """What every gate admission holds and how it leaves: the slot's :class:`Ticket` once
    entered, released on exit (or earlier, by :meth:`release`). Subclasses say what entering
    gives (:class:`Admission`: the ticket; ``ModelAdmission``: the class's Triton priority)."""

    __slots__ = ("_class_name", "_deadline", "_gate", "_ticket")

    def __init__(self, gate: Gate, class_name: str, deadline: float | None) -> None:
        self._gate = gate
        self._class_name = class_name
        self._deadline = deadline
        self._ticket: Ticket | None = None

    @property
    def depth(self) -> int | None:
        """The class's per-instance cap the slot was given under (:attr:`Ticket.depth`)."""
        ticket = self._ticket
        return ticket.depth if ticket is not None else None

    @property
    def backlog(self) -> int:
        """Requests of the class waiting at the gate now (read when this one left it)."""
        return self._gate.queued(self._class_name)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def served(self, seconds: float | None) -> None:
        """Its answer took ``seconds`` of device time (None: not known): said before the
        release, it pays the class's floor debt (``proxy.scheduling.queues._Floor``)."""
        ticket = self._ticket
        if ticket is not None:
            ticket.served_s = seconds

    def release(self) -> None:
        """Free the slot now (idempotent): what leaving the ``async with`` does."""
        ticket = self._ticket
        if ticket is not None:
            ticket.release()


class Admission(AdmissionBase):
    """``async with gate.admit(name) as ticket``: waits for a slot, releases it on exit."""

    __slots__ = ()

    async def __aenter__(self) -> Ticket:
        self._ticket = await self._gate.acquire(self._class_name, self._deadline)
        return self._ticket


class Gate:
    """Admission of requests into a pool of ``capacity()`` dispatch slots, by class."""

    def __init__(
        self,
        config: SchedulingConfig,
        capacity: Callable[[], int],
        clock: Clock,
        observer: GateObserver | None = None,
        instances: Callable[[], int] = lambda: 1,
        lateness: LatenessPredictor | None = None,
        fleet_part: float = 1.0,
    ) -> None:
        self._core: ClassQueues[asyncio.Future[Ticket]] = ClassQueues(config, fleet_part)
        self._capacity = capacity
        self._instances = instances
        self.lateness = lateness if lateness is not None else LatenessPredictor()
        """Predicts when a request would be answered. With ``scheduling.shed_late`` it sheds
        at arrival, and at the head of the queue, what would be answered after its budget
        (the class SLO or the client's deadline, whichever is earlier); without, only a request
        whose *client deadline* would pass before its answer is shed at the head of the queue
        (its client will have gone: serving it would be abandoned work)."""
        self._clock = clock
        self._observer = observer if observer is not None else GateObserver()
        self._order = 0
        self._closed = False
        self._pumping = False
        self._pump_again = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    @property
    def config(self) -> SchedulingConfig:
        return self._core.config

    def admit(self, class_name: str, deadline: float | None = None) -> Admission:
        """Wait for a slot for ``class_name``; raises :class:`Shed` when turned away.

        ``deadline``: the client's deadline (a time of the gate's clock), if it gave one. With
        deadline admission on, the request's budget is the earlier of it and its class's SLO
        from now (:meth:`Budget.of <proxy.scheduling.deadline.Budget.of>`): one deadline per
        request, whichever way it was given. A class the config does not know (a reload
        removed it) counts as the default class.
        """
        return Admission(self, class_name, deadline)

    def queued(self, class_name: str | None = None) -> int:
        return self._core.queued(class_name)

    def queued_uncapped(self) -> int:
        return self._core.queued_uncapped()

    def in_flight(self, class_name: str | None = None) -> int:
        return self._core.in_flight(class_name)

    def poke(self) -> None:
        """Expire timed-out waiters and dispatch as capacity allows; call when capacity grows."""
        self._pump()

    def set_share_scale(self, class_name: str, factor: float) -> None:
        """The class-limit loop's multiplier on ``class_name``'s ``max_share``; a raise may
        let waiters through at once."""
        self._core.set_share_scale(class_name, factor)
        self.poke()

    def set_fleet_part(self, part: float) -> None:
        """The part of the fleet this gate's floors are owed (``ClassQueues(fleet_part=)``)."""
        self._core.fleet_part = part

    def floor_debt(self, class_name: str) -> float | None:
        """Device-seconds the floor boost counts the class as owed (None: not floored)."""
        return self._core.floor_debt(class_name)

    def share_scale(self, class_name: str) -> float:
        """The factor :meth:`set_share_scale` last set for the class (1: none)."""
        return self._core.share_scale(class_name)

    def reconfigure(self, config: SchedulingConfig) -> None:
        """Swap in a reloaded section; waiters and in-flight slots carry over."""
        self._core.reconfigure(config)
        self._pump()

    def close(self) -> None:
        """Refuse new requests and shed every waiter (``shutdown``); in-flight ones finish."""
        self._closed = True
        for entry in self._core.drain():
            self._fail(entry, ShedReason.SHUTDOWN)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def acquire(self, class_name: str, client_deadline: float | None = None) -> Ticket:
        """What entering :meth:`admit`'s block does: wait for a slot, or raise :class:`Shed`.
        The caller releases the ticket, exactly once, by any path."""
        config = self._core.config
        name = class_name if class_name in config.classes else config.default_class
        if self._closed:
            self._observer.on_shed(name, ShedReason.SHUTDOWN)
            raise Shed(ShedReason.SHUTDOWN, config.retry_after_s, name)
        now = self._clock.now()
        budget = self._budget(name, client_deadline, now)
        budget_s = budget.remaining_s(now)
        # Nothing queued, nothing ahead: a request that would not wait is never shed for a
        # class budget (LatenessPredictor), so the prediction is skipped. Measured when
        # deadline admission became a default: HTTP with an SLO class against a fake Triton
        # (benchmarks/cpu_ab.py, +slo) 0.187 ms of CPU per request with it, 0.181 without
        # the prediction here, 0.180 with deadline admission off (session 35).
        if config.shed_late and budget_s is not None and budget_s > 0 and self._core.queued():
            ahead = self._core.queued_ahead(name)
            capacity = max(0, self._capacity())
            if self.lateness.shed_at_arrival(ahead, name, budget_s, now, capacity):
                self._observer.on_shed(name, ShedReason.LATE)
                raise Shed(ShedReason.LATE, config.retry_after_s, name)
        held_to = budget_s if config.shed_late or budget.hard else None
        if not self._pumping and not self._core.queued():
            # Nobody waits, so nobody is passed over: dispatch at once when a slot is free,
            # as the pump would have right after the push (ClassQueues.take), without the
            # entry, its future and the pump's pass over the queues (admission and release
            # 14.8-17.0 -> 7.0-7.5 µs through ModelGates, `timeit`, session 18). Nothing queued:
            # no timer is armed.
            capacity = max(0, self._capacity())
            if self._core.take(name, now, capacity, max(1, self._instances())):
                # Only a client deadline can be late before any wait (a slow answer).
                if (
                    budget.hard
                    and held_to is not None
                    and self.lateness.late(0.0, name, held_to, hard=True, now=now)
                ):
                    self._core.release(name)
                    self._observer.on_shed(name, ShedReason.LATE)
                    raise Shed(ShedReason.LATE, config.retry_after_s, name)
                ticket = self._ticket(name, 0.0, now)
                self._observer.on_dispatch(name, 0.0, ticket.order)
                return ticket
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        result = self._core.push(future, name, now, held_to, hard=budget.hard)
        for victim in result.evicted:
            self._fail(victim, ShedReason.OVERLOAD)
        if result.entry is None:
            reason = result.shed if result.shed is not None else ShedReason.OVERLOAD
            self._observer.on_shed(name, reason)
            raise Shed(reason, config.retry_after_s, name)
        entry = result.entry
        self._pump()
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(entry)
            raise

    def _abandon(self, entry: Entry[asyncio.Future[Ticket]]) -> None:
        future = entry.item
        if future.done() and not future.cancelled():
            if future.exception() is None:
                # Dispatched in the same tick as the cancellation: the slot is ours to give back.
                future.result().release()
            return
        if self._core.remove(entry):
            self._observer.on_cancel(entry.class_name)
            # Its class may have held a min_share reservation that others can now use.
            self._pump()

    def _release(self, ticket: Ticket) -> None:
        now = self._clock.now()
        self.lateness.on_release(now - ticket.dispatched_at)
        self._core.release(ticket.class_name, now, boosted=ticket.boosted, served_s=ticket.served_s)
        self._observer.on_complete(ticket.class_name)
        self._pump()

    def _fail(self, entry: Entry[asyncio.Future[Ticket]], reason: ShedReason) -> None:
        future = entry.item
        if future.done():  # cancelled while queued; its task is on its way out
            self._observer.on_cancel(entry.class_name)
            return
        future.set_exception(Shed(reason, self._core.config.retry_after_s, entry.class_name))
        self._observer.on_shed(entry.class_name, reason)

    def _pump(self) -> None:
        if self._pumping:  # an observer or a callback re-entered; the running pump loops again
            self._pump_again = True
            return
        if not self._core.queued():
            # Nothing waits, so nothing expires or dispatches, and no timer is due: what the
            # loop below ends with, without computing the capacity (about twenty Python calls
            # on every release; cProfile, session 17).
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        self._pumping = True
        try:
            again = True
            while again:
                self._pump_again = False
                now = self._clock.now()
                for expired in self._core.expire(now):
                    self._fail(expired, ShedReason.TIMEOUT)
                capacity = max(0, self._capacity())
                instances = max(1, self._instances())
                while (entry := self._core.pop(now, capacity, instances)) is not None:
                    future = entry.item
                    if future.done():
                        # Its task was cancelled while queued and has not run its handler yet;
                        # the handler will find it gone from the queue.
                        self._core.release(entry.class_name, boosted=entry.boosted)
                        self._observer.on_cancel(entry.class_name)
                        continue
                    waited = now - entry.enqueued_at
                    if self._late(entry, waited, now):
                        # Already past saving: its slot goes to the next one instead.
                        self._core.release(entry.class_name, boosted=entry.boosted)
                        self._fail(entry, ShedReason.LATE)
                        continue
                    ticket = self._ticket(entry.class_name, waited, now, entry.boosted)
                    future.set_result(ticket)
                    self._observer.on_dispatch(ticket.class_name, ticket.waited_s, ticket.order)
                    if ticket.boosted:
                        self._observer.on_boost(ticket.class_name)
                again = self._pump_again
            self._arm_timer()
        finally:
            self._pumping = False

    def _ticket(
        self, class_name: str, waited_s: float, now: float, boosted: bool = False
    ) -> Ticket:
        """The slot just taken for a request of the class that waited ``waited_s``."""
        # It was its class's oldest: the pop's limit had the depth of its wait.
        depth = self._core.config.classes[class_name].depth(waited_s)
        ticket = Ticket(self, class_name, waited_s, self._order, now, depth, boosted)
        self._order += 1
        self.lateness.on_dispatch(now)
        return ticket

    def _budget(self, name: str, client_deadline: float | None, now: float) -> Budget:
        """When the request stops being worth serving: the earlier of the client's deadline
        and its class's SLO from now."""
        slo = self._core.config.classes[name].slo_p99_ms
        return Budget.of(client_deadline, None if slo is None else now + slo / 1e3)

    def _late(self, entry: Entry[asyncio.Future[Ticket]], waited_s: float, now: float) -> bool:
        if entry.budget_s is None:
            return False
        return self.lateness.late(
            waited_s,
            entry.class_name,
            entry.budget_s,
            hard=entry.budget_hard,
            now=now,
            tail=self._core.config.late_by == "tail",
        )

    def _arm_timer(self) -> None:
        deadline = self._core.next_expiry(self._clock.now())
        if deadline is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None and self._timer_at <= deadline:
            return  # armed early enough; firing early only re-arms
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop, so no waiters to time out
        if self._timer is not None:
            self._timer.cancel()
        delay = max(_MIN_TIMER_S, deadline - self._clock.now())
        self._timer = loop.call_later(delay, self._on_timer)
        self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()
