"""Class admission per model: one gate each, sized from the fleet and the model's batching.

Each Triton model has its own batcher queue on every instance, so each model gets its own pool
of dispatch slots: ``healthy instances x per-instance concurrency`` (from the policy, or derived
from the model's ``max_batch_size`` and instance count). Excess requests wait in the proxy's
class queues, where the order is ours.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from proxy.clock import Clock
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.instances import Fleet
from proxy.scheduling.config import SchedulingConfig
from proxy.scheduling.gate import Gate, GateObserver
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


class ModelGates:
    def __init__(
        self, config: SchedulingConfig, fleet: Fleet, clock: Clock, observer: GateObserver
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.clock = clock
        self.observer = observer
        self.gates: dict[str, Gate] = {}
        self.share = 1.0
        """Fraction of the dispatch slots these gates own (a canary arm's gates split them)."""
        fleet.listeners.append(lambda _instance: self.poke())

    def capacity(self, info: ModelInfo) -> int:
        per_instance = self.config.instance_concurrency(info.max_batch_size, info.model_instances)
        slots = len(self.fleet.healthy()) * per_instance
        if self.share >= 1.0 or slots == 0:
            return slots
        return max(1, int(slots * self.share))

    def gate(self, model: str, info: ModelInfo) -> Gate:
        gate = self.gates.get(model)
        if gate is None:
            gate = self.gates[model] = Gate(
                self.config, lambda: self.capacity(info), self.clock, self.observer
            )
        return gate

    @contextlib.asynccontextmanager
    async def admit(
        self, model: str, info: ModelInfo, class_name: str
    ) -> AsyncIterator[int | None]:
        """Wait for a slot; yields the Triton priority to set on the request (or None)."""
        async with self.gate(model, info).admit(class_name):
            yield self.config.triton_priority_for(class_name, info.priority_levels)

    def poke(self) -> None:
        for gate in self.gates.values():
            gate.poke()

    def reconfigure(self, config: SchedulingConfig) -> None:
        self.config = config
        for gate in self.gates.values():
            gate.reconfigure(config)

    def close(self) -> None:
        for gate in self.gates.values():
            gate.close()
