"""The request log's arithmetic: where a request waited before its batch (pure, no servers)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from proxy.bench.request_log import RequestLog, analyse, anatomy, file_name, segments, waits
from proxy.bench.runner import OneScrapeProbe, PrometheusGaugeProbe, RunRecords
from proxy.bench.scenario import Arrival

# (sent s, batch start s, batch cost ms, server)
REQUESTS = [
    (-0.002, 0.000, 10, 1),  # batch A on server 1: 0-10 ms
    (0.005, 0.010, 5, 1),  # sent while A ran; batch B right after it: 10-15 ms
    (0.016, 0.040, 6, 1),  # sent 1 ms after B ended, nothing ran until 40 ms...
    (0.039, 0.040, 6, 1),  # ...when this arrival joined it
    (0.016, 0.017, 6, 2),  # another server, idle: 1 ms
]


def _log() -> RequestLog:
    schedule = [
        Arrival(
            index=i, t=sent, cls="realtime" if i else "online", tokens=8, session=None, warmup=False
        )
        for i, (sent, *_rest) in enumerate(REQUESTS)
    ]
    rec = RunRecords.empty(len(REQUESTS), 0.0)
    for i, (sent, begun, cost_ms, server) in enumerate(REQUESTS):
        rec.scheduled[i] = rec.started[i] = sent
        rec.finished[i] = begun + cost_ms / 1e3
        rec.outcome[i] = 0
        rec.batch[i] = (1, 8, cost_ms * 1000)
        rec.batch_start[i] = begun
        rec.batch_server[i] = server
    return RequestLog.of("proxy arm", 0, schedule, rec)


def test_a_wait_splits_into_busy_and_idle_time_of_the_server():
    w = waits(_log(), np.ones(len(REQUESTS), dtype=np.bool_))
    np.testing.assert_allclose(w.wait, [2, 5, 24, 1, 1], atol=1e-9)
    # sent while batch A ran: all of its wait was busy time; the third waited 24 ms of nothing
    np.testing.assert_allclose(w.idle, [2, 0, 24, 1, 1], atol=1e-9)
    assert w.released.tolist() == [False, False, True, False, False]
    assert math.isnan(w.since_answer[0]) and math.isnan(w.since_answer[1])
    np.testing.assert_allclose(w.since_answer[2:4], [1, 24], atol=1e-9)
    assert math.isnan(w.since_answer[4])  # server 2 had run nothing before


def test_a_request_without_a_known_batch_is_left_out():
    log = _log()
    log.batch_start[2] = np.nan
    w = waits(log, np.ones(len(REQUESTS), dtype=np.bool_))
    assert len(w.wait) == len(REQUESTS) - 1


def test_logs_survive_a_round_trip_and_are_analysed(tmp_path):
    path = tmp_path / file_name("proxy arm/x", 0)
    assert path.name == "proxy_arm_x#1.npz"
    _log().save(path)
    back = RequestLog.load(path)
    assert back.arm == "proxy arm" and back.classes == ("online", "realtime")
    np.testing.assert_array_equal(back.batch_server, _log().batch_server)
    text = analyse([back])
    row = next(line for line in text.splitlines() if "realtime" in line and " all " in line)
    # four realtime requests, one of them stalled (idle 24 ms > 5 ms), released by an arrival
    assert row.split()[4:6] == ["4", "3.0"] and "25.0%" in row and "100%" in row


PAGE = """# HELP triton_proxy_instance_in_flight Requests in flight
# TYPE triton_proxy_instance_in_flight gauge
triton_proxy_instance_in_flight{instance="triton-0"} 2.0
triton_proxy_instance_in_flight{instance="triton-1"} 0.0
triton_proxy_instance_in_flight_total{instance="triton-1"} 7.0
# TYPE triton_proxy_model_occupancy gauge
triton_proxy_model_occupancy{model="accel_sim"} 0.25
triton_proxy_model_occupancy{model="other"} 0.5
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="accel_sim",version="1"} 3
nv_inference_pending_request_count{model="simple",version="1"} 9
"""


def test_a_gauge_probe_reads_only_its_metric_from_a_page():
    split = PrometheusGaugeProbe(
        {"proxy": "-"}, "triton_proxy_instance_in_flight", None, "instance"
    )
    assert split.read("proxy", PAGE) == {"triton-0": 2.0, "triton-1": 0.0}  # not ..._total
    one = PrometheusGaugeProbe({"p": "-"}, "triton_proxy_model_occupancy", {"model": "accel_sim"})
    assert one.read("p", PAGE) == {"p": 0.25}
    triton = PrometheusGaugeProbe({}, "nv_inference_pending_request_count", {"model": "accel_sim"})
    assert triton.read("t0", PAGE) == {"t0": 3.0}
    assert triton.read("t0", "") == {}


async def test_gauges_of_one_page_are_read_from_one_scrape():
    page = {"proxy": "http://proxy/metrics"}
    in_flight = PrometheusGaugeProbe(page, "triton_proxy_instance_in_flight", None, "instance")
    occupancy = PrometheusGaugeProbe(page, "triton_proxy_model_occupancy", {"model": "accel_sim"})
    fetched: list[str] = []

    async def fetch(url: str) -> str:
        fetched.append(url)
        return PAGE

    in_flight.fetch = fetch  # type: ignore[method-assign]
    probe = OneScrapeProbe([(in_flight, " in flight"), (occupancy, " occupancy")])
    assert await probe.sample() == {
        "triton-0 in flight": 2.0,
        "triton-1 in flight": 0.0,
        "proxy occupancy": 0.25,
    }
    assert fetched == ["http://proxy/metrics"]  # once, for both gauges
    with pytest.raises(ValueError, match="same pages"):
        OneScrapeProbe([(in_flight, ""), (PrometheusGaugeProbe({"t": "x"}, "m"), "")])


def test_latency_splits_into_lag_wait_run_and_the_way_back():
    log = _log()
    log.finished[2] += 0.012  # its answer took 12 ms longer to come back
    log.scheduled[3] -= 0.004  # the generator sent it 4 ms late
    seg = segments(log, np.ones(len(REQUESTS), dtype=np.bool_))
    np.testing.assert_allclose(seg[2], [0, 24, 6, 12], atol=1e-9)
    np.testing.assert_allclose(seg[3], [4, 1, 6, 0], atol=1e-9)
    text = anatomy([log])
    assert text.splitlines()[1].split()[2:6] == ["lag", "to", "batch", "run"]
