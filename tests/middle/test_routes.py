"""Routes and credentials (issue 9, points 1 and 3), checked on what the fakes received.

Only canonical targets of Triton's route table reach an instance; everything else is 400 in
Triton's format (or the proxy's own 4xx) and counts against no instance's health. API keys
and the admin token stay at the proxy: not forwarded, not in metrics, not in logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.grpc import service_pb2 as pb

from tests.fakes.rawhttp import build, exchange
from tests.fakes.routes import path_problem
from tests.fakes.triton import FakeFleet
from tests.integration.harness import policy_for
from tests.middle.conftest import (
    ProxyFactory,
    grpc_inputs,
    http_inputs,
    infer_doc,
    port_of,
    raw,
    wait_for,
    with_defaults,
)

INFER_BODY = json.dumps(infer_doc()).encode()


def refused_targets(canary: int) -> list[tuple[str, str]]:
    return [
        ("POST", "/v2/models/../repository/models/simple/unload"),
        ("POST", "/v2/models/simple/../../repository/models/simple/unload"),
        ("POST", "/v2/models/%2e%2e/repository/models/simple/unload"),
        ("POST", "/v2/models/.%2E/.%2E/v2/repository/index"),
        ("POST", "/v2/models/x%2F..%2Fsimple/infer"),
        ("POST", "/v2/models/x%2f..%2fsimple/infer"),
        ("POST", "/v2/models/x%5C..%5Csimple/infer"),
        ("POST", "/v2/models/simple/./infer"),
        ("POST", "/v2/models/simple//infer"),
        ("POST", "/v2/models/simple/infer/"),
        ("POST", "/v2/models/simple/infer/.."),
        ("GET", "/v2/models/./simple/config"),
        ("GET", "/v2//models/simple/config"),
        ("GET", "/v2/models/simple%2Fconfig"),
        ("GET", "/v2/models/%2E%2E/%2E%2E/v2/health/ready"),
        ("GET", "/v2/models/simple/../../logging"),
        ("GET", "/../v2/models/simple/config"),
        ("GET", "/v2/models/simple\\..\\..\\logging"),
        ("GET", f"//127.0.0.1:{canary}/x"),
        ("GET", f"//127.0.0.1:{canary}/v2/health/ready"),
        ("GET", "//127.0.0.1:1/x"),
        ("GET", f"http://127.0.0.1:{canary}/v2/health/ready"),
        ("POST", f"http://127.0.0.1:{canary}/v2/models/simple/infer"),
        ("CONNECT", f"127.0.0.1:{canary}"),
    ]


# Authority-form with another method fails aiohttp's request-line parser, which answers a
# plain-text 400 before any handler runs: refused and never relayed, but not in Triton's
# JSON format (the proxy cannot reach it without replacing aiohttp's parser).
PARSER_REFUSED = [("GET", "127.0.0.1:{canary}"), ("POST", "127.0.0.1:{canary}")]


def test_refused_targets_get_400_and_reach_nothing(
    fakes: FakeFleet, proxy_on: ProxyFactory
) -> None:
    canary = fakes.add("canary", instance=False)
    with proxy_on({"routing": {"policy": {"name": "round_robin"}}}) as proxy:
        port = port_of(proxy)
        wrong = []
        for method, target in refused_targets(canary.http_port):
            body = INFER_BODY if method == "POST" else b""
            r = raw(port, method, target, body=body)
            if r.status != 400 or r.triton_error() is None:
                wrong.append(f"{method} {target}: {r.status} {r.body[:120]!r} {r.error}")
        for method, target in PARSER_REFUSED:
            r = raw(port, method, target.format(canary=canary.http_port))
            if r.status != 400:
                wrong.append(f"{method} {target}: {r.status} {r.body[:120]!r} {r.error}")
        fleet = proxy.runtime.fleet
        unhealthy = [i.name for i in fleet.all() if not i.healthy or i.failures]
        ejections = proxy.proxy.telemetry.ejections.collect()[0].samples
        refused_inferences = fakes.inferences()
        # A plain request still works afterwards.
        ok = raw(port, "POST", "/v2/models/simple/infer", body=INFER_BODY).status
    assert not wrong, "targets not refused with 400 in Triton's format:\n" + "\n".join(wrong)
    reached = [
        f"{r.instance}: {r.method} {r.raw_path}"
        for r in fakes.received(lambda r: r.protocol == "http")
        if path_problem(r.method, r.raw_path)
    ]
    assert not reached, f"refused targets reached instances: {reached}"
    assert not canary.seen(), f"the proxy fetched from the canary: {canary.seen()[:3]}"
    assert not refused_inferences, "a refused inference target reached an instance"
    assert not unhealthy, f"refused requests counted against instances: {unhealthy}"
    assert not [s for s in ejections if s.value], ejections
    assert ok == 200


def test_targets_outside_the_route_table_are_not_relayed(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    outside = [
        ("GET", "/metrics"),
        ("GET", "/v3/models/simple"),
        ("GET", "/"),
        ("GET", "/v2/models/simple/bogus"),
        ("DELETE", "/v2/models/simple"),
        ("PUT", "/v2/models/simple/infer"),
        ("GET", "/v2/models/simple/infer"),
        ("PATCH", "/v2/models/simple/config"),
        ("TRACE", "/v2/health/ready"),
        ("POST", "/v2/repository/models/simple/unload"),  # admin off
        ("POST", "/v2/logging"),  # admin off
    ]
    with proxy_on() as proxy:
        port = port_of(proxy)
        answers = {
            f"{m} {t}": raw(port, m, t, body=b"{}" if m != "GET" else b"") for m, t in outside
        }
    bad = {
        k: (r.status, r.body[:100])
        for k, r in answers.items()
        if not r.status or not 400 <= r.status < 500
    }
    assert not bad, f"expected a 4xx from the proxy: {bad}"
    reached = [
        f"{r.method} {r.raw_path}"
        for r in fakes.received(lambda r: r.protocol == "http")
        if path_problem(r.method, r.raw_path)
    ]
    assert not reached, f"relayed outside the route table: {reached}"


def test_table_routes_reach_the_instance_as_built(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    """Each read-only route arrives at an instance under its canonical path, unchanged."""
    targets = [
        "/v2",
        "/v2/models/simple",
        "/v2/models/simple/versions/1",
        "/v2/models/simple/ready",
        "/v2/models/simple/config",
        "/v2/models/simple/versions/1/config",
        "/v2/models/simple/stats",
        "/v2/models/stats",
        "/v2/logging",
        "/v2/trace/setting",
    ]
    with proxy_on() as proxy:
        port = port_of(proxy)
        fakes.clear()
        statuses = {t: raw(port, "GET", t).status for t in targets}
    assert all(s is not None and s < 500 for s in statuses.values()), statuses
    seen = {r.raw_path for r in fakes.received(lambda r: r.protocol == "http")}
    relayed = {t for t in targets if t in seen}
    # Health and a few settings may be answered by the proxy itself; model routes are Triton's.
    model_routes = {t for t in targets if t.startswith("/v2/models/")}
    assert model_routes <= relayed, f"not relayed as sent: {sorted(model_routes - relayed)}"
    assert all(path_problem("GET", p) is None for p in seen), seen


def test_ssrf_target_does_not_eject_instances(proxy_on: ProxyFactory) -> None:
    with proxy_on() as proxy:
        port = port_of(proxy)
        for _ in range(3):
            raw(port, "GET", "//127.0.0.1:1/x")
        statuses = [
            raw(port, "POST", "/v2/models/simple/infer", body=INFER_BODY).status for _ in range(6)
        ]
        healthy = [i.healthy for i in proxy.runtime.fleet.all()]
    assert statuses == [200] * 6, statuses
    assert all(healthy), healthy


# --- credentials ---------------------------------------------------------------------------

API_KEY = "sk-live-do-not-forward-1"
ADMIN_TOKEN = "adm-do-not-forward-2"
RAW_KEY = "raw-key-do-not-forward-3"


def credential_policy(header: str = "authorization", key: str = API_KEY) -> dict[str, Any]:
    return {
        "scheduling": {
            "default_class": "online",
            "api_key_header": header,
            "api_keys": {key: {"class_name": "realtime"}},
        },
        "admin": {"enabled": True, "token": ADMIN_TOKEN},
    }


def _secrets_in(received: list[Any], secrets: tuple[str, ...]) -> list[str]:
    found = []
    for r in received:
        for k, v in r.headers:
            if k == "authorization" or any(s in v for s in secrets):
                found.append(f"{r.instance} {r.protocol} {r.raw_path}: {k}: {v[:40]}")
    return found


def test_api_key_and_admin_token_are_not_forwarded(
    proxy_on: ProxyFactory, fakes: FakeFleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    # Fresh dicts: tritonclient adds Inference-Header-Content-Length to the one it is given.
    def bearer() -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def admin() -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    with proxy_on(credential_policy()) as proxy:
        with httpclient.InferenceServerClient(proxy.http) as c:
            c.infer("simple", http_inputs(), headers=bearer())
            c.infer("simple", http_inputs(binary=False), headers=bearer())
            c.get_model_config("simple", headers=bearer())
            c.get_model_metadata("simple", headers=bearer())
            c.load_model("simple", headers=admin())
            c.unload_model("simple", headers=admin())
            c.get_model_repository_index(headers=admin())
            c.update_log_settings({"log_verbose_level": 0}, headers=admin())
        port = port_of(proxy)
        gen = json.dumps({"text_input": "hi"}).encode()
        for path in ("/v2/models/gen/generate", "/v2/models/gen/generate_stream"):
            assert (
                raw(port, "POST", path, [("Authorization", f"Bearer {API_KEY}")], gen).status == 200
            )
        g = grpcclient.InferenceServerClient(proxy.grpc)
        meta = {"authorization": f"Bearer {API_KEY}"}
        g.infer("simple", grpc_inputs(), headers=meta)
        g.get_model_config("simple", headers=meta)
        g.load_model("simple", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        results: list[Any] = []
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=meta)
        for _ in range(2):
            g.async_stream_infer("simple", grpc_inputs())
        wait_for(lambda: len(results) == 2, what="stream replies")
        g.stop_stream()
        g.close()
        metrics = proxy.proxy.telemetry.exposition().decode()
    assert all(not isinstance(r, Exception) for r in results), results
    received = fakes.received()
    assert len([r for r in received if r.parameters is not None]) >= 7
    assert any("repository/models/simple/load" in r.raw_path for r in received)
    leaks = _secrets_in(received, (API_KEY, ADMIN_TOKEN))
    assert not leaks, "credentials forwarded to Triton:\n" + "\n".join(leaks)
    for secret in (API_KEY, ADMIN_TOKEN):
        assert secret not in metrics
        assert secret not in caplog.text


def test_raw_api_key_header_is_not_forwarded(fakes: FakeFleet) -> None:
    from tests.integration.harness import running_proxy

    with running_proxy(
        fakes.servers, with_defaults(credential_policy("x-api-key", RAW_KEY))
    ) as proxy:
        with httpclient.InferenceServerClient(proxy.http) as c:
            c.infer("simple", http_inputs(), headers={"X-Api-Key": RAW_KEY})
        g = grpcclient.InferenceServerClient(proxy.grpc)
        g.infer("simple", grpc_inputs(), headers={"x-api-key": RAW_KEY})
        g.close()
    leaks = _secrets_in(fakes.received(), (RAW_KEY,))
    assert fakes.inferences(), "nothing reached the fakes"
    assert not leaks, "API key header forwarded:\n" + "\n".join(leaks)


def test_a_mistyped_secret_is_not_printed_on_reload(
    fakes: FakeFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy edit whose admin token or API-key grant has the wrong type is refused, and
    the refusal names the place, not the secret."""
    from tests.integration.harness import running_proxy

    caplog.set_level(logging.DEBUG)
    path = tmp_path / "policy.yaml"
    doc = policy_for(fakes.servers, with_defaults({}))
    path.write_text(yaml.safe_dump(doc))
    with running_proxy(
        fakes.servers, with_defaults({}), policy_path=path, watch_interval_s=0.05
    ) as proxy:
        errors = proxy.proxy.telemetry.reloads.labels("error")
        bad_token = dict(doc, admin={"enabled": True, "token": 98765432123})
        path.write_text(yaml.safe_dump(bad_token))
        wait_for(lambda: errors._value.get() == 1, what="refused reload")
        bad_grant = dict(doc, scheduling={"api_keys": {"sk-live-secret-grant": "realtime"}})
        path.write_text(yaml.safe_dump(bad_grant))
        wait_for(lambda: errors._value.get() == 2, what="second refused reload")
    assert "98765432123" not in caplog.text, "the mistyped admin token is in the log"
    assert "sk-live-secret-grant" not in caplog.text, "the API key is in the log"


def test_grpc_admin_and_shared_memory_never_reach_instances(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    with proxy_on() as proxy:
        g = grpcclient.InferenceServerClient(proxy.grpc)
        codes = []
        for call in (
            lambda: g.load_model("simple"),
            lambda: g.unload_model("simple"),
            lambda: g.update_log_settings({"log_verbose_level": 1}),
            lambda: g.register_system_shared_memory("r", "/k", 16),
        ):
            try:
                call()
                codes.append("OK")
            except Exception as exc:  # tritonclient raises InferenceServerException
                codes.append(str(getattr(exc, "status", lambda: "?")()))
        g.close()
    assert "OK" not in codes, codes
    reached = fakes.received(lambda r: r.protocol == "grpc" and "Repository" in r.raw_path)
    reached += fakes.received(lambda r: r.protocol == "grpc" and "LogSettings" in r.raw_path)
    assert not reached, reached


def test_grpc_reflection_of_unknown_methods_is_unimplemented(proxy_on: ProxyFactory) -> None:
    with proxy_on() as proxy:
        ch = grpc.insecure_channel(proxy.grpc)
        try:
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary("/inference.GRPCInferenceService/NoSuch")(b"", timeout=5)
            code = err.value.code()  # type: ignore[attr-defined]
            ready = pb.ServerReadyResponse.FromString(
                ch.unary_unary("/inference.GRPCInferenceService/ServerReady")(b"", timeout=5)
            )
        finally:
            ch.close()
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert ready.ready


@pytest.mark.parametrize(
    ("target", "headers", "status"),
    [
        ("/v2/repository/models/simple/load", [], 403),  # no admin token
        ("/v2/no/such/route", [], 404),
        ("/v2/models/simple/infer", [("Content-Encoding", "br")], 400),
    ],
)
def test_what_the_head_decides_is_refused_before_the_body_is_read(
    proxy_on: ProxyFactory,
    fakes: FakeFleet,
    target: str,
    headers: list[tuple[str, str]],
    status: int,
) -> None:
    """A client that announces 50 MB and sends none of it is answered at once: the proxy
    reads (and holds against its byte budget) no body it would refuse anyway."""
    with proxy_on({"admin": {"enabled": True, "token": "s3cret"}}) as proxy:
        head = build("POST", target, headers, b"", content_length=50_000_000)
        answer = asyncio.run(exchange("127.0.0.1", port_of(proxy), head, timeout_s=5.0))
        assert answer.status == status, answer
        assert answer.triton_error()
        assert proxy.runtime.budget.in_use == 0
    assert not any(r.method == "POST" for f in fakes.servers for r in f.received)
