"""Cost per request: estimated from input shapes, learned per model from timings."""

from __future__ import annotations

import json

import pytest
from tritonclient.grpc import service_pb2 as pb

from proxy.scheduling.cost import CostModel, CostOverride, grpc_cost, http_cost, shape_cost


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
    assert http_cost(json.dumps(header).encode()) == 128
    assert http_cost(b"{}") == 1.0
    assert http_cost(b"not json at all") == 1.0


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
    assert grpc_cost(data) == 2048
    assert grpc_cost(data[:-10]) == 1.0  # truncated: unknown, not an error
    assert grpc_cost(b"\xff\xff\xff") == 1.0


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
