"""``bench --trace``: what each Triton's batcher did while a run went on, beside the proxy's own
counts, one line per probe sample (``trace.txt`` beside ``report.txt``).

The load probe already reads each Triton's ``/metrics`` and the proxy's every 0.5 s
(:func:`proxy.bench.arms.proxy_probe`). With ``--trace`` the same scrapes keep four of
Triton's counters for the scenario's model and the proxy's in-flight count by class; between
two samples they give, per server:

* rows per batch = Δ``nv_inference_count`` / Δ``nv_inference_exec_count`` (how full the
  batches ran: near ``max_batch_size`` is a fleet at its limit);
* batch time = Δ``nv_inference_compute_infer_duration_us`` / Δ``nv_inference_request_success``
  (Triton charges every request of a batch the batch's compute time, so this is the mean time
  of the batches that ran, weighted by their requests: long rows padding a batch show here);
* batches per second, and the requests queued in Triton (the gauge at the sample).

This is how round 32 found the long lane's overflow (docs/benchmarks.md): within a second of
an online burst every server ran 16-row padded batches with 40-87 queued, to the end of the
run. Off by default: a benchmark's figures are taken without it (the extra lines parsed in the
load generator's loop are small, but not nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from proxy.bench.runner import OneScrapeProbe, PrometheusGaugeProbe

TRITON_COUNTERS = {
    "nv_inference_exec_count": " batches",
    "nv_inference_count": " rows",
    "nv_inference_request_success": " requests",
    "nv_inference_compute_infer_duration_us": " compute us",
}
"""Triton's counters the trace keeps, by the suffix of their probe keys (``t0 rows``)."""
CLASS_IN_FLIGHT = "triton_proxy_class_in_flight"
CLASS_SUFFIX = " class in flight"
"""Probe keys ``<class> class in flight``: the proxy's requests of the model in flight."""
MODEL_GAUGES = {
    "triton_proxy_model_fill": " fill",
    "triton_proxy_model_long_load": " long load",
}
"""The proxy's model gauges the trace keeps beside its occupancy (``proxy.routing.occupancy``:
what decides whether long work is packed), by the suffix of their probe keys."""
OCCUPANCY_KEY = "proxy occupancy"
"""The probe key of the proxy's busy share (read by every proxy arm's probe)."""
TRACE_SUFFIXES = (*TRITON_COUNTERS.values(), CLASS_SUFFIX, *MODEL_GAUGES.values())

Sample = tuple[float, Mapping[str, float]]


def is_trace_key(key: str) -> bool:
    """A probe key only the trace reads (a counter or a class's count), not an instance's
    load: it stays out of the load series and their plot."""
    return key.endswith(TRACE_SUFFIXES)


def triton_counter_probes(
    urls: Mapping[str, str], model: str
) -> list[tuple[PrometheusGaugeProbe, str]]:
    """One probe per counter of :data:`TRITON_COUNTERS` over the Triton pages ``urls``, for
    a :class:`~proxy.bench.runner.OneScrapeProbe` that also reads their queue gauge."""
    return [
        (PrometheusGaugeProbe(urls, metric, {"model": model}), suffix)
        for metric, suffix in TRITON_COUNTERS.items()
    ]


def class_probe(page: Mapping[str, str], model: str) -> tuple[PrometheusGaugeProbe, str]:
    """The proxy's in-flight count of ``model`` by class, from its page ``page``."""
    probe = PrometheusGaugeProbe(page, CLASS_IN_FLIGHT, {"model": model}, split_label="class")
    return probe, CLASS_SUFFIX


def model_probes(page: Mapping[str, str], model: str) -> list[tuple[PrometheusGaugeProbe, str]]:
    """The proxy's fill and long load of ``model`` (:data:`MODEL_GAUGES`), from its page."""
    return [
        (PrometheusGaugeProbe(page, metric, {"model": model}), suffix)
        for metric, suffix in MODEL_GAUGES.items()
    ]


def with_counters(pending: PrometheusGaugeProbe, model: str, suffix: str = "") -> OneScrapeProbe:
    """``pending`` (Triton's queue gauge; its keys get ``suffix``) and the trace's counters,
    from one scrape of each Triton page."""
    return OneScrapeProbe([(pending, suffix), *triton_counter_probes(pending.urls, model)])


def render_trace(samples: Sequence[Sample], servers: Sequence[str]) -> str:
    """One line per sample after the first (module doc):

    ``t  classes in flight | occupancy, fill, long load | server: rows per batch, batch ms,
    batches/s, queued, proxy in flight | ...``; ``-`` where no batch ran there between the
    two samples, ``?`` where a sample lacks the figure (an endpoint that did not answer; the
    fill and long load where the proxy's configuration has none)."""
    classes = sorted(
        {k.removesuffix(CLASS_SUFFIX) for _, s in samples for k in s if k.endswith(CLASS_SUFFIX)}
    )
    gauged = any(OCCUPANCY_KEY in s for _, s in samples)
    gauges = (OCCUPANCY_KEY, *(f"proxy{suffix}" for suffix in MODEL_GAUGES.values()))
    head = "   t s | in flight " + "/".join(classes) if classes else "   t s"
    if gauged:
        head += " | occ  fill  long"
    cells = " | ".join(f"{n}: rows/batch  batch ms  batches/s  queued  proxy" for n in servers)
    lines = [f"{head} | {cells}"]
    for (t0, prev), (t1, now) in itertools.pairwise(samples):
        dt = t1 - t0
        row = [f"{t1:6.1f}"]
        if classes:
            row.append(" " + "/".join(_count(now.get(c + CLASS_SUFFIX)) for c in classes))
        if gauged:
            row.append(" ".join(_share(now.get(k)) for k in gauges))
        row += [_server(n, prev, now, dt) for n in servers]
        lines.append(" | ".join(row))
    return "\n".join(lines)


def _server(name: str, prev: Mapping[str, float], now: Mapping[str, float], dt: float) -> str:
    def delta(suffix: str) -> float | None:
        a, b = prev.get(name + suffix), now.get(name + suffix)
        return None if a is None or b is None else b - a

    batches, rows = delta(" batches"), delta(" rows")
    requests, compute = delta(" requests"), delta(" compute us")
    if batches is None or rows is None or requests is None or compute is None:
        per_batch = batch_ms = rate = "?"
    elif batches <= 0 or requests <= 0:
        per_batch, batch_ms, rate = "-", "-", "0"
    else:
        per_batch = f"{rows / batches:.1f}"
        batch_ms = f"{compute / requests / 1000:.0f}"
        rate = f"{batches / dt:.1f}" if dt > 0 else "?"
    queued = now.get(name + " queued", now.get(name))
    proxy = now.get(name + " proxy in flight")
    return (
        f"{name}: {per_batch:>5} {batch_ms:>5} {rate:>5} {_count(queued):>4} "
        f"{_count(proxy) if proxy is not None else '':>4}"
    )


def _count(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def _share(value: float | None) -> str:
    return "   ?" if value is None else f"{value:4.2f}"
