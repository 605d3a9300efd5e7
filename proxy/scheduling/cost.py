"""What a request costs: estimated from its input shapes, learned per model from timings.

**Estimate.** ``cost = max over inputs of rows x longest other dimension`` (``rows`` alone for a
1-D input): the padded work one request adds to a batch on an accelerator, whose time follows
``fixed + per_unit x batch x longest sequence``. It is read from what the frontends parse
anyway: the ``shape`` arrays of the JSON header (HTTP JSON and binary tensors) and
``ModelInferRequest.inputs[].shape`` (gRPC, walked on the wire by
:func:`proxy.frontends.kserve_grpc.input_shapes`; tensor bytes are skipped).

**Long requests.** A request is *long* when its cost is at least ``long_ratio`` times the
model's typical cost (an exponentially weighted median of recent costs), or its class is capped
per instance. Placement keeps short, important requests away from instances running long work.

**Learning the curve.** :class:`CostModel` fits ``seconds = base_s + per_unit_s x cost`` per model
by exponentially weighted least squares over requests that ran alone on their instance (no
other request of the model in flight there when it was sent and when it finished: its time is
one batch of exactly itself plus the network) and over *back-to-back batches*
(:class:`BatchTimes`): under load no request runs alone, and a curve fit only on the few short
requests that did (or left over from the first seconds) loses its slope, so a padded batch of
long rows looked as cheap as a short one (measured: ``case.yaml`` x1.5, docs/benchmarks.md,
issue 10, twenty-second round). ``scheduling.cost`` in the policy file overrides the fit per
model.
"""

from __future__ import annotations

import functools
import re
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from proxy.errors import Code, ProxyError

_SHAPE = re.compile(rb'"shape"\s*:\s*\[([0-9,\s]*)\]')
_MAX_COST = 1e12


def shape_cost(shape: Sequence[int]) -> float:
    """``rows x longest other dimension`` of one input (``rows`` for a 1-D input)."""
    if not shape:
        return 1.0
    rows = max(1, shape[0])
    longest = max(shape[1:], default=0)
    return float(rows * longest) if longest > 0 else float(rows)


def cost_of(shapes: Sequence[Sequence[int]]) -> float:
    """The request's cost: the largest of its inputs' (1 without a readable shape)."""
    if not shapes:
        return 1.0
    return min(_MAX_COST, max(map(shape_cost, shapes)))


def rows_of(shapes: Sequence[Sequence[int]]) -> int:
    """The rows (first dimension) of the costliest input: with :func:`cost_of`, ``cost / rows``
    is the length a batch the request joins is padded to (1 without a readable shape)."""
    if not shapes:
        return 1
    costliest = max(shapes, key=shape_cost)
    return max(1, costliest[0]) if costliest else 1


def http_shapes(json_header: bytes) -> list[tuple[int, ...]]:
    """The ``shape`` arrays of an HTTP JSON header, as far as a scan can read them.

    A regular expression, not a JSON parse: a header may carry megabytes of JSON tensor data,
    and inside a JSON string a quote is escaped, so ``"shape"`` only matches a real key.
    """
    return [
        _memo_dims(text) if len(text) <= _MEMO_DIMS_BYTES else _dims(text)
        for text in (m.group(1) for m in _SHAPE.finditer(json_header))
    ]


_MEMO_DIMS_BYTES = 64
"""Longest shape text memoised: the memo holds client bytes, so 1024 entries of at most this
(a shape of any real tensor is a few dozen bytes); longer ones are read each time."""


def _dims(text: bytes) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(b",") if d.strip())


# Memoised: a client sends the same few shapes over and over, and reading one took a list
# comprehension and two calls per dimension (cProfile, session 17).
_memo_dims = functools.lru_cache(maxsize=1024)(_dims)


def check_shapes(shapes: Sequence[Sequence[int]], nbytes: int) -> None:
    """Refuse (400) an input whose shape holds more elements than a ``nbytes`` request can.

    Every element of a tensor takes at least one byte of the request (a JSON value, a binary
    element, a protobuf field), so no valid request declares more elements than it has bytes.
    Triton 2.51 allocates from the declared shape before it checks the data and dies with
    ``std::bad_alloc`` on a huge one (found by the fuzz suite through the proxy): one client's
    request would take a whole server down.
    """
    for shape in shapes:
        elements = 1
        for dim in shape:
            elements *= max(dim, 0)
            if elements > nbytes:
                shown = list(shape) if len(shape) <= 8 else [*shape[:8], "..."]
                raise ProxyError(
                    Code.INVALID_ARG,
                    f"input shape {shown} holds more elements than a request of {nbytes} "
                    "bytes can carry; triton-proxy refuses it before it reaches Triton",
                )


@dataclass(frozen=True)
class CostOverride:
    """A model's cost curve, set by the operator instead of learned: one batch of ``units``
    (rows x longest dimension, padded) takes ``base_ms + per_unit_us x units`` inside Triton,
    the queue delay and the network included (what the proxy times for a request alone)."""

    base_ms: float
    per_unit_us: float

    def __post_init__(self) -> None:
        if self.base_ms < 0 or self.per_unit_us < 0:
            raise ValueError("base_ms and per_unit_us must be >= 0")


@dataclass
class _Fit:
    """Exponentially weighted sums for a least-squares line through (cost, seconds)."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    typical: float = 0.0
    """Exponentially weighted median of costs (stochastic approximation)."""
    samples: int = 0
    first: list[tuple[float, float]] | None = field(default_factory=list)
    """The first :data:`SEED` timings, held until the fit starts (None from then)."""

    def add(self, cost: float, seconds: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.x = self.x * decay + cost
        self.y = self.y * decay + seconds
        self.xx = self.xx * decay + cost * cost
        self.xy = self.xy * decay + cost * seconds
        self.samples += 1


CLIP = 3.0
"""A timed batch counts as at most this many times the curve's expectation, and at least
its fraction."""
SEED = 10
"""Timings a model's fit waits for before it gives a curve."""


PAIR_SPREAD = 0.25
""":func:`theil_sen` takes a slope only from two points whose ``x`` differ by more than this
share of the larger: closer sizes are one size to it. Why: a batch of 15 rows (7,500 units)
among nine of 16 (8,000) gave slopes of 2.6-4.6e-5 s per unit from the timing noise alone,
15-20x accel_sim's 2e-6; seeded so, the clipped fit never came back within the test's two
dozen batches (CI, session 44: ``test_the_cost_curve_is_learned_from_back_to_back_batches``
learned ``(0.178, 0.0)``; the same test failed in session 38 at a slope of 1.46e-6, put
down to a stall then)."""


def theil_sen(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(base, slope)`` of the Theil-Sen line through ``points``: the median slope over pairs
    whose ``x`` differ by more than :data:`PAIR_SPREAD` of the larger (0 when there are none;
    never below 0), then the median intercept. A few points far off (under ~29 %) do not
    move it."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if abs(x2 - x1) > PAIR_SPREAD * max(abs(x1), abs(x2))
    ]
    slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return max(0.0, statistics.median(y - slope * x for x, y in points)), slope


@dataclass
class CostModel:
    """Per model: the typical cost of its requests and its service-time curve.

    ``observe_cost`` sees every request (for the long threshold); ``observe_batch`` sees
    timed batches (for the curve): a request that ran alone (a batch of itself) or a batch
    :class:`BatchTimes` timed. Pure: no clock, no I/O.
    """

    long_ratio: float = 4.0
    decay: float = 0.99
    """Weight kept by past samples per new one (about the last 100 count)."""
    overrides: dict[str, CostOverride] = field(default_factory=dict)
    _fits: dict[str, _Fit] = field(default_factory=dict)
    _curves: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    """:meth:`curve`'s answers until the model's next timing: the same tuple object each time,
    so a reader can keep what it derived from it while ``is`` says it is the same."""

    def _fit(self, model: str, cost: float) -> _Fit:
        fit = self._fits.get(model)
        if fit is None:
            # Not ``setdefault``: that built a new _Fit on every call (twice per request).
            fit = self._fits[model] = _Fit(typical=cost)
        return fit

    def set_overrides(self, overrides: Mapping[str, CostOverride]) -> None:
        """Adopt the policy file's curves (``scheduling.cost.models``), e.g. on a reload."""
        self.overrides = dict(overrides)
        self._curves.clear()

    def observe_cost(self, model: str, cost: float) -> None:
        fit = self._fit(model, cost)
        # Median tracking: step towards the sample by a fraction of the current estimate.
        step = 0.05 * max(fit.typical, 1.0)
        fit.typical += step if cost > fit.typical else -step if cost < fit.typical else 0.0
        fit.typical = max(fit.typical, 1.0)

    def is_long(self, model: str, cost: float) -> bool:
        fit = self._fits.get(model)
        return fit is not None and cost >= self.long_ratio * fit.typical

    def observe_batch(self, model: str, cost: float, seconds: float) -> None:
        """A batch of ``cost`` padded units took ``seconds`` (queue delay included).

        Once the model has a curve, a sample counts as at most :data:`CLIP` times what the
        curve expects, and at least that fraction of it: what spoils a timing (a batcher
        stall of 500 ms, a batch split by a busy proxy, :class:`BatchTimes`) is far off, and
        one such sample moved a least-squares line for the next hundred. A curve that is
        truly wrong still moves: each sample pulls it up to that factor (the fit's own curve,
        not an override's, so a reload that drops the override finds the fit unbent by
        it). The fit starts from the :func:`theil_sen` line of the first :data:`SEED`
        timings (each enters at its cost, on that line): a stall among them has no curve to
        be clipped against (measured in CI: a 500 ms batch among the first ten left the
        least-squares slope at 0.8 of accel_sim's 2 us per unit)."""
        fit = self._fit(model, cost)
        self._curves.pop(model, None)
        if fit.first is not None:
            fit.first.append((cost, seconds))
            if len(fit.first) < SEED:
                return
            base, slope = theil_sen(fit.first)
            for x, _ in fit.first:
                fit.add(x, base + slope * x, self.decay)
            fit.first = None
            return
        fitted = self._fitted(model)
        if fitted is not None:
            seconds = _clip(seconds, fitted[0] + fitted[1] * cost)
        fit.add(cost, seconds, self.decay)

    def curve(self, model: str) -> tuple[float, float] | None:
        """``(base_s, per_unit_s)`` for ``model``, or None before enough samples."""
        try:
            return self._curves[model]
        except KeyError:
            curve = self._curves[model] = self._compute_curve(model)
            return curve

    def _compute_curve(self, model: str) -> tuple[float, float] | None:
        override = self.overrides.get(model)
        if override is not None:
            return override.base_ms / 1e3, override.per_unit_us / 1e6
        return self._fitted(model)

    def _fitted(self, model: str) -> tuple[float, float] | None:
        fit = self._fits.get(model)
        if fit is None or fit.samples < SEED or fit.w <= 0:
            return None
        mean_x, mean_y = fit.x / fit.w, fit.y / fit.w
        var = fit.xx / fit.w - mean_x * mean_x
        if var <= 1e-12 * max(1.0, mean_x * mean_x):
            return max(0.0, mean_y), 0.0  # one size seen so far: a flat line through it
        slope = max(0.0, (fit.xy / fit.w - mean_x * mean_y) / var)
        return max(0.0, mean_y - slope * mean_x), slope

    def batch_seconds(self, model: str, batch: int) -> float | None:
        """Expected time of a full batch of ``batch`` typical requests (padding to the
        typical cost), or None when the curve is unknown."""
        fit = self._fits.get(model)
        if fit is None:
            return None
        return self.seconds(model, max(1, batch) * fit.typical)

    def seconds(self, model: str, cost: float) -> float | None:
        """Expected service time of a batch of this one request, or None when unknown."""
        curve = self.curve(model)
        return None if curve is None else curve[0] + curve[1] * cost


def _clip(seconds: float, expected: float) -> float:
    if expected <= 0:
        return seconds
    return min(max(seconds, expected / CLIP), CLIP * expected)


GROUP_S = 0.001
"""Answers of one instance and model that come back within this of the one before are one
batch: Triton answers a batch's requests together, and the proxy handles them one after
another (16 answers took 3-5 ms end to end in the integration test, so a window from the first
answer split batches)."""
MIN_BATCH_S = 4 * GROUP_S
"""Back-to-back batches shorter than this are not timed: the grouping cannot tell them
apart. Such models are fit on requests that ran alone."""
MAX_KEYS = 4096
"""Instances x models timed at once; past it the first key timed is forgotten (instances
that left the fleet keep no entry for ever)."""


@dataclass(slots=True)
class _Group:
    """The answers of one batch so far."""

    first: float
    """When its first answer came."""
    last: float
    """When its latest answer came."""
    prev: float
    """When the batch before it first answered: the model instance was free from then
    (``-inf``: no batch before it seen, so nothing in it counts as queued)."""
    rows: int
    longest: float
    queued: bool
    """Every request in it had waited out the queue delay before ``prev``, so the batch
    started at ``prev`` (the batcher had no reason to wait)."""


class BatchTimes:
    """Times batches that ran back to back, from the answers of requests in flight.

    Triton answers a batch's requests together, so answers of an instance and model that
    come at most :data:`GROUP_S` after the one before are one batch, as are stragglers a
    busy proxy handled later and no answer past ``max_batch_size`` rows (:func:`_joins`):
    ``rows`` summed, ``longest`` the most units per row among them. When every request of a
    batch was sent at least the model's ``max_queue_delay`` before the previous batch
    answered, it was queued and ready then, and the batch started when the previous one
    ended: its time is the gap between the two batches' first answers, and its units are
    ``rows x longest`` (padded). A sample is given back when the batch after it starts
    (:meth:`answered`) and fed to the same fit as a request that ran alone
    (:meth:`CostModel.observe_batch`), with the queue delay added (a request alone waits it;
    its network time, a fraction of a millisecond, is not added).

    What breaks a sample: another client of the same Triton (or another proxy replica)
    running batches in between, a model with more than one model instance (two batches run at
    once: the caller does not time those), answers of one batch handled further apart than
    :func:`_joins` allows (the part answered first is timed as the whole batch with fewer
    rows: too slow for its units; the rest is timed from it: too fast), a batch shorter than
    :data:`MIN_BATCH_S` (skipped), and Triton's batcher stall (``proxy.routing.wake``: a ready
    batch that waits for the next arrival is timed too long). :meth:`CostModel.observe_batch`
    bounds how far one slow sample moves the curve.
    Pure: the caller passes the clock readings. Holds one group per key (instance and model),
    at most :data:`MAX_KEYS`.
    """

    def __init__(self) -> None:
        self._groups: dict[Hashable, _Group] = {}

    def answered(
        self,
        key: Hashable,
        at: float,
        sent_at: float,
        rows: int,
        cost: float,
        delay_s: float,
        max_batch: int,
    ) -> tuple[float, float] | None:
        """A request of ``rows`` and ``cost`` sent at ``sent_at`` answered at ``at`` on
        ``key``, a model whose batches hold at most ``max_batch`` rows.
        Returns ``(units, seconds)`` of the batch before it when this answer starts a new
        batch and that one ran back to back, else None."""
        longest = cost / max(1, rows)
        group = self._groups.get(key)
        if group is not None and _joins(group, at, sent_at, rows, delay_s, max_batch):
            group.last = at
            group.rows += rows
            group.longest = max(group.longest, longest)
            group.queued = group.queued and sent_at + delay_s <= group.prev
            return None
        sample = None
        prev = float("-inf")
        if group is not None:
            prev = group.first
            seconds = group.first - group.prev
            if group.queued and seconds >= MIN_BATCH_S:
                sample = (group.rows * group.longest, seconds + delay_s)
        queued = sent_at + delay_s <= prev
        if group is None and len(self._groups) >= MAX_KEYS:
            del self._groups[next(iter(self._groups))]
        self._groups[key] = _Group(at, at, prev, rows, longest, queued)
        return sample


def _joins(
    group: _Group, at: float, sent_at: float, rows: int, delay_s: float, max_batch: int
) -> bool:
    """Whether an answer belongs to ``group``'s batch.

    Never when its rows would make the batch larger than the model's ``max_batch_size``.
    Yes when it came within :data:`GROUP_S` of the answer before. Also, later (a *straggler*:
    a busy proxy handled the answers of one batch over several milliseconds), when the batch
    was timed back to back, this request was ready when that batch began, the batch had room
    for it (Triton's batcher takes every ready request up to ``max_batch_size``) and the
    answer came within half the batch's time (at least :data:`MIN_BATCH_S`) of its first
    answer: then it was in that batch. (A process that shares its cores with a busy one is
    descheduled for several milliseconds at a time: a 21 ms batch handled as 1 row, then 15
    rows 6.6 ms later, was measured so with a busy loop beside the integration test on 2
    cores.) What this rule gets wrong: a model whose batcher cuts batches short of room
    (``preferred_batch_size``, or inputs of unequal shapes that are not ragged) and whose
    next batch is shorter than half the one before: that batch's rows count in the one
    before.
    """
    if group.rows + rows > max_batch:
        return False
    if at - group.last <= GROUP_S:
        return True
    window = max(MIN_BATCH_S, (group.first - group.prev) / 2)
    return group.queued and sent_at + delay_s <= group.prev and at - group.first < window
