"""Editing the policy file reloads it safely: a good edit applies, a bad one is refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from tests.integration.harness import policy_for, running_proxy

pytestmark = pytest.mark.integration


def reloads(proxy: Any, result: str) -> float:
    return proxy.proxy.telemetry.reloads.labels(result)._value.get()  # type: ignore[no-any-return]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def infer(url: str) -> None:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        i = httpclient.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        inputs.append(i)
    with httpclient.InferenceServerClient(url) as c:
        c.infer("simple", inputs)


def test_policy_file_edits_reload(triton_fleet: Any, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    servers = triton_fleet.servers
    doc = policy_for(servers, {"routing": {"policy": {"name": "round_robin"}}})
    path.write_text(yaml.safe_dump(doc))
    with running_proxy(servers, doc, policy_path=path, watch_interval_s=0.1) as proxy:
        infer(proxy.http)
        assert proxy.runtime.router.policy("simple")[0] == "round_robin"

        # A good edit: new policy, classes on, one instance removed.
        doc["routing"] = {"policy": {"name": "least_requests"}}
        doc["scheduling"] = {"default_class": "online"}
        doc["instances"] = doc["instances"][:2]
        path.write_text(yaml.safe_dump(doc))
        wait_for(lambda: reloads(proxy, "ok") == 1)
        rt = proxy.runtime
        assert rt.router.policy("simple")[0] == "least_requests"
        assert rt.gates is not None and rt.dispatcher.admission is rt.gates
        assert [i.name for i in rt.fleet.all()] == [s.name for s in servers[:2]]
        for _ in range(6):
            infer(proxy.http)
        # Slots are released just after each answer is written (the dispatcher's deliver).
        gates = rt.gates
        wait_for(lambda: gates.gates["simple"].in_flight() == 0)
        used = {inst for (m, p, inst) in rt.router.stats.decisions if p == "least_requests"}
        assert used <= {s.name for s in servers[:2]}

        # A bad edit is refused with the reason; the running policy stays and serves.
        path.write_text(
            "routing:\n  policy: {name: fastest}\n"
            + yaml.safe_dump({"instances": doc["instances"]})
        )
        wait_for(lambda: reloads(proxy, "error") == 1)
        assert proxy.runtime.router.policy("simple")[0] == "least_requests"
        infer(proxy.http)
        assert proxy.proxy.config.routing.policy.name == "least_requests"
