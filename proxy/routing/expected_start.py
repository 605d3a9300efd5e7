"""Least expected start: where the request would begin executing soonest, by class."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.select import load_params, pick_min, weight_of
from proxy.routing.view import ModelView


@dataclass(frozen=True)
class ExpectedStartParams:
    long_weight: float = 3.0
    """How many full short batches one long request in flight is worth: roughly the time of a
    batch padded to a long request over that of a batch of short ones."""

    long_placement: Literal["pack", "spread"] = "spread"
    """``pack``: a long request joins the instance that already runs the most long work (a
    *long lane*), so the other instances keep short batches; ``spread`` (the default): the
    fewest long requests. ``spread`` stays the default until ``pack`` wins in the benchmark: in
    one run of the offline-burst scenario at 1.5x load the lane lost to spread with a cap of 1
    (real-time P99 1.54x against 0.52x the best baseline, docs/benchmarks.md)."""
    pack_above: float | None = None
    """``pack`` only while the model's fleet occupancy (``RouteRequest.occupancy``, the
    smoothed share of its instances with work in flight, ``proxy.routing.occupancy``) is at
    least this; below it long work is placed as with ``spread``. None (the default): always
    pack. A lane keeps long work from padding every instance's short batches, which pays
    when the fleet is busy; on a lightly loaded fleet the long requests it holds back wait
    for the lane where they would have started at once elsewhere (module
    ``proxy.routing.occupancy``). Measured (``long_share.yaml``, ``pack_above: 0.5``, 3
    repetitions, docs/benchmarks.md, sixteenth round): on three servers online's P99 at x0.25
    1.15x the best baseline's against the lane's 1.56x, real-time not better (1.27x against
    1.16x), and at x0.5, where the occupancy straddles 0.5, real-time 0.85x against 0.61x;
    on six servers below capacity better than the lane on every class, still 1.5-2.9x round
    robin's. Those light-load ratios carried the benchmark's own probe stall (seventeenth
    round); without it, ``long_share.yaml`` x0.25: real-time 15.7 / online 25.1 ms against
    the best baseline's 18.9 / 28.0, the lane 16.1 / 41.1; but on ``case.yaml`` x0.25 its
    spread long rows hit Triton's batcher stall on instances the wake does not judge (P99
    256 against the lane's 64 ms). Opt-in."""
    pack_capped: Literal["occupancy", "always", "backlogged"] = "occupancy"
    """With ``pack_above``, when a request of a class with ``max_per_instance``
    (``class_cap``) is packed: ``occupancy`` (the default) as any long work, at
    ``pack_above`` or more; ``always``, at any occupancy; ``backlogged``, at any occupancy
    while requests of its class wait at the gate (``RouteRequest.class_queued``), as when
    an offline job drops many at once, and at ``pack_above`` otherwise. Other long work
    waits for ``pack_above`` in every case. Measured (docs/benchmarks.md, issue 10,
    twenty-third round, 3 repetitions): ``always`` cut the real-time P99 at ``burst.yaml``
    x0.5 from 0.80x to 0.11x the best baseline's, but online's at ``long_share.yaml`` x0.5,
    whose offline arrives steadily, rose from 0.73x to 1.02x (the lane held one of three
    instances online's 512-token rows used); ``backlogged`` packs in the burst only."""
    spread_alone: bool = False
    """A long request placed as ``spread`` (or below ``pack_above``) counts an instance with
    work of a more important priority level in flight (``Candidate.above``) as holding one
    more long request: its row would pad that work's batch, or wait for it. Measured with
    ``pack_above: 0.5`` (sixteenth round, one run): at x0.5 on three servers real-time 0.99x
    and online 1.17x the best baseline against 1.10x / 1.48x without it; level at x0.25 and
    on six servers. Opt-in."""
    lane_depth: int | None = None
    """``pack``: long requests of an uncapped class per instance before the lane opens
    another instance; default ``2 x max_batch_size`` (one batch running, one forming). A
    class with ``max_per_instance`` uses that instead (the gate and placement enforce it)."""

    busy_weight: float = 0.5
    """Batches a short request expects to wait on an instance with anything of the model in
    flight, whatever its level: the batch running there, which no priority pre-empts. Without
    it a real-time request scored an instance running one online request (level 2) as idle
    (``ahead`` = 0), joined it at random, waited for that batch, and, in about one case in
    eight, for Triton's batcher stall as well (proxy.routing.wake)."""

    long_to_idle: bool = False
    """``pack``: a long request of a class without ``max_per_instance`` goes to an instance
    with nothing of the model in flight when there is one, and joins the lane only when none
    is idle. In the lane, Triton fills its batch with the lane's queued lower-priority long
    rows (up to a full 87 ms batch in ``benchmarks/issue10/case.yaml``, after the one
    running); on an idle instance it starts at once. Off by default: in the benchmark
    (docs/benchmarks.md, issue 10 fifth round, 3 repetitions) it cut online's P99 at half load
    from 1.86x to 1.55x the best baseline's, but at x1 the long rows it sent to idle
    instances padded the real-time batches that followed them there: real-time P99 115.6
    against 83.4 ms, 98.4 % within the SLO against 99.5 %, which loses the goodput."""

    idle_reserve: int = 0
    """``long_to_idle``: idle instances that must remain for short work after a long request
    takes one. 0: any idle instance takes it; 1: only while another instance stays idle, so
    under load (when at most one instance is ever idle) long work stays in the lane. Measured
    (arm ``proxy_rank_lane+idle``, docs/benchmarks.md, issue 10 sixth round, 3 repetitions):
    online's P99 at x0.25 61.0 against 72.6 ms, but at x1 real-time attainment 98.6 %
    against 99.6 %, as with ``long_to_idle`` alone: opt-in."""

    quiet_depth: int = 0
    """``long_to_idle``: a long request of an uncapped class that finds no idle instance it
    may take (none, or ``idle_reserve`` keeps them) goes to a *quiet* one before it joins the
    lane: no long work in flight and fewer than ``quiet_depth`` requests of the model, so its
    padded batch holds at most that many short rows. In the lane it waits for the running
    long batch and runs in one filled with the lane's queued rows. 0 (the default): off.
    Under load no instance stays under a small depth, and long work keeps to the lane.
    Measured (``benchmarks/issue10/long_share.yaml``, 30 % of online requests are 512-token
    rows; ``quiet_depth: 4``, 3 repetitions, docs/benchmarks.md, tenth round): it moves the
    tail from online to real-time. At x0.25 online's P99 1.25x the best baseline's against
    1.74x without it, but real-time 1.84x against 0.92x; at x0.5 online 1.52x against 1.66x,
    real-time 1.07x against 0.57x; at x1 online 0.86x against 1.22x, real-time 0.53x against
    0.41x (100 % within its SLO). The short rows it pads are real-time's: opt-in."""

    quiet_alone: bool = False
    """``quiet_depth``: a quiet instance must also have nothing of a more important priority
    level in flight (``Candidate.above`` = 0), so the short rows the long batch pads are its
    own level's or lower, never a more important class's. ``quiet_depth`` alone let online's
    long rows pad real-time batches (above). Measured (``long_share.yaml``, ``quiet_depth:
    2``, 3 repetitions, docs/benchmarks.md, eleventh round): real-time stayed level with the
    shallow lane (0.94x / 0.78x / 0.13x the best baseline at x0.25 / x0.5 / x1), but online's
    P99 did not come down enough (1.26x / 1.48x / 0.27x against 1.36x / 1.37x / 0.27x): its
    512-token rows still wait behind the lane's offline batches or run in a padded batch.
    Opt-in."""

    short_reserve: int = 0
    """``pack``: a packed long request does not open an instance free of long work
    (``long_in_flight`` 0) while at most this many of the model's instances are free of it
    (``RouteRequest.free_of_long``, sampled every 0.1 s): it joins the lane instead, past
    ``lane_depth`` (or its class's ``max_per_instance``) if need be, and past the lane
    instances' slot limits (:meth:`ExpectedStart.keep_off` takes those instances out before
    placement's filters; the gate still bounds the fleet's total). A class with
    ``max_per_instance`` is held only while the fleet's busy share is at least
    ``pack_above`` (:meth:`ExpectedStart.holds_short`). Why: a lane that overflows opens the
    last instances running short batches only; the long rows pad them, every batch on the
    fleet becomes a padded one, the fleet serves no more than its FIFO capacity, and under
    overload the queues inside Triton never drain again (measured: an online burst at
    ``benchmarks/issue10/online_burst.yaml`` x2, every instance's batches 16 rows padded to
    512 tokens for the rest of the run, offline at the lowest priority starved; docs/
    benchmarks.md, issue 10, thirty-second round). The overflow waits in the lane's queue
    instead, where deadline admission sheds what would be late. Until session 39 the
    reserve held the uncapped classes only, and the throughput class's packed requests
    (its floor boost, a lane deeper than its gate's count) opened the last short instance
    at ``online_burst.yaml`` x2: every later long row counted it as lane, and one
    repetition in three to five locked (docs/benchmarks.md, issue 10, thirty-ninth round).
    0 (the default): off."""

    reserve_spread: bool = False
    """With ``short_reserve`` and ``pack_above``: the reserve holds long work that is not
    packed too. A long request of a class without ``max_per_instance`` whose occupancy (the
    fill, with ``routing.occupancy_depth``) is below ``pack_above`` is placed by the
    policy's own rule (the replay, or ``spread``) but kept off the last ``short_reserve``
    instances free of long work while the model's busy share (``RouteRequest.busy``, the
    share of instances with anything in flight) is at least ``pack_above``: the fleet is
    busy, yet batches do not form deep enough for the fill to pack. Why: there the fill
    spread online's 512-token rows over every instance, and real-time rode with them
    (``long_share.yaml`` x1.5 on three servers: real-time's P99 97-108 ms against 34-39
    with the lane, docs/benchmarks.md, issue 10, forty-third and forty-fourth rounds).
    Kept off one instance, the spread rows leave real-time a batch of its own there.
    Measured (forty-fourth round, 3 repetitions per run): real-time's P99 there 61.7 / 63.4
    ms against 83.8 / 103.4 in two runs (the shipped file's 72.6 against 159.6), online
    0.76-0.93x; at ``online_burst.yaml`` x1.5 67.6 against 111.7; level in thirteen other
    cells of seven scenarios and six servers, except that one repetition of
    ``online_burst.yaml`` x1 doubled online's P99 (within its SLO: a burst's long rows,
    held off the reserve, queued deep on the others). It never acts where the fill does
    not decide: there a long request is not packed only while the busy share is below
    ``pack_above``. Off by default; on in the class default."""

    def __post_init__(self) -> None:
        if self.short_reserve < 0:
            raise ValueError(f"short_reserve must be >= 0, got {self.short_reserve}")
        if self.quiet_depth < 0:
            raise ValueError(f"quiet_depth must be >= 0, got {self.quiet_depth}")
        if self.idle_reserve < 0:
            raise ValueError(f"idle_reserve must be >= 0, got {self.idle_reserve}")
        if self.busy_weight < 0:
            raise ValueError(f"busy_weight must be >= 0, got {self.busy_weight}")
        if self.long_weight < 0:
            raise ValueError(f"long_weight must be >= 0, got {self.long_weight}")
        if self.lane_depth is not None and self.lane_depth < 1:
            raise ValueError(f"lane_depth must be >= 1 or null, got {self.lane_depth}")
        if self.pack_above is not None and not 0.0 <= self.pack_above <= 1.0:
            raise ValueError(f"pack_above must be within [0, 1] or null, got {self.pack_above}")


class ExpectedStart:
    """Pick the instance where the request would start soonest, counting only the work that
    Triton's batcher serves before it.

    Formula, for a request of priority level ``p`` on a model with ``max_batch_size`` ``B``::

        short request:  score = ((ahead + 1) / B + busy_weight * [model_in_flight > 0]
                                 + long_weight * min(long_in_flight, 2)) / weight
        long, spread:   score = (long_weight * (long_in_flight + [spread_alone and above > 0])
                                 + (model_in_flight + 1) / B) / weight
        long, pack:     key = (opens, full, where, -class_in_flight, ±long_in_flight,
                               short_in_flight, model_in_flight, 1 / weight)

    (lexicographic; ``short_in_flight = model_in_flight - long_in_flight``; with
    ``pack_above``, a long request is packed only while the request's ``occupancy`` is at
    least that, and scored as ``spread`` below it). ``pack`` fills
    the instance that already runs long work (for a class with ``max_per_instance``: that
    class's work first) until it is ``full``, before it opens another, and opens the one with
    the fewest short requests, whose batches it would pad; held off the instances free of
    long work (``short_reserve``) with every lane instance full, the one with the least long
    work takes the overflow (``±long_in_flight``: plus then, minus otherwise). ``full``: the
    class holds its
    ``max_per_instance`` there (placement drops such instances before the policy sees them,
    and the gate, with ``spare_instances``, admits no more than the lane holds); for a class
    without a cap, ``long_in_flight >= lane_depth``; ``class_in_flight`` counts only for a
    capped class. ``opens`` (``short_reserve``): 1 for an instance free of long work while a
    held request may not open one (at most ``short_reserve`` are free), else 0. ``where`` ranks,
    for a long request of an uncapped class (``long_to_idle``), an instance with nothing of the
    model in flight 0 (while ``idle_reserve`` allows it), a quiet one 1 (``quiet_depth``: no
    long work, fewer than ``quiet_depth`` in flight, and with ``quiet_alone`` nothing of a more
    important level) and any other 2; for every other long request it is 2 everywhere. Short
    requests avoid the lane through the ``long_weight`` term, so at light load long work runs on
    one instance and the others serve short batches only (size-interval assignment); under load
    the lane grows one instance at a time.

    where ``ahead`` counts this proxy's requests of the model in flight on the instance at level
    ``<= p`` (with Triton priorities, work queued at lower levels waits behind this request, so it
    does not delay it), ``(ahead + 1) / B`` is the number of batches to wait for, and long work
    in flight may hold the instance for a batch padded to its length: the one running, and the
    one this request joins, which Triton fills with queued lower-level rows. Long work queued
    further back at a lower level does not delay it, hence at most 2 count: a deep lane
    repels short requests no more than a shallow one, and they spill onto it only when the
    instances without long work have more than ``2 x long_weight`` batches of their own.
    Ties at random.

    Why not least outstanding work: with batching, a short request's marginal cost on an instance
    already running short requests is small, and chasing the emptiest instance herds traffic
    (measured: worse than round robin). Counting batches rather than requests, and keeping short,
    important requests off instances running long work, is what pays.

    Reads ``ahead`` (falls back to ``model_in_flight``), ``above`` (``quiet_alone``),
    ``long_in_flight``, ``weight`` and the request's ``long`` and ``batch`` (with
    ``short_reserve`` also its ``free_of_long``, with ``reserve_spread`` its ``busy``).

    Source: the "shortest expected delay" rule of queueing theory (Whitt, *Deciding which queue
    to join*, 1986) applied to priority batch servers; the long-work separation follows the
    size-interval task assignment idea (SITA, Harchol-Balter et al., 1999).
    """

    reads_ahead = True
    keeps_sessions = False

    def __init__(self, params: ExpectedStartParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self.packs_long = params.long_placement == "pack"

    def busy(self, request: RouteRequest) -> bool:
        """Whether the fleet is busy enough for packing: ``occupancy`` at least
        ``pack_above`` (always without it)."""
        above = self.params.pack_above
        return above is None or request.occupancy >= above

    def packs(self, request: RouteRequest) -> bool:
        """Whether ``request`` is long work placed by ``pack`` (at this occupancy)."""
        p = self.params
        return (
            request.long
            and p.long_placement == "pack"
            and (
                self.busy(request)
                or (
                    request.class_cap is not None
                    and (
                        p.pack_capped == "always"
                        or (p.pack_capped == "backlogged" and request.class_queued > 0)
                    )
                )
            )
        )

    def holds_short(self, request: RouteRequest) -> bool:
        """Whether ``request``, packed long work (with ``reserve_spread``, an uncapped class's
        long work not packed as well), must keep off the instances free of long work
        (``short_reserve``). A class with ``max_per_instance`` is held only while the fleet
        is busy (its ``occupancy``, the busy share, at least ``pack_above``): when the more
        important classes go idle its gate lends it the spare instances, and then the busy
        share falls below that."""
        p = self.params
        free = request.free_of_long
        if not p.short_reserve or free is None or len(free) > p.short_reserve:
            return False
        if request.class_cap is not None and not self.busy(request):
            return False
        if self.packs(request):
            return True
        return (
            p.reserve_spread
            and request.long
            and request.class_cap is None
            and p.pack_above is not None
            and request.busy >= p.pack_above
        )

    def keep_off(self, request: RouteRequest) -> frozenset[str]:
        """With ``short_reserve``, a held request (:meth:`holds_short`) keeps off the instances
        free of long work, before placement's slot filter: when every lane instance is at its
        slot limit the filter would otherwise leave only those, and the long rows would open
        them (measured, docs/benchmarks.md, issue 10, thirty-third round)."""
        free = request.free_of_long
        return free if free is not None and self.holds_short(request) else frozenset()

    def to_idle(self, request: RouteRequest) -> bool:
        """Whether ``request`` is long work that ``long_to_idle`` may send to an idle instance."""
        return self.packs(request) and self.params.long_to_idle and not request.class_cap

    def key(
        self, request: RouteRequest, to_idle: bool = True
    ) -> Callable[[Candidate], tuple[float, ...]]:
        """The score of the docstring for requests like ``request`` (its ``long``, ``batch``);
        ``to_idle=False``: as if ``long_to_idle`` were off."""
        batch = max(1, request.batch)
        long_weight = self.params.long_weight
        busy_weight = self.params.busy_weight

        if self.packs(request):
            cap = request.class_cap
            depth = self.params.lane_depth or 2 * batch
            held = self.holds_short(request)
            eligible = self.to_idle(request)
            to_idle = to_idle and eligible
            quiet = self.params.quiet_depth if eligible else 0
            alone = self.params.quiet_alone

            def where(c: Candidate) -> float:
                if c.model_in_flight == 0:
                    return 0.0 if to_idle else 2.0
                if c.long_in_flight or c.model_in_flight >= quiet or (alone and c.above):
                    return 2.0
                return 1.0

            def key(c: Candidate) -> tuple[float, ...]:
                full = c.class_in_flight >= cap if cap else c.long_in_flight >= depth
                return (
                    float(held and not c.long_in_flight),
                    float(full),
                    where(c),
                    -float(c.class_in_flight if cap else 0),
                    # fill the fullest lane instance; held past the depth, even out the overflow
                    float(c.long_in_flight if full and held else -c.long_in_flight),
                    float(c.model_in_flight - c.long_in_flight),
                    float(c.model_in_flight),
                    1.0 / weight_of(c),
                )

        elif request.long:
            alone = self.params.spread_alone

            def key(c: Candidate) -> tuple[float, ...]:
                long = c.long_in_flight + (1 if alone and c.above else 0)
                score = long_weight * long + (c.model_in_flight + 1) / batch
                return (score / weight_of(c),)

        else:

            def key(c: Candidate) -> tuple[float, ...]:
                ahead = c.model_in_flight if c.ahead is None else c.ahead
                score = (
                    (ahead + 1) / batch
                    + (busy_weight if c.model_in_flight else 0.0)
                    + long_weight * min(c.long_in_flight, 2)
                )
                return (score / weight_of(c),)

        return key

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        key = self.key(request)
        reserve = self.params.idle_reserve
        if reserve and self.to_idle(request):
            keys = {c.name: key(c) for c in candidates}  # each key once, not twice
            # key = (opens, full, where, ...): idle and free to open is (0, 0, 0)
            if sum(1 for k in keys.values() if k[:3] == (0.0, 0.0, 0.0)) <= reserve:
                return pick_min(candidates, self.key(request, to_idle=False), self._rng)
            return pick_min(candidates, lambda c: keys[c.name], self._rng)
        return pick_min(candidates, key, self._rng)

    def choose_view(self, view: ModelView, request: RouteRequest) -> Candidate:
        """The minimum of a sorted index (O(log n)), one per (long, batch); the view is per
        priority level already (``ahead`` depends on it). With ``idle_reserve``, the idle
        instances (not full, nothing in flight) sort first in the ``long_to_idle`` index, so
        whether more than ``idle_reserve`` of them are at the lowest filter level is a look at
        one entry (O(1))."""
        tag: tuple[object, ...] = (
            "expected_start",
            request.long,
            max(1, request.batch),
            self.packs(request),
            self.holds_short(request),
        )
        ordering = view.ordering(tag, self.key(request))
        reserve = self.params.idle_reserve
        if reserve and self.to_idle(request):
            items = ordering.items
            first = items[0] if items else None
            spare = items[reserve] if len(items) > reserve else None
            # entry = (filter level, opens, full, where, ..., position, member)
            if first is None or spare is None or spare[:4] != (first[0], 0.0, 0.0, 0.0):
                tag = (*tag, "no_idle")
                ordering = view.ordering(tag, self.key(request, to_idle=False))
        return ordering.pick_min(self._rng)


def factory(params: Mapping[str, Any], rng: random.Random) -> ExpectedStart:
    return ExpectedStart(load_params(ExpectedStartParams, params), rng)
