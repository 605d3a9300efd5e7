"""Turns the fleet's state into routing candidates and asks the router for one.

Feedback weights and staleness are applied by the router (``proxy.routing.engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proxy.fleet.instances import ChangeJournal, Fleet, Instance
from proxy.fleet.snapshot import InstanceSnapshot
from proxy.fleet.upstream import HttpUpstreams
from proxy.routing.base import NEVER, Candidate, RouteRequest

Placer = Callable[[RouteRequest, "FleetPlacement", frozenset[str]], Candidate | None]
"""(request, candidate source, excluded names) -> the chosen candidate, or None if none
(``Router.place`` of the router in force)."""
SnapshotSource = Callable[[str], InstanceSnapshot | None]
"""instance name -> its last scraped snapshot, or None"""


Builder = Callable[[str], tuple[Candidate, int] | None]
"""instance name -> its routing candidate and filter level, or None (``FleetPlacement.builder``)"""
SlotLimit = Callable[[str, str], int | None]
"""(instance name, model) -> requests of the model the instance may hold, or None (no bound)"""


def _no_snapshot(name: str) -> InstanceSnapshot | None:
    return None


def _no_limit(instance: str, model: str) -> int | None:
    return None


ByLevel = Callable[[str], bool]
"""Whether a request of the model counts against an instance's slots only the requests there
that Triton serves no later than itself (its priority level or a more important one)"""


def _shared(model: str) -> bool:
    return False


def _ignore(name: str) -> None:
    return None


def _keeps_sessions(model: str) -> bool:
    return True


class FleetPlacement:
    """The candidate source of routing (``proxy.routing.view.CandidateSource``) over the
    fleet's live state, and the per-request filters placement applies.

    Filters: instances with a free slot (adaptive concurrency) if any, else all; of those,
    instances under the class's per-instance cap (``max_per_instance``) if any, else all.
    The gate admits no more than the sum of the slots (and cap x instances of a capped
    class), so one has room unless a retry excluded it; then any instance serves rather
    than none. A candidate's *filter level* (``2 * full + at_cap``) encodes both: the kept
    candidates are those at the lowest level present. With ``slots_by_level`` (the model's
    ``slot_sharing`` ``by_rank`` or ``placed_by_rank``, as its gate enforces it) a request
    finds a slot free when fewer than the limit of the requests there would be served before
    it or with it (``ahead`` at its Triton priority level): real-time work does not spill
    onto a long lane because online work filled the short instance's slots.
    """

    def __init__(
        self,
        fleet: Fleet,
        upstreams: HttpUpstreams,
        placer: Placer,
        snapshots: SnapshotSource = _no_snapshot,
        slot_limit: SlotLimit = _no_limit,
        slots_by_level: ByLevel = _shared,
        on_wake: Callable[[str], None] = _ignore,
        keeps_sessions: Callable[[str], bool] = _keeps_sessions,
    ) -> None:
        self.fleet = fleet
        self.on_wake = on_wake
        """Told the name of each quiet instance a request was sent to (proxy.routing.wake)."""
        self.keeps_sessions = keeps_sessions
        """Whether a model's policy places by session key: the wake then leaves keyed
        requests where the policy chose."""
        self.upstreams = upstreams
        self.placer = placer
        self.snapshots = snapshots
        self.slot_limit = slot_limit
        self._by_level = slots_by_level

    @property
    def journal(self) -> ChangeJournal:
        return self.fleet.journal

    @property
    def positions(self) -> Mapping[str, int]:
        return self.fleet.positions

    def slots_by_level(self, model: str) -> bool:
        return self._by_level(model)

    def builder(self, request: RouteRequest) -> Builder:
        """``build(name)``: the candidate of instance ``name`` for requests shaped like
        ``request`` and its filter level, or None when the instance takes none (unknown,
        unhealthy, the model out or draining there).

        What the request fixes (model, class, level, cap) is read once here: a routing view
        calls the result for every change it refreshes, and one call with the request's
        fields in locals replaced three methods (candidate, level, build): measured under
        callgrind, 14,300 CPU instructions per call against 18,600."""
        fleet = self.fleet
        model = request.model
        class_key = (model, request.class_name or "")
        level = request.level
        cap = request.class_cap
        # Read once per builder: a reload that changes it builds a new router, and new views.
        by_level = self._by_level(model)

        def build(name: str) -> tuple[Candidate, int] | None:
            inst = fleet.instances.get(name)
            if inst is None or not inst.serves(model) or model in inst.draining:
                return None
            in_model = inst.model_in_flight.get(model, 0)
            in_class = inst.class_in_flight.get(class_key, 0)
            # ``ahead_of`` with no level is the model's count, read above.
            ahead, above = (in_model, 0) if level is None else inst.ahead_of(model, level)
            c = Candidate.fast(
                {
                    "name": name,
                    "in_flight": inst.in_flight,
                    "model_in_flight": in_model,
                    "connections": self.upstreams.open_connections(inst) + inst.streams,
                    "snapshot": self.snapshots(name),
                    "stale": False,  # judged by the router from the snapshot's age
                    "weight": 1.0,
                    "ahead": ahead,
                    "above": above,
                    "long_in_flight": inst.long_in_flight.get(model, 0),
                    "class_in_flight": in_class,
                    "flights": inst.flights.get(model),
                    "answered_at": inst.answered_at.get(model, NEVER),
                }
            )
            # The filter level: ``2 * (no free slot) + (the class at its per-instance cap)``.
            limit = self.slot_limit(name, model)
            full = limit is not None and (ahead if by_level else in_model) >= limit
            return c, 2 * full + (cap is not None and in_class >= cap)

        return build

    def candidates(
        self, request: RouteRequest, exclude: frozenset[str] = frozenset()
    ) -> list[tuple[Candidate, int]]:
        """Every instance that could take ``request`` and its filter level, before the
        filters (linear)."""
        build = self.builder(request)
        out = []
        for name in self.fleet.instances:
            if name not in exclude:
                built = build(name)
                if built is not None:
                    out.append(built)
        return out

    def filtered(
        self, request: RouteRequest, exclude: frozenset[str] = frozenset()
    ) -> list[Candidate]:
        """The candidates the router chooses among: those at the lowest filter level (linear;
        :meth:`pick` gets the same decision from a view kept up to date)."""
        candidates = self.candidates(request, exclude)
        if not candidates:
            return []
        low = min(level for _, level in candidates)
        return [c for c, level in candidates if level == low]

    def pick(self, request: RouteRequest, exclude: frozenset[str]) -> Instance | None:
        chosen = self.placer(request, self, exclude)
        if chosen is None:
            return None
        if (
            self.fleet.quiet
            and not request.long
            and (request.session_key is None or not self.keeps_sessions(request.model))
        ):
            woken = self._wake(request, exclude, chosen.name)
            if woken is not None:
                return woken
        return self.fleet.get(chosen.name)

    def _wake(self, request: RouteRequest, exclude: frozenset[str], chosen: str) -> Instance | None:
        """A quiet instance of the model with a free slot under the class's cap, instead of
        the policy's choice (``proxy.routing.wake``), or None."""
        quiet = self.fleet.quiet.get(request.model)
        if not quiet or chosen in quiet:
            return None
        build = self.builder(request)
        for name in sorted(quiet):
            if name in exclude:
                continue
            built = build(name)
            if built is not None and built[1] == 0:
                quiet.discard(name)
                woken = self.fleet.get(name)
                woken.woken_at = self.fleet.clock.now()
                self.on_wake(name)
                return woken
        return None
