"""Parsing Triton's /metrics, the sliding window over scrapes, and the async Scraper."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import FakeClock
from proxy.fleet import metrics
from proxy.fleet.metrics import METRICS, LoadTracker, Scrape, parse
from proxy.fleet.scraper import Scraper

# Sample lines from a real Triton 2.51 (model "simple", one request served), with HELP/TYPE
# lines in the form Triton writes them.
TRITON_SAMPLE = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="simple",version="1"} 1
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="simple",reason="OTHER",version="1"} 0
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="simple",version="1"} 1
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="simple",version="1"} 1
# HELP nv_inference_request_duration_us Cumulative inference request duration in microseconds (includes cached requests)
# TYPE nv_inference_request_duration_us counter
nv_inference_request_duration_us{model="simple",version="1"} 855
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds (includes cached requests)
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="simple",version="1"} 221
# HELP nv_inference_compute_input_duration_us Cumulative compute input duration in microseconds (does not include cached requests)
# TYPE nv_inference_compute_input_duration_us counter
nv_inference_compute_input_duration_us{model="simple",version="1"} 121
# HELP nv_inference_compute_infer_duration_us Cumulative compute inference duration in microseconds (does not include cached requests)
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="simple",version="1"} 416
# HELP nv_inference_compute_output_duration_us Cumulative inference compute output duration in microseconds (does not include cached requests)
# TYPE nv_inference_compute_output_duration_us counter
nv_inference_compute_output_duration_us{model="simple",version="1"} 91
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="simple",version="1"} 0
# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]
# TYPE nv_cpu_utilization gauge
nv_cpu_utilization 0
# HELP nv_cpu_memory_total_bytes CPU total memory (RAM), in bytes
# TYPE nv_cpu_memory_total_bytes gauge
nv_cpu_memory_total_bytes 25276510208
# HELP nv_cpu_memory_used_bytes CPU used memory (RAM), in bytes
# TYPE nv_cpu_memory_used_bytes gauge
nv_cpu_memory_used_bytes 576253952
"""  # noqa: E501 (verbatim server output)

TRT_LLM_SAMPLE = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 4
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 7
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.25
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 2000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 6000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 8000
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-aaaa"} 0.4
nv_gpu_utilization{gpu_uuid="GPU-bbbb"} 0.8
# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes
# TYPE nv_gpu_memory_total_bytes gauge
nv_gpu_memory_total_bytes{gpu_uuid="GPU-aaaa"} 100
nv_gpu_memory_total_bytes{gpu_uuid="GPU-bbbb"} 300
# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes
# TYPE nv_gpu_memory_used_bytes gauge
nv_gpu_memory_used_bytes{gpu_uuid="GPU-aaaa"} 50
nv_gpu_memory_used_bytes{gpu_uuid="GPU-bbbb"} 150
"""  # noqa: E501 (names and labels as the TensorRT-LLM backend writes them)


def triton_text(
    model: str = "simple",
    *,
    success: float,
    queue_us: float,
    compute_us: float = 0.0,
    inferences: float | None = None,
    executions: float | None = None,
    pending: float = 0,
    failure: float = 0,
    version: str = "1",
) -> str:
    """Metrics text for one model with given cumulative counters (compute split in thirds)."""
    labels = f'model="{model}",version="{version}"'
    third = compute_us / 3
    lines = [
        f"nv_inference_request_success{{{labels}}} {success}",
        f'nv_inference_request_failure{{model="{model}",reason="BACKEND",version="{version}"}}'
        f" {failure}",
        f'nv_inference_request_failure{{model="{model}",reason="OTHER",version="{version}"}} 0',
        f"nv_inference_count{{{labels}}} {inferences if inferences is not None else success}",
        f"nv_inference_exec_count{{{labels}}} {executions if executions is not None else success}",
        f"nv_inference_queue_duration_us{{{labels}}} {queue_us}",
        f"nv_inference_compute_input_duration_us{{{labels}}} {third}",
        f"nv_inference_compute_infer_duration_us{{{labels}}} {third}",
        f"nv_inference_compute_output_duration_us{{{labels}}} {third}",
        f"nv_inference_pending_request_count{{{labels}}} {pending}",
    ]
    return "\n".join(lines) + "\n"


# --- parsing -----------------------------------------------------------------------------


def test_parse_real_triton_sample() -> None:
    scrape = parse(TRITON_SAMPLE)
    assert scrape.series == {
        ("simple", "1"): {
            "success": 1,
            "failure": 0,
            "inferences": 1,
            "executions": 1,
            "request_us": 855,
            "queue_us": 221,
            "compute_input_us": 121,
            "compute_infer_us": 416,
            "compute_output_us": 91,
            "pending": 0,
        }
    }
    assert scrape.instance == {
        "cpu_utilization": 0,
        "cpu_memory_total": 25276510208,
        "cpu_memory_used": 576253952,
    }


@pytest.mark.parametrize("text", [TRITON_SAMPLE, TRT_LLM_SAMPLE])
def test_parse_agrees_with_prometheus_client(text: str) -> None:
    """Our small parser reads every sample we care about exactly as the reference one does."""
    names = {s.name for s in METRICS}
    reference: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # prometheus_client names counter samples "<family>_total"; Triton's lines do not.
            if family.name in names:
                reference[(family.name, tuple(sorted(sample.labels.items())))] = sample.value
    ours = {(n, tuple(sorted(labels.items()))): v for n, labels, v in metrics._samples(text)}
    assert ours == reference
    assert ours  # the comparison means something


def test_parse_trt_llm_and_gpu_names() -> None:
    scrape = parse(TRT_LLM_SAMPLE)
    fields = scrape.series[("tensorrt_llm", "1")]
    assert fields == {
        "llm_waiting": 3,
        "llm_active": 7,
        "kv_fraction": 0.25,
        "kv_used": 2000,
        "kv_max": 8000,
    }
    assert scrape.instance["gpu_utilization"] == pytest.approx(0.6)  # mean over GPUs
    assert scrape.instance["gpu_memory_used"] == 200  # summed
    assert scrape.instance["gpu_memory_total"] == 400
    snap = LoadTracker(10).observe(scrape, at=1.0)
    assert snap.kv_cache_fraction == 0.25
    assert snap.model("tensorrt_llm").kv_cache_fraction == 0.25
    assert snap.active_requests == 7
    assert snap.waiting_requests == 3
    assert snap.gpu_memory_fraction == pytest.approx(0.5)
    assert snap.gpu_utilization == pytest.approx(0.6)


def test_kv_fraction_from_used_over_max_when_no_fraction_label() -> None:
    text = "\n".join(
        line for line in TRT_LLM_SAMPLE.splitlines() if 'kv_cache_block_type="fraction"' not in line
    )
    snap = LoadTracker(10).observe(parse(text), at=0.0)
    assert snap.model("tensorrt_llm").kv_cache_fraction == pytest.approx(2000 / 8000)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # label values with escapes, a comma and a brace inside quotes; timestamps allowed
        (
            'nv_inference_count{model="a\\"b,}",version="1"} 5 1700000000000\n',
            {('a"b,}', "1"): {"inferences": 5.0}},
        ),
        # labels in any order, spaces after commas, trailing comma
        (
            'nv_inference_count{ version="2", model="m", } 7\n',
            {("m", "2"): {"inferences": 7.0}},
        ),
        # failures summed over reasons
        (
            'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 2\n'
            'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 3\n',
            {("m", "1"): {"failure": 5.0}},
        ),
        # unknown metrics and comments are skipped, even when malformed
        ("# junk\nnv_unknown{oops 1\nnv_pinned_memory_pool_total_bytes 1\n", {}),
        # a model metric without a model label is ignored
        ("nv_inference_count 3\n", {}),
    ],
)
def test_parse_table(text: str, expected: dict[tuple[str, str], dict[str, float]]) -> None:
    assert parse(text).series == expected


@pytest.mark.parametrize(
    "text",
    [
        'nv_inference_count{model="m" 1\n',
        'nv_inference_count{model="m"}\n',
        'nv_inference_count{model="m"} abc\n',
        "nv_inference_count{model=m} 1\n",
    ],
)
def test_parse_rejects_malformed_lines_we_read(text: str) -> None:
    with pytest.raises(ValueError):
        parse(text)


# --- window math -------------------------------------------------------------------------


def test_window_means_and_rates() -> None:
    t = LoadTracker(window_s=10.0)
    first = t.observe(parse(triton_text(success=100, queue_us=10_000, compute_us=30_000)), 0.0)
    # The first scrape is only a baseline: counters since server start are not "recent".
    assert first.model("simple").queue_us is None
    assert first.model("simple").request_rate == 0.0
    snap = t.observe(
        parse(
            triton_text(
                success=150,
                queue_us=20_000,
                compute_us=60_000,
                inferences=250,
                executions=125,
                pending=4,
                failure=5,
            )
        ),
        5.0,
    )
    load = snap.model("simple")
    assert snap.taken_at == 5.0
    assert load.pending == 4
    assert load.queue_us == pytest.approx(10_000 / 50)
    assert load.compute_us == pytest.approx(30_000 / 50)
    assert load.request_rate == pytest.approx(50 / 5)
    assert load.exec_rate == pytest.approx((125 - 100) / 5)
    assert load.mean_batch == pytest.approx((250 - 100) / (125 - 100))
    assert load.failure_rate == pytest.approx(5 / 5)
    assert load.queue_us_p95 == pytest.approx(200)


def test_window_slides() -> None:
    """Old traffic leaves the window: means reflect only the last ``window_s`` seconds."""
    t = LoadTracker(window_s=2.0)
    success, queue = 0.0, 0.0
    snap = t.observe(parse(triton_text(success=0, queue_us=0)), 0.0)
    # 10 s of slow requests (1000 µs queue each), then 3 s of fast ones (10 µs each).
    for second in range(1, 14):
        success += 10
        queue += 10 * (1000 if second <= 10 else 10)
        snap = t.observe(parse(triton_text(success=success, queue_us=queue)), float(second))
    load = snap.model("simple")
    assert load.queue_us == pytest.approx(10)
    assert load.request_rate == pytest.approx(10)
    assert load.queue_us_p95 == pytest.approx(10)


def test_queue_p95_over_intervals() -> None:
    t = LoadTracker(window_s=100.0)
    success, queue = 0.0, 0.0
    t.observe(parse(triton_text(success=0, queue_us=0)), 0.0)
    per_interval = [100.0] * 19 + [5000.0]
    snap = None
    for i, q in enumerate(per_interval, start=1):
        success += 1
        queue += q
        snap = t.observe(parse(triton_text(success=success, queue_us=queue)), float(i))
    assert snap is not None
    # nearest rank: ceil(0.95 * 20) = 19th of 20 sorted values
    assert snap.model("simple").queue_us_p95 == 100.0
    success += 1
    queue += 5000.0
    snap = t.observe(parse(triton_text(success=success, queue_us=queue)), 21.0)
    assert snap.model("simple").queue_us_p95 == 5000.0


def test_idle_window_has_no_means() -> None:
    t = LoadTracker(window_s=10.0)
    t.observe(parse(triton_text(success=5, queue_us=500)), 0.0)
    snap = t.observe(parse(triton_text(success=5, queue_us=500, pending=2)), 1.0)
    load = snap.model("simple")
    assert (load.queue_us, load.compute_us, load.mean_batch, load.queue_us_p95) == (
        None,
        None,
        None,
        None,
    )
    assert load.request_rate == 0.0
    assert load.pending == 2


def test_counter_reset_on_model_reload() -> None:
    """Counters back near 0 after a reload: the new value is the delta, never a negative rate."""
    t = LoadTracker(window_s=100.0)
    t.observe(parse(triton_text(success=1000, queue_us=100_000)), 0.0)
    t.observe(parse(triton_text(success=1010, queue_us=101_000)), 1.0)  # +10 req, +1000 µs
    snap = t.observe(parse(triton_text(success=4, queue_us=2_000)), 2.0)  # reload, then +4 req
    load = snap.model("simple")
    assert load.request_rate == pytest.approx((10 + 4) / 2)
    assert load.queue_us == pytest.approx((1_000 + 2_000) / (10 + 4))
    assert load.queue_us_p95 == pytest.approx(500)  # intervals: 100 µs and 500 µs
    snap = t.observe(parse(triton_text(success=6, queue_us=2_200)), 3.0)
    assert snap.model("simple").request_rate == pytest.approx((10 + 4 + 2) / 3)


def test_model_loaded_between_scrapes_counts_from_zero() -> None:
    t = LoadTracker(window_s=100.0)
    t.observe(parse(triton_text("a", success=10, queue_us=10)), 0.0)
    both = triton_text("a", success=10, queue_us=10) + triton_text("b", success=3, queue_us=300)
    snap = t.observe(parse(both), 1.0)
    assert snap.model("b").request_rate == pytest.approx(3)
    assert snap.model("b").queue_us == pytest.approx(100)
    assert snap.model("a").request_rate == 0.0


def test_model_unloaded_and_back_never_goes_negative() -> None:
    t = LoadTracker(window_s=100.0)
    t.observe(parse(triton_text("a", success=50, queue_us=50)), 0.0)
    t.observe(parse(triton_text("a", success=60, queue_us=60)), 1.0)
    gone = t.observe(parse(""), 2.0)
    assert "a" not in gone.models
    back = t.observe(parse(triton_text("a", success=2, queue_us=2)), 3.0)
    assert back.model("a").request_rate == pytest.approx((10 + 2) / 3)


def test_versions_are_summed_per_model() -> None:
    t = LoadTracker(window_s=100.0)
    text0 = triton_text(success=0, queue_us=0, version="1") + triton_text(
        success=0, queue_us=0, version="2"
    )
    t.observe(parse(text0), 0.0)
    text1 = triton_text(success=10, queue_us=1000, pending=1, version="1") + triton_text(
        success=30, queue_us=1000, pending=2, version="2"
    )
    load = t.observe(parse(text1), 1.0).model("simple")
    assert load.request_rate == pytest.approx(40)
    assert load.queue_us == pytest.approx(2000 / 40)
    assert load.pending == 3


def test_time_going_backwards_is_an_error() -> None:
    t = LoadTracker(window_s=10.0)
    t.observe(Scrape(), 5.0)
    with pytest.raises(ValueError, match="backwards"):
        t.observe(Scrape(), 4.0)


# --- async scraper -----------------------------------------------------------------------


class FakeTriton:
    """A tiny metrics endpoint whose counters the test moves."""

    def __init__(self) -> None:
        self.success = 0
        self.queue_us = 0
        self.fail = False
        self.hits = 0

    async def metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.fail:
            return web.Response(status=500, text="boom")
        return web.Response(
            text=TRITON_SAMPLE + triton_text("m", success=self.success, queue_us=self.queue_us),
            content_type="text/plain",
        )


async def test_scraper_against_http_server() -> None:
    triton = FakeTriton()
    app = web.Application()
    app.router.add_get("/metrics", triton.metrics)
    server = TestServer(app)
    await server.start_server()
    try:
        url = str(server.make_url("/metrics"))
        clock = FakeClock(100.0)
        async with aiohttp.ClientSession() as session:
            scraper = Scraper(
                clock,
                {"t0": url, "dead": "http://127.0.0.1:1/metrics"},
                interval_s=0.01,
                window_s=30.0,
                timeout_s=2.0,
                session=session,
            )
            await scraper.scrape_once()
            assert scraper.snapshot("dead") is None
            assert scraper.last_error("dead") is not None
            assert scraper.failures["dead"] == 1

            clock.advance(1.0)
            triton.success, triton.queue_us = 20, 4000
            await scraper.scrape_once()
            snap = scraper.snapshot("t0")
            assert snap is not None
            assert snap.taken_at == 101.0
            assert snap.model("m").queue_us == pytest.approx(200)
            assert snap.model("m").request_rate == pytest.approx(20)
            assert snap.cpu_memory_fraction == pytest.approx(576253952 / 25276510208)

            # A failed scrape keeps the old snapshot (it goes stale by age).
            triton.fail = True
            clock.advance(1.0)
            await scraper.scrape_once()
            assert scraper.snapshot("t0") is snap
            assert "500" in (scraper.last_error("t0") or "")
            triton.fail = False

            # The polling loop runs, and stops without leaving a task behind.
            before = triton.hits
            tasks_before = asyncio.all_tasks()
            async with scraper:
                for _ in range(500):
                    if triton.hits >= before + 3:
                        break
                    await asyncio.sleep(0.01)
            assert triton.hits >= before + 3
            assert scraper.last_error("t0") is None
            assert asyncio.all_tasks() == tasks_before
            assert not session.closed  # an injected session is the caller's to close

            scraper.set_targets({"t1": url})
            assert scraper.snapshot("t0") is None
            assert scraper.snapshots() == {}
    finally:
        await server.close()


async def test_scraper_owns_its_session_when_none_is_given() -> None:
    scraper = Scraper(FakeClock(), {"x": "http://127.0.0.1:1/metrics"}, interval_s=0.01)
    async with scraper:
        await scraper.scrape_once()
    assert scraper.failures["x"] >= 1
    assert scraper._session is None
