"""How busy the fleet is for each model: the smoothed share of its instances with work in
flight (*occupancy*), which lets a policy change its placement with the load.

Why: a long lane (``expected_start`` with ``long_placement: pack``) pays when the fleet is
busy, where it keeps long work from padding every instance's short batches, and costs when it
is not: on a lightly loaded fleet, round robin's long requests start at once wherever they
land, while the lane's wait for the lane (issue 10: online's P99 1.4-1.7x the best baseline's
at a quarter and half of three servers' capacity, and on six servers the lane lost on every
class below capacity; docs/benchmarks.md, fifteenth and sixteenth rounds).
``ExpectedStartParams.pack_above`` packs only while the occupancy is at least its value.

The measure is the proxy's own: at every sample, the share of the healthy instances serving
the model that have at least one of the proxy's requests of it in flight (queued in Triton or
running), smoothed by an exponential moving average with time constant ``tau_s``. It counts
whatever holds an instance, so it is near 1 at the fleet's capacity whatever the batches
look like, and it does not depend on where placement put the work (every instance counts
the same). A model at the fleet's limit now is *saturated* (``ModelGates.saturated``: a
request of a class without a per-instance cap waits at the gate, or a full batch is in flight
per instance): its occupancy is 1 at once, and decays from there with ``tau_s`` once it is
not. Why: a surge from idle to twice capacity took the average about 5 s to reach 0.9, and
in those seconds ``expected_finish`` (``pack_above: 0.9``) spread online's long rows onto
every instance; Triton's queues filled with padded mixed batches (55 queued per instance),
every instance then held more long work than a lane's depth, so packing found no lane and
kept spreading, and the fleet never came back (``long_share.yaml`` x2: real-time 89-92 %
within its SLO, online 0 %, offline nothing; packing from the first request held 100 % /
100 %). Neither a hysteresis on the average (keep packing down to 0.6) nor the gate's wait
alone (it comes only once all 64 slots per instance are taken, 0.5-1 s in) nor 32 slots
or adaptive concurrency changed that; a batch in flight per instance comes within about
0.25 s, and with it the same arm held (100 % / 100 %, offline 286 per window;
docs/benchmarks.md, twenty-third round). It is sampled by the runtime's periodic scan
(``SAMPLE_S``), never on the request path. Each worker of ``serve --workers N`` sees only its
own requests: the share it measures is that of the instances holding *its* work, a lower
bound of the fleet's.

With ``routing.occupancy_depth`` (0.25 in the class default, 0 where a file names a policy)
the same scan also keeps each model's *fill* at that depth (``Fleet.fills``, one table per
depth an arm uses; :func:`busy_shares` with a depth): the mean of its requests in flight per
instance over that share of ``max_batch_size``, at most 1, averaged and saturated alike. An
SLO class's long work packs by it (``Fleet.occupancy_for``): the busy share says whether
instances have anything to run, not whether batches form, and on six servers at half their
capacity it hovered at 0.9 with batches of 1.4 rows (docs/benchmarks.md, issue 10,
thirty-seventh round). With ``routing.fill_from_load`` as well, the fill decides only while
that long work is heavy: its *long load* (:class:`LongLoad`), the device time its requests
would take in full batches per second, is at least that many instances' worth; below, the
busy share decides as without the fill. Why: the lane holds an uncapped class's long work on
one instance until it is ``lane_depth`` deep, which is right while one instance runs it all
and wrong once it cannot (six servers: online's 512-token rows needed 0.9 of an instance,
the lane filled to 32 and ran them in 15-row batches), and replaying that long work where it
finishes soonest, which the fill does there, pads real-time's batches where the lane would
have kept it away (three servers at their FIFO capacity: online's long rows needed 0.1 of an
instance; docs/benchmarks.md, issue 10, thirty-eighth round).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.fleet.instances import Instance

TAU_S = 2.0
"""Time constant of the average: a step in load shows after about ``TAU_S`` (63 %), so one
burst of a few hundred milliseconds does not flip placement, and a sustained change does
within seconds."""

SAMPLE_S = 0.1
"""How often the runtime samples the fleet (a scan over every instance: 100 ms keeps it
under 1 % of a core at 1,000 instances)."""


@dataclass(frozen=True, slots=True)
class FillRule:
    """When one arm's uncapped classes read the fill (``Fleet.occupancy_for``): its
    ``routing.occupancy_depth`` (``depth``; 0: never) and ``routing.fill_from_load``
    (``from_load``; 0: whatever the long load). Each arm of a canary rollout has its own, so a
    canary can trial another rule; the fleet keeps one fill table per depth in use."""

    depth: float = 0.0
    from_load: float = 0.0


NO_FILL = FillRule()


def busy_shares(
    instances: Iterable[Instance], depth: Callable[[str], int] | None = None
) -> dict[str, float]:
    """model -> how busy the instances serving it (healthy, the model not out there) are,
    for every model with anything in flight: without ``depth``, the share of them that have
    some of it in flight; with it, the mean of their requests of it in flight over
    ``depth(model)`` (at least 1), at most 1."""
    pool = list(instances)
    held: dict[str, int] = {}
    for inst in pool:
        for model, n in inst.model_in_flight.items():
            if n > 0 and inst.serves(model):
                held[model] = held.get(model, 0) + (n if depth is not None else 1)
    out = {}
    for model, n in held.items():
        # A busy instance serves the model, so the count of those serving it is at least 1.
        serving = sum(1 for i in pool if i.serves(model))
        out[model] = n / serving if depth is None else min(1.0, n / serving / max(1, depth(model)))
    return out


def long_free(instances: Iterable[Instance]) -> dict[str, frozenset[str]]:
    """model -> the instances serving it that have none of its long work in flight
    (``Instance.long_in_flight``), for every model with long work in flight somewhere: what
    ``ExpectedStartParams.short_reserve`` reads (``RouteRequest.free_of_long``). Sampled with
    the busy shares, never on the request path."""
    pool = list(instances)
    held = {m for i in pool for m, n in i.long_in_flight.items() if n > 0 and i.serves(m)}
    return {
        model: frozenset(
            i.name for i in pool if i.serves(model) and not i.long_in_flight.get(model)
        )
        for model in held
    }


class Occupancy:
    """The smoothed busy share per model (module doc). ``sample`` folds in one scan's
    shares; a model missing from a scan counts as 0 there (nothing in flight), and one that
    has decayed below ``1e-4`` is forgotten, so the table holds only models in use (and
    stays bounded by them, whatever clients send: a model reaches it only once requests of
    it are in flight on an instance)."""

    def __init__(self, tau_s: float = TAU_S) -> None:
        if not tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = tau_s
        self.values: dict[str, float] = {}
        self._at: float | None = None

    def sample(self, shares: dict[str, float], now: float, saturated: Collection[str] = ()) -> None:
        """Fold in the busy shares seen at clock time ``now``: ``v += a * (share - v)`` with
        ``a = 1 - exp(-dt / tau_s)``, ``dt`` since the previous sample (a model not seen
        before starts from 0); a ``saturated`` model's value is 1 (module doc)."""
        dt = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        a = 1.0 - math.exp(-dt / self.tau_s)
        values = self.values
        for model in values.keys() | shares.keys() | set(saturated):
            share = shares.get(model, 0.0)
            if model in saturated:
                v = 1.0
            else:
                v = values.get(model, 0.0)
                v += a * (share - v)
            if v < 1e-4 and not share:
                values.pop(model, None)
            else:
                values[model] = v

    def get(self, model: str) -> float:
        return self.values.get(model, 0.0)


class LongLoad:
    """Each model's *long load*: the device time per second that the long requests of
    classes without ``max_per_instance`` dispatched to it would take in full batches, in
    instances' worth (1.0: one instance busy all the time), smoothed as :class:`Occupancy`
    is (module doc).

    A request's share is ``base_s x rows / max_batch + per_unit_s x cost`` on the model's
    learned cost curve (:class:`proxy.routing.batcher.BatcherModel`): its rows' part of a
    full batch's fixed time plus its padded units (``cost``: rows x longest dimension).
    :meth:`add` is the request path's part (one dict update for such a request);
    :meth:`sample` divides by the time since the previous sample, times ``scale`` (the
    worker count: each worker sees its share), and folds it into the average. Models are as
    bounded as the occupancy's: a model reaches the table only once a request of it was
    placed, and leaves it once decayed."""

    def __init__(self, tau_s: float = TAU_S) -> None:
        self.rates = Occupancy(tau_s)
        self.pending: dict[str, float] = {}
        self._at: float | None = None

    def add(self, model: str, seconds: float) -> None:
        pending = self.pending
        pending[model] = pending.get(model, 0.0) + seconds

    def sample(self, now: float, scale: float = 1.0) -> None:
        pending, self.pending = self.pending, {}
        dt = None if self._at is None else now - self._at
        self._at = now
        if dt is None or dt <= 0:
            return  # the first sample only starts the clock (what came before has no span)
        self.rates.sample({m: s * scale / dt for m, s in pending.items()}, now)

    def get(self, model: str) -> float:
        return self.rates.get(model)
