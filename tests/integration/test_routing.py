"""Load-aware routing against real Triton servers, asserted on the proxy's routing counts."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

SHORT_REQUESTS = 60


def ids(n: int) -> list[httpclient.InferInput]:
    i = httpclient.InferInput("INPUT_IDS", [1, n], "INT64")
    i.set_data_from_numpy(np.arange(1, n + 1, dtype=np.int64).reshape(1, n), binary_data=True)
    return [i]


def simple() -> list[httpclient.InferInput]:
    out = []
    for name in ("INPUT0", "INPUT1"):
        i = httpclient.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(np.ones((1, 16), dtype=np.int32), binary_data=True)
        out.append(i)
    return out


@contextmanager
def busy(url: str, clients: int, headers: dict[str, str] | None = None) -> Iterator[None]:
    """``clients`` closed-loop senders of long accel_sim requests to ``url`` until exit."""
    stop = threading.Event()

    def loop() -> None:
        with httpclient.InferenceServerClient(url, network_timeout=60) as c:
            while not stop.is_set():
                c.infer("accel_sim", ids(512), headers=headers)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(loop) for _ in range(clients)]
        try:
            yield
        finally:
            stop.set()
            for f in futures:
                f.result()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def decisions(proxy: ProxyThread, model: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for (m, _policy, instance), n in list(proxy.runtime.router.stats.decisions.items()):
        if m == model:
            out[instance] += n
    return out


@pytest.mark.parametrize(
    ("policy", "max_share"),
    [("round_robin", None), ("least_requests", 0.1), ("weighted_score", 0.1), ("p2c", 0.1)],
)
def test_busy_instance_seen_through_proxy_in_flight(
    triton_fleet: Any, policy: str, max_share: float | None
) -> None:
    """Long requests pinned (by session) to one instance; short ones routed by ``policy``."""
    doc = {
        "routing": {
            "policy": {"name": policy},
            "models": {
                "accel_sim": {"name": "consistent_hash", "params": {"load_factor": 50}},
            },
        }
    }
    with running_proxy(triton_fleet.servers, doc) as proxy:
        fleet = proxy.runtime.fleet
        with busy(proxy.http, 8, {"x-session-id": "batch-job"}):
            wait_for(lambda: max(i.in_flight for i in fleet.all()) >= 6)
            busy_name = decisions(proxy, "accel_sim").most_common(1)[0][0]
            seen: list[int] = []
            with httpclient.InferenceServerClient(proxy.http) as c:
                for _ in range(SHORT_REQUESTS):
                    seen.append(fleet.get(busy_name).in_flight)
                    c.infer("simple", simple())
            # The busy instance really was busy while the short requests were routed (a single
            # sample can catch its clients between two requests).
            assert sum(seen) / len(seen) >= 4, seen
        short = decisions(proxy, "simple")
    assert sum(short.values()) == SHORT_REQUESTS
    share = short[busy_name] / SHORT_REQUESTS
    if max_share is None:
        # Round robin ignores load: the busy instance takes its third.
        assert share == pytest.approx(1 / 3, abs=0.02), short
    else:
        assert share <= max_share, short


def test_weighted_score_sees_load_from_tritons_metrics(triton_fleet: Any) -> None:
    """Load the proxy never saw (sent straight to one Triton) shows in the scraped pending
    count, and the queue-depth term steers short requests away from it."""
    doc = {
        "scrape": {"interval_s": 0.2, "window_s": 2.0},
        "routing": {"policy": {"name": "weighted_score", "params": {"active_requests": 0}}},
    }
    target = triton_fleet.server(0)
    with running_proxy(triton_fleet.servers, doc) as proxy:
        scraper = proxy.runtime.scraper

        def pending() -> float:
            snap = scraper.snapshot(target.name)
            return snap.model("accel_sim").pending if snap else 0.0

        with busy(target.http_url.removeprefix("http://"), 24):
            wait_for(lambda: pending() >= 4)
            with httpclient.InferenceServerClient(proxy.http) as c:
                for _ in range(SHORT_REQUESTS):
                    c.infer("accel_sim", ids(8))
            still_busy = pending()
        short = decisions(proxy, "accel_sim")
    assert still_busy >= 1
    assert sum(short.values()) == SHORT_REQUESTS
    assert short[target.name] / SHORT_REQUESTS <= 0.15, short
