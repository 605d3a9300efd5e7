"""Turns the fleet's state into routing candidates and asks the router for one.

Feedback weights and staleness are applied by the router (``proxy.routing.engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.snapshot import InstanceSnapshot
from proxy.fleet.upstream import HttpUpstreams
from proxy.routing.base import Candidate, RouteRequest

Chooser = Callable[[Sequence[Candidate], RouteRequest], Candidate]
SnapshotSource = Callable[[str], InstanceSnapshot | None]
"""instance name -> its last scraped snapshot, or None"""


SlotLimit = Callable[[str, str], int | None]
"""(instance name, model) -> requests of the model the instance may hold, or None (no bound)"""


def _no_snapshot(name: str) -> InstanceSnapshot | None:
    return None


def _no_limit(instance: str, model: str) -> int | None:
    return None


class FleetPlacement:
    def __init__(
        self,
        fleet: Fleet,
        upstreams: HttpUpstreams,
        chooser: Chooser,
        snapshots: SnapshotSource = _no_snapshot,
        slot_limit: SlotLimit = _no_limit,
    ) -> None:
        self.fleet = fleet
        self.upstreams = upstreams
        self.chooser = chooser
        self.snapshots = snapshots
        self.slot_limit = slot_limit

    def candidates(
        self, request: RouteRequest, exclude: frozenset[str] = frozenset()
    ) -> list[Candidate]:
        model = request.model
        out = []
        for inst in self.fleet.serving(model):
            if inst.name in exclude or model in inst.draining:
                continue
            out.append(
                Candidate(
                    name=inst.name,
                    in_flight=inst.in_flight,
                    model_in_flight=inst.model_in_flight.get(model, 0),
                    connections=self.upstreams.open_connections(inst) + inst.streams,
                    snapshot=self.snapshots(inst.name),
                    stale=False,  # judged by the router from the snapshot's age
                    ahead=inst.ahead_of(model, request.level),
                    long_in_flight=inst.long_in_flight.get(model, 0),
                    class_in_flight=inst.class_in_flight.get((model, request.class_name or ""), 0),
                )
            )
        return out

    def pick(self, request: RouteRequest, exclude: frozenset[str]) -> Instance | None:
        candidates = self.candidates(request, exclude)
        if not candidates:
            return None
        # Instances with a free slot (adaptive concurrency). The gate admits no more than the
        # sum of the slots, so one has room unless a retry excluded it; then any serves.
        free = [
            c
            for c in candidates
            if (limit := self.slot_limit(c.name, request.model)) is None
            or c.model_in_flight < limit
        ]
        candidates = free or candidates
        cap = request.class_cap
        if cap is not None:
            # The class's per-instance cap (max_per_instance). The gate admits at most
            # cap x healthy instances of the class, so one is under the cap unless a retry
            # excluded it; then any instance serves rather than none.
            under = [c for c in candidates if c.class_in_flight < cap]
            candidates = under or candidates
        return self.fleet.get(self.chooser(candidates, request).name)
