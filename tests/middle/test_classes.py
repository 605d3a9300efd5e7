"""Classes cannot be escaped; model names are canonical; unknown models cost nothing
(issue 9, point 2). Every assertion is on the priority the fake instance received.

Classes: realtime -> Triton priority 1, online 2 (the default class), offline 3. The offline
client always asks for priority 1; whatever the encoding or endpoint, the instance must see 3,
or the proxy must refuse the request with a clear 4xx and the instance see nothing.
"""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb

from tests.fakes.rawhttp import RawResponse
from tests.fakes.triton import FakeFleet, Fault, Received
from tests.middle.conftest import (
    ProxyFactory,
    grpc_inputs,
    infer_doc,
    port_of,
    raw,
    wait_for,
)

OFFLINE = "offline-key"
GATEWAY = "gateway-key"
CLASSES = {
    "scheduling": {
        "default_class": "online",
        "api_keys": {
            OFFLINE: {"class_name": "offline"},
            GATEWAY: {"class_name": "online", "allow_class_header": True},
        },
        "classes": {
            "realtime": {"rank": 0, "triton_priority": 1},
            "online": {"rank": 1, "triton_priority": 2},
            "offline": {"rank": 2, "triton_priority": 3},
        },
    },
    "routing": {"policy": {"name": "round_robin"}},
}


def offline(*extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {OFFLINE}"), *extra]


def only_inference(fakes: FakeFleet) -> Received:
    got = fakes.inferences()
    assert len(got) == 1, f"expected one inference at the instances, got {len(got)}: {got}"
    return got[0]


def priority_seen(
    fakes: FakeFleet, send: Callable[[], RawResponse], wanted: int = 3
) -> tuple[str, Any]:
    """Run ``send``; the request must reach an instance with priority ``wanted``, or be refused
    with a 4xx (Triton's format) without reaching one. Returns ("ok"|"refused", detail)."""
    fakes.clear()
    r = send()
    got = fakes.inferences()
    if r.status is not None and 400 <= r.status < 500 and not got:
        assert r.triton_error(), f"refusal not in Triton's error format: {r.body[:200]!r}"
        return "refused", r.triton_error()
    assert r.status == 200, f"{r.status} {r.body[:300]!r}"
    assert len(got) == 1, got
    assert got[0].parameters is not None
    assert got[0].parameters.get("priority") == wanted, (
        f"instance received priority {got[0].parameters.get('priority')!r}, class gives {wanted}"
    )
    return "ok", got[0]


def test_offline_class_priority_on_every_http_body_form(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    doc = infer_doc({"priority": 1})
    plain = json.dumps(doc).encode()
    path = "/v2/models/simple/infer"
    with proxy_on(CLASSES) as proxy:
        port = port_of(proxy)
        cases: dict[str, Callable[[], RawResponse]] = {
            "json": lambda: raw(port, "POST", path, offline(), plain),
            "json without parameters": lambda: raw(
                port, "POST", path, offline(), json.dumps(infer_doc()).encode()
            ),
            "priority as string": lambda: raw(
                port, "POST", path, offline(), json.dumps(infer_doc({"priority": "1"})).encode()
            ),
            "uint64-sized priority": lambda: raw(
                port,
                "POST",
                path,
                offline(),
                json.dumps(infer_doc({"priority": 2**64 + 1})).encode(),
            ),
            "identity encoding": lambda: raw(
                port, "POST", path, offline(("Content-Encoding", "identity")), plain
            ),
            "gzip": lambda: raw(
                port, "POST", path, offline(("Content-Encoding", "gzip")), gzip.compress(plain)
            ),
            "deflate": lambda: raw(
                port, "POST", path, offline(("Content-Encoding", "deflate")), zlib.compress(plain)
            ),
            "gzip, identity": lambda: raw(
                port,
                "POST",
                path,
                offline(("Content-Encoding", "gzip, identity")),
                gzip.compress(plain),
            ),
            "duplicate parameters objects": lambda: raw(
                port,
                "POST",
                path,
                offline(),
                b'{"parameters": {"priority": 1}, "parameters": {"priority": 1},' + plain[1:],
            ),
            "version path": lambda: raw(
                port, "POST", "/v2/models/simple/versions/1/infer", offline(), plain
            ),
            "class header without the grant": lambda: raw(
                port, "POST", path, offline(("x-triton-proxy-class", "realtime")), plain
            ),
        }
        outcomes = {}
        failures = []
        for name, send in cases.items():
            try:
                outcomes[name] = priority_seen(fakes, send)[0]
            except AssertionError as exc:
                failures.append(f"{name}: {exc}")
    assert not failures, "class priority escaped:\n" + "\n".join(failures)
    # Well-formed bodies in the encodings Triton accepts must be served, not refused.
    served = ("json", "identity encoding", "gzip", "deflate", "version path")
    refused = {name: outcomes[name] for name in served if outcomes[name] != "ok"}
    assert not refused, f"well-formed requests refused: {refused}"


def test_compressed_requests_from_tritonclient_are_served(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """tritonclient's own request compression (gzip and deflate), through the proxy."""
    import tritonclient.http as httpclient

    from tests.middle.conftest import http_inputs

    with proxy_on(CLASSES) as proxy, httpclient.InferenceServerClient(proxy.http) as c:
        for algorithm in ("gzip", "deflate"):
            for binary in (True, False):
                result = c.infer(
                    "simple",
                    http_inputs(binary=binary),
                    headers={"Authorization": f"Bearer {OFFLINE}"},
                    request_compression_algorithm=algorithm,
                )
                assert result.as_numpy("OUTPUT0") is not None
    seen = [(r.parameters or {}).get("priority") for r in fakes.inferences()]
    assert seen == [3, 3, 3, 3], seen


def binary_body(parameters: dict[str, Any]) -> tuple[bytes, int]:
    """A binary-tensor infer body (JSON header + raw INT32 bytes) and its header length."""
    tensor = np.arange(16, dtype=np.int32).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": [1, 16],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": len(tensor)},
                }
                for name in ("INPUT0", "INPUT1")
            ],
            "parameters": parameters,
        }
    ).encode()
    return header + tensor + tensor, len(header)


def test_offline_class_priority_on_binary_tensors(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    # tritonclient refuses to send "priority" itself; raw bytes as another client would.
    body, header_length = binary_body({"priority": 1})
    headers = offline(("Inference-Header-Content-Length", str(header_length)))
    with proxy_on(CLASSES) as proxy:
        outcome = priority_seen(
            fakes, lambda: raw(port_of(proxy), "POST", "/v2/models/simple/infer", headers, body)
        )
    assert outcome[0] == "ok", outcome
    got = outcome[1]
    assert got.body.endswith(np.arange(16, dtype=np.int32).tobytes() * 2), "tensor bytes intact"
    header_length = int(got.header("inference-header-content-length") or 0)
    assert json.loads(got.body[:header_length])["parameters"]["priority"] == 3


def test_generate_endpoints_are_admitted_in_the_callers_class(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """Triton's generate extension has no request priority: its ``parameters`` are the
    model's own (docs/protocol/extension_generate.md), so a client's ``priority`` there does
    not reach the batcher and the class acts through the proxy's queue. Checked: both
    endpoints are served, pass the gate in the caller's class, and reach one instance."""
    body = json.dumps({"text_input": "hi", "parameters": {"priority": 1}}).encode()
    with proxy_on(CLASSES) as proxy:
        port = port_of(proxy)
        answers = [
            raw(port, "POST", path, offline(), body)
            for path in ("/v2/models/gen/generate", "/v2/models/gen/generate_stream")
        ]
        counted = {
            s.labels["class"]
            for metric in proxy.proxy.telemetry.requests.collect()
            for s in metric.samples
            if s.name.endswith("_total") and s.labels["model"] == "gen" and s.value
        }
    assert [a.status for a in answers] == [200, 200], [(a.status, a.body[:200]) for a in answers]
    assert b"token2" in answers[1].body, "server-sent events relayed"
    assert len(fakes.inferences()) == 2
    assert counted == {"offline"}, counted


def grpc_request(**priority: int) -> bytes:
    """A ModelInferRequest for simple asking for a priority (int64_param=..., uint64_param=...)."""
    request = pb.ModelInferRequest(model_name="simple")
    for choice, value in priority.items():
        setattr(request.parameters["priority"], choice, value)
    return bytes(request.SerializeToString())


def test_grpc_unary_and_stream_get_the_class_priority(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    # tritonclient refuses to send "priority" itself: a raw channel, as another client would.
    meta = (("authorization", f"Bearer {OFFLINE}"),)
    messages = [grpc_request(int64_param=1), grpc_request(uint64_param=1), grpc_request()]
    with proxy_on(CLASSES) as proxy:
        ch = grpc.insecure_channel(proxy.grpc)
        try:
            for message in messages:
                ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
                    message, metadata=meta, timeout=10
                )
            replies = list(
                ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
                    iter(messages), metadata=meta, timeout=10
                )
            )
        finally:
            ch.close()
    assert len(replies) == 3
    seen = [
        (r.raw_path.rsplit("/", 1)[-1], (r.parameters or {}).get("priority"))
        for r in fakes.inferences()
    ]
    assert seen.count(("ModelInfer", 3)) == 3, seen
    assert seen.count(("ModelStreamInfer", 3)) == 3, seen
    assert len(seen) == 6, seen


def test_class_header_needs_a_grant(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    plain = json.dumps(infer_doc()).encode()
    path = "/v2/models/simple/infer"
    with proxy_on(CLASSES) as proxy:
        port = port_of(proxy)
        anonymous = priority_seen(
            fakes, lambda: raw(port, "POST", path, [("x-triton-proxy-class", "realtime")], plain), 2
        )
        granted = priority_seen(
            fakes,
            lambda: raw(
                port,
                "POST",
                path,
                [("Authorization", f"Bearer {GATEWAY}"), ("x-triton-proxy-class", "realtime")],
                plain,
            ),
            1,
        )
    assert anonymous[0] == granted[0] == "ok"


# --- unknown models and the catalog -------------------------------------------------------


def config_fetches(fakes: FakeFleet, model: str) -> int:
    return len(
        fakes.received(
            lambda r: (
                r.raw_path.endswith(f"/models/{model}/config")
                or (r.raw_path.endswith("/ModelConfig") and model.encode() in r.body)
            )
        )
    )


def test_unknown_model_is_404_from_the_proxy_with_a_bounded_negative_cache(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    body = json.dumps(infer_doc()).encode()
    with proxy_on(CLASSES) as proxy:
        port = port_of(proxy)
        answers = [raw(port, "POST", "/v2/models/nosuch/infer", [], body) for _ in range(20)]
        g = grpcclient.InferenceServerClient(proxy.grpc)
        try:
            g.infer("nosuch", grpc_inputs())
            grpc_status = "OK"
        except Exception as exc:  # InferenceServerException
            grpc_status = str(getattr(exc, "status", lambda: "?")())
        g.close()
        rt = proxy.runtime
        metrics = proxy.proxy.telemetry.exposition().decode()
        gates = set(rt.gates.gates) if rt.gates is not None else set()
        decided = {m for (m, _, _) in rt.router.stats.decisions}
    assert {a.status for a in answers} == {404}, [a.status for a in answers]
    assert all("nosuch" in (a.triton_error() or "") for a in answers)
    assert "NOT_FOUND" in grpc_status or "404" in grpc_status, grpc_status
    assert not fakes.inferences(), "an inference for an unknown model reached an instance"
    assert config_fetches(fakes, "nosuch") <= len(fakes.servers), (
        f"{config_fetches(fakes, 'nosuch')} config fetches for 21 requests of one unknown model"
    )
    assert '"nosuch"' not in metrics, "the unknown name became a label value"
    assert 'model="other"' in metrics
    assert "nosuch" not in gates and "nosuch" not in decided, "routing state for an unknown model"


def test_catalog_refresh_is_single_flight(proxy_on: ProxyFactory, fakes: FakeFleet) -> None:
    body = json.dumps(infer_doc()).encode()
    with proxy_on(CLASSES) as proxy:
        port = port_of(proxy)
        fakes.clear()
        statuses: list[int | None] = []
        threads = [
            threading.Thread(
                target=lambda: statuses.append(
                    raw(port, "POST", "/v2/models/simple/infer", [], body).status
                )
            )
            for _ in range(50)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert statuses == [200] * 50, statuses
    fetched = config_fetches(fakes, "simple")
    assert fetched <= len(fakes.servers), (
        f"50 concurrent first requests caused {fetched} config fetches"
    )


def test_a_canary_with_classes_of_its_own_learns_from_its_own_answers(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    """Every request goes to the canary arm (share 1), whose classes and gates are its own:
    the time its requests spent inside Triton feeds the canary's gates (deadline admission,
    adaptive concurrency), and the main arm's gates, which admitted none of them, learn
    nothing."""
    policy = {**CLASSES, "canary": {"share": 1.0, "scheduling": CLASSES["scheduling"]}}
    body = json.dumps(infer_doc()).encode()
    with proxy_on(policy) as proxy:
        port = port_of(proxy)
        for _ in range(3):
            r = raw(port, "POST", "/v2/models/simple/infer", offline(), body)
            assert r.status == 200, (r.status, r.body)
        dispatcher = proxy.runtime.dispatcher
        canary, main = dispatcher.canary.admission, dispatcher.admission
        assert canary is not None and main is not None and canary is not main
        assert canary.expected_inside_s("simple", "offline") > 0
        assert main.expected_inside_s("simple", "offline") == 0


def test_a_shed_stream_message_is_answered_and_counted(
    proxy_on: ProxyFactory, fakes: FakeFleet
) -> None:
    # Every slot (one per fake) is held by a hanging unary call and offline's one-place queue
    # by another: a stream's offline message is shed (queue full), answered
    # RESOURCE_EXHAUSTED on the stream, and counted like a shed unary request. Its count once
    # raised instead (a label missing), and the stream's handler failed (found in CI,
    # session 35).
    for fake in fakes.servers:
        fake.faults.append(Fault("hang", models=frozenset({"simple"})))
    scheduling = {
        **CLASSES["scheduling"],
        "concurrency": 1,
        "classes": {
            **CLASSES["scheduling"]["classes"],  # type: ignore[dict-item]
            "offline": {"rank": 2, "triton_priority": 3, "max_queue": 1},
        },
    }
    body = json.dumps(infer_doc()).encode()
    try:
        with proxy_on({**CLASSES, "scheduling": scheduling}) as proxy:
            port = port_of(proxy)
            path = "/v2/models/simple/infer"
            gates = proxy.runtime.gates
            callers: list[threading.Thread] = []

            def call(headers: list[tuple[str, str]]) -> None:
                t = threading.Thread(target=raw, args=(port, "POST", path, headers, body))
                t.daemon = True
                t.start()
                callers.append(t)

            for _ in range(3):  # online first, until it holds every slot
                call([])
            wait_for(lambda: "simple" in gates.gates and gates.gates["simple"].in_flight() == 3)
            call(offline())  # then offline's one place in its queue
            wait_for(lambda: gates.gates["simple"].queued("offline") == 1)
            meta = (("authorization", f"Bearer {OFFLINE}"),)
            with grpc.insecure_channel(proxy.grpc) as ch:
                stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
                replies = list(stream(iter([grpc_request()]), metadata=meta, timeout=10))
            shed = proxy.proxy.telemetry.requests_by.get(
                "simple", "offline", "-", "shed_queue_full", "main"
            )
            count = shed._value.get()
            for fake in fakes.servers:
                fake.release()
            for t in callers:
                t.join(10)
    finally:
        for fake in fakes.servers:
            fake.release()
    assert len(replies) == 1, replies
    answer = pb.ModelStreamInferResponse.FromString(replies[0])
    assert "of class 'offline' was shed" in answer.error_message, answer
    assert count == 1
