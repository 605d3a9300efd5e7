"""Every metric the proxy exports, on an injected registry (no global one).

Counters and histograms are updated on the request path; fleet state (health, in-flight,
scraped load) is read at scrape time by a collector, so it never goes stale in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from proxy.runtime import Runtime

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "triton_proxy_requests",
            "Requests answered, by model, class, instance, outcome and canary arm",
            ["model", "class", "instance", "outcome", "arm"],
            registry=r,
        )
        self.latency = Histogram(
            "triton_proxy_request_duration_seconds",
            "Time from arrival at the proxy to the last response byte, by model, class and arm",
            ["model", "class", "arm"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            "triton_proxy_slo_requests",
            "Requests of classes with a latency SLO, by whether they met it (result: met, or "
            "missed when slower than slo_p99_ms or shed); the SLO attainment and burn rates",
            ["model", "class", "result", "arm"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "triton_proxy_queue_wait_seconds",
            "Time a request waited in its class queue in the proxy before dispatch",
            ["class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            "triton_proxy_shed",
            "Requests refused by admission (429 / RESOURCE_EXHAUSTED), by class and reason",
            ["class", "reason"],
            registry=r,
        )
        self.decisions = Counter(
            "triton_proxy_routing_decisions",
            "Routing decisions, by model, policy, chosen instance and arm",
            ["model", "policy", "instance", "arm"],
            registry=r,
        )
        self.decision_time = Histogram(
            "triton_proxy_routing_decision_seconds",
            "Time spent choosing an instance, by policy",
            ["policy"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "triton_proxy_retries", "Requests re-sent to another instance", registry=r
        )
        self.ejections = Counter(
            "triton_proxy_ejections",
            "Instances taken out of rotation (failed probe or connection), by instance",
            ["instance"],
            registry=r,
        )
        self.reloads = Counter(
            "triton_proxy_policy_reloads",
            "Policy file reloads, by result",
            ["result"],
            registry=r,
        )
        self._fleet_collector: _FleetCollector | None = None

    def watch(self, runtime: Callable[[], Runtime]) -> None:
        """Export the live state of whatever runtime is current at scrape time."""
        if self._fleet_collector is None:
            self._fleet_collector = _FleetCollector(runtime)
            self.registry.register(self._fleet_collector)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    def __init__(self, runtime: Callable[[], Runtime]) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        rt = self._runtime()
        healthy = GaugeMetricFamily(
            "triton_proxy_instance_healthy",
            "1 when the instance is in rotation",
            labels=["instance"],
        )
        in_flight = GaugeMetricFamily(
            "triton_proxy_instance_in_flight",
            "Requests the proxy has in flight on the instance",
            labels=["instance"],
        )
        model_in_flight = GaugeMetricFamily(
            "triton_proxy_model_in_flight",
            "Requests the proxy has in flight, by instance and model",
            labels=["instance", "model"],
        )
        for inst in rt.fleet.all():
            healthy.add_metric([inst.name], 1.0 if inst.healthy else 0.0)
            in_flight.add_metric([inst.name], inst.in_flight)
            for model, n in inst.model_in_flight.items():
                model_in_flight.add_metric([inst.name, model], n)
        yield healthy
        yield in_flight
        yield model_in_flight
        yield from rt.extra_metrics()
