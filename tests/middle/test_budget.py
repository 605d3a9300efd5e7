"""Bounded memory under abuse (issue 9, point 8): request bodies held by the proxy (queued and
in flight) stay under ``limits.max_buffered_bytes``; beyond it 429 / RESOURCE_EXHAUSTED, over
HTTP and gRPC alike. Checked on what the fakes received while their answers hang."""

from __future__ import annotations

import threading
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from tests.fakes.triton import FakeFleet, Fault
from tests.middle.conftest import ProxyFactory, port_of, raw, wait_for

BODY_LIMIT = 64 * 1024
BUDGET = 256 * 1024
PAYLOAD = 60 * 1024  # four fit the budget, a fifth does not
POLICY = {
    "limits": {"max_body_bytes": BODY_LIMIT, "max_buffered_bytes": BUDGET, "connect_timeout_s": 1.0}
}


def grpc_message() -> bytes:
    request = pb.ModelInferRequest(model_name="simple")
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "INT32"
    tensor.shape.extend([1, PAYLOAD // 4])
    request.raw_input_contents.append(b"\0" * PAYLOAD)
    return bytes(request.SerializeToString())


def http_body() -> bytes:
    return b'{"inputs": [], "pad": "' + b"x" * PAYLOAD + b'"}'


def test_bodies_in_flight_stay_within_the_byte_budget(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    for fake in fakes.servers:
        fake.faults.append(Fault("hang", models=frozenset({"simple"})))
    results: list[Any] = []
    try:
        with proxy_on(POLICY) as proxy:
            port = port_of(proxy)

            def via_grpc() -> None:
                with grpc.insecure_channel(proxy.grpc) as ch:
                    try:
                        ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
                            grpc_message(), timeout=30
                        )
                        results.append("OK")
                    except grpc.RpcError as exc:
                        results.append(exc.code().name)  # type: ignore[attr-defined]

            def via_http() -> None:
                r = raw(port, "POST", "/v2/models/simple/infer", [], http_body(), timeout_s=30)
                results.append(r.status if r.triton_error() or r.status == 200 else f"{r.status}?")

            threads = [threading.Thread(target=via_grpc) for _ in range(6)]
            threads += [threading.Thread(target=via_http) for _ in range(6)]
            for t in threads:
                t.start()
            # Refusals come back at once; the admitted ones hang at the fakes.
            wait_for(lambda: len(results) >= 8, 20, "refusals of the requests over the budget")
            reached = len(fakes.inferences())
            for fake in fakes.servers:
                fake.release()
            for t in threads:
                t.join(30)
            # An answer goes out before the proxy's accounting of its request (the
            # dispatcher's deliver), the body's release included: a moment later, none held.
            wait_for(lambda: proxy.runtime.budget.in_use == 0, 5, "the byte budget released")
            budget_after = proxy.runtime.budget.in_use
    finally:
        for fake in fakes.servers:
            fake.release()
    refused = [r for r in results if r in ("RESOURCE_EXHAUSTED", 429)]
    served = [r for r in results if r in ("OK", 200)]
    assert len(results) == 12, results
    assert reached <= BUDGET // PAYLOAD, (
        f"{reached} bodies of {PAYLOAD} B held with a {BUDGET} B budget"
    )
    assert len(refused) == 12 - len(served) and len(refused) >= 12 - BUDGET // PAYLOAD, results
    assert budget_after == 0
