"""Frozen views of one Triton instance's load, as scraped from its /metrics.

The scraper (``proxy.fleet.scraper``) builds these; routing policies only read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelLoad:
    """Load of one model on one instance, averaged over the scrape window."""

    pending: float = 0.0
    """``nv_inference_pending_request_count``: requests queued in Triton, not yet executing."""
    queue_us: float | None = None
    """Mean queue time per request over the window (µs); None without traffic in the window."""
    compute_us: float | None = None
    """Mean compute (input + infer + output) time per request over the window (µs)."""
    queue_us_p95: float | None = None
    """P95 over the window of the per-scrape mean queue time (µs), for instance feedback."""
    exec_rate: float = 0.0
    """Batches executed per second over the window."""
    request_rate: float = 0.0
    """Successful requests per second over the window."""
    mean_batch: float | None = None
    """Inferences per execution over the window."""
    failure_rate: float = 0.0
    """Failed requests per second over the window (all ``reason`` labels)."""
    kv_cache_fraction: float | None = None
    """TensorRT-LLM KV-cache blocks used / max for this model, when exported."""


NO_LOAD = ModelLoad()
"""The load of a model a snapshot does not mention (frozen, so one instance serves all)."""


@dataclass(frozen=True)
class InstanceSnapshot:
    """Everything scraped from one instance at ``taken_at`` (clock seconds)."""

    taken_at: float
    models: Mapping[str, ModelLoad] = field(default_factory=dict)
    gpu_utilization: float | None = None
    gpu_memory_fraction: float | None = None
    cpu_utilization: float | None = None
    cpu_memory_fraction: float | None = None
    kv_cache_fraction: float | None = None
    """TensorRT-LLM KV-cache blocks used / max, when the backend exports it."""
    active_requests: float | None = None
    """TensorRT-LLM active requests, when exported."""
    waiting_requests: float | None = None
    """TensorRT-LLM requests waiting for a slot, when exported."""

    def model(self, name: str) -> ModelLoad:
        # One shared empty load: ``get(name, ModelLoad())`` built the default on every call,
        # found or not (3 µs of a 9-field frozen __init__, paid per score in routing).
        return self.models.get(name, NO_LOAD)
