"""Triton's Prometheus text, parsed into raw per-model samples and windowed into snapshots.

Two pure pieces, no I/O:

* :func:`parse` reads the text of ``:8002/metrics`` and keeps only the series named in
  :data:`METRICS`, the one table that maps Triton metric names to our field names.
* :class:`LoadTracker` turns successive parses of one instance (with the clock time each was
  taken) into a frozen :class:`~proxy.fleet.snapshot.InstanceSnapshot`: means per request
  from counter deltas over a sliding window, surviving counter resets (a model reload sets its
  counters back to 0).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad

Scope = Literal["model", "instance"]
Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class MetricSpec:
    """How one Triton series maps to a field of :class:`Scrape`."""

    name: str
    """Triton metric name."""
    field: str
    """Our field name."""
    scope: Scope
    """``model``: labelled ``model``/``version``; ``instance``: whole server (GPU, CPU)."""
    kind: Kind
    """Counters get reset-aware deltas; gauges are read as they are."""
    label: tuple[str, str] | None = None
    """Only series with this ``(label, value)`` pair (TensorRT-LLM multiplexes one name)."""


_C: Final = "counter"
_G: Final = "gauge"

METRICS: Final[tuple[MetricSpec, ...]] = (
    # Per model and version (Triton core).
    MetricSpec("nv_inference_request_success", "success", "model", _C),
    MetricSpec("nv_inference_request_failure", "failure", "model", _C),
    MetricSpec("nv_inference_count", "inferences", "model", _C),
    MetricSpec("nv_inference_exec_count", "executions", "model", _C),
    MetricSpec("nv_inference_request_duration_us", "request_us", "model", _C),
    MetricSpec("nv_inference_queue_duration_us", "queue_us", "model", _C),
    MetricSpec("nv_inference_compute_input_duration_us", "compute_input_us", "model", _C),
    MetricSpec("nv_inference_compute_infer_duration_us", "compute_infer_us", "model", _C),
    MetricSpec("nv_inference_compute_output_duration_us", "compute_output_us", "model", _C),
    MetricSpec("nv_inference_pending_request_count", "pending", "model", _G),
    # Per model (TensorRT-LLM backend).
    MetricSpec(
        "nv_trt_llm_kv_cache_block_metrics", "kv_used", "model", _G, ("kv_cache_block_type", "used")
    ),
    MetricSpec(
        "nv_trt_llm_kv_cache_block_metrics", "kv_max", "model", _G, ("kv_cache_block_type", "max")
    ),
    MetricSpec(
        "nv_trt_llm_kv_cache_block_metrics",
        "kv_fraction",
        "model",
        _G,
        ("kv_cache_block_type", "fraction"),
    ),
    MetricSpec("nv_trt_llm_request_metrics", "llm_active", "model", _G, ("request_type", "active")),
    MetricSpec(
        "nv_trt_llm_request_metrics", "llm_waiting", "model", _G, ("request_type", "waiting")
    ),
    # Whole server; GPU series carry a gpu_uuid label each.
    MetricSpec("nv_gpu_utilization", "gpu_utilization", "instance", _G),
    MetricSpec("nv_gpu_memory_used_bytes", "gpu_memory_used", "instance", _G),
    MetricSpec("nv_gpu_memory_total_bytes", "gpu_memory_total", "instance", _G),
    MetricSpec("nv_cpu_utilization", "cpu_utilization", "instance", _G),
    MetricSpec("nv_cpu_memory_used_bytes", "cpu_memory_used", "instance", _G),
    MetricSpec("nv_cpu_memory_total_bytes", "cpu_memory_total", "instance", _G),
)
"""Every Triton metric the proxy reads, and nothing else."""

COUNTER_FIELDS: Final[frozenset[str]] = frozenset(s.field for s in METRICS if s.kind == _C)

_BY_NAME: Final[Mapping[str, tuple[MetricSpec, ...]]] = {
    name: tuple(s for s in METRICS if s.name == name) for name in {s.name for s in METRICS}
}

_MEAN_FIELDS: Final = frozenset({"gpu_utilization"})
"""Instance fields averaged over GPUs; every other repeated field is summed."""

SeriesKey = tuple[str, str]
"""``(model, version)``."""


@dataclass(frozen=True)
class Scrape:
    """One parse of one instance's metrics text."""

    series: Mapping[SeriesKey, Mapping[str, float]] = field(default_factory=dict)
    """Per ``(model, version)``: field -> value (repeated series, e.g. failure reasons, summed)."""
    instance: Mapping[str, float] = field(default_factory=dict)
    """Server-wide fields (GPU utilization averaged over GPUs, bytes summed)."""


def _parse_labels(line: str, start: int) -> tuple[dict[str, str], int]:
    """Labels from ``line[start:]`` (just after ``{``); returns them and the index after ``}``."""
    labels: dict[str, str] = {}
    i = start
    n = len(line)
    while True:
        while i < n and line[i] in " ,":
            i += 1
        if i >= n:
            raise ValueError(f"unterminated labels in {line!r}")
        if line[i] == "}":
            return labels, i + 1
        eq = line.find("=", i)
        if eq < 0 or eq + 1 >= n or line[eq + 1] != '"':
            raise ValueError(f"bad label in {line!r}")
        key = line[i:eq].strip()
        i = eq + 2
        chars: list[str] = []
        while True:
            if i >= n:
                raise ValueError(f"unterminated label value in {line!r}")
            c = line[i]
            if c == "\\" and i + 1 < n:
                nxt = line[i + 1]
                chars.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                chars.append(c)
                i += 1
        labels[key] = "".join(chars)


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample whose name is in :data:`METRICS`."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        end = 0
        while end < len(line) and line[end] not in "{ \t":
            end += 1
        name = line[:end]
        if name not in _BY_NAME:
            continue
        labels: dict[str, str] = {}
        rest = end
        if end < len(line) and line[end] == "{":
            labels, rest = _parse_labels(line, end + 1)
        parts = line[rest:].split()
        if not parts:
            raise ValueError(f"sample without a value: {line!r}")
        yield name, labels, float(parts[0])


def parse(text: str) -> Scrape:
    """Parse Triton's Prometheus text format, keeping only the series in :data:`METRICS`.

    Raises ValueError on a malformed line of a series we read; other lines are not looked at.
    A model-scoped series without a ``model`` label is ignored.
    """
    series: dict[SeriesKey, dict[str, float]] = {}
    inst: dict[str, list[float]] = {}
    for name, labels, value in _samples(text):
        for spec in _BY_NAME[name]:
            if spec.label is not None and labels.get(spec.label[0]) != spec.label[1]:
                continue
            if spec.scope == "instance":
                inst.setdefault(spec.field, []).append(value)
                continue
            model = labels.get("model")
            if model is None:
                continue
            fields = series.setdefault((model, labels.get("version", "")), {})
            fields[spec.field] = fields.get(spec.field, 0.0) + value
    instance = {k: (sum(v) / len(v) if k in _MEAN_FIELDS else sum(v)) for k, v in inst.items() if v}
    return Scrape(series=series, instance=instance)


@dataclass(frozen=True)
class _Point:
    """One scrape in the window: reset-adjusted cumulative counters per series."""

    at: float
    counters: Mapping[SeriesKey, Mapping[str, float]]
    queue_us: Mapping[str, float]
    """Per model: mean queue µs per request between the previous scrape and this one."""


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _fraction(used: float | None, total: float | None) -> float | None:
    if used is None or total is None or total <= 0:
        return None
    return used / total


class LoadTracker:
    """Sliding window over successive scrapes of ONE instance, producing snapshots.

    Counters: each series keeps a reset-adjusted running total. A delta below zero means the
    model was reloaded (Triton restarted its counters at 0), so the new value itself is the
    delta. A series that appears after the first scrape (a model loaded in between) counts from
    0. Window figures are differences between the newest point and the newest point at or
    before ``now - window_s``:

    * ``queue_us = Δqueue_duration_us / Δrequest_success`` (mean µs per request);
    * ``compute_us = Δ(compute_input + compute_infer + compute_output)_us / Δrequest_success``;
    * ``exec_rate = Δexec_count / Δt``, ``request_rate = Δrequest_success / Δt``,
      ``failure_rate = Δrequest_failure / Δt``;
    * ``mean_batch = Δinference_count / Δexec_count``;
    * ``queue_us_p95``: nearest-rank P95 of the per-scrape-interval mean queue time, over the
      intervals in the window that saw requests.

    Gauges (pending requests, GPU/CPU, KV cache) come from the newest scrape; versions of one
    model are summed. KV-cache use is the backend's own ``fraction`` (highest version), else
    ``used / max``; the server-wide figure is the fullest model's.
    """

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._points: deque[_Point] = deque()
        self._raw: dict[SeriesKey, Mapping[str, float]] = {}
        self._adjusted: dict[SeriesKey, dict[str, float]] = {}

    def observe(self, scrape: Scrape, at: float) -> InstanceSnapshot:
        """Add the scrape taken at clock time ``at`` and return the new snapshot."""
        if self._points and at < self._points[-1].at:
            raise ValueError(f"scrape time went backwards ({at} < {self._points[-1].at})")
        first = not self._points
        prev_adjusted = {k: dict(v) for k, v in self._adjusted.items()}
        for key, fields in scrape.series.items():
            old = self._raw.get(key)
            acc = self._adjusted.setdefault(key, {})
            for name in COUNTER_FIELDS:
                value = fields.get(name)
                if value is None:
                    continue
                if first:
                    delta = 0.0
                elif old is None or name not in old:
                    delta = value  # appeared since the last scrape: counted from 0
                else:
                    delta = value - old[name]
                    if delta < 0:
                        delta = value  # counter reset (model reload)
                acc[name] = acc.get(name, 0.0) + delta
        self._raw = {k: dict(v) for k, v in scrape.series.items()}
        # Series that vanished keep their adjusted totals so a later return cannot go negative.

        interval_queue: dict[str, float] = {}
        if not first:
            for model, (dq, ds) in self._model_deltas(
                prev_adjusted, self._adjusted, ("queue_us", "success")
            ).items():
                mean = _ratio(dq, ds)
                if mean is not None:
                    interval_queue[model] = mean
        counters = {k: dict(v) for k, v in self._adjusted.items()}
        self._points.append(_Point(at=at, counters=counters, queue_us=interval_queue))
        start = at - self.window_s
        while len(self._points) >= 2 and self._points[1].at <= start:
            self._points.popleft()
        return self._snapshot(scrape, at)

    @staticmethod
    def _model_deltas(
        old: Mapping[SeriesKey, Mapping[str, float]],
        new: Mapping[SeriesKey, Mapping[str, float]],
        names: tuple[str, ...],
    ) -> dict[str, tuple[float, ...]]:
        """Per model, the deltas of ``names`` from ``old`` to ``new``, summed over versions."""
        out: dict[str, list[float]] = {}
        for (model, version), fields in new.items():
            before = old.get((model, version), {})
            acc = out.setdefault(model, [0.0] * len(names))
            for i, name in enumerate(names):
                acc[i] += fields.get(name, 0.0) - before.get(name, 0.0)
        return {m: tuple(v) for m, v in out.items()}

    def _snapshot(self, scrape: Scrape, at: float) -> InstanceSnapshot:
        oldest, newest = self._points[0], self._points[-1]
        dt = newest.at - oldest.at
        names = (
            "success",
            "failure",
            "inferences",
            "executions",
            "queue_us",
            "compute_input_us",
            "compute_infer_us",
            "compute_output_us",
        )
        deltas = self._model_deltas(oldest.counters, newest.counters, names)
        gauges: dict[str, dict[str, float]] = {}
        kv_fraction: dict[str, float] = {}
        for (model, _version), fields in scrape.series.items():
            acc = gauges.setdefault(model, {})
            for name in ("pending", "kv_used", "kv_max", "llm_active", "llm_waiting"):
                if name in fields:
                    acc[name] = acc.get(name, 0.0) + fields[name]
            if "kv_fraction" in fields:
                kv_fraction[model] = max(kv_fraction.get(model, 0.0), fields["kv_fraction"])
        models: dict[str, ModelLoad] = {}
        for model in gauges:
            succ, fail, inf, execs, queue, c_in, c_inf, c_out = deltas.get(model, (0.0,) * 8)
            g = gauges[model]
            kv = kv_fraction.get(model, _fraction(g.get("kv_used"), g.get("kv_max")))
            samples = [p.queue_us[model] for p in list(self._points)[1:] if model in p.queue_us]
            models[model] = ModelLoad(
                pending=g.get("pending", 0.0),
                queue_us=_ratio(queue, succ),
                compute_us=_ratio(c_in + c_inf + c_out, succ),
                queue_us_p95=_p95(samples),
                exec_rate=execs / dt if dt > 0 else 0.0,
                request_rate=succ / dt if dt > 0 else 0.0,
                mean_batch=_ratio(inf, execs),
                failure_rate=fail / dt if dt > 0 else 0.0,
                kv_cache_fraction=kv,
            )
        return InstanceSnapshot(
            taken_at=at,
            models=models,
            gpu_utilization=scrape.instance.get("gpu_utilization"),
            gpu_memory_fraction=_fraction(
                scrape.instance.get("gpu_memory_used"), scrape.instance.get("gpu_memory_total")
            ),
            cpu_utilization=scrape.instance.get("cpu_utilization"),
            cpu_memory_fraction=_fraction(
                scrape.instance.get("cpu_memory_used"), scrape.instance.get("cpu_memory_total")
            ),
            kv_cache_fraction=max(
                (m.kv_cache_fraction for m in models.values() if m.kv_cache_fraction is not None),
                default=None,
            ),
            active_requests=_sum_present(gauges, "llm_active"),
            waiting_requests=_sum_present(gauges, "llm_waiting"),
        )


def _sum_present(gauges: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    values = [g[name] for g in gauges.values() if name in g]
    return sum(values) if values else None
