"""Changing a model's batching window on live servers: a drained reload, one instance at a time.

For each instance that serves the model and runs another window:

1. read the model's config from that instance (``GET /v2/models/NAME/config``);
2. mark the (instance, model) draining: placement sends the model's new requests elsewhere;
3. wait, at most ``drain_timeout_s``, until the proxy has none of the model's requests in
   flight there (so nothing sits in that Triton's queue when the reload begins: a request
   queued during a reload was measured waiting ~4.4 s); on timeout the instance keeps its
   window and the change stops there;
4. load the model with the same config but ``dynamic_batching.max_queue_delay_microseconds``
   (``POST /v2/repository/models/NAME/load``, ``{"parameters": {"config": ...}}``);
5. wait until the model is ready again, then clear the mark.

An instance is drained only while another healthy instance takes the model's requests; a
fleet with a single instance is not reloaded (``no_other_instance``). Before each instance is
drained, ``can_drain`` (the loops' headroom rule, :mod:`proxy.control.headroom`) may defer the
rest of the change: :attr:`ApplyResult.deferred`, and the instances already changed keep the
new window. While an instance drains,
the model's gate counts none of its slots (``ModelGates.capacity``), so the other instances are
not pushed past theirs: the surplus waits in the class queues, in class order. A server not
started with ``--model-control-mode=explicit`` refuses the load: :attr:`ApplyResult.refused`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.control.headroom import Headroom
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.model_control import (
    ModelControl,
    ModelControlError,
    batching_window_us,
    with_batching_window,
)

log = logging.getLogger(__name__)

_POLL_S = 0.005


@dataclass
class ApplyResult:
    changed: list[str] = field(default_factory=list)
    """Instances now running the new window."""
    failed: str | None = None
    """Why the change stopped before reaching every instance (None: it did)."""
    refused: bool = False
    """The server does not allow model control (not in explicit mode)."""
    deferred: Headroom | None = None
    """``can_drain`` said no before an instance was drained (the others lacked headroom)."""


class WindowApplier:
    def __init__(
        self,
        fleet: Fleet,
        control: ModelControl,
        *,
        on_window: Callable[[str, str, int | None], None] = lambda i, m, w: None,
        on_drain: Callable[[], None] = lambda: None,
        remote_in_flight: Callable[[str, str], int | None] = lambda i, m: 0,
    ) -> None:
        self.fleet = fleet
        self.control = control
        self.on_drain = on_drain
        """Called after a drain mark is set or cleared: the gates' capacity changed (and, with
        workers, the leader publishes the mark)."""
        self.remote_in_flight = remote_in_flight
        """(instance, model) -> the model's requests other worker processes still have in
        flight on the instance; None while one of them has not applied the drain mark yet."""
        self.on_window = on_window
        """Called with (instance, model, window_us) whenever an instance's window is learnt."""

    async def read(self, instance: Instance, model: str) -> int | None:
        """The window ``instance`` runs for ``model`` (None: no dynamic batcher)."""
        config = await self.control.config(instance, model)
        window = batching_window_us(config)
        self.on_window(instance.name, model, window)
        return window

    async def apply(
        self,
        model: str,
        window_us: int,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        can_drain: Callable[[Instance, str], Headroom] | None = None,
    ) -> ApplyResult:
        result = ApplyResult()
        for instance in list(self.fleet.serving(model)):
            try:
                config = await self.control.config(instance, model)
            except ModelControlError as exc:
                if exc.status == 400 or exc.status == 404:
                    continue  # the instance does not serve this model
                result.failed = f"{instance.name}: cannot read config: {exc.message}"
                return result
            current = batching_window_us(config)
            self.on_window(instance.name, model, current)
            if current is None or current == window_us:
                continue
            others = [
                i
                for i in self.fleet.serving(model)
                if i is not instance and model not in i.draining
            ]
            if not others:
                result.failed = "no_other_instance"
                return result
            if can_drain is not None:
                verdict = can_drain(instance, model)
                if not verdict.ok:
                    result.deferred = verdict
                    result.failed = f"{instance.name}: {verdict.reason}: {verdict.detail}"
                    return result
            instance.draining.add(model)
            self.on_drain()
            try:
                if not await self._drained(instance, model, drain_timeout_s):
                    remote = self.remote_in_flight(instance.name, model)
                    result.failed = (
                        f"{instance.name}: still {instance.model_in_flight.get(model, 0)} "
                        f"request(s) in flight after {drain_timeout_s:g} s (other workers: "
                        f"{'not all answered' if remote is None else remote})"
                    )
                    return result
                try:
                    await self.control.load(
                        instance, model, with_batching_window(config, window_us)
                    )
                except ModelControlError as exc:
                    result.refused = exc.refused
                    result.failed = f"{instance.name}: load refused: {exc.message}"
                    return result
                if not await self.control.wait_ready(instance, model, ready_timeout_s):
                    result.failed = f"{instance.name}: not ready {ready_timeout_s:g} s after load"
                    return result
                result.changed.append(instance.name)
                self.on_window(instance.name, model, window_us)
            finally:
                instance.draining.discard(model)
                self.on_drain()
        return result

    async def _drained(self, instance: Instance, model: str, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (
            instance.model_in_flight.get(model, 0) > 0
            or self.remote_in_flight(instance.name, model) != 0
        ):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True
