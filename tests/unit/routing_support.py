"""Builders shared by the routing tests."""

from __future__ import annotations

from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.routing.base import Candidate

MODEL = "m"


def cand(
    name: str,
    *,
    in_flight: int = 0,
    model_in_flight: int | None = None,
    connections: int = 0,
    snapshot: InstanceSnapshot | None = None,
    stale: bool = False,
    weight: float = 1.0,
) -> Candidate:
    return Candidate(
        name=name,
        in_flight=in_flight,
        model_in_flight=in_flight if model_in_flight is None else model_in_flight,
        connections=connections,
        snapshot=snapshot,
        stale=stale,
        weight=weight,
    )


def snap(
    taken_at: float = 0.0,
    *,
    pending: float = 0.0,
    queue_us: float | None = None,
    queue_us_p95: float | None = None,
    kv: float | None = None,
    gpu_mem: float | None = None,
    model: str = MODEL,
) -> InstanceSnapshot:
    load = ModelLoad(pending=pending, queue_us=queue_us, queue_us_p95=queue_us_p95)
    return InstanceSnapshot(
        taken_at=taken_at,
        models={model: load},
        kv_cache_fraction=kv,
        gpu_memory_fraction=gpu_mem,
    )
