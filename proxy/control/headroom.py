"""Headroom rule: may an instance be taken out of a model's rotation for a drained reload?

A batching-window change reloads the model on one instance at a time, and that instance serves
none of the model's requests while it drains and reloads (measured: about 7 s per server on an
idle 2-core machine, 17-50 s under a surge, docs/benchmarks.md). The other instances must carry
the model's whole load meanwhile; on a 2-server fleet near capacity they cannot, a backlog
builds and the top class waits behind it. The rule defers the change until they can.

Pure: :func:`check` takes what the proxy already knows about the model's instances and returns
a :class:`Headroom` verdict; the control loops gather the inputs and keep the history.

Inputs, for one model, with ``I`` the healthy instances that serve it and are not draining,
``D`` the instance to drain, ``O = I - {D}`` the others and ``r`` = ``headroom_ratio``:

- ``in_flight(i)``: the proxy's requests of the model in flight on ``i``; ``queued``: those
  waiting in the model's class queues in the proxy; ``slots(i)``: the gate's dispatch slots
  for the model on ``i`` (adaptive or fixed);
- ``L = max(L_now, mean of L over the loops' window)`` with ``L = sum_i in_flight(i) +
  queued``: the requests the model holds in the proxy (the larger of now and the recent mean,
  so that a load that has just risen, or just paused, counts);
- ``u(i) = min(1, exec_rate(i) * compute_s(i) / model_instances)``: the share of ``i``'s model
  instances that execute (Triton's executions per second times the mean compute time of a
  request, which for a batched request is its batch's time, over the ``instance_group``
  count), from the scraper's snapshot; unknown when the instance has executions but no
  compute time, 0 when it executed nothing.

Two conditions; the rule holds only when every one whose inputs are known holds:

1. **slots**: ``L <= r * sum_{j in O} slots(j)``: the requests now in the proxy fit in the
   others' slots with ``1 - r`` to spare;
2. **busy**: ``U = sum_{i in I} u(i) <= r * |O|``: the execution time the model uses now, in
   instances, fits on the others at ``r`` of their time. (Slots alone miss a saturated device:
   a fleet can be busy all the time with fewer requests in flight than slots.)

With ``O`` empty the rule never holds (``no_other_instance``). The loops apply the rule to every
instance the change will drain, before the change starts and again before each instance is
drained (the load may have risen since), so a rollout also pauses between instances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceLoad:
    """One healthy, non-draining instance that serves the model, as the proxy sees it."""

    name: str
    in_flight: int
    """The proxy's requests of the model in flight there."""
    slots: int | None
    """The gate's dispatch slots for the model there (None: the gate does not exist yet)."""
    busy: float | None
    """Share of its model instances executing, in [0, 1] (None: unknown)."""


@dataclass(frozen=True)
class Headroom:
    ok: bool
    reason: str
    """``ok``, ``no_other_instance``, ``slots`` or ``busy`` (the first condition that failed)."""
    detail: str
    """The figures behind it, for the log line."""


def busy_share(exec_rate: float, compute_us: float | None, model_instances: int) -> float | None:
    """``u = min(1, exec_rate * compute_s / model_instances)``; 0 without executions, None when
    there were executions but no compute time is known."""
    if exec_rate <= 0:
        return 0.0
    if compute_us is None:
        return None
    return min(1.0, exec_rate * compute_us / 1e6 / max(1, model_instances))


def load_of(loads: Sequence[InstanceLoad], queued: int) -> int:
    """``L_now``: the model's requests in flight on its instances plus those queued in the
    proxy."""
    return sum(i.in_flight for i in loads) + queued


def check(drain: str, loads: Sequence[InstanceLoad], load: float, ratio: float) -> Headroom:
    """May ``drain`` leave the rotation while the others in ``loads`` carry ``load`` (``L``,
    see the module docstring)? ``loads`` holds every healthy, non-draining instance that serves
    the model, ``drain`` among them."""
    others = [i for i in loads if i.name != drain]
    if not others:
        return Headroom(False, "no_other_instance", f"no instance but {drain} serves the model")
    slots = [i.slots for i in others]
    if all(s is not None for s in slots):
        room = sum(s for s in slots if s is not None)
        if load > ratio * room:
            return Headroom(
                False,
                "slots",
                f"{load:.1f} requests in the proxy > {ratio:g} x {room} slots on the others",
            )
    busy = [i.busy for i in loads]
    known = [b for b in busy if b is not None]
    if known:
        # Unknown instances count as busy as the busiest known one.
        used = sum(known) + max(known) * (len(busy) - len(known))
        if used > ratio * len(others):
            return Headroom(
                False,
                "busy",
                f"{used:.2f} instances busy > {ratio:g} x {len(others)} other instance(s)",
            )
    return Headroom(True, "ok", f"load {load:.1f} fits on {len(others)} other instance(s)")


def check_all(
    drains: Sequence[str], loads: Sequence[InstanceLoad], load: float, ratio: float
) -> Headroom:
    """:func:`check` for every instance a change will drain; the first that fails decides."""
    verdict = Headroom(True, "ok", "nothing to drain")
    for name in drains:
        verdict = check(name, loads, load, ratio)
        if not verdict.ok:
            return verdict
    return verdict
