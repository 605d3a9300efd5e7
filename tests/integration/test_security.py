"""The gateway's refusals, against real Triton servers: nothing a client's path or body says
reaches what it should not (issue 9). What the far side received is asserted in the middle
ring (tests/middle), whose fake servers record every request; here real Triton proves the
refused requests changed nothing and the accepted ones still work."""

from __future__ import annotations

import gzip
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

KEYS = {"rt-key": {"class_name": "realtime"}, "off-key": {"class_name": "offline"}}


@pytest.fixture(scope="module")
def proxy(triton_fleet: Any) -> Iterator[ProxyThread]:
    with running_proxy(triton_fleet.servers, {"scheduling": {"api_keys": KEYS}}) as p:
        yield p


def raw(address: str, request_line: str, body: bytes = b"", headers: str = "") -> tuple[int, bytes]:
    """One HTTP/1.1 request sent as written (no client normalises its path)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"{request_line} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), payload


def model_ready(server: Any, model: str) -> bool:
    url = f"{server.http_url}/v2/models/{model}/ready"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.mark.parametrize(
    "request_line",
    [
        "POST /v2/models/../repository/models/simple/unload",
        "POST /v2/models/%2e%2e/repository/models/simple/unload",
        "POST /v2/models/x%2F..%2F..%2Frepository%2Fmodels%2Fsimple/unload",
        "POST //127.0.0.1:1/v2/repository/models/simple/unload",
        "POST http://127.0.0.1:1/v2/repository/models/simple/unload",
    ],
)
def test_model_control_cannot_be_reached_through_a_crafted_path(
    proxy: ProxyThread, triton_fleet: Any, request_line: str
) -> None:
    status, body = raw(proxy.http, request_line, b"{}")
    assert status == 400, body
    assert "error" in json.loads(body)
    assert all(model_ready(s, "simple") for s in triton_fleet.servers)


def test_no_target_reaches_another_service_and_refusals_eject_nothing(
    proxy: ProxyThread, triton_fleet: Any
) -> None:
    metrics_port = triton_fleet.servers[0].metrics_url.split(":")[2].split("/")[0]
    for line in (
        f"GET //127.0.0.1:{metrics_port}/metrics",
        f"GET http://127.0.0.1:{metrics_port}/metrics",
        "GET //127.0.0.1:1/x",
        "GET /metrics",
    ):
        status, body = raw(proxy.http, line)
        assert status in (400, 404), (line, status)
        assert b"nv_inference" not in body
    # Refused requests are the client's fault, never the instances': none was ejected.
    assert all(i.healthy for i in proxy.runtime.fleet.all())
    client = httpclient.InferenceServerClient(proxy.http)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    assert client.infer("simple", inputs).as_numpy("OUTPUT0") is not None


def test_invented_model_names_get_404_and_add_no_metric_series(proxy: ProxyThread) -> None:
    def series() -> set[str]:
        """The exposition's series (name and labels, without values)."""
        text = proxy.proxy.telemetry.exposition().decode()
        return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line[:1] not in "#"}

    # A subset, not equality: a series may lawfully go in between (the smoothed occupancy
    # of a model an earlier test used decays and is forgotten); none may come.
    before = None
    for i in range(60):
        status, body = raw(proxy.http, f"POST /v2/models/invented-{i}/infer", b'{"inputs":[]}')
        assert status == 404
        assert (
            json.loads(body)["error"] == f"Request for unknown model: 'invented-{i}' is not found"
        )
        if i == 9:
            before = series()
    assert before is not None and series() - before == set()
    text = proxy.proxy.telemetry.exposition().decode()
    assert "invented-" not in text
    assert 'model="other"' in text
    assert proxy.runtime.catalog.unknown_count() <= proxy.runtime.catalog.max_unknown


@pytest.mark.parametrize("binary", [False, True])
def test_compressed_bodies_are_decoded_and_get_the_class_priority(
    proxy: ProxyThread, binary: bool
) -> None:
    """accel_sim has priority levels: the class's priority is set on the decoded body, which
    Triton then serves (a body the proxy could not rewrite would be refused, not passed)."""
    ids = np.arange(8, dtype=np.int64).reshape(1, 8)
    inp = httpclient.InferInput("INPUT_IDS", [1, 8], "INT64")
    inp.set_data_from_numpy(ids, binary_data=binary)
    body, header_length = httpclient.InferenceServerClient.generate_request_body([inp], priority=1)
    headers = "Authorization: Bearer off-key\r\nContent-Encoding: gzip\r\n"
    if header_length is not None:
        headers += f"Inference-Header-Content-Length: {header_length}\r\n"
    status, payload = raw(
        proxy.http, "POST /v2/models/accel_sim/infer", gzip.compress(body), headers
    )
    assert status == 200, payload
    status, payload = raw(
        proxy.http,
        "POST /v2/models/accel_sim/infer",
        b"\x1f\x8b not gzip",
        "Content-Encoding: gzip\r\n",
    )
    assert status == 400 and b"could not read the request body" in payload
    status, payload = raw(
        proxy.http, "POST /v2/models/accel_sim/infer", b"abc", "Content-Encoding: br\r\n"
    )
    assert status == 400 and b"unsupported Content-Encoding" in payload
    # A zip bomb costs no more than the body limit: 413 once its decompressed bytes pass it.
    limit = proxy.runtime.config.limits.max_body_bytes
    bomb = gzip.compress(b"\0" * (limit + 1024))
    status, payload = raw(
        proxy.http, "POST /v2/models/accel_sim/infer", bomb, "Content-Encoding: gzip\r\n"
    )
    assert status == 413, payload


def test_the_reload_log_never_shows_a_secret(
    triton_fleet: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import yaml

    from tests.integration.harness import policy_for

    path = tmp_path / "policy.yaml"
    doc = policy_for(triton_fleet.servers)
    path.write_text(yaml.safe_dump(doc))
    from proxy import config as config_mod
    from proxy.app import ProxyServer
    from tests.integration.harness import ProxyThread as Thread

    server = ProxyServer(config_mod.load_file(path), policy_path=path, watch_interval_s=0.1)
    thread = Thread(server)
    thread.start()
    try:
        doc["admin"] = {"enabled": True, "token": 4815162342}  # a mistyped token
        path.write_text(yaml.safe_dump(doc))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "admin.token" not in caplog.text:
            time.sleep(0.1)
        assert "admin.token" in caplog.text
        assert "4815162342" not in caplog.text
    finally:
        thread.stop()
