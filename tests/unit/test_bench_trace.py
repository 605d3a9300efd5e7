"""``bench --trace`` (proxy.bench.trace): the probe keys it adds, and the lines it renders."""

from pathlib import Path

import numpy as np
import pytest

import proxy.telemetry
from proxy.bench.arms import PROXY_IN_FLIGHT, MergedProbe, proxy_probe, triton_pending_probe
from proxy.bench.results import probed_load
from proxy.bench.runner import OneScrapeProbe, PrometheusGaugeProbe, RunRecords
from proxy.bench.trace import (
    CLASS_IN_FLIGHT,
    TRITON_COUNTERS,
    is_trace_key,
    render_trace,
    with_counters,
)

TRITON_PAGE = """# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="accel_sim",version="1"} 10
nv_inference_exec_count{model="simple",version="1"} 99
nv_inference_count{model="accel_sim",version="1"} 150
nv_inference_request_success{model="accel_sim",version="1"} 140
nv_inference_compute_infer_duration_us{model="accel_sim",version="1"} 2800000
nv_inference_pending_request_count{model="accel_sim",version="1"} 7
"""


class _Server:
    def __init__(self, name: str) -> None:
        self.name = name
        self.http_url = f"http://{name}:8000"
        self.metrics_url = f"http://{name}:8002/metrics"


def test_one_scrape_of_a_triton_page_gives_its_queue_and_batch_counters():
    pending = PrometheusGaugeProbe(
        {"t0": "-"}, "nv_inference_pending_request_count", {"model": "accel_sim"}
    )
    probe = with_counters(pending, "accel_sim")
    got: dict[str, float] = {}
    for part, suffix in probe.parts:
        got.update({k + suffix: v for k, v in part.read("t0", TRITON_PAGE).items()})
    assert got == {
        "t0": 7.0,
        "t0 batches": 10.0,  # accel_sim's only, not simple's 99
        "t0 rows": 150.0,
        "t0 requests": 140.0,
        "t0 compute us": 2_800_000.0,
    }
    assert set(TRITON_COUNTERS) == {
        "nv_inference_exec_count",
        "nv_inference_count",
        "nv_inference_request_success",
        "nv_inference_compute_infer_duration_us",
    }


def test_the_probes_add_the_trace_only_when_asked():
    servers = [_Server("t0"), _Server("t1")]
    assert isinstance(triton_pending_probe(servers, "m"), PrometheusGaugeProbe)
    traced = triton_pending_probe(servers, "m", trace=True)
    assert isinstance(traced, OneScrapeProbe) and len(traced.parts) == 1 + len(TRITON_COUNTERS)

    class Endpoints:
        metrics_url = "http://proxy/metrics"
        pid = None

    plain = proxy_probe(servers, "m", Endpoints(), trace=False)  # type: ignore[arg-type]
    full = proxy_probe(servers, "m", Endpoints(), trace=True)  # type: ignore[arg-type]
    assert isinstance(plain, MergedProbe) and isinstance(full, MergedProbe)
    metrics = [
        [p.metric for p, _ in part.parts]
        for probe in (plain, full)
        for part, _ in probe.parts
        if isinstance(part, OneScrapeProbe)
    ]
    assert CLASS_IN_FLIGHT not in metrics[0]  # plain has only the proxy page's scrape
    assert CLASS_IN_FLIGHT in metrics[-1]
    # the queue keeps its " queued" key with the counters read beside it
    triton = next(p for p, _ in full.parts if isinstance(p, OneScrapeProbe))
    assert triton.parts[0][1] == " queued" and full.parts[0][1] == ""


def test_the_gauges_the_trace_reads_are_the_ones_the_proxy_exports():
    # as the dashboards' test checks theirs: a renamed gauge must not leave the trace blank
    source = Path(proxy.telemetry.__file__).read_text()
    assert f'"{CLASS_IN_FLIGHT}"' in source
    assert f'"{PROXY_IN_FLIGHT}"' in source


def test_trace_keys_stay_out_of_the_load_series():
    assert is_trace_key("t0 rows") and is_trace_key("realtime class in flight")
    assert not is_trace_key("t0 queued") and not is_trace_key("t0 proxy in flight")
    rec = RunRecords.empty(1, 0.0)
    rec.load_samples = [(0.5, {"t0 queued": 3.0, "t0 rows": 10.0, "online class in flight": 2})]
    series = probed_load(rec)
    assert list(series.values) == ["t0 queued"]
    assert np.isfinite(series.t).all()


def test_render_trace_gives_each_servers_batches_between_samples():
    samples = [
        (
            0.5,
            {
                "t0 batches": 10,
                "t0 rows": 100,
                "t0 requests": 90,
                "t0 compute us": 900_000,
                "t0 queued": 1,
                "t1 batches": 4,
                "t1 rows": 4,
                "t1 requests": 4,
                "t1 compute us": 40_000,
            },
        ),
        (
            1.0,
            {
                "t0 batches": 15,
                "t0 rows": 180,
                "t0 requests": 170,
                "t0 compute us": 900_000 + 80 * 150_000,
                "t0 queued": 40,
                "t0 proxy in flight": 52,
                "t1 batches": 4,
                "t1 rows": 4,
                "t1 requests": 4,
                "t1 compute us": 40_000,
                "realtime class in flight": 3,
                "offline class in flight": 16,
                "online class in flight": 40,
            },
        ),
        (1.5, {"t0 queued": 2}),  # t0's page did not answer in full
    ]
    lines = render_trace(samples, ["t0", "t1"]).splitlines()
    assert len(lines) == 3  # the heading and one line per sample after the first
    assert "in flight offline/online/realtime" in lines[0]
    first = lines[1]
    assert first.split("|")[1].split() == ["16/40/3"]
    t0 = first.split("|")[2].split()
    # 80 rows in 5 batches, 150 ms each (the requests' mean compute), 10 batches/s, 40 queued
    assert t0 == ["t0:", "16.0", "150", "10.0", "40", "52"]
    assert first.split("|")[3].split() == ["t1:", "-", "-", "0", "?"]
    assert lines[2].split("|")[2].split()[:4] == ["t0:", "?", "?", "?"]


@pytest.mark.parametrize("samples", [[], [(0.5, {"t0": 1.0})]])
def test_render_trace_of_fewer_than_two_samples_is_its_heading(samples):
    assert render_trace(samples, ["t0"]).count("\n") == 0


def test_render_trace_gives_the_proxys_occupancy_fill_and_long_load():
    assert is_trace_key("proxy fill") and is_trace_key("proxy long load")
    base = {"t0 batches": 1, "t0 rows": 1, "t0 requests": 1, "t0 compute us": 1}
    samples = [
        (0.5, {**base, "proxy occupancy": 0.5}),
        (1.0, {**base, "proxy occupancy": 1.0, "proxy fill": 0.875, "proxy long load": 0.5}),
        (1.5, {**base, "proxy occupancy": 0.25}),  # a configuration without the fill
    ]
    lines = render_trace(samples, ["t0"]).splitlines()
    assert lines[0].split("|")[1].split() == ["occ", "fill", "long"]
    assert lines[1].split("|")[1].split() == ["1.00", "0.88", "0.50"]
    assert lines[2].split("|")[1].split() == ["0.25", "?", "?"]
    # without the proxy's page (a direct arm) the column is not there
    assert "occ" not in render_trace([(0.5, base), (1.0, base)], ["t0"])
