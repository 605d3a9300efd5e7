"""Reading routing fields from gRPC infer requests on the wire, and appending a parameter."""

from __future__ import annotations

from typing import Any

import pytest
from tritonclient.grpc import service_pb2 as pb

from proxy.frontends import kserve_grpc
from proxy.frontends.grpc import SERVICE, GrpcFrontend
from proxy.frontends.kserve_grpc import (
    input_shapes,
    read_infer,
    read_request,
    routing_fields,
    with_parameters,
)
from proxy.request import NO_PARAMS, InferParams


def request(**params: Any) -> Any:
    r = pb.ModelInferRequest(model_name="accumulator", model_version="1", id="req-7")
    for key, (kind, value) in params.items():
        setattr(r.parameters[key], kind, value)
    i = r.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    i.parameters["binary_data_size"].int64_param = 4
    r.outputs.add(name="OUTPUT")
    r.raw_input_contents.append(b"\x05\x00\x00\x00")
    return r


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, NO_PARAMS),
        (
            {
                "sequence_id": ("int64_param", 42),
                "sequence_start": ("bool_param", True),
                "sequence_end": ("bool_param", False),
            },
            InferParams(sequence_id=42, sequence_start=True),
        ),
        (
            {"sequence_id": ("string_param", "user-9"), "sequence_end": ("bool_param", True)},
            InferParams(sequence_id="user-9", sequence_end=True),
        ),
        ({"sequence_id": ("uint64_param", 7)}, InferParams(sequence_id=7)),
        ({"sequence_id": ("int64_param", 0)}, NO_PARAMS),
        ({"priority": ("uint64_param", 2)}, InferParams(priority=2)),
        ({"priority": ("int64_param", 1)}, InferParams(priority=1)),
        ({"timeout": ("int64_param", 1000)}, InferParams(timeout_us=1000)),
        ({"timeout": ("int64_param", -5)}, NO_PARAMS),
    ],
)
def test_read_infer(params: dict[str, tuple[str, Any]], expected: InferParams) -> None:
    assert read_infer(request(**params).SerializeToString()) == ("accumulator", expected)


def test_routing_fields_skip_tensors() -> None:
    r = request(priority=("int64_param", 3))
    r.raw_input_contents.append(b"x" * 1_000_000)
    subset = routing_fields(r.SerializeToString())
    assert len(subset) < 100
    parsed = pb.ModelInferRequest.FromString(subset)
    assert parsed.model_name == "accumulator"
    assert parsed.parameters["priority"].int64_param == 3
    assert not parsed.inputs and not parsed.raw_input_contents


@pytest.mark.parametrize("data", [b"\x0a\x05abc", b"\xff" * 11, b"\x0b\x00", b"\x0a"])
def test_unreadable_request_still_routes(data: bytes) -> None:
    assert read_infer(data) == ("", NO_PARAMS)
    assert read_request(data) == ("", NO_PARAMS, ())


def _long_request() -> bytes:
    """Field keys and lengths of more than one byte: a long model name, many inputs, an
    unpacked shape, a field number past 15, a fixed64 and a fixed32 field."""
    r = request(priority=("int64_param", 2), sequence_id=("string_param", "s" * 300))
    r.model_name = "m" * 200
    for n in range(40):
        r.inputs.add(name=f"in{n}", datatype="FP32", shape=[n + 1, 3 * n + 1])
    r.raw_input_contents.append(b"\x00" * 70_000)
    data: bytes = r.SerializeToString()
    unpacked_shape = b"\x18\x07\x18\x09"  # InferInputTensor.shape as two varint fields
    tensor = b"\x0a\x01x" + unpacked_shape
    data += b"\x2a" + bytes([len(tensor)]) + tensor
    data += b"\x81\x01" + b"\x00" * 8  # field 16, fixed64 (unknown: skipped)
    return data + b"\x85\x01" + b"\x00" * 4  # field 16, fixed32


def test_the_walk_keeps_the_fields_asked_for_as_protobuf_reads_them() -> None:
    data = _long_request()
    whole = pb.ModelInferRequest.FromString(data)
    kept = pb.ModelInferRequest.FromString(routing_fields(data, frozenset({1, 4, 5})))
    expected = pb.ModelInferRequest(model_name=whole.model_name, inputs=whole.inputs)
    for key, value in whole.parameters.items():
        expected.parameters[key].CopyFrom(value)
    assert kept == expected and len(kept.inputs) == 42
    tensors = pb.ModelInferRequest.FromString(routing_fields(data, frozenset({7})))
    assert tensors == pb.ModelInferRequest(raw_input_contents=whole.raw_input_contents)
    with pytest.raises((ValueError, IndexError)):
        routing_fields(data[:-3], frozenset({1}))


def test_read_request_is_read_infer_and_input_shapes_in_one() -> None:
    for data in (
        _long_request(),
        request(sequence_id=("int64_param", 5)).SerializeToString(),
        request().SerializeToString(),
    ):
        model, params = read_infer(data)
        assert read_request(data) == (model, params, input_shapes(data))
        assert read_request(data) == (model, params, input_shapes(data))  # memoised
    assert read_request(_long_request())[2][-1] == (7, 9)  # the unpacked shape


def test_only_small_requests_are_memoised() -> None:
    # The memo holds client bytes: inputs that carry their tensor inline are read, not kept.
    kserve_grpc._read_memo.cache_clear()
    small = request()
    read_request(small.SerializeToString())
    assert kserve_grpc._read_memo.cache_info().currsize == 1
    inline = request()
    inline.inputs[0].contents.int_contents.extend(range(2000))
    assert read_request(inline.SerializeToString())[2] == ((1, 1),)
    assert kserve_grpc._read_memo.cache_info().currsize == 1


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"priority": ("uint64_param", 1)},
        {"sequence_id": ("int64_param", 5), "priority": ("int64_param", 3)},
    ],
)
def test_with_parameters_sets_values_and_keeps_the_rest(
    params: dict[str, tuple[str, Any]],
) -> None:
    original = request(**params)
    data = original.SerializeToString()
    assert with_parameters(data, {}) == data
    edited = with_parameters(data, {"priority": 2, "timeout": 1500})
    # The original bytes are untouched: one map entry is appended.
    assert edited.startswith(data)
    parsed = pb.ModelInferRequest.FromString(edited)
    assert parsed.parameters["priority"].WhichOneof("parameter_choice") == "int64_param"
    assert parsed.parameters["priority"].int64_param == 2
    expected = pb.ModelInferRequest()
    expected.CopyFrom(original)
    expected.parameters["priority"].CopyFrom(pb.InferParameter(int64_param=2))
    expected.parameters["timeout"].CopyFrom(pb.InferParameter(int64_param=1500))
    assert parsed == expected
    assert read_infer(edited)[1].priority == 2
    assert read_infer(edited)[1].timeout_us == 1500


def test_frontend_serves_every_method_of_the_service() -> None:
    service = pb.DESCRIPTOR.services_by_name[SERVICE.split(".")[-1]]
    names = {m.name for m in service.methods}
    unary = {m.name for m in service.methods if not m.client_streaming}
    served = set(GrpcFrontend(lambda: None).unary_methods())  # type: ignore[arg-type, return-value]
    assert served == unary
    assert names - unary == {"ModelStreamInfer"}
