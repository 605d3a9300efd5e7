"""gRPC streams pass the gate per message (issue 9, point 7); shutdown drains (point 6)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from tests.fakes.process import ProxyProcess
from tests.fakes.rawhttp import build, exchange
from tests.fakes.triton import FakeFleet, Fault
from tests.middle.conftest import FAST_HEALTH, ProxyFactory, infer_doc, port_of, raw, wait_for

BODY = json.dumps(infer_doc()).encode()
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
TIGHT = {
    "scheduling": {
        "default_class": "online",
        "concurrency": 1,
        "classes": {"online": {"rank": 0, "triton_priority": 1, "queue_timeout_s": 2}},
    }
}


def message() -> bytes:
    return bytes(pb.ModelInferRequest(model_name="simple").SerializeToString())


def test_idle_streams_hold_no_gate_slot(proxy_on: ProxyFactory) -> None:
    """Capacity is 3 (1 per instance). Ten open streams, each idle after one answered
    message, must not starve unary calls; each stream's later messages are served too."""
    with proxy_on(TIGHT) as proxy:
        ch = grpc.insecure_channel(proxy.grpc)
        queues: list[Any] = []
        streams = []
        try:
            for _ in range(10):
                q: Any = __import__("queue").Queue()
                queues.append(q)

                def requests(q: Any = q) -> Any:
                    while (item := q.get()) is not None:
                        yield item

                call = ch.stream_stream(STREAM)(requests(), timeout=30)
                streams.append(call)
                q.put(message())
                reply = pb.ModelStreamInferResponse.FromString(next(call))
                assert not reply.error_message, reply.error_message
            unary = [ch.unary_unary(INFER)(message(), timeout=10) for _ in range(6)]
            http = [
                raw(port_of(proxy), "POST", "/v2/models/simple/infer", [], BODY).status
                for _ in range(6)
            ]
            for q, call in zip(queues, streams, strict=True):
                q.put(message())
                reply = pb.ModelStreamInferResponse.FromString(next(call))
                assert not reply.error_message, reply.error_message
        finally:
            for q in queues:
                q.put(None)
            for call in streams:
                call.cancel()
            ch.close()
    assert len(unary) == 6
    assert http == [200] * 6, http


def _free_port_refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_sigterm_drains_queued_and_in_flight_requests(tmp_path: Path) -> None:
    """Capacity 3, 12 concurrent requests of 1 s each (4 s of work), drain timeout 2.5 s, then
    SIGTERM: in-flight ones finish (200), queued ones finish or get 503 in Triton's format;
    readiness goes false (or the listener closes) at once; the process exits 0."""
    with FakeFleet(3) as fakes:
        for fake in fakes.servers:
            fake.faults.append(Fault("delay", delay_s=1.0))
        policy: dict[str, Any] = {
            "instances": [
                {"name": s.name, "http": s.http_url, "grpc": s.grpc_address} for s in fakes.servers
            ],
            "health": FAST_HEALTH,
            "limits": {"drain_timeout_s": 2.5},
            "scheduling": {
                "default_class": "online",
                "concurrency": 1,
                "classes": {"online": {"rank": 0, "triton_priority": 1, "queue_timeout_s": 60}},
            },
        }
        with ProxyProcess(policy, tmp_path) as proxy:
            port = proxy.http_port
            answers: list[Any] = []

            async def one() -> None:
                answers.append(
                    await exchange(
                        "127.0.0.1",
                        port,
                        build("POST", "/v2/models/simple/infer", [], BODY),
                        timeout_s=30,
                    )
                )

            def load() -> None:
                async def all_of_them() -> None:
                    await asyncio.gather(*(one() for _ in range(12)))

                asyncio.run(all_of_them())

            loader = threading.Thread(target=load)
            loader.start()
            deadline = time.monotonic() + 10
            while len(fakes.inferences()) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            in_flight = len(fakes.inferences())
            proxy.signal(signal.SIGTERM)
            time.sleep(0.3)
            not_ready = _free_port_refuses(port) or (
                raw(port, "GET", "/v2/health/ready", timeout_s=2).status != 200
            )
            code = proxy.wait(30)
            loader.join(30)
            log = proxy.log()
    assert in_flight >= 3, "requests were not in flight when SIGTERM came"
    assert not_ready, "after SIGTERM the proxy still accepted and reported ready"
    assert code == 0, f"exit status {code}:\n{log[-2000:]}"
    assert len(answers) == 12
    statuses = [a.status for a in answers]
    assert statuses.count(200) >= 3, f"in-flight requests did not finish: {statuses}"
    bad = [
        (a.status, a.body[:150], a.error)
        for a in answers
        if a.status != 200 and not (a.status == 503 and a.triton_error())
    ]
    assert not bad, f"queued requests must finish or get 503: {bad}"


def _class_in_flight(proxy: Any) -> float:
    assert proxy.ports is not None
    text = raw(proxy.ports.metrics, "GET", "/metrics", [], b"").body.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("triton_proxy_class_in_flight{") and 'model="simple"' in line
    )


def test_a_grpc_call_cancelled_in_flight_keeps_its_slot_while_triton_may_still_run_it(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """Triton stops a cancelled request only while it is queued (or in a model that polls
    ``is_cancelled()``); a running batch finishes. So a gRPC call cancelled in flight holds its
    gate slot for the rest of its class's mean time inside Triton, not a moment less, then
    gives it back: the gate never sends more than its limit into a busy Triton."""
    for fake in fakes.servers:
        fake.faults.append(Fault("delay", delay_s=2.0))
    with proxy_on(TIGHT) as proxy:
        ch = grpc.insecure_channel(proxy.grpc)
        try:
            infer = ch.unary_unary(INFER)
            # Three answered calls: the class's mean time inside is about 2 s.
            warm = [infer.future(message(), timeout=30) for _ in range(3)]
            for w in warm:
                assert pb.ModelInferResponse.FromString(w.result()).model_name == "simple"
            gone = [infer.future(message(), timeout=0.3) for _ in range(3)]
            for call in gone:
                try:
                    call.result()
                except grpc.RpcError as exc:
                    assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            # Their clients have gone; Triton would still be running them.
            assert _class_in_flight(proxy) == 3
            wait_for(lambda: _class_in_flight(proxy) == 0, 10, "the held slots are given back")
        finally:
            ch.close()
