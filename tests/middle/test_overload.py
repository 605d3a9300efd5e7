"""scheduling.overload in the running proxy: while its event loop lags, the least important
class is refused at arrival (429 + Retry-After, gRPC RESOURCE_EXHAUSTED) and the top class is
served; without lag nothing is refused. The lag is made by blocking the proxy's own loop."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.fakes.triton import FakeFleet
from tests.middle.conftest import ProxyFactory, grpc_inputs, infer_doc, port_of, raw, wait_for

REALTIME = "realtime-key"
OFFLINE = "offline-key"
POLICY: dict[str, Any] = {
    "scheduling": {
        "default_class": "offline",
        "api_keys": {REALTIME: {"class_name": "realtime"}, OFFLINE: {"class_name": "offline"}},
        "classes": {
            "realtime": {"rank": 0, "triton_priority": 1},
            "offline": {"rank": 1, "triton_priority": 2},
        },
        "overload": {"lag_ms": 20, "step_s": 0.2, "up": 1.0},
    },
    "routing": {"policy": {"name": "round_robin"}},
}


def infer(port: int, key: str) -> tuple[int, dict[str, str], bytes]:
    resp = raw(
        port,
        "POST",
        "/v2/models/simple/infer",
        [("Authorization", f"Bearer {key}"), ("Content-Type", "application/json")],
        json.dumps(infer_doc()).encode(),
    )
    assert resp.status is not None, resp.error
    return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.body


def metric(port: int, name: str) -> str:
    return "\n".join(
        line
        for line in raw(port, "GET", "/metrics").body.decode().splitlines()
        if line.startswith(name)
    )


def test_a_lagging_loop_refuses_the_lowest_class_and_serves_the_top_one(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    with proxy_on(POLICY) as proxy:
        port = port_of(proxy)
        assert proxy.ports is not None
        assert infer(port, OFFLINE)[0] == 200  # no lag: served
        stop = threading.Event()

        def block() -> None:  # the loop stalls 80 ms in every 90: a mean lag well over 20 ms
            time.sleep(0.08)
            if not stop.is_set():
                proxy.loop.call_later(0.01, block)

        proxy.loop.call_soon_threadsafe(block)
        try:
            metrics_port = proxy.ports.metrics
            wait_for(
                lambda: (
                    "triton_proxy_overload_pressure 1.0"
                    in metric(metrics_port, "triton_proxy_overload_pressure")
                ),
                what="pressure at its ceiling",
            )
            status, headers, body = infer(port, OFFLINE)
            assert status == 429, body
            assert headers.get("retry-after") == "1"
            assert b"short of CPU" in body and b"offline" in body and b"lags" in body
            assert infer(port, REALTIME)[0] == 200
            with grpcclient.InferenceServerClient(f"127.0.0.1:{proxy.ports.grpc}") as c:
                with pytest.raises(InferenceServerException) as info:
                    c.infer("simple", grpc_inputs(), headers={"authorization": f"Bearer {OFFLINE}"})
                assert info.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED)
                c.infer("simple", grpc_inputs(), headers={"authorization": f"Bearer {REALTIME}"})
            assert 'class="offline",reason="busy"' in metric(metrics_port, "triton_proxy_shed")
        finally:
            stop.set()
        wait_for(
            lambda: (
                "triton_proxy_overload_pressure 0.0"
                in metric(proxy.ports.metrics, "triton_proxy_overload_pressure")
            ),
            what="pressure given back",
        )
        assert infer(port, OFFLINE)[0] == 200
