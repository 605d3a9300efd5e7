"""Earliest expected finish: where Triton's batcher would finish this request soonest."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.batcher import BatcherModel, Job
from proxy.routing.expected_start import ExpectedStart, ExpectedStartParams
from proxy.routing.select import load_params, pick_min, weight_of
from proxy.routing.view import LevelSequence, ModelView


def shortlist_key(candidate: Candidate) -> tuple[float]:
    """``(model_in_flight + 1) / weight``: which candidates are replayed first."""
    return ((candidate.model_in_flight + 1) / weight_of(candidate),)


@dataclass(frozen=True)
class ExpectedFinishParams:
    consider: int = 8
    """Candidates replayed per decision: those with the fewest requests of the model in flight
    (by :func:`shortlist_key`, ties in fleet order). A replay costs tens of microseconds, so a
    large fleet is not replayed whole; on a fleet of at most this many instances the choice is
    over all of them."""

    count_delays: bool = False
    """Also count the delay the request adds to the requests already in flight on the
    candidate (each later batch, and the one it pads), weighted by their level: a long
    request then keeps away from instances whose queued short rows it would pad, and long
    work gathers where long work already waits. Off: the request's own finish alone."""
    level_weight: float = 4.0
    """``count_delays``: a request at priority rank ``r`` (1 = most important) weighs
    ``level_weight ** -(r - 1)``: a real-time millisecond counts four online ones."""

    pack_above: float | None = None
    """Long work (``RouteRequest.long``: a class with a per-instance cap, or a request the
    cost model calls long) is placed as ``expected_start``'s ``pack`` while the model's fleet
    occupancy (``RouteRequest.occupancy``, ``proxy.routing.occupancy``) is at least this:
    onto the instance already running the most long work (a capped class: its own) until
    it is full, before another is opened, so the other instances run short batches only.
    Short work is still replayed, and keeps off the lane because the replay sees its padded
    batches. None (the default): every request is replayed; 0: long work is always packed.
    Why: the replay places each request where it finishes soonest, which mixes long and
    short rows in every instance's batches. Below capacity that is what minimises waiting;
    at and past it, mixed batches cap the fleet at its FIFO capacity (``case.yaml``: 434
    req/s mixed against 894 batched by length) and the queues grow without bound: measured
    (``case.yaml`` x1.5, docs/benchmarks.md, twenty-second round) 51 % of real-time within
    its SLO, the lane 100 %; packing only the capped class was not enough (65 %): online's
    512-token rows, one in ten, still padded every instance's batches."""

    pack_capped: Literal["occupancy", "always", "backlogged"] = "occupancy"
    """With ``pack_above``: when a class with ``max_per_instance`` is packed
    (``ExpectedStartParams.pack_capped``)."""

    lane_depth: int | None = None
    """With ``pack_above``: long requests of an uncapped class an instance of the lane holds
    before another instance is opened to them (``ExpectedStartParams.lane_depth``; default
    ``2 x max_batch_size``). Measured (docs/benchmarks.md, issue 10, thirty-second and
    thirty-third rounds, 3 repetitions on five scenarios): 64 kept an online burst at
    ``online_burst.yaml`` x2 from overflowing the lane (real-time 96.6-100 % within its SLO
    against 93.5-97.9 %) but lengthened online's tail where nothing locks (``long_share.yaml``
    x2 online P99 455-483 against 335-344 ms) and tipped ``case.yaml`` x2 on a loaded machine
    (real-time 86 % within its SLO against 97 % in two repetitions of one run). Not a default:
    ``short_reserve`` is the remedy for the overflow."""

    short_reserve: int = 0
    """With ``pack_above``: the lane never opens the last this-many instances free of long
    work to an uncapped class's long requests (``ExpectedStartParams.short_reserve``).
    Measured (docs/benchmarks.md, issue 10, thirty-third round, 3 repetitions, once the reserve
    acted before placement's slot filter): at ``online_burst.yaml`` x2 every SLO held in all
    three repetitions (real-time P99 59-62 ms against 171-312 without it, offline above its
    floor), level on the five scenarios at x1-x2. On in ``policies/mixed-traffic.yaml`` and,
    since the thirty-fourth round, in the class default (``proxy.routing.config.CLASS_POLICY``);
    off (0) where a file names ``expected_finish`` without it."""

    reserve_spread: bool = False
    """With ``pack_above`` and ``short_reserve``: ``ExpectedStartParams.reserve_spread``."""

    def __post_init__(self) -> None:
        if self.pack_above is not None and not 0.0 <= self.pack_above <= 1.0:
            raise ValueError(f"pack_above must be within [0, 1] or null, got {self.pack_above}")
        if self.consider < 1:
            raise ValueError(f"consider must be >= 1, got {self.consider}")
        if self.level_weight < 1:
            raise ValueError(f"level_weight must be >= 1, got {self.level_weight}")


class ExpectedFinish:
    """Pick the instance where the request would finish soonest, by a replay of each
    instance's Triton dynamic batcher over this proxy's requests in flight there
    (:mod:`proxy.routing.batcher`).

    Formula::

        shortlist = the `consider` candidates with the least (model_in_flight + 1) / weight
        choose      argmin over shortlist of (finish(candidate) - now) / weight
        with count_delays:
                    argmin over shortlist of (w(request) * (finish - now)
                        + sum over requests x in flight of w(x) * (end_with(x) - end_without(x)))
                        / weight,   w(level) = level_weight ** -(rank(level) - 1)
        with pack_above, a long request while occupancy >= pack_above:
                    expected_start's ``pack`` key (fill the instance running the most long
                    work until it is full, then open the one with the fewest short requests)

    where ``finish`` replays the batcher with the request added: the batch it joins (by its
    priority level, behind the batch running), how long that batch is padded (its rows x its
    longest request, on the model's learned cost curve), and the queue delay when it would
    wait alone. It counts what a count of requests cannot: a short request is kept from an
    instance about to start a padded batch, and a long one from an instance whose queued
    short rows it would pad and wait behind; and it spreads work because a request joining
    a queue makes that queue's batches longer. Ties (e.g. idle instances) at random. Until the
    model's curve is learned (``RouteRequest.batcher`` is None) it places as least requests
    over the shortlist.

    Reads ``flights``, ``answered_at``, ``model_in_flight``, ``weight`` and the request's
    ``batcher``, ``level``, ``rows``, ``cost`` and ``now`` (with ``pack_above`` also
    ``long``, ``occupancy``, ``class_cap``, ``class_in_flight`` and ``long_in_flight``; with
    ``short_reserve`` the request's ``free_of_long``, with ``reserve_spread`` its ``busy``).

    Measured (docs/benchmarks.md, issue 10, twenty-first round): with classes and the
    nudge it beats the best baseline below capacity in ``long_share.yaml`` and ``case.yaml``
    (real-time 0.65-0.98x, online 0.71-0.98x), where the lanes lose online; at capacity it
    needs a gate that keeps a backlogged throughput class off most instances (the shallow
    lane's ``max_per_instance``, ``shallow_per_instance`` and ``spare_instances``): behind
    the plain gate, that class's backlog refilled every instance and batches padded as under
    round robin. Past capacity even behind that gate it collapsed (``case.yaml`` x1.5: 51 %
    of real-time within its SLO), until long work was packed (``pack_above``) and the cost
    curve was learned under load as well (``proxy.scheduling.cost.BatchTimes``): then, with
    ``count_delays``, ``pack_above: 0.9``, the nudge and the lane's gate
    (``policies/mixed-traffic.yaml``), real-time 0.16-0.76x and online 0.42-0.82x of the best
    baseline's P99 at ``case.yaml`` x0.25-x2 and ``long_share.yaml`` x0.5-x1, 99.9 % of
    real-time within its SLO at ``case.yaml`` x2; it collapsed at ``long_share.yaml`` x2
    (92.5 %, online shed; twenty-second round) until a surge counted as full occupancy at
    once (``proxy.routing.occupancy``): then 100 % / 100 % there (twenty-third round). It
    loses to the shallow lane on ``burst.yaml`` below capacity unless ``pack_capped``.

    Source: the "shortest expected delay" rule (Whitt, *Deciding which queue to join*, 1986)
    with the delay computed by simulating each server's batcher rather than from queue length;
    measured against the proxy's other rules in a discrete-event model of the benchmark
    before it was built (docs/benchmarks.md, issue 10, twenty-first round).
    """

    reads_ahead = False
    keeps_sessions = False

    def __init__(self, params: ExpectedFinishParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        pack_above = params.pack_above
        self.packs_long = pack_above is not None
        self._lane = (
            None
            if pack_above is None
            else ExpectedStart(
                ExpectedStartParams(
                    long_placement="pack",
                    pack_above=pack_above,
                    pack_capped=params.pack_capped,
                    lane_depth=params.lane_depth,
                    short_reserve=params.short_reserve,
                    reserve_spread=params.reserve_spread,
                ),
                rng,
            )
        )

    def keep_off(self, request: RouteRequest) -> frozenset[str]:
        """The lane's (``ExpectedStart.keep_off``: ``short_reserve``)."""
        lane = self._lane
        return frozenset() if lane is None else lane.keep_off(request)

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        lane = self._lane
        if lane is not None and lane.packs(request):
            return lane.choose(candidates, request)
        shortlist = sorted(candidates, key=shortlist_key)[: self.params.consider]
        return self._best(shortlist, request)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The same shortlist from a sorted index (O(log n) to keep, ``consider`` to read)."""
        lane = self._lane
        if lane is not None and lane.packs(request):
            return lane.choose_view(view, request)
        ordering = view.ordering("expected_finish", shortlist_key)
        lowest = LevelSequence(ordering.items, view.count[view.min_level()])
        return self._best(lowest[: self.params.consider], request)

    def _best(self, shortlist: Sequence[Candidate], request: RouteRequest) -> Candidate:
        batcher = request.batcher
        if batcher is None:
            return pick_min(shortlist, shortlist_key, self._rng)
        now = request.now
        job = Job(request.level or 0, max(1, request.rows), request.cost)
        if not self.params.count_delays:

            def key(c: Candidate) -> tuple[float]:
                flights = c.flights.values() if c.flights else ()
                finish = batcher.finish(flights, c.answered_at, now, job)
                return ((finish - now) / weight_of(c),)

            return pick_min(shortlist, key, self._rng)

        weights = _LevelWeights(batcher, self.params.level_weight)

        def delays(c: Candidate) -> tuple[float]:
            flights = c.flights.values() if c.flights else ()
            before, after, finish = batcher.with_and_without(flights, c.answered_at, now, job)
            added = 0.0
            for f in flights:
                ident = id(f)
                added += weights[f[1].level] * (after[ident] - before[ident])
            return ((weights[job.level] * (finish - now) + added) / weight_of(c),)

        return pick_min(shortlist, delays, self._rng)


class _LevelWeights(dict[int, float]):
    """``count_delays``' weight of a request by its level, ``level_weight ** -(rank - 1)``,
    computed once per level and decision (read once per request in flight replayed)."""

    def __init__(self, batcher: BatcherModel, base: float) -> None:
        super().__init__()
        self._batcher = batcher
        self._base = base

    def __missing__(self, level: int) -> float:
        weight = self[level] = float(self._base ** -(self._batcher.rank(level) - 1))
        return weight


def factory(params: Mapping[str, Any], rng: random.Random) -> ExpectedFinish:
    return ExpectedFinish(load_params(ExpectedFinishParams, params), rng)
