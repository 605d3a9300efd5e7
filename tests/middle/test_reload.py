"""Reloads lose nothing (issue 9, point 4) and the policy watch survives any error (point 5),
against fakes, with traffic during every reload."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import grpc
import yaml
from tritonclient.grpc import service_pb2 as pb

from proxy import config as config_mod
from proxy.config import ProxyConfig
from tests.fakes.triton import FakeFleet, Fault
from tests.integration.harness import ProxyThread, policy_for, running_proxy
from tests.middle.conftest import infer_doc, port_of, raw, wait_for, with_defaults

BODY = json.dumps(infer_doc()).encode()


def reloads(proxy: ProxyThread, result: str) -> float:
    return float(proxy.proxy.telemetry.reloads.labels(result)._value.get())


def write(path: Path, doc: dict[str, Any]) -> None:
    # Written whole then renamed: the watcher never reads half a file.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)


class Traffic:
    """HTTP and gRPC clients sending requests until stopped; every answer is kept."""

    def __init__(self, proxy: ProxyThread, threads: int = 3) -> None:
        self.port = port_of(proxy)
        self.grpc = proxy.grpc
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.count = 0
        self._threads = [threading.Thread(target=self._http) for _ in range(threads)]
        self._threads.append(threading.Thread(target=self._grpc))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)

    def _http(self) -> None:
        while not self.stop.is_set():
            r = raw(self.port, "POST", "/v2/models/simple/infer", [], BODY, timeout_s=30)
            self.count += 1
            if r.status != 200:
                self.failures.append(f"HTTP {r.status} {r.body[:200]!r} {r.error}")

    def _grpc(self) -> None:
        request = pb.ModelInferRequest(model_name="simple").SerializeToString()
        with grpc.insecure_channel(self.grpc) as ch:
            call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            while not self.stop.is_set():
                try:
                    call(request, timeout=30)
                except grpc.RpcError as exc:
                    self.failures.append(f"gRPC {exc.code()} {exc.details()}")  # type: ignore[attr-defined]
                self.count += 1


def test_reload_loop_during_traffic_fails_nothing(fakes: FakeFleet, tmp_path: Path) -> None:
    """20 reloads (instance removed and re-added, policies and classes switched) while HTTP
    and gRPC clients send requests that are in flight on the removed instance: 0 failures."""
    for fake in fakes.servers:
        fake.faults.append(Fault("delay", delay_s=0.05))
    path = tmp_path / "policy.yaml"
    base = policy_for(
        fakes.servers, with_defaults({"routing": {"policy": {"name": "round_robin"}}})
    )
    write(path, base)
    variants = []
    for i in range(20):
        doc = dict(base)
        if i % 2 == 0:
            doc["instances"] = base["instances"][:2]
        doc["routing"] = {"policy": {"name": ("least_requests", "round_robin", "p2c")[i % 3]}}
        if i % 4 in (1, 2):
            doc["scheduling"] = {"default_class": "online"}
        variants.append(doc)
    with (
        running_proxy(fakes.servers, base, policy_path=path, watch_interval_s=0.05) as proxy,
        Traffic(proxy) as traffic,
    ):
        wait_for(lambda: traffic.count >= 20, what="traffic before the reloads")
        for i, doc in enumerate(variants, start=1):
            write(path, doc)
            wait_for(lambda n=i: reloads(proxy, "ok") >= n, what=f"reload {i}")
            seen = traffic.count
            wait_for(lambda s=seen: traffic.count >= s + 4, what="traffic after a reload")
        total = traffic.count
    assert reloads(proxy, "error") == 0
    assert total >= 100
    assert not traffic.failures, (
        f"{len(traffic.failures)} of {total} failed: {traffic.failures[:5]}"
    )


def test_requests_in_flight_on_a_removed_instance_finish(fakes: FakeFleet, tmp_path: Path) -> None:
    slow = fakes.servers[2]
    slow.faults.append(Fault("delay", delay_s=1.0))
    path = tmp_path / "policy.yaml"
    base = policy_for(
        fakes.servers, with_defaults({"routing": {"policy": {"name": "round_robin"}}})
    )
    write(path, base)
    answers: list[Any] = []
    with running_proxy(fakes.servers, base, policy_path=path, watch_interval_s=0.05) as proxy:
        port = port_of(proxy)
        threads = [
            threading.Thread(
                target=lambda: answers.append(
                    raw(port, "POST", "/v2/models/simple/infer", [], BODY, timeout_s=30)
                )
            )
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: len(slow.inferences()) >= 2, what="requests in flight on fake-2")
        write(path, dict(base, instances=base["instances"][:2]))
        wait_for(lambda: reloads(proxy, "ok") == 1, what="reload")
        for t in threads:
            t.join(30)
    assert [a.status for a in answers] == [200] * 6, [
        (a.status, a.body[:200], a.error) for a in answers
    ]


def test_a_sequence_bound_to_a_removed_instance_ends_with_a_clear_error(
    fakes: FakeFleet, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    base = policy_for(
        fakes.servers, with_defaults({"routing": {"policy": {"name": "round_robin"}}})
    )
    write(path, base)
    start = json.dumps(infer_doc({"sequence_id": 99, "sequence_start": True}, 0)).encode()
    step = json.dumps(infer_doc({"sequence_id": 99}, 0)).encode()
    with running_proxy(fakes.servers, base, policy_path=path, watch_interval_s=0.05) as proxy:
        port = port_of(proxy)
        assert raw(port, "POST", "/v2/models/seq/infer", [], start).status == 200
        holder = next(f.name for f in fakes.servers if f.inferences())
        write(path, dict(base, instances=[i for i in base["instances"] if i["name"] != holder]))
        wait_for(lambda: reloads(proxy, "ok") == 1, what="reload")
        r = raw(port, "POST", "/v2/models/seq/infer", [], step)
        after = raw(port, "POST", "/v2/models/simple/infer", [], BODY).status
    assert (r.status is not None and 400 <= r.status < 500) or r.status == 503, (r.status, r.body)
    message = r.triton_error() or ""
    assert "sequence" in message and "99" in message, f"not a clear error: {r.status} {r.body!r}"
    assert after == 200


def test_the_policy_watch_survives_an_unexpected_error(fakes: FakeFleet, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    base = policy_for(
        fakes.servers, with_defaults({"routing": {"policy": {"name": "round_robin"}}})
    )
    write(path, base)
    calls = {"n": 0}

    def flaky_loader(p: Path) -> ProxyConfig:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("disk on fire")
        return config_mod.load_file(p)

    with running_proxy(
        fakes.servers, base, policy_path=path, watch_interval_s=0.05, policy_loader=flaky_loader
    ) as proxy:
        write(path, dict(base, routing={"policy": {"name": "p2c"}}))
        wait_for(lambda: calls["n"] >= 1, what="first reload attempt")
        write(path, dict(base, routing={"policy": {"name": "least_requests"}}))
        wait_for(lambda: reloads(proxy, "ok") >= 1, timeout_s=5, what="a reload after the error")
        name = proxy.runtime.router.policy("simple")[0]
    assert name == "least_requests"


def test_a_reload_sets_and_clears_a_models_cost_curve(fakes: FakeFleet, tmp_path: Path) -> None:
    """``scheduling.cost.models`` replaces the learned curve on start and on every reload."""
    path = tmp_path / "policy.yaml"
    cost = {"models": {"simple": {"base_ms": 5, "per_unit_us": 20}}}
    base = policy_for(fakes.servers, with_defaults({"scheduling": {"cost": cost}}))
    write(path, base)
    with running_proxy(fakes.servers, base, policy_path=path, watch_interval_s=0.05) as proxy:
        costs = proxy.proxy.runtime.dispatcher.costs
        assert costs.curve("simple") == (0.005, 20e-6)
        write(path, {**base, "scheduling": {"default_class": "online"}})
        wait_for(lambda: reloads(proxy, "ok") >= 1, what="the reload")
        assert costs.curve("simple") is None  # nothing learned yet: no curve
