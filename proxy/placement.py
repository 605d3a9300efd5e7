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


def _no_snapshot(name: str) -> InstanceSnapshot | None:
    return None


class FleetPlacement:
    def __init__(
        self,
        fleet: Fleet,
        upstreams: HttpUpstreams,
        chooser: Chooser,
        snapshots: SnapshotSource = _no_snapshot,
    ) -> None:
        self.fleet = fleet
        self.upstreams = upstreams
        self.chooser = chooser
        self.snapshots = snapshots

    def candidates(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Candidate]:
        out = []
        for inst in self.fleet.healthy():
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
                )
            )
        return out

    def pick(self, request: RouteRequest, exclude: frozenset[str]) -> Instance | None:
        candidates = self.candidates(request.model, exclude)
        if not candidates:
            return None
        return self.fleet.get(self.chooser(candidates, request).name)
