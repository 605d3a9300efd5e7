"""Adaptive concurrency: how many requests of a model each Triton instance may hold.

Replaces the fixed ``2 x max_batch_size`` slots per instance. Work the proxy has not yet sent
waits in its class queues, where the order is the proxy's; work inside Triton is ordered only
by Triton's priority levels and is batched together, so long requests pad short ones. Too few
slots and batches cannot fill (throughput falls); too many and the top class waits behind work
that is already inside Triton. The right number moves with the load mix, so it is learned.

**Signal.** The time requests of the most important class spend inside Triton (sent to
answered) on that instance, over a window of ``window_s``, counting only requests sent while
no long request (:mod:`proxy.scheduling.cost`'s ``long_ratio``, or a capped class) of the
model was in flight there. Other classes' samples never count as the signal (their requests
are long, and they wait behind the top class by priority: more slots cause neither); nor do
top-class requests sent beside long work: they ran in, or behind, a batch padded to a long
row, which no number of slots shortens, and fewer slots only push the long work onto
instances without it (measured, session 30: at ``long_share.yaml`` x2 behind the long lane,
such samples cut every instance to its floor, the lane could no longer take online's long
rows, real-time batches were padded to 512 tokens and the cuts went on; docs/benchmarks.md).
Both kinds only estimate the batch that may be running (below). A window without top-class
samples (an instance of the long lane, say) holds the limit or grows it.

**Law** (AIMD, once per window with samples)::

    if top class sampled and p90(top inside time) > target and the limit bound:
        limit = max(low, limit * decrease)
    elif the limit bound in the window:
        limit = min(high, limit + step)

    target = max(target_fraction x slo, 2 x batch_s, min(slo, running_s + batch_s))

``batch_s`` is a full batch of the model's typical requests (the learned cost curve,
:mod:`proxy.scheduling.cost`): a request may always find one batch running and must then run
in the next. ``running_s`` is the median time inside Triton of the other classes' requests in
the window: the batch a top-class request finds running is usually one of theirs (a long,
padded batch when long work shares the instance), and no number of slots shortens a batch
that has begun, so the target leaves room for it (up to the SLO itself). "The limit bound":
some answer in the window left at least ``limit`` requests of the model in flight there; when
it never did, the time inside Triton is not queueing that the slots allow, and cutting them
cannot help (issue 10's first version cut without this test and, with long work on every
instance, ratcheted every instance down to its floor at x1 load: docs/benchmarks.md).
``low = min_batches x B x n``, ``high = max_batches x B x n`` and ``step = max(1, B x n / 4)``,
where ``B`` is ``max_batch_size`` (1 without batching) and ``n`` the model's instance count
per server. The limit starts at ``start_batches x B x n`` (default: ``high``, so it is cut on
evidence rather than grown into; deep Triton queues are what fill batches, and starting at 2
batches cost the long lane its room in the first seconds of a surge). The limit only grows
while it binds, so an idle instance keeps the limit that served it last. Bounds keep a full
batch formable at all times.

Source: TCP's AIMD (Chiu and Jain, 1989) applied to request concurrency as in Netflix's
``concurrency-limits`` (AIMDLimit), with a latency target taken from the SLO instead of a
measured no-load RTT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.stats.window import WindowedQuantiles


@dataclass(frozen=True)
class AdaptiveConcurrencyConfig:
    """``scheduling.adaptive_concurrency`` in the policy file. On by default since session 31
    (measured never worse than the fixed ``2 x max_batch_size`` slots it replaced, better
    under bursts and at twice capacity: docs/benchmarks.md, issue 10, thirtieth round); off
    (or a fixed ``scheduling.concurrency``) gives fixed slots."""

    enabled: bool = True
    target_fraction: float = 0.5
    """Target time inside Triton as a fraction of the top class's ``slo_p99_ms``."""
    target_s: float | None = None
    """A fixed target instead (seconds); also used when no class has an SLO (default 0.1)."""
    min_batches: float = 1.0
    max_batches: float = 4.0
    start_batches: float | None = None
    """Where each limit starts, in full batches; None: ``max_batches``."""
    decrease: float = 0.8
    window_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.target_fraction <= 1:
            raise ValueError("target_fraction must be within (0, 1]")
        if self.target_s is not None and self.target_s <= 0:
            raise ValueError("target_s must be > 0")
        if not 0 < self.min_batches <= self.max_batches:
            raise ValueError("need 0 < min_batches <= max_batches")
        start = self.start_batches
        if start is not None and not self.min_batches <= start <= self.max_batches:
            raise ValueError("need min_batches <= start_batches <= max_batches")
        if not 0 < self.decrease < 1:
            raise ValueError("decrease must be within (0, 1)")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")


@dataclass
class ConcurrencyLimit:
    """The AIMD law for one (instance, model); pure: the caller passes the time."""

    low: float
    high: float
    step: float
    target_s: float
    decrease: float
    window_s: float
    limit: float = 0.0
    ceiling_s: float | None = None
    """The top class's SLO: the running-batch allowance never raises the target above it."""
    _top: WindowedQuantiles = field(init=False)
    _other: WindowedQuantiles = field(init=False)
    _bound: bool = False
    _next_at: float | None = None

    def __post_init__(self) -> None:
        # The starting limit (the ceiling unless given), within the bounds.
        self.limit = min(self.high, max(self.low, self.limit or self.high))
        self._top = WindowedQuantiles(self.window_s)
        self._other = WindowedQuantiles(self.window_s)

    def current(self) -> int:
        return max(1, int(self.limit))

    def target(self, now: float, batch_s: float | None = None) -> float:
        """The top class's p90 time inside Triton above which the limit falls (see the
        module's formula)."""
        own = batch_s if batch_s is not None else 0.0
        target = max(self.target_s, 2 * own)
        running = self._other.quantile(0.5, now)
        if running is not None:
            allowance = running + own
            if self.ceiling_s is not None:
                allowance = min(allowance, self.ceiling_s)
            target = max(target, allowance)
        return target

    def observe(
        self,
        inside_s: float,
        top_class: bool,
        in_flight: int,
        now: float,
        batch_s: float | None = None,
    ) -> str | None:
        """Record one answered request; returns ``"down"``/``"up"`` when the limit moved.

        ``batch_s``: the model's current full-batch time, when known (raises the target)."""
        (self._top if top_class else self._other).record(inside_s, now)
        if in_flight >= self.current():
            self._bound = True
        if self._next_at is None:
            self._next_at = now + self.window_s
        if now < self._next_at:
            return None
        self._next_at = now + self.window_s
        p90 = self._top.quantile(0.9, now)
        bound, self._bound = self._bound, False
        target = self.target(now, batch_s)
        if p90 is not None and p90 > target and bound:
            new = max(self.low, self.limit * self.decrease)
            direction = "down"
        elif bound:
            new = min(self.high, self.limit + self.step)
            direction = "up"
        else:
            return None
        if int(new) == int(self.limit):
            self.limit = new
            return None
        self.limit = new
        return direction


class AdaptiveConcurrency:
    """One :class:`ConcurrencyLimit` per (instance, model), created on first use."""

    def __init__(self, config: AdaptiveConcurrencyConfig, top_slo_s: float | None) -> None:
        self.config = config
        target = config.target_s
        if target is None:
            target = top_slo_s * config.target_fraction if top_slo_s else 0.1
        self.target_s = target
        self.ceiling_s = top_slo_s
        self._limits: dict[tuple[str, str], ConcurrencyLimit] = {}

    def _get(self, instance: str, model: str, per_batch: int) -> ConcurrencyLimit:
        key = (instance, model)
        law = self._limits.get(key)
        if law is None:
            c = self.config
            law = self._limits[key] = ConcurrencyLimit(
                low=max(1.0, c.min_batches * per_batch),
                high=max(1.0, c.max_batches * per_batch),
                step=max(1.0, per_batch / 4),
                target_s=self.target_s,
                decrease=c.decrease,
                window_s=c.window_s,
                limit=(c.start_batches or c.max_batches) * per_batch,
                ceiling_s=self.ceiling_s,
            )
        return law

    def limit(self, instance: str, model: str, per_batch: int) -> int:
        """Slots for ``model`` on ``instance``; ``per_batch`` = max_batch_size x instances."""
        return self._get(instance, model, per_batch).current()

    def observe(
        self,
        instance: str,
        model: str,
        per_batch: int,
        inside_s: float,
        top_class: bool,
        in_flight: int,
        now: float,
        batch_s: float | None = None,
    ) -> str | None:
        law = self._get(instance, model, per_batch)
        return law.observe(inside_s, top_class, in_flight, now, batch_s)

    def forget_instance(self, instance: str) -> None:
        for key in [k for k in self._limits if k[0] == instance]:
            del self._limits[key]

    def current(self) -> dict[tuple[str, str], int]:
        return {key: law.current() for key, law in self._limits.items()}
