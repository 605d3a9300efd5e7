"""The policy file's ``scheduling:`` section: request classes, dispatch order, quotas, API keys.

Load it with ``strict.load(SchedulingConfig, data, "scheduling", source)`` (or
:func:`load_scheduling`); every check below runs at load time and fails with the file and the
path inside it. Omitting the section gives three classes::

    scheduling:
      default_class: online
      dispatch: strict_aging            # or weighted_round_robin
      aging: {step_s: 1.0}              # strict_aging: one rank level gained per step_s waited
      max_queued_total: null            # global queue bound; over it, the lowest classes shed
      retry_after_s: 1.0                # Retry-After sent with every shed
      overload: null                    # {lag_ms: 20}: while the proxy's own event loop
                                        # lags, refuse the least important classes first
      concurrency: null                 # per-instance dispatch slots; null = derived
      slot_sharing: null                # shared: one pool; by_rank: a class counts only the
                                        # slots held by classes at least as important as
                                        # itself; placed_by_rank: one pool at the gate, by
                                        # rank in placement; null: placed_by_rank where the
                                        # model's routing packs long work and it has
                                        # priority levels, else shared
      starved_after_s: 2.0              # a min_share class owes this many seconds of its
                                        # share of device time: its next requests go at the
                                        # top class's priority, as many as pay the debt
      throughput_lane: true             # classes without an SLO, below one with it: a long
                                        # lane per model (SchedulingConfig.throughput_lane)
      class_header: x-triton-proxy-class
      api_key_header: authorization     # "Authorization: Bearer <key>"; other names: raw value
      api_keys:
        "sha256:9f86d0...":             # sha256 hex of the key, or the key itself
          class_name: realtime
          allow_class_header: true      # this key may pick any class with class_header
      classes:
        realtime: {rank: 0, triton_priority: 1, slo_p99_ms: 100, min_share: 0.2,
                   max_queue: 200, queue_timeout_s: 2, weight: 6}
        online:   {rank: 1, triton_priority: 2, slo_p99_ms: 500, min_share: 0.1,
                   max_queue: 1000, queue_timeout_s: 10, weight: 3}
        offline:  {rank: 2, triton_priority: 3, max_share: 0.5, min_share: 0.05,
                   max_queue: 5000, queue_timeout_s: 120, weight: 1}

``classes`` replaces the default set as a whole; ``default_class`` must name one of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from proxy import strict
from proxy.control.concurrency import AdaptiveConcurrencyConfig
from proxy.scheduling.cost import CostOverride
from proxy.strict import mask_secret

DispatchMode = Literal["strict_aging", "weighted_round_robin"]
SlotSharing = Literal["shared", "by_rank", "placed_by_rank"]
LateBy = Literal["mean", "tail"]

HASHED_KEY_PREFIX = "sha256:"
"""An ``api_keys`` entry starting with this holds the key's SHA-256 hex digest, not the key."""

_CLASS_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # also a header value and a metric label
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # RFC 9110 token


@dataclass(frozen=True)
class ClassConfig:
    """One request class. Lower ``rank`` is more important (0 = most)."""

    rank: int
    triton_priority: int = 0
    """Triton dynamic-batcher priority level set on forwarded requests (1 = highest); 0 = unset.
    See :meth:`SchedulingConfig.triton_priority_for`."""
    slo_p99_ms: float | None = None
    """Latency objective; read by the SLO controllers, not by the queues."""
    max_concurrency: int | None = None
    """Hard cap on this class's requests in flight, whatever the capacity."""
    max_per_instance: int | None = None
    """At most this many of the class's requests in flight on any one instance (placement
    spreads them). Keeps long, low-priority work from padding the batches of every instance:
    e.g. 1 for an offline class of long requests. With ``spare_instances`` it is the depth of
    the class's work on each instance of its lane instead (see there)."""
    spare_instances: int = 0
    """Instances kept free of this class (a *long lane*): the gate admits at most
    ``max_per_instance x (healthy instances - spare_instances)`` of the class (never below
    ``max_per_instance``), and placement (``expected_start``) packs the class onto instances
    that already run it before it opens another, so short, more important work has
    ``spare_instances`` instances whose batches this class never pads. Needs
    ``max_per_instance``. The spares are lent to the class while every more important class
    has been idle (nothing queued, nothing in flight, no arrival) for ``spare_idle_s``: with
    nobody to keep them for, they would only idle while the class's queue grows."""
    spare_fraction: float = 0.0
    """At least this fraction of the healthy instances (rounded down) kept spare, with
    ``spare_instances`` the minimum: a lane that keeps the same share of a larger fleet free
    of the class's long work. The derived lane (:attr:`SchedulingConfig.throughput_lane`)
    keeps a third (one spare of three servers, two of six): on six servers one spare left
    real-time at 0.75x the best baseline's P99 at 1.5x ``burst.yaml``'s capacity, two gave
    0.20x of the one-spare figure (49 against 240 ms) with offline completing as much
    (docs/benchmarks.md, thirty-fifth round)."""
    shallow_per_instance: int | None = None
    """With ``max_per_instance``: the depth while the class's queue moves. At most this many
    of its requests are in flight per instance while the oldest one queued has waited less
    than ``deepen_after_s``; ``max_per_instance`` while it has waited longer (the class is
    not keeping up). Triton fills a batch from what is queued, so a shallow lane runs small
    batches of the class: a more important long request that lands there waits for a small
    batch and runs in one (issue 10's case at x1, fixed depth 2 against 8: online's P99
    175 -> 92 ms, offline completions 502 -> 497 per 10 s). A backlog gets the full depth
    back, where full batches pay (fixed depth 2 lost 31-45 % of offline's completions at
    1.5x and 2x the FIFO capacity)."""
    deepen_after_s: float = 1.0
    """How long the class's oldest queued request may wait before its lane returns to
    ``max_per_instance`` (with ``shallow_per_instance``)."""
    spare_idle_s: float = 1.0
    """How long the more important classes must have been idle before the class may use its
    ``spare_instances`` too."""
    spare_per_instance: int = 0
    """Requests of the class each spare instance may hold while the spares are kept for the
    more important classes and the class is not keeping up (its oldest queued request has
    waited ``deepen_after_s``); 0: none. The gate admits this many more per spare than the
    lane's instances hold, and placement, which fills the instances already running the
    class before it opens another, leaves them on the instance running the least of it, so
    while the lane's instances are full one instance per spare holds at most this many of
    the class (never more than the lane's depth). For a class of small requests whose
    throughput matters: a spare kept whole for a real-time class that uses a few percent of
    it idles while the class's queue grows. Only behind a backlog because lending costs the
    classes above their tail wherever it happens: measured (docs/benchmarks.md, issue 10,
    forty-seventh round), lent at any time it won nothing at ``case.yaml`` x1 (offline kept
    up without it) and doubled real-time's P99; on ``one_row_job.yaml``, whose offline is
    always behind, 1 / 2 / 4 lent gave offline +18-20 / +25-29 / +34-41 % of its
    completions at x1-x2 for real-time P99s of 30-39 / 59-63 / 70-72 ms against 15-26 (SLO
    100 ms); on ``burst.yaml``, whose offline drains each burst anyway, 1 lent doubled
    real-time's P99 at x1 (within its SLO) for no more completions: off by default. Acts
    only on a lane (``spare_instances``, ``spare_fraction`` or the derived lane)."""
    min_share: float = 0.0
    """Fraction of capacity reserved while this class has work waiting: others cannot take the
    last ``floor(min_share * capacity)`` slots it is short of."""
    max_share: float = 1.0
    """This class never holds more than ``max(1, floor(max_share * capacity))`` slots."""
    max_queue: int = 1000
    """Queue length cap; a request arriving at a full queue is shed (``queue_full``)."""
    queue_timeout_s: float | None = 30.0
    """A request still queued after this long is shed (``timeout``); null = wait for ever."""
    weight: int = 1
    """Share of dispatches under ``weighted_round_robin``."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0 = most important), got {self.rank}")
        if self.triton_priority < 0:
            raise ValueError(
                f"triton_priority must be >= 0 (1 = highest, 0 = unset), got {self.triton_priority}"
            )
        if self.slo_p99_ms is not None and self.slo_p99_ms <= 0:
            raise ValueError(f"slo_p99_ms must be > 0, got {self.slo_p99_ms}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or null, got {self.max_concurrency}")
        if self.max_per_instance is not None and self.max_per_instance < 1:
            raise ValueError(f"max_per_instance must be >= 1 or null, got {self.max_per_instance}")
        if self.spare_instances < 0:
            raise ValueError(f"spare_instances must be >= 0, got {self.spare_instances}")
        if self.spare_idle_s < 0:
            raise ValueError(f"spare_idle_s must be >= 0, got {self.spare_idle_s}")
        if self.spare_per_instance < 0:
            raise ValueError(f"spare_per_instance must be >= 0, got {self.spare_per_instance}")
        if self.spare_instances and self.max_per_instance is None:
            raise ValueError("spare_instances needs max_per_instance (the lane's depth)")
        if not 0.0 <= self.spare_fraction < 1.0:
            raise ValueError(f"spare_fraction must be within [0, 1), got {self.spare_fraction}")
        if self.spare_fraction and self.max_per_instance is None:
            raise ValueError("spare_fraction needs max_per_instance (the lane's depth)")
        if not self.deepen_after_s > 0:
            raise ValueError(f"deepen_after_s must be > 0, got {self.deepen_after_s}")
        if self.shallow_per_instance is not None:
            if self.max_per_instance is None:
                raise ValueError("shallow_per_instance needs max_per_instance (the full depth)")
            if not 1 <= self.shallow_per_instance <= self.max_per_instance:
                raise ValueError(
                    "shallow_per_instance must be between 1 and max_per_instance "
                    f"({self.max_per_instance}), got {self.shallow_per_instance}"
                )
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share must be within [0, 1], got {self.min_share}")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(
                f"max_share must be within (0, 1] (0 would starve the class), got {self.max_share}"
            )
        if self.min_share > self.max_share:
            raise ValueError(
                f"min_share ({self.min_share}) must not exceed max_share ({self.max_share})"
            )
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0 or null, got {self.queue_timeout_s}")
        if self.weight < 1:
            raise ValueError(f"weight must be >= 1, got {self.weight}")

    def spares(self, instances: int) -> int:
        """Instances kept free of the class out of ``instances``: ``spare_instances``, or
        ``spare_fraction`` of them (rounded down) where that is more."""
        return max(self.spare_instances, math.floor(self.spare_fraction * instances + 1e-9))

    def lane(self, instances: int, spare: bool = True) -> int:
        """The instances the class may run on: all but :meth:`spares` (at least one), or
        all of them when the spares are lent (``spare=False``)."""
        return max(1, instances - self.spares(instances)) if spare else instances

    def behind(self, waited_s: float | None) -> bool:
        """Whether the class is not keeping up: its oldest queued request has waited
        ``waited_s`` (None: nothing queued), at least ``deepen_after_s``."""
        return waited_s is not None and waited_s >= self.deepen_after_s

    def depth(self, waited_s: float | None = None) -> int | None:
        """Requests of the class in flight per instance now, its oldest queued request having
        waited ``waited_s`` (None: nothing queued): ``shallow_per_instance`` until that
        reaches ``deepen_after_s``, then ``max_per_instance`` (None: no per-instance cap)."""
        full = self.max_per_instance
        if full is None or self.shallow_per_instance is None:
            return full
        return full if self.behind(waited_s) else self.shallow_per_instance

    def share_limit(
        self,
        capacity: int,
        instances: int = 1,
        scale: float = 1.0,
        spare: bool = True,
        waited_s: float | None = None,
    ) -> int:
        """Most slots this class may hold out of ``capacity`` over ``instances`` healthy
        instances (max_share, max_concurrency, and the per-instance depth (:meth:`depth`, the
        oldest queued request having waited ``waited_s``) over the instances of the class's
        lane (:meth:`lane`)).

        Never below 1 while there is any capacity, so a small fleet cannot round a class to 0.
        ``scale`` (the class-limit loop's factor, <= 1) multiplies ``max_share`` but never takes
        the limit below the class's ``min_share`` reservation. ``spare=False``: the spare
        instances are lent to the class (see ``spare_instances``).
        """
        limit = capacity
        share = self.max_share * scale
        if share < 1.0:
            limit = max(1, math.floor(share * capacity + 1e-9))
            if scale < 1.0:
                limit = max(limit, math.floor(self.min_share * capacity + 1e-9))
        if self.max_concurrency is not None:
            limit = min(limit, self.max_concurrency)
        lane = self.lane(instances, spare)
        depth = self.depth(waited_s)
        if depth is not None:
            held = depth * lane
            if self.behind(waited_s):
                held += min(depth, self.spare_per_instance) * (instances - lane)
            limit = min(limit, max(1, held))
        return limit

    def reserved(self, capacity: int, instances: int = 1, waited_s: float | None = None) -> int:
        """Slots guaranteed to this class while it has work waiting (``min_share``)."""
        return min(
            math.floor(self.min_share * capacity + 1e-9),
            self.share_limit(capacity, instances, waited_s=waited_s),
        )


@dataclass(frozen=True)
class OverloadConfig:
    """``scheduling.overload``: refuse the lowest classes while the proxy's own event loop
    lags (:mod:`proxy.scheduling.overload`)."""

    lag_ms: float = 20.0
    """Mean lag of the event loop over a step above which the pressure rises (ms)."""
    step_s: float = 0.5
    """How often the pressure moves."""
    up: float = 0.25
    """Pressure added per step above ``lag_ms``."""
    down: float = 0.1
    """Pressure taken away per step below half of ``lag_ms``."""

    def __post_init__(self) -> None:
        for name in ("lag_ms", "step_s", "up", "down"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class AgingConfig:
    """Anti-starvation for ``strict_aging``.

    A request's effective rank is ``max(floor_rank, rank - floor(waited / step_s))`` where
    ``floor_rank`` is 0 for the most important class and 1 for every other one: aging lets a
    lower class catch up with the others, but never outrank the top class. What keeps the
    lowest classes from starving under overload is their ``min_share`` reservation. The queue
    heads are
    served in order of (effective rank, arrival time). A request of rank ``r`` that arrives at
    ``t0`` therefore has effective rank 0 from ``t0 + r * step_s`` on, and from then on only
    requests that were already queued at ``t0`` can be dispatched before it (later ones lose the
    tie on arrival time). Its wait is thus bounded by::

        r * step_s + (time to dispatch the requests queued ahead of it at t0)

    where "ahead" is at most ``max_queued_total`` (or the sum of the ``max_queue``), provided
    its own class is not held at its ``max_share`` / ``max_concurrency`` cap (then it waits for
    its own class's slots, which free up as they complete) and capacity is not zero.
    """

    step_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError(f"step_s must be > 0, got {self.step_s}")


@dataclass(frozen=True)
class ApiKeyConfig:
    """What one API key grants."""

    class_name: str
    allow_class_header: bool = False
    """Trust this key's ``class_header``: it may choose any configured class per request."""


def _default_classes() -> Mapping[str, ClassConfig]:
    return MappingProxyType(
        {
            "realtime": ClassConfig(
                rank=0,
                triton_priority=1,
                slo_p99_ms=100.0,
                min_share=0.2,
                max_queue=200,
                queue_timeout_s=2.0,
                weight=6,
            ),
            "online": ClassConfig(
                rank=1,
                triton_priority=2,
                slo_p99_ms=500.0,
                min_share=0.1,
                max_queue=1000,
                queue_timeout_s=10.0,
                weight=3,
            ),
            "offline": ClassConfig(
                rank=2,
                triton_priority=3,
                max_share=0.5,
                min_share=0.05,
                max_queue=5000,
                queue_timeout_s=120.0,
                weight=1,
            ),
        }
    )


def _no_keys() -> Mapping[str, ApiKeyConfig]:
    return MappingProxyType({})


@dataclass(frozen=True)
class CostConfig:
    """``scheduling.cost``: what requests cost (:mod:`proxy.scheduling.cost`)."""

    models: Mapping[str, CostOverride] = field(default_factory=dict)
    """Model name -> ``{base_ms, per_unit_us}``: its cost curve, used instead of the one
    learned from requests that ran alone (placement's batcher replay, the wake, adaptive
    concurrency read it)."""


@dataclass(frozen=True)
class SchedulingConfig:
    """The whole ``scheduling:`` section, validated and frozen."""

    classes: Mapping[str, ClassConfig] = field(default_factory=_default_classes)
    default_class: str = "online"
    """Class of requests without a known API key."""
    dispatch: DispatchMode = "strict_aging"
    aging: AgingConfig = field(default_factory=AgingConfig)
    max_queued_total: int | None = None
    """Bound on requests queued over all classes; null = only the per-class ``max_queue``."""
    retry_after_s: float = 1.0
    api_keys: Mapping[str, ApiKeyConfig] = field(
        default_factory=_no_keys, metadata=strict.SECRET_KEYS
    )
    class_header: str = "x-triton-proxy-class"
    api_key_header: str = "authorization"
    """``authorization`` expects ``Bearer <key>``; any other header carries the bare key."""
    concurrency: int | None = None
    """Fixed dispatch slots per Triton instance; null (the default) = adaptive
    (``adaptive_concurrency``), or :func:`derive_concurrency` from the model when that is
    disabled."""
    slot_sharing: SlotSharing | None = None
    """How classes count the dispatch slots (capacity) against each other.

    ``shared``: one pool; a class may dispatch while fewer than ``capacity`` requests of any
    class are in flight. ``by_rank``: a class counts only the requests in flight of classes at
    least as important as itself (rank <= its own), as Triton's priority queue does: a
    real-time request never waits in the proxy for slots held by online or offline work, which
    Triton queues behind it anyway. Lower classes still yield to every class above them, and a
    class short of its ``min_share`` reservation may dispatch whatever the others hold, so its
    share holds under overload. In flight over all classes is then at most ``capacity`` per
    distinct rank (plus the reservations), not ``capacity``. Use it when the classes map onto
    Triton priority levels (``triton_priority``) of models that have them; without them Triton
    serves in arrival order and ``shared`` is the right count. ``placed_by_rank``: the gate
    counts one pool, as ``shared`` does (Triton's queues stay as deep as the slots), and
    placement's free-slot filter counts an instance's slots by rank, as ``by_rank`` does (a
    real-time request still finds the instance kept free of long work open when online work
    holds its slots, instead of spilling onto a long lane).

    ``null`` (the default): ``placed_by_rank`` for a model whose routing packs long work (the
    class default's placement, :meth:`for_model`) and whose batcher has priority levels,
    ``shared`` elsewhere. Measured (docs/benchmarks.md, issue 10, fortieth round): on that
    placement, shared slots let online's requests fill the one instance kept free of long
    work in ``online_burst.yaml``'s bursts at 2x capacity, and real-time then spilled onto
    the long lane (97.8-98.8 % within its SLO in 2 of 10 repetitions). ``by_rank`` mended
    that but cost real-time a tenth of its attainment where it surges beyond the fleet
    (``surge.yaml`` x1: 66 % against 74 % within its SLO): with more in flight, real-time
    waited inside Triton, where deadline admission cannot shed it, instead of at the gate.
    ``placed_by_rank`` keeps the gate's pool and takes only placement's count."""
    shed_late: bool | None = None
    """Deadline admission: shed at once a request predicted to be answered after its budget
    (its class's ``slo_p99_ms`` or its client's deadline, whichever is earlier), instead of
    serving it late (:mod:`proxy.scheduling.lateness`). Off, a request is still not sent when
    its *client deadline* would pass before its answer (abandoned work). ``null`` (the
    default): on for a model whose routing policy gathers long work into a lane
    (``Policy.packs_long``, as the class default's does; :meth:`for_model`), off for the
    others. Measured with the class default and its derived lane (docs/benchmarks.md,
    thirty-fifth round): where the top class queues beyond the fleet (``surge.yaml``) it is
    what holds real-time and online (x1: 75 % of real-time within its SLO against 58 %, online
    97 % against 84 %; x2: 45 % against 16 %, online 85 % against 20 %), and on the five
    other scenarios at 1-2x it shed nothing and changed nothing beyond the repetitions'
    spread. Without a lane (the class default of session 29) it cost real-time at
    ``burst.yaml`` x2 (36 % -> 21 % within its SLO): batches padded by offline bursts make
    everyone late, and shedding cannot help that; hence not under a policy that does not
    pack."""
    starved_after_s: float | None = 2.0
    """The floor boost: a class with a ``min_share`` below the top class is owed device time at
    its share of the fleet and 30 % more (``1.3 x min_share x instances`` device-seconds per
    second, ``proxy.scheduling.queues.FLOOR_AIM``: a share held exactly falls short in some
    windows) while it has requests queued or in flight, and each answer pays back its request's
    device time (by the model's learned cost curve). Once it owes this many seconds of that,
    with requests of it stuck in flight and more waiting at the gate, it is *starved*: Triton's
    priority queue serves every more important level first, so under a sustained overload of
    those its requests wait inside Triton for ever, holding the slots its reservation gave them.
    While starved, the class's next requests go at the top class's Triton priority
    (``triton_priority_for(top_class())``), beyond its own limits, as many as pay the debt (at
    most its reservation, ``floor(min_share x capacity)``, in flight;
    ``proxy.scheduling.queues._Floor``): the reservation holds inside Triton too. ``null``:
    never. Measured on ``surge.yaml`` (docs/benchmarks.md, thirty-sixth and forty-first
    rounds)."""
    late_by: LateBy = "mean"
    """With ``shed_late``, what a request that has waited is held to against its class's SLO:
    ``mean``, its wait plus the class's mean time inside Triton; ``tail``, its wait plus that
    mean plus two mean deviations while the estimate is fresh (the rule client deadlines
    always have; :mod:`proxy.scheduling.lateness`). A request that has not waited is never
    shed either way. ``tail`` is opt-in: it cut the real-time P99 of a surge beyond the fleet
    (``surge.yaml``) by 10-20 %, but shed real-time requests where offline bursts fill the
    fleet (``burst.yaml`` x2) while ``mean`` shed none (docs/benchmarks.md, thirty-first
    round)."""
    adaptive_concurrency: AdaptiveConcurrencyConfig = field(
        default_factory=AdaptiveConcurrencyConfig
    )
    """Slots per (instance, model) learned from the top class's time inside Triton
    (:mod:`proxy.control.concurrency`); used when ``concurrency`` is null."""
    cost: CostConfig = field(default_factory=CostConfig)
    """Cost curves set per model instead of learned (:class:`CostConfig`)."""
    overload: OverloadConfig | None = None
    """Refuse the least important classes while the proxy's own event loop lags (its process
    short of CPU): :mod:`proxy.scheduling.overload`. ``null`` (the default): never."""
    throughput_lane: bool = True
    """A *throughput class* (no ``slo_p99_ms``, ranked below a class that has one) that sets
    no ``max_per_instance`` runs in a long lane derived from each model's batching
    (:func:`derived_lane`): ``max_per_instance`` half the model's ``max_batch_size``,
    ``shallow_per_instance`` a quarter of that, ``spare_instances: 1`` and
    ``spare_fraction: 1/3`` (one spare of three servers, two of six). Without it, a burst
    of the class's long requests fills every instance's batches, and the classes with an SLO
    wait behind them: issue 10's benchmark measured the class default collapse at 1-2x the
    fleet's FIFO capacity without a lane (``burst.yaml`` real-time 39-77 % within its SLO)
    and hold every SLO with it (docs/benchmarks.md, thirty-fourth round). ``false``: such
    classes run uncapped (the behaviour before session 34). Models with a ``max_batch_size``
    under 2 batch nothing, so nothing pads: no lane there. Nor on a model whose routing
    policy does not gather long work into a lane (``Policy.packs_long``: the class default
    ``expected_finish`` with ``pack_above``, ``expected_start`` with ``long_placement:
    pack``): under ``least_requests`` the more important classes land on the lane's
    instances anyway, and at 2x ``burst.yaml``'s capacity the lane cost offline its
    ``min_share`` floor (51-65 completions per window against 71; 181-194 without it;
    docs/benchmarks.md, thirty-fourth round). Re-derived on every reload."""

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("classes must name at least one class")
        for name in self.classes:
            if not _CLASS_NAME.match(name):
                raise ValueError(
                    f"class name {name!r} must be letters, digits, '_', '.' or '-' only"
                )
        total_min = sum(c.min_share for c in self.classes.values())
        if total_min > 1.0 + 1e-9:
            raise ValueError(f"the classes' min_share add up to {total_min:g}, more than 1")
        known = ", ".join(sorted(self.classes))
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not a class; known: {known}")
        for key, grant in self.api_keys.items():
            if not key:
                raise ValueError("api_keys: an empty key")
            if grant.class_name not in self.classes:
                raise ValueError(
                    f"api_keys[{mask_secret(key)}]: class {grant.class_name!r} is not a class; "
                    f"known: {known}"
                )
            if key.startswith(HASHED_KEY_PREFIX) and not re.fullmatch(
                r"[0-9a-fA-F]{64}", key[len(HASHED_KEY_PREFIX) :]
            ):
                raise ValueError(
                    f"api_keys[{mask_secret(key)}]: after '{HASHED_KEY_PREFIX}' give 64 hex digits"
                )
        for what, header in (
            ("class_header", self.class_header),
            ("api_key_header", self.api_key_header),
        ):
            if not _HEADER_NAME.match(header):
                raise ValueError(f"{what} {header!r} is not a valid header name")
        if self.max_queued_total is not None and self.max_queued_total < 1:
            raise ValueError(f"max_queued_total must be >= 1 or null, got {self.max_queued_total}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.starved_after_s is not None and not self.starved_after_s > 0:
            raise ValueError(f"starved_after_s must be > 0 or null, got {self.starved_after_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 or null, got {self.concurrency}")

    def triton_priority_for(self, class_name: str, priority_levels: int) -> int | None:
        """The ``priority`` parameter to set on a request of ``class_name``, or None for none.

        ``priority_levels`` is the target model's ``dynamic_batching.priority_levels`` (0 when
        absent). Triton ignores priority without priority levels, so none is set then.
        Otherwise the class always decides, whatever the client sent: a class with
        ``triton_priority: 0`` gets 0, Triton's default level. A level above the model's count
        is clamped to its lowest level (``priority_levels``): Triton itself would treat it as
        the *default* level, which may rank above it and would invert the classes.
        """
        if priority_levels <= 0:
            return None
        cls = self.classes.get(class_name) or self.classes[self.default_class]
        return min(cls.triton_priority, priority_levels)

    def top_class(self) -> str:
        """The most important class (lowest rank; the first such in the file)."""
        return min(self.classes, key=lambda name: self.classes[name].rank)

    def boosted_classes(self) -> tuple[str, ...]:
        """The classes the floor boost may lift (:attr:`starved_after_s`): a ``min_share``,
        ranked below the top class."""
        if self.starved_after_s is None:
            return ()
        top = min(c.rank for c in self.classes.values())
        return tuple(n for n, c in self.classes.items() if c.min_share > 0 and c.rank > top)

    def adaptive(self) -> bool:
        return self.concurrency is None and self.adaptive_concurrency.enabled

    def lane_classes(self) -> tuple[str, ...]:
        """The classes :attr:`throughput_lane` gives a derived lane: no SLO, no
        ``max_per_instance`` of their own, ranked below a class with an SLO."""
        if not self.throughput_lane:
            return ()
        ranks = [c.rank for c in self.classes.values() if c.slo_p99_ms is not None]
        if not ranks:
            return ()
        best = min(ranks)
        return tuple(
            name
            for name, c in self.classes.items()
            if c.slo_p99_ms is None and c.max_per_instance is None and c.rank > best
        )

    def ranks_placement(self) -> bool:
        """Placement counts an instance's slots by rank (``by_rank``, ``placed_by_rank``)."""
        return self.slot_sharing in ("by_rank", "placed_by_rank")

    def for_model(
        self, max_batch_size: int, packs_long: bool = True, priority_levels: int = 0
    ) -> SchedulingConfig:
        """This section as the gate of a model with ``max_batch_size`` enforces it: each of
        :meth:`lane_classes` with its :func:`derived_lane`, and ``shed_late`` and
        ``slot_sharing`` decided where the file leaves them ``null``. ``packs_long``: whether
        the model's routing policy gathers long work into a lane
        (``proxy.routing.base.Policy.packs_long``); without it no lane is derived and
        ``shed_late`` defaults to off. ``priority_levels``: the model's batcher's (0: none,
        Triton serves in arrival order); slots are counted by rank by default only where it
        has some and the routing packs long work (``placed_by_rank``)."""
        config = self
        if self.shed_late is None:
            config = dataclasses.replace(config, shed_late=packs_long)
        if self.slot_sharing is None:
            ranked = packs_long and priority_levels > 0
            sharing: SlotSharing = "placed_by_rank" if ranked else "shared"
            config = dataclasses.replace(config, slot_sharing=sharing)
        lane = derived_lane(max_batch_size)
        names = self.lane_classes()
        if lane is None or not names or not packs_long:
            return config
        depth, shallow = lane
        classes = dict(self.classes)
        for name in names:
            classes[name] = dataclasses.replace(
                classes[name],
                max_per_instance=depth,
                shallow_per_instance=shallow,
                spare_instances=1,
                spare_fraction=DERIVED_SPARE_FRACTION,
            )
        return dataclasses.replace(config, classes=MappingProxyType(classes))

    def instance_concurrency(self, max_batch_size: int, model_instances: int = 1) -> int:
        """Dispatch slots for one Triton instance: ``concurrency``, else derived from the model."""
        if self.concurrency is not None:
            return self.concurrency
        return derive_concurrency(max_batch_size, model_instances)


def derive_concurrency(max_batch_size: int, model_instances: int = 1) -> int:
    """Requests to keep in flight on one Triton instance: ``2 * max(1, max_batch_size) * n``.

    One full batch executing and one forming per model instance (``instance_group`` count n)
    keeps the instance busy while leaving the rest of the queue in the proxy, where ordering is
    ours; more only moves the queue into Triton's FIFO. ``max_batch_size`` 0 (no batching)
    counts as 1.
    """
    return 2 * max(1, max_batch_size) * max(1, model_instances)


def load_scheduling(
    data: Any, source: str | None = None, path: str = "scheduling"
) -> SchedulingConfig:
    """Strictly load the section from plain YAML data (None = all defaults)."""
    return strict.load(SchedulingConfig, data, path, source)


DERIVED_SPARE_FRACTION = 1 / 3
"""The share of a model's instances a derived lane keeps spare (at least one):
:attr:`ClassConfig.spare_fraction`."""


def derived_lane(max_batch_size: int) -> tuple[int, int] | None:
    """``(max_per_instance, shallow_per_instance)`` of a throughput class's derived lane on a
    model (:attr:`SchedulingConfig.throughput_lane`), or None for a model that does not batch.

    Half a batch of requests per lane instance, a quarter of that while the class's queue
    moves. For issue 10's model (``max_batch_size`` 16, offline requests of 4 rows) that is
    the lane ``policies/mixed-traffic.yaml`` sets and the benchmark measured: 8 (two batches
    of offline rows, one running and one forming) and 2 (half a batch, so a more important
    long request that lands there runs in a small batch). Requests of one row make the lane
    shallower in rows (8 rows of 16): in ``benchmarks/issue10/one_row_job.yaml`` such a class
    lost 41-42 % of its completions while real-time went from about 10 % to 100 % within its
    SLO. Where the class's requests are small and its throughput matters more than the
    others' tails, set its ``spare_per_instance`` (the derived lane keeps it: a few of its
    requests on each spare) or its ``max_per_instance``."""
    if max_batch_size < 2:
        return None
    depth = max_batch_size // 2
    return depth, max(1, depth // 4)
