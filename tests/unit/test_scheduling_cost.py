"""Cost per request: estimated from input shapes, learned per model from timings."""

from __future__ import annotations

import json

import pytest
from tritonclient.grpc import service_pb2 as pb

from proxy.frontends.kserve_grpc import input_shapes
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.cost import (
    CostModel,
    CostOverride,
    cost_of,
    http_shapes,
    rows_of,
    shape_cost,
)
from proxy.strict import ConfigError


@pytest.mark.parametrize(
    ("shape", "cost"),
    [([1, 512], 512), ([4, 64], 256), ([8], 8), ([2, 16, 3], 32), ([], 1), ([3, 0], 3)],
)
def test_shape_cost_is_rows_times_the_longest_other_dimension(
    shape: list[int], cost: float
) -> None:
    assert shape_cost(shape) == cost


def test_http_cost_reads_every_input_shape_and_ignores_strings() -> None:
    header = {
        "inputs": [
            {"name": "A", "shape": [2, 64], "datatype": "INT64", "data": [0] * 128},
            {"name": "B", "shape": [2, 8], "datatype": "BYTES", "data": ['"shape": [9, 9999]']},
        ]
    }
    assert cost_of(http_shapes(json.dumps(header).encode())) == 128
    assert cost_of(http_shapes(b"{}")) == 1.0
    assert cost_of(http_shapes(b"not json at all")) == 1.0


def test_grpc_cost_walks_input_shapes_without_reading_tensor_bytes() -> None:
    request = pb.ModelInferRequest(model_name="m")
    a = request.inputs.add()
    a.name, a.datatype = "A", "INT64"
    a.shape.extend([4, 512])
    b = request.inputs.add()
    b.name = "B"
    b.shape.extend([4, 8])
    request.raw_input_contents.append(b"\x00" * 4096)
    data = request.SerializeToString()
    assert cost_of(input_shapes(data)) == 2048
    assert input_shapes(data[:-10]) == ()  # truncated: unknown, not an error
    assert input_shapes(b"\xff\xff\xff") == ()
    assert cost_of([]) == 1.0


def test_long_requests_are_several_times_the_models_typical_cost() -> None:
    model = CostModel(long_ratio=4.0)
    for _ in range(300):
        model.observe_cost("m", 32)
    assert not model.is_long("m", 64)
    assert model.is_long("m", 512)
    assert not model.is_long("unseen", 10_000)


def test_the_curve_is_learned_from_requests_that_ran_alone() -> None:
    model = CostModel()
    assert model.seconds("m", 100) is None
    for cost in (8, 64, 256, 512) * 10:
        model.observe_alone("m", cost, 0.005 + 20e-6 * cost)
    base, per_unit = model.curve("m") or (0.0, 0.0)
    assert base == pytest.approx(0.005, rel=1e-6)
    assert per_unit == pytest.approx(20e-6, rel=1e-6)
    assert model.seconds("m", 1000) == pytest.approx(0.025)


def test_an_override_wins_over_the_fit() -> None:
    model = CostModel(overrides={"m": CostOverride(base_ms=3, per_unit_us=2)})
    assert model.seconds("m", 1000) == pytest.approx(0.005)


def test_a_full_batch_pads_to_the_typical_request() -> None:
    model = CostModel(overrides={"m": CostOverride(base_ms=5, per_unit_us=20)})
    assert model.batch_seconds("m", 16) is None  # no cost seen yet: typical unknown
    for _ in range(50):
        model.observe_cost("m", 100)
    assert model.batch_seconds("m", 16) == pytest.approx(0.005 + 20e-6 * 16 * 100, rel=0.05)


def test_shapes_no_request_could_carry_are_refused() -> None:
    from proxy.errors import Code, ProxyError
    from proxy.scheduling.cost import check_shapes

    header = b'{"inputs":[{"name":"A","shape":[1,16],"datatype":"INT32","data":[0]}]}'
    check_shapes(http_shapes(header), 64)  # 16 elements in a 64-byte request: possible
    with pytest.raises(ProxyError) as info:
        check_shapes(http_shapes(b'{"inputs":[{"shape":[100000,100000]}]}'), 10_000)
    assert info.value.code is Code.INVALID_ARG and "more elements" in info.value.message
    check_shapes([[0, 10**30]], 10)  # empty tensor: nothing to carry
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add().shape.extend([1 << 20, 1 << 20])
    data = request.SerializeToString()
    assert input_shapes(data) == ((1 << 20, 1 << 20),)
    with pytest.raises(ProxyError):
        check_shapes(input_shapes(data), len(data))


def test_only_short_shape_texts_are_memoised():
    # The memo holds client bytes: a long shape text is read, never kept.
    from proxy.scheduling import cost

    long_dims = b",".join([b"1"] * 200)
    before = cost._memo_dims.cache_info().currsize
    assert http_shapes(b'{"shape":[' + long_dims + b"]}") == [(1,) * 200]
    assert cost._memo_dims.cache_info().currsize == before
    assert http_shapes(b'{"shape":[2, 77]}') == [(2, 77)]
    assert cost._memo_dims.cache_info().currsize <= 1024


def test_the_curve_is_computed_once_per_timing_and_overrides_replace_it() -> None:
    model = CostModel()
    for cost in (8, 64, 256, 512) * 10:
        model.observe_alone("m", cost, 0.005 + 20e-6 * cost)
    first = model.curve("m")
    assert model.curve("m") is first  # cached: the same tuple until the next timing
    model.observe_alone("m", 64, 0.020)
    assert model.curve("m") is not first
    model.set_overrides({"m": CostOverride(base_ms=1, per_unit_us=1)})
    assert model.curve("m") == pytest.approx((0.001, 1e-6))
    model.set_overrides({})
    assert model.curve("m") != pytest.approx((0.001, 1e-6))


def test_rows_are_those_of_the_costliest_input() -> None:
    assert rows_of([(4, 8), (2, 512)]) == 2
    assert rows_of([(3,)]) == 3
    assert rows_of([]) == 1
    assert rows_of([()]) == 1
    assert rows_of([(0, 16)]) == 1


def test_the_policy_file_sets_a_models_curve() -> None:
    config = load_scheduling({"cost": {"models": {"m": {"base_ms": 5, "per_unit_us": 20}}}})
    assert config.cost.models["m"] == CostOverride(base_ms=5, per_unit_us=20)
    with pytest.raises(ConfigError, match=r"scheduling\.cost\.models\.m"):
        load_scheduling({"cost": {"models": {"m": {"base_ms": -1, "per_unit_us": 0}}}})
    with pytest.raises(ConfigError, match="unknown key"):
        load_scheduling({"cost": {"model": {}}})
