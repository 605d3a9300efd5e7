"""The HTTP frontend against real Triton servers, through the real tritonclient."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def proxy(triton_fleet: Any) -> Iterator[ProxyThread]:
    policy = {
        "limits": {"max_body_bytes": MAX_BODY},
        "routing": {"policy": {"name": "round_robin"}},
    }
    with running_proxy(triton_fleet.servers, policy) as p:
        yield p


def _url(server: Any) -> str:
    return str(server.http_url).removeprefix("http://")


def simple_inputs(binary: bool) -> list[httpclient.InferInput]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32) * 3
    inputs = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        i = httpclient.InferInput(name, list(arr.shape), "INT32")
        i.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(i)
    return inputs


def ids_input(n: int, binary: bool, seed: int = 0) -> list[httpclient.InferInput]:
    ids = np.random.default_rng(seed).integers(1, 999, size=(1, n), dtype=np.int64)
    i = httpclient.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    i.set_data_from_numpy(ids, binary_data=binary)
    return [i]


CASES: list[tuple[str, Any, list[str]]] = [
    ("simple", simple_inputs, ["OUTPUT0", "OUTPUT1"]),
    ("text_encoder", lambda binary: ids_input(24, binary), ["EMBEDDING"]),
    ("accel_sim", lambda binary: ids_input(8, binary), ["OUTPUT"]),
]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize(("model", "make_inputs", "outputs"), CASES, ids=[c[0] for c in CASES])
def test_same_outputs_through_proxy_and_direct(
    proxy: ProxyThread,
    triton_fleet: Any,
    model: str,
    make_inputs: Any,
    outputs: list[str],
    binary: bool,
) -> None:
    requested = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs]
    results = []
    for url in (_url(triton_fleet.servers[0]), proxy.http):
        with httpclient.InferenceServerClient(url) as client:
            r = client.infer(model, make_inputs(binary), outputs=requested)
            results.append({o: r.as_numpy(o) for o in outputs})
    direct, proxied = results
    for o in outputs:
        np.testing.assert_allclose(proxied[o], direct[o], rtol=1e-5, atol=1e-6)


def _inference_counts(triton_fleet: Any, model: str) -> list[int]:
    counts = []
    for server in triton_fleet.servers:
        with httpclient.InferenceServerClient(_url(server)) as client:
            stats = client.get_inference_statistics(model)["model_stats"][0]
            counts.append(int(stats["inference_count"]))
    return counts


def test_requests_spread_over_all_instances(proxy: ProxyThread, triton_fleet: Any) -> None:
    before = _inference_counts(triton_fleet, "simple")
    with httpclient.InferenceServerClient(proxy.http) as client:
        for _ in range(30):
            client.infer("simple", simple_inputs(True))
    after = _inference_counts(triton_fleet, "simple")
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 30
    assert served == [10, 10, 10], served  # round robin is exact


def test_health_and_metadata_match(proxy: ProxyThread, triton_fleet: Any) -> None:
    answers = []
    for url in (_url(triton_fleet.servers[0]), proxy.http):
        with httpclient.InferenceServerClient(url) as c:
            answers.append(
                (
                    c.is_server_live(),
                    c.is_server_ready(),
                    c.get_server_metadata(),
                    c.is_model_ready("simple"),
                    c.get_model_metadata("text_encoder"),
                    c.get_model_config("accel_sim"),
                )
            )
    assert answers[0] == answers[1]


def raw(
    address: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


BINARY_HEADER = json.dumps(
    {
        "inputs": [
            {
                "name": n,
                "shape": [1, 16],
                "datatype": "INT32",
                "parameters": {"binary_data_size": 64},
            }
            for n in ("INPUT0", "INPUT1")
        ]
    }
).encode()

ERROR_CASES = {
    "unknown model": ("/v2/models/no_such_model/infer", b'{"inputs": []}', {}),
    "malformed json": ("/v2/models/simple/infer", b'{"inputs": [', {}),
    "wrong binary header length": (
        "/v2/models/simple/infer",
        BINARY_HEADER + bytes(128),
        {"Inference-Header-Content-Length": str(len(BINARY_HEADER) + 7)},
    ),
    "header length past the body": (
        "/v2/models/simple/infer",
        BINARY_HEADER + bytes(128),
        {"Inference-Header-Content-Length": "99999"},
    ),
    "binary data too short": (
        "/v2/models/simple/infer",
        BINARY_HEADER + bytes(100),
        {"Inference-Header-Content-Length": str(len(BINARY_HEADER))},
    ),
    "unknown path": ("/v2/no/such/thing", b"", {}),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_match_triton(proxy: ProxyThread, triton_fleet: Any, case: str) -> None:
    path, body, headers = ERROR_CASES[case]
    direct = raw(_url(triton_fleet.servers[0]), "POST", path, body, headers)
    proxied = raw(proxy.http, "POST", path, body, headers)
    assert direct[0] >= 400
    assert proxied == direct
    assert "error" in json.loads(proxied[1])


def test_oversized_body_is_refused_in_tritons_format(proxy: ProxyThread) -> None:
    # Triton 2.51 itself has no body limit (a 69 MB body reaches the model); the proxy has one.
    body = BINARY_HEADER + bytes(MAX_BODY)
    status, data = raw(
        proxy.http,
        "POST",
        "/v2/models/simple/infer",
        body,
        {"Inference-Header-Content-Length": str(len(BINARY_HEADER))},
    )
    assert status == 413
    assert "maximum allowed input size of 262144 bytes" in json.loads(data)["error"]
    with httpclient.InferenceServerClient(proxy.http) as client:
        assert client.infer("simple", simple_inputs(True)).as_numpy("OUTPUT0") is not None


def test_model_control_needs_the_admin_token(proxy: ProxyThread) -> None:
    status, data = raw(proxy.http, "POST", "/v2/repository/models/simple/unload")
    assert status == 403 and "disabled" in json.loads(data)["error"]
    with httpclient.InferenceServerClient(proxy.http) as client:
        with pytest.raises(InferenceServerException, match="disabled"):
            client.unload_model("simple")
        assert client.is_model_ready("simple")


def test_admin_token_enables_model_control(triton_fleet: Any) -> None:
    policy = {"admin": {"enabled": True, "token": "s3cret"}}
    with running_proxy(triton_fleet.servers, policy) as p:
        status, _ = raw(
            p.http, "POST", "/v2/repository/index", headers={"Authorization": "Bearer wrong"}
        )
        assert status == 403
        status, data = raw(
            p.http, "POST", "/v2/repository/index", headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and {"name": "simple", "version": "1", "state": "READY"} in [
            {k: m.get(k) for k in ("name", "version", "state")} for m in json.loads(data)
        ]
        # Loading an already loaded model is a no-op on every instance.
        status, _ = raw(
            p.http,
            "POST",
            "/v2/repository/models/simple/load",
            headers={"Authorization": "Bearer s3cret"},
        )
        assert status == 200


def test_shared_memory_is_refused_clearly(proxy: ProxyThread) -> None:
    with (
        httpclient.InferenceServerClient(proxy.http) as client,
        pytest.raises(
            InferenceServerException, match="shared memory is not supported through triton-proxy"
        ),
    ):
        client.register_system_shared_memory("region", "/key", 64)
