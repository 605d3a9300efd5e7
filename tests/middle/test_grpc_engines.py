"""Both gRPC engines (``listen.grpc_engine``): the proxy's own HTTP/2 (the default, which every
other gRPC test runs on) and ``grpc.aio``, kept as the fallback, give a client the same
answers, the same errors and the same streams, and the fakes receive the same requests."""

from __future__ import annotations

from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from proxy.h2.client import H2Upstreams
from proxy.h2.server import H2GrpcServer
from tests.middle.conftest import ProxyFactory, grpc_inputs, wait_for

CLASSES = {
    "classes": {"rt": {"rank": 0, "triton_priority": 1}, "bulk": {"rank": 1, "triton_priority": 2}},
    "default_class": "bulk",
    "api_keys": {"engine-key": {"class_name": "rt"}},
}


def _session(proxy_on: ProxyFactory, engine: str) -> dict[str, Any]:
    policy = {"listen": {"grpc_engine": engine}, "scheduling": CLASSES}
    seen: dict[str, Any] = {}
    with proxy_on(policy) as proxy:
        assert isinstance(proxy.proxy._grpc_server, H2GrpcServer) == (engine == "h2")
        assert isinstance(proxy.proxy.runtime.grpc_upstreams, H2Upstreams) == (engine == "h2")
        client = grpcclient.InferenceServerClient(proxy.grpc)
        try:
            headers = {"authorization": "Bearer engine-key"}
            answer = client.infer("simple", grpc_inputs(), headers=headers, client_timeout=10)
            seen["output"] = answer.as_numpy("OUTPUT0").tolist()
            seen["config"] = client.get_model_config("simple", as_json=True)["config"]["name"]
            with pytest.raises(InferenceServerException) as unknown:
                client.infer("no_such_model", grpc_inputs())
            seen["unknown"] = (unknown.value.status(), unknown.value.message())
            with pytest.raises(InferenceServerException) as control:
                client.load_model("simple")  # no admin token
            seen["control"] = control.value.status()
            results: list[Any] = []
            client.start_stream(callback=lambda result, error: results.append(error or result))
            for _ in range(3):
                client.async_stream_infer("simple", grpc_inputs())
            wait_for(lambda: len(results) == 3, what="stream answers")
            client.stop_stream()
            seen["stream"] = [r.as_numpy("OUTPUT0").tolist() for r in results]
        finally:
            client.close()
    return seen


def test_both_engines_answer_alike(proxy_on: ProxyFactory, fakes: Any) -> None:
    by_engine = {}
    for engine in ("h2", "grpcio"):
        fakes.received()  # forget what came before
        seen = _session(proxy_on, engine)
        inferences = [r for r in fakes.received() if r.protocol == "grpc" and r.parameters]
        seen["priorities"] = sorted({r.parameters.get("priority") for r in inferences} - {None})
        by_engine[engine] = seen
    assert by_engine["h2"] == by_engine["grpcio"]
    assert by_engine["h2"]["priorities"] == [1, 2]  # the key's class, then the default class
    assert by_engine["h2"]["control"] == "StatusCode.PERMISSION_DENIED"
