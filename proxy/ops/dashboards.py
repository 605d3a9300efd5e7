"""The Grafana dashboards, generated from Python: ``python -m proxy.ops.dashboards``.

Each dashboard is a list of rows of panels; a panel is a title, a unit and PromQL targets. The
JSON written to ``docker/grafana/dashboards/`` is Grafana's dashboard model (``schemaVersion``
39, Grafana 11), provisioned by ``docker/grafana/provisioning/``. Every dashboard has a
``datasource`` variable and the ``model``, ``class`` and ``instance`` variables it filters on
(multi-value, "All" = ``.*``). ``--check`` fails when the committed files differ from what this
module generates; the test suite runs that check.

Where the numbers come from:

- the proxy's own metrics (``proxy/telemetry.py``, ``proxy/runtime.py``), scraped with
  ``honor_labels: true`` so that its ``instance`` label (a Triton instance's name in the policy)
  wins over Prometheus' target label;
- each Triton server's ``/metrics`` (``nv_inference_*``, ``nv_gpu_*``, ``nv_cpu_*``), scraped
  with ``instance`` set to the same name as in the policy, so both sides join on ``instance``.

One explicit list keeps panels out of the pass/fail set of the Prometheus proof
(``tests/integration/test_dashboards_prometheus.py``), which reports them instead:
:data:`GPU_METRICS`, since Triton exports ``nv_gpu_*`` only where it sees a GPU. Every other
query must return data there, the control dashboard's included (the proof runs the control
loops in dry run).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from proxy.scheduling.queues import FLOOR_AIM

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "docker" / "grafana" / "dashboards"
SCHEMA_VERSION = 39
RATE = "$__rate_interval"

GPU_METRICS = frozenset(
    {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
)
"""Triton exports these only where it sees a GPU."""

Requirement = Literal["gpu"]
_METRIC = re.compile(r"\b((?:triton_proxy|nv)_[a-zA-Z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """The proxy and Triton metric names an expression reads."""
    return set(_METRIC.findall(expr))


def requirement(expr: str) -> Requirement | None:
    """Why a query may rightly return nothing: ``gpu`` (no GPU, no ``nv_gpu_*``); else None."""
    names = metric_names(expr)
    if names & GPU_METRICS:
        return "gpu"
    return None


# --- model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    description: str = ""
    kind: Literal["timeseries", "stat"] = "timeseries"
    width: int = 12
    height: int = 8
    dashed: str | None = None
    """Regex of series names drawn as dashed lines (SLO lines)."""
    max: float | None = None
    thresholds: tuple[tuple[float, str], ...] = ()
    """(value, colour) steps above the base colour; shown as lines on time series."""


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = field(default=("triton-proxy",))

    def panels(self) -> Iterator[Panel]:
        for row in self.rows:
            yield from row.panels


# Which metric each template variable takes its values from.
VARIABLES: dict[str, tuple[str, str]] = {
    "model": ("Model", "label_values(triton_proxy_requests_total, model)"),
    "class": ("Class", "label_values(triton_proxy_requests_total, class)"),
    "instance": ("Instance", "label_values(triton_proxy_instance_healthy, instance)"),
}


# --- PromQL helpers ---------------------------------------------------------------------------
def sel(metric: str, *filters: str, extra: str = "") -> str:
    """``metric{label=~"$label",...}`` for the template variables in ``filters``."""
    matchers = [f'{f}=~"${f}"' for f in filters]
    if extra:
        matchers.append(extra)
    return f"{metric}{{{','.join(matchers)}}}"


def agg(op: str, by: str, expr: str) -> str:
    """``op by (by) (expr)``; ``by`` empty: ``op(expr)``."""
    return f"{op} by ({by}) ({expr})" if by else f"{op}({expr})"


def rate_sum(metric: str, by: str, *filters: str, extra: str = "") -> str:
    return f"sum by ({by}) (rate({sel(metric, *filters, extra=extra)}[{RATE}]))"


def quantile(q: float, histogram: str, by: str, *filters: str) -> str:
    inner = rate_sum(f"{histogram}_bucket", f"{by}, le", *filters)
    return f"histogram_quantile({q}, {inner})"


def per_request_us(parts: Sequence[str], by: str) -> str:
    """Mean Triton time per request in seconds from its cumulative ``*_duration_us`` counters."""
    num = " + ".join(rate_sum(p, by, "model", "instance") for p in parts)
    den = rate_sum("nv_inference_request_success", by, "model", "instance")
    return f"({num}) / {den} / 1e6"


def quantiles(
    histogram: str, by: str, filters: tuple[str, ...], qs: Sequence[float]
) -> tuple[Target, ...]:
    return tuple(
        Target(quantile(q, histogram, by, *filters), f"{{{{{by}}}}} P{round(q * 100)}") for q in qs
    )


# --- the dashboards ---------------------------------------------------------------------------
def overview() -> Dashboard:
    mc = ("model", "class")
    latency = (
        *quantiles("triton_proxy_request_duration_seconds", "class", mc, (0.5, 0.95, 0.99)),
        Target('max by (class) (triton_proxy_class_slo_seconds{class=~"$class"})', "{{class}} SLO"),
    )
    slo = "triton_proxy_slo_requests_total"
    met, missed = (sel(slo, *mc, extra=f'result="{r}"') for r in ("met", "missed"))
    # "or missed * 0": a class whose every request missed reads 0%, not nothing.
    attainment = Target(
        f"sum by (class) (rate({met}[{RATE}]) or rate({missed}[{RATE}]) * 0)"
        f" / {rate_sum(slo, 'class', *mc)}",
        "{{class}}",
    )
    return Dashboard(
        uid="triton-proxy-overview",
        title="triton-proxy / Overview",
        description="Per-class tail latency against the SLO, attainment, throughput, sheds.",
        variables=("model", "class", "instance"),
        rows=(
            Row(
                "Latency against the SLO",
                (
                    Panel(
                        "Latency P50 / P95 / P99 by class, with the SLO",
                        latency,
                        unit="s",
                        width=16,
                        dashed=".* SLO$",
                        description="Arrival at the proxy to the last response byte. Dashed: "
                        "the class's slo_p99_ms from the policy.",
                    ),
                    Panel(
                        "SLO attainment",
                        (attainment,),
                        unit="percentunit",
                        kind="stat",
                        width=8,
                        thresholds=((0.95, "orange"), (0.99, "green")),
                        description="Share of requests of classes with an SLO that finished "
                        "within it and were not shed (objective: 99%).",
                    ),
                ),
            ),
            Row(
                "Traffic",
                (
                    Panel(
                        "Throughput by outcome",
                        (
                            Target(
                                rate_sum("triton_proxy_requests_total", "outcome", *mc, "instance"),
                                "{{outcome}}",
                            ),
                        ),
                        unit="reqps",
                        width=8,
                        description="Outcome: the HTTP status Triton answered, ok for gRPC, "
                        "shed_* for the proxy's 429s, or the proxy's own error.",
                    ),
                    Panel(
                        "Throughput by class",
                        (
                            Target(
                                rate_sum("triton_proxy_requests_total", "class", *mc), "{{class}}"
                            ),
                        ),
                        unit="reqps",
                        width=8,
                    ),
                    Panel(
                        "Sheds and floor boosts by class",
                        (
                            Target(
                                rate_sum("triton_proxy_shed_total", "class, reason", "class"),
                                "{{class}} {{reason}}",
                            ),
                            Target(
                                rate_sum("triton_proxy_boosted_total", "class", "class"),
                                "{{class}} boosted",
                            ),
                        ),
                        unit="reqps",
                        width=8,
                        description="429 / RESOURCE_EXHAUSTED: queue_full, timeout (waited "
                        "past queue_timeout_s), overload or late (deadline admission). "
                        "boosted: requests of a class starved of its min_share floor sent at "
                        "the top class's Triton priority (scheduling.starved_after_s).",
                    ),
                ),
            ),
            Row(
                "Canary arms (policy canary: section; only main without one)",
                (
                    Panel(
                        "P99 by class and arm",
                        (
                            Target(
                                quantile(
                                    0.99, "triton_proxy_request_duration_seconds", "class, arm", *mc
                                ),
                                "{{class}} {{arm}}",
                            ),
                        ),
                        unit="s",
                        width=12,
                        description="`triton-proxy canary --window 30m` prints these side by "
                        "side with a bootstrap interval of the difference.",
                    ),
                    Panel(
                        "Throughput by arm and outcome",
                        (
                            Target(
                                rate_sum("triton_proxy_requests_total", "arm, outcome", *mc),
                                "{{arm}} {{outcome}}",
                            ),
                        ),
                        unit="reqps",
                        width=12,
                    ),
                ),
            ),
        ),
    )


def queues() -> Dashboard:
    mi = ("model", "instance")
    return Dashboard(
        uid="triton-proxy-queues",
        title="triton-proxy / Queues",
        description="Where requests wait: the proxy's class queues, then Triton's own queue.",
        variables=("model", "class", "instance"),
        rows=(
            Row(
                "Proxy class queues",
                (
                    Panel(
                        "Proxy queue wait P50 / P99 by class",
                        quantiles(
                            "triton_proxy_queue_wait_seconds", "class", ("class",), (0.5, 0.99)
                        ),
                        unit="s",
                        width=6,
                    ),
                    Panel(
                        "Requests queued in the proxy by class",
                        (
                            Target(
                                agg(
                                    "sum",
                                    "class",
                                    sel("triton_proxy_class_queued", "model", "class"),
                                ),
                                "{{class}}",
                            ),
                        ),
                        width=6,
                    ),
                    Panel(
                        "Dispatched and running by class, and gate capacity",
                        (
                            Target(
                                agg(
                                    "sum",
                                    "class",
                                    sel("triton_proxy_class_in_flight", "model", "class"),
                                ),
                                "{{class}}",
                            ),
                            Target(
                                f"sum({sel('triton_proxy_model_capacity', 'model')})",
                                "capacity",
                            ),
                        ),
                        width=6,
                        dashed="capacity",
                    ),
                    Panel(
                        "Floor debt by class (device-seconds owed)",
                        (
                            Target(
                                agg(
                                    "sum",
                                    "class",
                                    sel("triton_proxy_class_floor_debt_seconds", "model", "class"),
                                ),
                                "{{class}}",
                            ),
                        ),
                        unit="s",
                        width=6,
                        description="The floor boost's account (scheduling.starved_after_s): "
                        f"device time a class with a min_share is owed at {FLOOR_AIM:g} times "
                        "its share of the fleet, less what its answers took. It boosts once "
                        f"this reaches starved_after_s x {FLOOR_AIM:g} x min_share x instances "
                        "(per worker with serve --workers N: that / N); 0 while served at its "
                        "share.",
                    ),
                ),
            ),
            Row(
                "Triton, per instance (from Triton's nv_inference_* metrics)",
                (
                    Panel(
                        "Triton queue time per request",
                        (
                            Target(
                                per_request_us(["nv_inference_queue_duration_us"], "instance"),
                                "{{instance}}",
                            ),
                        ),
                        unit="s",
                        width=8,
                        description="rate(nv_inference_queue_duration_us) / "
                        "rate(nv_inference_request_success): mean time in Triton's scheduler "
                        "queue.",
                    ),
                    Panel(
                        "Triton compute time per request",
                        (
                            Target(
                                per_request_us(
                                    [
                                        "nv_inference_compute_input_duration_us",
                                        "nv_inference_compute_infer_duration_us",
                                        "nv_inference_compute_output_duration_us",
                                    ],
                                    "instance",
                                ),
                                "{{instance}}",
                            ),
                        ),
                        unit="s",
                        width=8,
                    ),
                    Panel(
                        "Triton queue depth (pending requests)",
                        (
                            Target(
                                agg(
                                    "sum",
                                    "instance",
                                    sel("nv_inference_pending_request_count", *mi),
                                ),
                                "{{instance}}",
                            ),
                        ),
                        width=8,
                    ),
                    Panel(
                        "Triton queue time as the proxy's router sees it",
                        (
                            Target(
                                agg(
                                    "max",
                                    "instance",
                                    sel("triton_proxy_scraped_queue_seconds", *mi),
                                ),
                                "{{instance}}",
                            ),
                        ),
                        unit="s",
                        width=12,
                        description="The proxy's own scrape of Triton (scrape.window_s), which "
                        "the load-aware policies read.",
                    ),
                    Panel(
                        "Triton pending requests as the proxy's router sees them",
                        (
                            Target(
                                agg(
                                    "sum",
                                    "instance",
                                    sel("triton_proxy_scraped_pending_requests", *mi),
                                ),
                                "{{instance}}",
                            ),
                        ),
                        width=12,
                    ),
                ),
            ),
        ),
    )


def instances() -> Dashboard:
    mi = ("model", "instance")
    ejections = sel("triton_proxy_ejections_total", "instance")
    return Dashboard(
        uid="triton-proxy-instances",
        title="triton-proxy / Instances",
        description="Each Triton instance: in rotation or not, load, GPU and CPU, feedback weight.",
        variables=("model", "instance"),
        rows=(
            Row(
                "Rotation",
                (
                    Panel(
                        "In rotation (1) or ejected (0)",
                        (Target(sel("triton_proxy_instance_healthy", "instance"), "{{instance}}"),),
                        width=8,
                        max=1.0,
                    ),
                    Panel(
                        "Ejections",
                        (
                            Target(
                                agg(
                                    "sum",
                                    "instance",
                                    f"increase({ejections}[{RATE}])",
                                ),
                                "{{instance}}",
                            ),
                        ),
                        width=8,
                        description="Failed readiness probes or connection errors that took "
                        "the instance out of rotation.",
                    ),
                    Panel(
                        "Age of the proxy's view of each Triton's metrics",
                        (
                            Target(
                                sel("triton_proxy_scrape_age_seconds", "instance"), "{{instance}}"
                            ),
                        ),
                        unit="s",
                        width=8,
                    ),
                    Panel(
                        "Requests in flight through the proxy",
                        (
                            Target(
                                sel("triton_proxy_instance_in_flight", "instance"), "{{instance}}"
                            ),
                        ),
                        width=8,
                    ),
                    Panel(
                        "Occupancy (share of each model's instances holding its work) and fill",
                        (
                            Target(sel("triton_proxy_model_occupancy", "model"), "{{model}}"),
                            Target(sel("triton_proxy_model_fill", "model"), "{{model}} fill"),
                        ),
                        unit="percentunit",
                        width=8,
                        max=1.0,
                        description="Smoothed over 2 s (proxy/routing/occupancy.py); "
                        "expected_start's pack_above packs long work only above it. Fill, "
                        "with routing.occupancy_depth: mean requests in flight per instance "
                        "over that share of max_batch_size, what packs an SLO class's long "
                        "work.",
                    ),
                    Panel(
                        "Long load of the SLO classes (instances' worth of full batches)",
                        (Target(sel("triton_proxy_model_long_load", "model"), "{{model}}"),),
                        width=8,
                        description="Device time per second that the long requests of classes "
                        "without max_per_instance would take in full batches, on the learned "
                        "cost curve (proxy/routing/occupancy.py LongLoad). From "
                        "routing.fill_from_load on, the fill packs their long work; below it, "
                        "the occupancy.",
                    ),
                    Panel(
                        "Feedback weight (1 = no penalty)",
                        (
                            Target(
                                sel("triton_proxy_instance_feedback_weight", *mi),
                                "{{instance}} {{model}}",
                            ),
                        ),
                        width=8,
                        max=1.0,
                        description="Lowered while an instance's queue-wait P95 stays above "
                        "routing.feedback.queue_p95_threshold_us and peer_ratio x its peers'.",
                    ),
                ),
            ),
            Row(
                "Hardware (from Triton's metrics)",
                (
                    Panel(
                        "GPU utilisation",
                        (
                            Target(
                                sel("nv_gpu_utilization", "instance"), "{{instance}} {{gpu_uuid}}"
                            ),
                        ),
                        unit="percentunit",
                        width=12,
                        max=1.0,
                    ),
                    Panel(
                        "GPU memory used",
                        (
                            Target(
                                sel("nv_gpu_memory_used_bytes", "instance"),
                                "{{instance}} {{gpu_uuid}}",
                            ),
                            Target(
                                sel("nv_gpu_memory_total_bytes", "instance"),
                                "{{instance}} {{gpu_uuid}} total",
                            ),
                        ),
                        unit="bytes",
                        width=12,
                        dashed=".* total$",
                    ),
                    Panel(
                        "CPU utilisation",
                        (Target(sel("nv_cpu_utilization", "instance"), "{{instance}}"),),
                        unit="percentunit",
                        width=12,
                        max=1.0,
                    ),
                    Panel(
                        "CPU memory used",
                        (Target(sel("nv_cpu_memory_used_bytes", "instance"), "{{instance}}"),),
                        unit="bytes",
                        width=12,
                    ),
                ),
            ),
        ),
    )


def control() -> Dashboard:
    return Dashboard(
        uid="triton-proxy-control",
        title="triton-proxy / Control loops",
        description="The SLO control loops (docs/control.md): batching windows, class limits, "
        "adaptive concurrency and every decision, made or (in dry run) only reported.",
        variables=("model", "class", "instance"),
        rows=(
            Row(
                "Knobs",
                (
                    Panel(
                        "Batching window by model and instance",
                        (
                            Target(
                                sel("triton_proxy_batching_window_seconds", "model", "instance"),
                                "{{model}} {{instance}}",
                            ),
                        ),
                        unit="s",
                        description="Triton's max_queue_delay_microseconds on each instance, as "
                        "the batching-window loop last read or set it.",
                    ),
                    Panel(
                        "Class limits",
                        (
                            Target(
                                sel("triton_proxy_class_limit", "model", "class"),
                                "{{model}} {{class}}",
                            ),
                        ),
                        description="Share of the model's slots each class below the top one "
                        "may hold: max_share x the class-limit loop's factor (in dry run: what it "
                        "would set).",
                    ),
                    Panel(
                        "Adaptive concurrency per instance",
                        (
                            Target(
                                sel("triton_proxy_adaptive_concurrency", "model", "instance"),
                                "{{model}} {{instance}}",
                            ),
                            Target(
                                f"sum({sel('triton_proxy_model_capacity', 'model')})",
                                "gate capacity",
                            ),
                        ),
                        dashed="gate capacity",
                        description="Slots adaptive concurrency gives each instance for the model. "
                        "Dashed: the model gate's dispatch slots.",
                    ),
                ),
            ),
            Row(
                "Decisions",
                (
                    Panel(
                        "Decisions by loop, direction and reason",
                        (
                            Target(
                                "sum by (loop, direction, reason) (increase("
                                f"{sel('triton_proxy_control_decisions_total', 'model')}[{RATE}]))"
                                " or label_replace(sum by (loop, direction, reason) (increase("
                                f"{sel('triton_proxy_control_dry_run_decisions_total', 'model')}"
                                f'[{RATE}])), "mode", "dry run", "", "")',
                                "{{loop}} {{direction}} {{reason}} {{mode}}",
                            ),
                        ),
                        dashed=".* dry run$",
                        description="Changes the loops made; dashed: those they would have made "
                        "(control.dry_run).",
                    ),
                    Panel(
                        "Batching window: wanted against what each instance runs",
                        (
                            Target(
                                sel("triton_proxy_batching_window_target_seconds", "model"),
                                "{{model}} target",
                            ),
                            Target(
                                sel("triton_proxy_batching_window_seconds", "model", "instance"),
                                "{{model}} {{instance}}",
                            ),
                        ),
                        unit="s",
                        dashed=".* target$",
                        description="A gap that lasts is a loop whose changes do not land "
                        "(alert TritonProxyControlStuck).",
                    ),
                    Panel(
                        "Changes refused or failed",
                        (
                            Target(
                                "sum by (loop, model) (increase("
                                f"{sel('triton_proxy_control_apply_failures_total', 'model')}"
                                f"[{RATE}]))",
                                "{{loop}} {{model}} apply failed",
                            ),
                            Target(
                                "sum by (loop, model, reason) (increase("
                                f"{sel('triton_proxy_control_off_total', 'model')}[{RATE}]))",
                                "{{loop}} {{model}} off: {{reason}}",
                            ),
                        ),
                        description="apply failed: a change that could not be applied on "
                        "every instance; off: the loop gave up on the model (refused: Triton "
                        "is not in explicit model control mode).",
                    ),
                ),
            ),
        ),
    )


def routing() -> Dashboard:
    return Dashboard(
        uid="triton-proxy-routing",
        title="triton-proxy / Routing",
        description="Which instance each routing policy chose, and how long choosing took.",
        variables=("model", "instance"),
        rows=(
            Row(
                "Decisions",
                (
                    Panel(
                        "Routing decisions by policy",
                        (
                            Target(
                                rate_sum(
                                    "triton_proxy_routing_decisions_total",
                                    "policy",
                                    "model",
                                    "instance",
                                ),
                                "{{policy}}",
                            ),
                        ),
                        unit="reqps",
                        width=8,
                    ),
                    Panel(
                        "Routing decisions by instance",
                        (
                            Target(
                                rate_sum(
                                    "triton_proxy_routing_decisions_total",
                                    "policy, instance",
                                    "model",
                                    "instance",
                                ),
                                "{{policy}} → {{instance}}",
                            ),
                        ),
                        unit="reqps",
                        width=8,
                    ),
                    Panel(
                        "Retries on another instance",
                        (Target(f"sum(rate(triton_proxy_retries_total[{RATE}]))", "retries"),),
                        unit="reqps",
                        width=8,
                    ),
                    Panel(
                        "Decision latency P50 / P99 by policy",
                        quantiles(
                            "triton_proxy_routing_decision_seconds", "policy", (), (0.5, 0.99)
                        ),
                        unit="s",
                        width=12,
                    ),
                    Panel(
                        "Proxy event-loop lag P50 / P99 (by worker): is the proxy short of CPU?",
                        quantiles("triton_proxy_event_loop_lag_seconds", "worker", (), (0.5, 0.99)),
                        unit="s",
                        width=12,
                    ),
                    Panel(
                        "Overload guard: least important classes refused at arrival "
                        "(scheduling.overload; by worker)",
                        (
                            Target(
                                "max by (worker) (triton_proxy_overload_pressure)",
                                "worker {{worker}}",
                            ),
                        ),
                        unit="none",
                        width=12,
                    ),
                    Panel(
                        "Garbage-collector pauses P99 by generation (2 = full collection)",
                        quantiles("triton_proxy_gc_pause_seconds", "generation", (), (0.99,)),
                        unit="s",
                        width=12,
                    ),
                    Panel(
                        "Garbage-collector time per second (share of one core)",
                        (
                            Target(
                                f"sum by (generation) "
                                f"(rate(triton_proxy_gc_pause_seconds_sum[{RATE}]))",
                                "generation {{generation}}",
                            ),
                        ),
                        unit="percentunit",
                        width=12,
                    ),
                ),
            ),
        ),
    )


DASHBOARDS = {
    "overview": overview,
    "queues": queues,
    "instances": instances,
    "control": control,
    "routing": routing,
}


# --- JSON -------------------------------------------------------------------------------------
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str) -> dict[str, Any]:
    label, query = VARIABLES[name]
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "hide": 0,
    }


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [
        {"color": "blue" if panel.kind == "timeseries" else "red", "value": None}
    ]
    steps += [{"color": colour, "value": value} for value, colour in panel.thresholds]
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "palette-classic" if panel.kind == "timeseries" else "thresholds"},
    }
    if panel.max is not None:
        defaults["max"] = panel.max
        defaults["min"] = 0
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": False,
            "thresholdsStyle": {"mode": "line" if panel.thresholds else "off"},
        }
        options: dict[str, Any] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    overrides: list[dict[str, Any]] = []
    if panel.dashed:
        overrides.append(
            {
                "matcher": {"id": "byRegexp", "options": panel.dashed},
                "properties": [
                    {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                    {"id": "custom.lineWidth", "value": 2},
                ],
            }
        )
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": t.expr,
                "legendFormat": t.legend,
                "range": True,
                "editorMode": "code",
            }
            for i, t in enumerate(panel.targets)
        ],
    }


def to_json(d: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in d.rows:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x, line_h = pid + 1, y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, line_h = 0, y + line_h, 0
            panels.append(_panel(panel, pid, x, y))
            pid, x, line_h = pid + 1, x + panel.width, max(line_h, panel.height)
        y += line_h
    variables = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "regex": "",
            "current": {},
            "options": [],
            "refresh": 1,
            "hide": 0,
        }
    ]
    variables += [_variable(v) for v in d.variables]
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": list(d.tags),
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "type": "dashboards",
                "tags": ["triton-proxy"],
                "asDropdown": True,
                "title": "triton-proxy",
            }
        ],
        "templating": {"list": variables},
        "panels": panels,
    }


def render(d: Dashboard) -> str:
    return json.dumps(to_json(d), indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    return {f"{name}.json": render(build()) for name, build in DASHBOARDS.items()}


def check(directory: Path = DASHBOARD_DIR) -> list[str]:
    """What differs between ``directory`` and the generator's output (empty when in step)."""
    problems = []
    expected = expected_files()
    for name, text in expected.items():
        path = directory / name
        if not path.exists():
            problems.append(f"{path}: missing")
        elif path.read_text() != text:
            problems.append(f"{path}: differs from the generator's output")
    for path in sorted(directory.glob("*.json")):
        if path.name not in expected:
            problems.append(f"{path}: not generated by proxy/ops/dashboards.py")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.ops.dashboards", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    parser.add_argument("--dir", type=Path, default=DASHBOARD_DIR)
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.dir)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run: python -m proxy.ops.dashboards", file=sys.stderr)
        return 1 if problems else 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, text in expected_files().items():
        (args.dir / name).write_text(text)
        print(args.dir / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
