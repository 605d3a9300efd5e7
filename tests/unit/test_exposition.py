"""The proxy's own page renderer writes what prometheus_client's ``generate_latest`` writes,
byte for byte: the proxy's whole page (counters and histograms from the request path, the fleet
collector's gauges, label values that need escaping), every family type through the collected
path, the bound on kept texts, and the multi-worker merge."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
    metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from proxy import config as config_mod
from proxy.clock import FakeClock
from proxy.exposition import Registry, render_families
from proxy.fleet.catalog import ModelInfo
from proxy.fleet.snapshot import InstanceSnapshot, ModelLoad
from proxy.observer import RequestRecord
from proxy.runtime import Runtime
from proxy.telemetry import RequestTelemetry, Telemetry, merge_workers

NASTY = 'a"b\\c\nd'
"""A model name a client could send: every character the text format escapes."""
MODELS = ("simple", NASTY, "modèle")
CLASSES = {
    "realtime": {"rank": 0, "slo_p99_ms": 100},
    "online": {"rank": 1, "slo_p99_ms": 500},
    "offline": {"rank": 2},
}
INFO = ModelInfo(max_batch_size=8, priority_levels=3, model_instances=1, decoupled=False)


def parsed(page: bytes) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], str]]]]:
    """The page's families and samples (values as text: NaN equals NaN)."""
    return [
        (f.name, f.type, f.documentation, [(s.name, s.labels, repr(s.value)) for s in f.samples])
        for f in text_string_to_metric_families(page.decode())
    ]


def assert_same_page(registry: Registry) -> bytes:
    page = registry.exposition()
    expected = generate_latest(registry)
    assert parsed(page) == parsed(expected)
    assert page == expected
    return page


def proxy_telemetry(requests: int = 600) -> tuple[Runtime, Telemetry]:
    """A Telemetry watching a runtime with 3 instances and 3 classes, with requests observed."""
    doc = {
        "instances": [
            {"name": n, "http": f"http://127.0.0.1:{i + 1}", "metrics": f"http://127.0.0.1:{i + 1}"}
            for i, n in enumerate("abc")
        ],
        "scheduling": {"default_class": "offline", "classes": CLASSES},
    }
    telemetry = Telemetry()
    rt = Runtime(config_mod.parse(doc, "p"), FakeClock(), random.Random(0), telemetry)
    telemetry.watch(lambda: rt)
    for model in MODELS:
        rt.catalog._cache[model] = (INFO, 1e9)
        assert rt.gates is not None
        rt.gates.gate(model, INFO)
    for inst in rt.fleet.all():
        inst.model_in_flight[NASTY] += 1
    for name in "abc":
        loads = {m: ModelLoad(pending=2, queue_us=150.0, compute_us=2500.0) for m in MODELS}
        rt.scraper._snapshots[name] = InstanceSnapshot(0.0, loads)  # type: ignore[union-attr]
    observe(telemetry, requests, random.Random(1))
    return rt, telemetry


def observe(telemetry: Telemetry, requests: int, r: random.Random) -> None:
    on_request = RequestTelemetry(telemetry).on_request
    for _ in range(requests):
        model, klass, inst = r.choice(MODELS), r.choice(list(CLASSES)), r.choice("abc")
        outcome = r.choice(["200", "503", "shed_deadline"])
        latency = r.expovariate(5.0)
        on_request(
            RequestRecord(model, klass, inst, outcome, latency, 0.0, 1.0, False, 0.0, slo_s=0.1)
        )
        telemetry.queue_wait_by.get(klass).observe(latency / 10)
        telemetry.decisions_by.get(model, "least_requests", inst, "main").inc()
    telemetry.retries.inc()
    telemetry.loop_lag.observe(0.003)
    telemetry.gc_pause.labels("2").observe(0.02)


def test_the_proxys_page_is_generate_latests_byte_for_byte() -> None:
    _, telemetry = proxy_telemetry()
    page = assert_same_page(telemetry.registry)
    # The families the test means to cover are there, escaped model names included.
    text = page.decode()
    for series in (
        'triton_proxy_requests_total{arm="main",class="online",instance="a",model="a\\"b\\\\c\\nd"',
        'triton_proxy_request_duration_seconds_bucket{arm="main",class="realtime",le="0.5"',
        'triton_proxy_model_in_flight{instance="b",model="a\\"b\\\\c\\nd"} 1.0',
        'triton_proxy_class_queued{class="offline",model="modèle"} 0.0',
        "triton_proxy_retries_total 1.0",
        "# TYPE triton_proxy_requests_created gauge",
    ):
        assert series in text
    # Kept texts, new values: the next scrape still matches.
    observe(telemetry, 50, random.Random(2))
    assert_same_page(telemetry.registry)


def test_series_texts_are_bounded_and_every_series_is_still_written() -> None:
    registry = Registry(max_series=3)
    counter = Counter("c", "a counter", ["model"], registry=registry)
    histogram = Histogram("h", "a histogram", ["model"], buckets=(0.1, 1.0), registry=registry)
    for i in range(10):
        counter.labels(f"m{i}").inc(i)
        histogram.labels(f'm"{i}').observe(i / 10)
    assert_same_page(registry)
    assert_same_page(registry)
    for metric in (counter, histogram):
        assert len(registry._pages[metric]._texts) == 3  # type: ignore[union-attr]


class Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def every_kind_of_family() -> list[Metric]:
    counter = CounterMetricFamily("jobs", "Jobs\\done\nso far", labels=["queue"], created=12.5)
    counter.add_metric(["x"], 3, created=1700000000.25)
    counter.add_metric([NASTY], 4.5, timestamp=1700000001.5)
    gauge = GaugeMetricFamily("temperature", "Degrees", labels=["room", "floor"])
    gauge.add_metric(["b", "2"], -1.5e-7)
    gauge.add_metric(["a", "1"], 1234567.0)
    gauge.add_metric(["c", "0"], float("nan"))
    gauge.add_metric(["d", "0"], float("-inf"))
    summary = SummaryMetricFamily("rpc", "Calls", count_value=4, sum_value=2.5)
    histogram = HistogramMetricFamily(
        "size", "Sizes", buckets=[("1.0", 2), ("+Inf", 5)], sum_value=9.0
    )
    gauge_histogram = GaugeHistogramMetricFamily(
        "backlog", "Backlog", buckets=[("10.0", 1), ("+Inf", 3)], gsum_value=40.0
    )
    info = InfoMetricFamily("build", "Build", value={"version": "1.2", "commit": "abc"})
    stateset = StateSetMetricFamily("mode", "Mode", value={"on": True, "off": False})
    unknown = UnknownMetricFamily("mystery", "Unknown", value=7)
    empty = GaugeMetricFamily("nothing", "No samples", labels=["x"])
    return [counter, gauge, summary, histogram, gauge_histogram, info, stateset, unknown, empty]


def test_collected_families_of_every_kind_are_written_as_generate_latest_does() -> None:
    registry = Registry()
    registry.register(Families(every_kind_of_family()))
    Gauge("g", "a gauge", ["x"], registry=registry).labels("1").set(2)
    Summary("s", "a summary", registry=registry).observe(0.5)
    Info("i", "an info", registry=registry).info({"k": "v"})
    Enum("e", "an enum", states=["up", "down"], registry=registry)
    Histogram("neg", "negative bounds: no _sum", buckets=(-1.0, 0.0, 1.0), registry=registry)
    Counter("unused", "no children yet", ["model"], registry=registry)
    assert_same_page(registry)


def test_without_created_series_the_page_still_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_use_created", False)
    registry = Registry()
    Counter("c", "a counter", ["model"], registry=registry).labels("m").inc()
    Histogram("h", "a histogram", registry=registry).observe(0.2)
    page = assert_same_page(registry)
    assert b"_created" not in page


def test_an_unregistered_collector_leaves_the_page() -> None:
    registry = Registry()
    kept = Counter("kept", "kept", registry=registry)
    gone = Counter("gone", "gone", registry=registry)
    registry.unregister(gone)
    kept.inc()
    assert b"gone" not in assert_same_page(registry)


def test_target_info_is_refused_rather_than_left_off_the_page() -> None:
    with pytest.raises(NotImplementedError):
        Registry().set_target_info({"service": "proxy"})


def test_merged_pages_are_written_as_generate_latest_would() -> None:
    _, telemetry = proxy_telemetry(requests=100)
    page = telemetry.exposition().decode()
    merged = merge_workers([("0", page), ("1", page)])
    families = list(text_string_to_metric_families(merged.decode()))
    assert {s.labels["worker"] for f in families for s in f.samples} == {"0", "1"}
    plain = CollectorRegistry()
    plain.register(Families(families))
    assert merged == generate_latest(plain) == render_families(families)


@pytest.mark.parametrize("starved_after_s", [5.0, None], ids=["boost", "off"])
def test_the_floor_boost_counter_reads_zero_for_every_class_it_may_lift(
    starved_after_s: float | None,
) -> None:
    # A dashboard's rate of it reads 0 rather than no data before the first boost: the
    # classes with a min_share below the top one, and only where the boost is on.
    classes = {
        "realtime": {"rank": 0, "min_share": 0.2},
        "online": {"rank": 1, "min_share": 0.1},
        "offline": {"rank": 2},
    }
    doc = {
        "instances": [{"name": "a", "http": "http://127.0.0.1:1"}],
        "scheduling": {
            "default_class": "offline",
            "classes": classes,
            "starved_after_s": starved_after_s,
        },
    }
    telemetry = Telemetry()
    rt = Runtime(config_mod.parse(doc, "p"), FakeClock(), random.Random(0), telemetry)
    assert rt.gates is not None
    info = ModelInfo(max_batch_size=4, priority_levels=3, model_instances=1, decoupled=False)
    rt.gates.gate("m", info)  # a model's gate, made by its first request
    telemetry.watch(lambda: rt)  # the live state, as the app exports it
    families = {f.name: f for f in text_string_to_metric_families(telemetry.exposition().decode())}
    samples = [
        (s.labels["class"], s.value)
        for s in families["triton_proxy_boosted"].samples
        if s.name == "triton_proxy_boosted_total"
    ]
    assert samples == ([("online", 0.0)] if starved_after_s else [])
    # ... and so does its debt (in device-seconds), per model
    debts = [
        (s.labels["model"], s.labels["class"], s.value)
        for s in families["triton_proxy_class_floor_debt_seconds"].samples
    ]
    assert debts == ([("m", "online", 0.0)] if starved_after_s else [])
