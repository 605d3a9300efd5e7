"""Adaptive concurrency: how many requests of a model each Triton instance may hold.

Replaces the fixed ``2 x max_batch_size`` slots per instance. Work the proxy has not yet sent
waits in its class queues, where the order is the proxy's; work inside Triton is ordered only
by Triton's priority levels and is batched together, so long requests pad short ones. Too few
slots and batches cannot fill (throughput falls); too many and the top class waits behind work
that is already inside Triton. The right number moves with the load mix, so it is learned.

**Signal.** The time requests of the most important class spend inside Triton (sent to
answered) on that instance, over a window of ``window_s``; other classes' samples are used only
when the top class sent none (their long requests are expected to take long).

**Law** (AIMD, once per window with samples)::

    if p90(inside time) > target:           limit = max(low, limit * decrease)
    elif limit was reached in the window:   limit = min(high, limit + step)

with ``target = max(target_fraction x top class's slo_p99_ms, 2 x batch_s)``: the rest of the SLO
is left for waiting in the proxy, but never less than two full batches of the model's typical
requests (``batch_s``, from the learned cost curve, :mod:`proxy.scheduling.cost`), since a
request may always find one batch running and must then run in the next;
``low = min_batches x B x n``, ``high = max_batches x B x n`` and
``step = max(1, B x n / 4)``, where ``B`` is ``max_batch_size`` (1 without batching) and ``n``
the model's instance count per server. The limit only grows while it binds, so an idle
instance keeps the limit that served it last. Bounds keep a full batch formable at all times.

Source: TCP's AIMD (Chiu and Jain, 1989) applied to request concurrency as in Netflix's
``concurrency-limits`` (AIMDLimit), with a latency target taken from the SLO instead of a
measured no-load RTT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.stats.window import WindowedQuantiles


@dataclass(frozen=True)
class AdaptiveConcurrencyConfig:
    """``scheduling.adaptive_concurrency`` in the policy file. Off by default: with long
    batch work on every instance the top class's time inside Triton stays above the target,
    the law cuts slots to its floor and the queue moves into the proxy (docs/benchmarks.md)."""

    enabled: bool = False
    target_fraction: float = 0.5
    """Target time inside Triton as a fraction of the top class's ``slo_p99_ms``."""
    target_s: float | None = None
    """A fixed target instead (seconds); also used when no class has an SLO (default 0.1)."""
    min_batches: float = 1.0
    max_batches: float = 4.0
    decrease: float = 0.8
    window_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.target_fraction <= 1:
            raise ValueError("target_fraction must be within (0, 1]")
        if self.target_s is not None and self.target_s <= 0:
            raise ValueError("target_s must be > 0")
        if not 0 < self.min_batches <= self.max_batches:
            raise ValueError("need 0 < min_batches <= max_batches")
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
    _top: WindowedQuantiles = field(init=False)
    _any: WindowedQuantiles = field(init=False)
    _bound: bool = False
    _next_at: float | None = None

    def __post_init__(self) -> None:
        # The starting limit (the fixed gate's 2 x B x n unless given), within the bounds.
        self.limit = min(self.high, max(self.low, self.limit or 2 * self.step * 2))
        self._top = WindowedQuantiles(self.window_s)
        self._any = WindowedQuantiles(self.window_s)

    def current(self) -> int:
        return max(1, int(self.limit))

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
        (self._top if top_class else self._any).record(inside_s, now)
        if in_flight >= self.current():
            self._bound = True
        if self._next_at is None:
            self._next_at = now + self.window_s
        if now < self._next_at:
            return None
        self._next_at = now + self.window_s
        window = self._top if self._top.count(now) else self._any
        p90 = window.quantile(0.9, now)
        bound, self._bound = self._bound, False
        target = max(self.target_s, 2 * batch_s) if batch_s is not None else self.target_s
        if p90 is not None and p90 > target:
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
                limit=2.0 * per_batch,  # clamped to [low, high] by the law
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
