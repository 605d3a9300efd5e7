"""The interface every routing policy implements.

A policy is a small synchronous class: it sees the whole candidate list (healthy instances
that serve the model) and a frozen view of each, and returns one. It does no I/O and keeps no
clock of its own; randomness comes from the ``random.Random`` passed to its factory.

Each policy decides in two ways that must agree: ``choose`` over a list (the definition) and
``choose_view`` over a :class:`~proxy.routing.view.ModelView`, which the proxy uses per request
because it does not grow with the fleet. A policy object serves one of the two ways: stateful
policies (round robin, consistent hashing) keep separate state for each.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from proxy.fleet.snapshot import NO_LOAD, InstanceSnapshot, ModelLoad

if TYPE_CHECKING:
    from proxy.fleet.instances import Work
    from proxy.routing.batcher import BatcherModel
    from proxy.routing.view import ModelView

NEVER = float("-inf")
"""``Candidate.answered_at`` of an instance where no request of the model has finished yet."""


@dataclass(frozen=True)
class Candidate:
    """One instance that could take the request, as the router sees it right now."""

    name: str
    in_flight: int
    """Requests this proxy has sent to the instance (all models) and not yet finished."""
    model_in_flight: int
    """Same, for the request's model only."""
    connections: int
    """Open upstream connections (HTTP keep-alive sockets + active gRPC streams)."""
    snapshot: InstanceSnapshot | None
    """Last scraped metrics, or None if never scraped."""
    stale: bool
    """True when the snapshot is older than the staleness limit."""
    weight: float = 1.0
    """Selection weight from instance feedback (1.0 = healthy, lower = penalised)."""
    ahead: int | None = None
    """Requests of the model in flight here that Triton serves before this one (same or
    higher priority level); None when unknown (then ``model_in_flight``)."""
    above: int = 0
    """Of ``ahead``, those at a more important level than the request's (0 when it carries
    none): Triton puts their rows first in any batch this request joins."""
    long_in_flight: int = 0
    """Long requests of the model in flight here (see :class:`RouteRequest.long`)."""
    class_in_flight: int = 0
    """Requests of the model and the request's class in flight here."""
    flights: Mapping[int, tuple[float, Work]] | None = None
    """The requests of the model in flight here, ``(sent at, work)`` (live: the instance's
    own record, :attr:`proxy.fleet.instances.Instance.flights`); None when not known."""
    answered_at: float = NEVER
    """Clock time a request of the model last finished here (:data:`NEVER`: none yet)."""

    def load(self, model: str) -> ModelLoad:
        return self.snapshot.model(model) if self.snapshot is not None else NO_LOAD

    @staticmethod
    def fast(fields: dict[str, Any]) -> Candidate:
        """``Candidate(**fields)`` with every field given, without the frozen ``__init__``,
        adopting ``fields`` (the caller's own dict display) as the instance's dict: 6,800
        CPU instructions against 8,200 for the same with keyword arguments and 3.4 µs for
        ``__init__`` (which sets each field through ``object.__setattr__``); paid on every
        refresh of a routing view."""
        if len(fields) != _FIELD_COUNT:
            raise TypeError(f"Candidate.fast needs all {_FIELD_COUNT} fields, got {sorted(fields)}")
        c: Candidate = object.__new__(Candidate)
        object.__setattr__(c, "__dict__", fields)
        return c

    def prepared(self, snapshot: InstanceSnapshot | None, stale: bool, weight: float) -> Candidate:
        """A copy with the engine's view of snapshot, staleness and weight (copies the
        instance dict: 0.8 µs against 4.3 µs for ``dataclasses.replace``, measured)."""
        c: Candidate = object.__new__(Candidate)
        d = c.__dict__
        d.update(self.__dict__)
        d["snapshot"], d["stale"], d["weight"] = snapshot, stale, weight
        return c


_FIELD_COUNT = len(dataclasses.fields(Candidate))


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about the request being routed."""

    model: str
    session_key: str | None = None
    cost: float = 1.0
    """Relative cost estimate (e.g. tokens); 1.0 when unknown."""
    class_name: str | None = None
    level: int | None = None
    """Triton priority level the request will carry (None: not set by the proxy)."""
    long: bool = False
    """Long work: it makes the batch it joins long (padding), so short requests avoid it."""
    class_cap: int | None = None
    """At most this many requests of the class per instance (``max_per_instance``)."""
    class_queued: int = 0
    """Requests of the class still waiting at its gate when this one left it (0 without
    classes): a backlog (``ExpectedStartParams.pack_capped``)."""
    batch: int = 1
    """The model's ``max_batch_size`` (at least 1)."""
    occupancy: float = 1.0
    """Smoothed share of the model's instances with work in flight, 0..1
    (``proxy.routing.occupancy``); 1.0 when not measured."""
    busy: float = 1.0
    """The model's busy share (``proxy.routing.occupancy``) whatever the arm's fill rule
    (``occupancy`` may be the fill); 1.0 when not measured."""
    free_of_long: frozenset[str] | None = None
    """The instances serving the model with none of its long work in flight, as of the last
    scan (``proxy.routing.occupancy.long_free``); None when no long work is in flight or not
    measured (``ExpectedStartParams.short_reserve``)."""
    rows: int = 1
    """Rows of the request (``cost / rows``: the length its batch is padded to)."""
    batcher: BatcherModel | None = None
    """The model's batcher and cost curve (``proxy.routing.batcher``); None until the curve
    is learned, or without a dynamic batcher."""
    now: float = 0.0
    """Clock time of the decision (what the batcher replay predicts from)."""

    @staticmethod
    def fast(fields: dict[str, Any]) -> RouteRequest:
        """``RouteRequest(**fields)`` with every field given, as :meth:`Candidate.fast` builds
        a candidate: one is built per request, and the frozen ``__init__`` took 1.3-1.7 µs
        against 0.5-0.6 µs (``timeit``, session 17)."""
        if len(fields) != _REQUEST_FIELD_COUNT:
            raise TypeError(
                f"RouteRequest.fast needs all {_REQUEST_FIELD_COUNT} fields, got {sorted(fields)}"
            )
        r: RouteRequest = object.__new__(RouteRequest)
        object.__setattr__(r, "__dict__", fields)
        return r


_REQUEST_FIELD_COUNT = len(dataclasses.fields(RouteRequest))


class Policy(Protocol):
    reads_ahead: bool
    """Whether decisions read ``Candidate.ahead`` (which depends on the request's priority
    level): views are then kept per level."""
    keeps_sessions: bool
    """Whether decisions follow ``RouteRequest.session_key`` (a session stays on its
    instance): nothing may then move a keyed request elsewhere (``proxy.routing.wake``)."""
    packs_long: bool
    """Whether the policy gathers long work onto few instances when the fleet is busy (a
    *long lane*), keeping the others' batches short: only then does a throughput class get
    the lane :attr:`proxy.scheduling.config.SchedulingConfig.throughput_lane` derives."""

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        """Pick one of ``candidates`` (never empty). The definition of the policy: linear in
        the number of candidates."""
        ...

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The same decision over a view of the candidates kept up to date between requests
        (``proxy.routing.view``; never empty), without visiting every candidate."""
        ...

    def keep_off(self, request: RouteRequest) -> frozenset[str]:
        """Instances ``request`` must not be placed on while any other can take it: placement
        takes them out before its filters (a free slot, the class's cap), as a retry's, and
        puts them back only when nothing else serves (``Router.place``). Most policies keep
        off none (:func:`keep_none`)."""
        ...


def keep_none(policy: object, request: RouteRequest) -> frozenset[str]:
    """``Policy.keep_off`` of a policy that keeps no request off any instance."""
    return frozenset()


PolicyFactory = Callable[[dict[str, Any], random.Random], Policy]
"""Builds a policy from its validated parameter mapping and a seeded random generator."""
