"""The middle ring: the real proxy (in-process, its own thread) in front of fake Triton
servers that record what they receive. Runs in seconds; no tritonserver needed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.fakes.rawhttp import RawResponse, build, exchange
from tests.fakes.triton import FakeFleet
from tests.integration.harness import ProxyThread, running_proxy

# Fast health reactions: the fakes answer in microseconds.
FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.middle)


@pytest.fixture
def fakes() -> Iterator[FakeFleet]:
    with FakeFleet(3) as fleet:
        yield fleet


def with_defaults(policy: dict[str, Any] | None) -> dict[str, Any]:
    doc = dict(policy or {})
    doc.setdefault("health", FAST_HEALTH)
    doc.setdefault("limits", {"connect_timeout_s": 1.0})
    return doc


ProxyFactory = Callable[..., contextlib.AbstractContextManager[ProxyThread]]


@pytest.fixture
def proxy_on(fakes: FakeFleet) -> ProxyFactory:
    """``with proxy_on(policy) as proxy:`` the real proxy in front of ``fakes``."""

    def make(policy: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return running_proxy(fakes.servers, with_defaults(policy), **kwargs)

    return make


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s"
        time.sleep(0.02)


def raw(
    port: int,
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    **kwargs: Any,
) -> RawResponse:
    """One request with exactly this target (no client-side normalisation)."""
    data = build(method, target, headers, body, content_length=bool(body) or method == "POST")
    return asyncio.run(exchange("127.0.0.1", port, data, **kwargs))


def port_of(proxy: ProxyThread) -> int:
    assert proxy.ports is not None
    return proxy.ports.http


def infer_doc(parameters: dict[str, Any] | None = None, model_inputs: int = 2) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "inputs": [
            {"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
            for i in range(model_inputs)
        ]
    }
    if parameters is not None:
        doc["parameters"] = parameters
    return doc


def http_inputs(binary: bool = True) -> list[httpclient.InferInput]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a, binary_data=binary)
    return inputs


def grpc_inputs() -> list[grpcclient.InferInput]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return inputs
