"""Class admission per model: one gate each, sized from the fleet and the model's batching.

Each Triton model has its own batcher queue on every instance, so each model gets its own pool
of dispatch slots: ``instances serving the model x per-instance concurrency`` (from the
policy, or derived from the model's ``max_batch_size`` and instance count). Excess requests
wait in the proxy's class queues, where the order is ours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.clock import Clock
from proxy.control.concurrency import AdaptiveConcurrency
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.instances import Fleet
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.gate import AdmissionBase, Gate, GateObserver
from proxy.scheduling.queues import ShedReason


class FanOutObserver(GateObserver):
    """Passes every gate event to several observers (telemetry, tests)."""

    def __init__(self, observers: Sequence[GateObserver]) -> None:
        self.observers = tuple(observers)

    def on_dispatch(self, class_name: str, waited_s: float, order: int) -> None:
        for o in self.observers:
            o.on_dispatch(class_name, waited_s, order)

    def on_shed(self, class_name: str, reason: ShedReason) -> None:
        for o in self.observers:
            o.on_shed(class_name, reason)

    def on_cancel(self, class_name: str) -> None:
        for o in self.observers:
            o.on_cancel(class_name)

    def on_complete(self, class_name: str) -> None:
        for o in self.observers:
            o.on_complete(class_name)

    def on_boost(self, class_name: str) -> None:
        for o in self.observers:
            o.on_boost(class_name)


class ModelAdmission(AdmissionBase):
    """A gate admission that gives the class's Triton priority when it enters (the top
    class's for a slot the floor boost gave: ``SchedulingConfig.starved_after_s``).

    A class, not an ``@asynccontextmanager``: one is entered per request, and the generator
    wrapper was 6 % of the proxy's samples under load with classes on (py-spy,
    docs/benchmarks.md). It enters the gate itself (:meth:`Gate.acquire`) rather than through
    an :class:`~proxy.scheduling.gate.Admission`: one object and one coroutine layer less per
    request (session 18).
    """

    __slots__ = ("_levels", "_priority")

    def __init__(
        self,
        gate: Gate,
        class_name: str,
        deadline: float | None,
        priority: int | None,
        levels: int,
    ) -> None:
        super().__init__(gate, class_name, deadline)
        self._priority = priority
        self._levels = levels

    async def __aenter__(self) -> int | None:
        ticket = self._ticket = await self._gate.acquire(self._class_name, self._deadline)
        if ticket.boosted:
            config = self._gate.config
            return config.triton_priority_for(config.top_class(), self._levels)
        return self._priority


def _packs_long(model: str) -> bool:
    """``ModelGates.packs_long`` without a router: every model's routing packs."""
    return True


class ModelGates:
    def __init__(
        self,
        config: SchedulingConfig,
        fleet: Fleet,
        clock: Clock,
        observer: GateObserver,
        *,
        workers: int = 1,
        packs_long: Callable[[str], bool] = _packs_long,
    ) -> None:
        self.config = config
        self.packs_long = packs_long
        """Whether a model's routing gathers long work into a lane (``Router.packs_long``,
        read when its gate is made and on every reconfigure): only then are throughput
        classes given a derived lane, and deadline admission is on unless the file says
        (:meth:`SchedulingConfig.for_model`)."""
        self.workers = workers
        """Proxy processes sharing the fleet: each takes ``ceil(1/workers)`` of the slots."""
        self.fleet = fleet
        self.clock = clock
        self.observer = observer
        self.gates: dict[str, Gate] = {}
        self._infos: dict[str, ModelInfo] = {}
        self.adaptive = self._new_adaptive(config)
        self._share = 1.0
        fleet.listeners.append(lambda _instance: self.poke())

    @property
    def share(self) -> float:
        """Fraction of the dispatch slots these gates own (a canary arm's gates split them)."""
        return self._share

    @share.setter
    def share(self, share: float) -> None:
        self._share = share
        for gate in self.gates.values():
            gate.set_fleet_part(self._fleet_part())

    def _fleet_part(self) -> float:
        """The part of the fleet these gates' floors are owed: this arm's share of this
        worker's part (``proxy.scheduling.queues._Floor``)."""
        return self._share / self.workers

    @staticmethod
    def _new_adaptive(config: SchedulingConfig) -> AdaptiveConcurrency | None:
        if not config.adaptive():
            return None
        slo_ms = config.classes[config.top_class()].slo_p99_ms
        return AdaptiveConcurrency(
            config.adaptive_concurrency, slo_ms / 1e3 if slo_ms is not None else None
        )

    def capacity(self, info: ModelInfo, model: str) -> int:
        """Dispatch slots of the model's gate: the sum of its instances' slots (an instance
        drained for a reload of the model counts none)."""
        serving = [inst for inst in self.fleet.serving(model) if model not in inst.draining]
        if self.adaptive is None and serving:
            # Fixed or derived, every instance has the same slots: computed once, not once per
            # instance (read on every admission: 2.2 -> 1.6 µs with three instances, 1.3 -> 1.2
            # with one, `timeit`, session 18).
            return len(serving) * self.slots(serving[0].name, model, info)
        return sum(self.slots(inst.name, model, info) for inst in serving)

    def slots(self, instance: str, model: str, info: ModelInfo) -> int:
        """Requests of ``model`` that ``instance`` may hold (adaptive, or fixed/derived)."""
        if self.adaptive is not None:
            per_batch = max(1, info.max_batch_size) * max(1, info.model_instances)
            slots = self.adaptive.limit(instance, model, per_batch)
        else:
            slots = self.config.instance_concurrency(info.max_batch_size, info.model_instances)
        if self.workers > 1:
            # One of N worker processes: see proxy.workers.per_worker_scheduling for the bound.
            slots = max(1, -(-slots // self.workers))
        if self.share < 1.0:
            # A canary arm's gates own their share of the slots, never less than one.
            slots = max(1, int(slots * self.share))
        return slots

    def info(self, model: str) -> ModelInfo | None:
        """The model's batching facts, once its gate exists."""
        return self._infos.get(model)

    def slots_by_level(self, model: str) -> bool:
        """Placement counts against an instance's slots of ``model`` only the requests Triton
        serves no later than the new one (``slot_sharing: by_rank`` or ``placed_by_rank`` as
        the model's gate enforces it, :meth:`config_for`)."""
        return self.config_for(model).ranks_placement()

    def slot_limit(self, instance: str, model: str) -> int | None:
        """Placement's per-instance bound for ``model``, or None before its gate exists."""
        info = self._infos.get(model)
        return None if info is None else self.slots(instance, model, info)

    def observe_inside(
        self,
        instance: str,
        model: str,
        class_name: str,
        inside_s: float,
        in_flight: int,
        beside_long: bool,
        batch_s: float | None = None,
    ) -> str | None:
        """One answered request's time inside Triton; feeds adaptive concurrency and deadline
        admission. ``beside_long``: it was sent while long work of the model was in flight on
        the instance (it then never counts as adaptive concurrency's signal).
        ``batch_s``: the model's full-batch time when the cost model knows it."""
        info = self._infos.get(model)
        gate = self.gates.get(model)
        if gate is not None:
            gate.lateness.observe_inside(class_name, inside_s, self.clock.now())
        if self.adaptive is None or info is None:
            return None
        per_batch = max(1, info.max_batch_size) * max(1, info.model_instances)
        direction = self.adaptive.observe(
            instance,
            model,
            per_batch,
            inside_s,
            class_name == self.config.top_class() and not beside_long,
            in_flight,
            self.clock.now(),
            batch_s,
        )
        if direction is not None:
            gate = self.gates.get(model)
            if gate is not None:
                gate.poke()  # more slots may dispatch waiters now
        return direction

    def expected_inside_s(self, model: str, class_name: str) -> float:
        """The mean time a request of the class spends inside Triton for the model (0 until
        one was answered)."""
        gate = self.gates.get(model)
        return gate.lateness.inside(class_name) if gate is not None else 0.0

    def config_for(self, model: str) -> SchedulingConfig:
        """The section as ``model``'s gate enforces it (:meth:`SchedulingConfig.for_model`:
        the derived lanes of throughput classes), or as written before the gate exists."""
        gate = self.gates.get(model)
        return gate.config if gate is not None else self.config

    def gate(self, model: str, info: ModelInfo) -> Gate:
        gate = self.gates.get(model)
        if gate is None:
            self._infos[model] = info
            gate = self.gates[model] = Gate(
                self._enforced(self.config, model, info),
                lambda: self.capacity(info, model),
                self.clock,
                self.observer,
                instances=lambda: len(self.fleet.serving(model)),
                fleet_part=self._fleet_part(),
            )
        return gate

    def _enforced(self, config: SchedulingConfig, model: str, info: ModelInfo) -> SchedulingConfig:
        """``config`` as ``model``'s gate enforces it (:meth:`SchedulingConfig.for_model`)."""
        return config.for_model(info.max_batch_size, self.packs_long(model), info.priority_levels)

    def admit(
        self, model: str, info: ModelInfo, class_name: str, deadline: float | None = None
    ) -> ModelAdmission:
        """``async with``: wait for a slot; gives the Triton priority to set (or None).
        ``deadline``: the client's, if any (:meth:`Gate.admit`)."""
        priority = self.config.triton_priority_for(class_name, info.priority_levels)
        return ModelAdmission(
            self.gate(model, info), class_name, deadline, priority, info.priority_levels
        )

    def saturated(self) -> set[str]:
        """Models at the fleet's limit now (``proxy.routing.occupancy``: their occupancy
        counts as 1 at once): requests of a class without a per-instance cap wait at the
        gate, or ``max_batch_size`` requests are in flight per instance serving the model,
        a batch queued behind each running one (this worker's share of them with ``serve
        --workers``). Requests, not rows: with requests of several rows it fires later than
        the batches fill."""
        out = set()
        for model, gate in self.gates.items():
            info = self._infos[model]
            full = max(1, info.max_batch_size) * len(self.fleet.serving(model)) / self.workers
            if gate.queued_uncapped() or gate.in_flight() >= max(1.0, full):
                out.add(model)
        return out

    def queued_total(self) -> int:
        """Requests waiting in any model's class queue."""
        return sum(gate.queued() for gate in self.gates.values())

    def poke(self) -> None:
        for gate in self.gates.values():
            gate.poke()

    def reconfigure(self, config: SchedulingConfig) -> None:
        if (
            config.adaptive() != self.config.adaptive()
            or config.adaptive_concurrency != self.config.adaptive_concurrency
        ):
            self.adaptive = self._new_adaptive(config)
        self.config = config
        for model, gate in self.gates.items():
            info = self._infos[model]
            gate.reconfigure(self._enforced(config, model, info))

    def close(self) -> None:
        for gate in self.gates.values():
            gate.close()
