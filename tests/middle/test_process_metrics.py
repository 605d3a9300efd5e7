"""The proxy process's own health on /metrics: collector pauses."""

from __future__ import annotations

import gc
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.middle.conftest import ProxyFactory


def gc_pauses(metrics_port: int) -> dict[str, float]:
    """generation -> collections timed by ``triton_proxy_gc_pause_seconds``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        s.labels["generation"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "triton_proxy_gc_pause_seconds"
        for s in family.samples
        if s.name.endswith("_count")
    }


def test_collector_pauses_are_timed_while_the_proxy_serves(proxy_on: ProxyFactory) -> None:
    hooks = len(gc.callbacks)
    with proxy_on() as proxy:
        assert proxy.ports is not None
        assert len(gc.callbacks) == hooks + 1
        before = gc_pauses(proxy.ports.metrics)
        gc.collect()  # the proxy runs in this process: a full collection is one of its pauses
        after = gc_pauses(proxy.ports.metrics)
        assert after["2"] >= before.get("2", 0.0) + 1
    # Stopped: the process-wide hook is gone (tests start many proxies in one process).
    assert len(gc.callbacks) == hooks
