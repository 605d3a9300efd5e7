"""Cost per request: estimated from input shapes, learned per model from timings."""

from __future__ import annotations

import json

import pytest
from tritonclient.grpc import service_pb2 as pb

from proxy.frontends.kserve_grpc import input_shapes
from proxy.scheduling.config import load_scheduling
from proxy.scheduling.cost import (
    BatchTimes,
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
        model.observe_batch("m", cost, 0.005 + 20e-6 * cost)
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
        model.observe_batch("m", cost, 0.005 + 20e-6 * cost)
    first = model.curve("m")
    assert model.curve("m") is first  # cached: the same tuple until the next timing
    model.observe_batch("m", 64, 0.020)
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


DELAY = 0.002


def test_back_to_back_batches_are_timed_from_their_first_answers() -> None:
    times = BatchTimes()
    key = ("t0", "m")
    # Batch 1: two requests answered at 0.100 (nothing known before it: no sample).
    assert times.answered(key, 0.1000, 0.050, 1, 64, DELAY, 16) is None
    assert times.answered(key, 0.1003, 0.051, 1, 64, DELAY, 16) is None
    # Batch 2: three requests of 4 rows x 512, all queued well before 0.100; 87 ms later.
    for i in range(3):
        assert times.answered(key, 0.187 + i * 0.0002, 0.060, 4, 2048, DELAY, 16) is None
    # Batch 3's first answer closes batch 2: 12 rows padded to 512, 87 ms (+ the delay).
    sample = times.answered(key, 0.200, 0.150, 1, 64, DELAY, 16)
    assert sample is not None
    assert sample[0] == pytest.approx(12 * 512)
    assert sample[1] == pytest.approx(0.087 + DELAY)


def test_a_batch_whose_requests_came_late_is_not_timed() -> None:
    times = BatchTimes()
    key = ("t0", "m")
    times.answered(key, 0.100, 0.050, 1, 64, DELAY, 16)
    # Sent 1 ms before the previous batch answered: it may have waited for the queue delay
    # (or for more rows), so the gap is not its batch's time.
    times.answered(key, 0.120, 0.099, 1, 64, DELAY, 16)
    assert times.answered(key, 0.140, 0.130, 1, 64, DELAY, 16) is None
    # One late member spoils a batch of queued ones.
    times.answered(key, 0.160, 0.100, 1, 64, DELAY, 16)
    times.answered(key, 0.1605, 0.139, 1, 64, DELAY, 16)
    assert times.answered(key, 0.180, 0.170, 1, 64, DELAY, 16) is None


def test_short_batches_and_other_keys_are_not_mixed() -> None:
    times = BatchTimes()
    a, b = ("t0", "m"), ("t1", "m")
    times.answered(a, 0.100, 0.050, 1, 64, DELAY, 16)
    times.answered(b, 0.1002, 0.050, 1, 64, DELAY, 16)  # another instance: not a's batch
    times.answered(a, 0.103, 0.050, 1, 64, DELAY, 16)  # 3 ms: under MIN_BATCH_S
    assert times.answered(a, 0.120, 0.050, 1, 64, DELAY, 16) is None
    assert times.answered(a, 0.140, 0.050, 1, 64, DELAY, 16) == pytest.approx((64, 0.017 + DELAY))


def test_the_curve_keeps_its_slope_under_load() -> None:
    # Under load no request runs alone: a curve fit on a few short requests in the first
    # seconds has a slope of noise; timed back-to-back batches of long rows give it back.
    model = CostModel()
    for cost in (8, 64) * 6:
        model.observe_batch("m", cost, 0.0075)  # flat: 5 ms + 2 ms delay + network
    assert (model.curve("m") or (0, 1))[1] == pytest.approx(0.0, abs=1e-9)
    times = BatchTimes()
    t = 1.0
    for i in range(200):
        rows, longest = (16, 512) if i % 2 else (6, 64)
        t += 0.005 + 10e-6 * rows * longest
        sample = times.answered(("t0", "m"), t, 0.0, rows, rows * longest, DELAY, 16)
        if sample is not None:
            model.observe_batch("m", *sample)
    base, per_unit = model.curve("m") or (0.0, 0.0)
    assert per_unit == pytest.approx(10e-6, rel=0.05)
    assert base == pytest.approx(0.007, rel=0.1)


@pytest.mark.parametrize(
    "offsets",
    [
        # The proxy handles a batch's answers one after another: 16 answers 0.3 ms apart.
        [i * 0.0003 for i in range(16)],
        # A descheduled proxy handled 15 answers of the 16-row, 21 ms batch 6.6 ms after the
        # first (measured with a busy loop beside it on 2 cores): they were ready when the
        # batch began and it had room, so they were in it.
        [0.0] + [0.0066] * 15,
    ],
)
def test_a_batch_answered_over_several_milliseconds_is_one_batch(offsets: list[float]) -> None:
    times = BatchTimes()
    key = ("t0", "m")
    times.answered(key, 0.100, 0.050, 1, 500, DELAY, 16)
    for offset in offsets:
        assert times.answered(key, 0.121 + offset, 0.060, 1, 500, DELAY, 16) is None
    sample = times.answered(key, 0.150, 0.120, 1, 500, DELAY, 16)
    assert sample == pytest.approx((16 * 500, 0.021 + DELAY))


def test_an_answer_past_max_batch_size_rows_starts_the_next_batch() -> None:
    times = BatchTimes()
    key = ("t0", "m")
    times.answered(key, 0.100, 0.050, 1, 64, DELAY, 4)
    for i in range(4):
        times.answered(key, 0.110 + i * 0.0001, 0.060, 1, 64, DELAY, 4)
    # Within GROUP_S of the one before, but a fifth row cannot be in a batch of 4: the next
    # batch's first answer, and it closes the full one.
    assert times.answered(key, 0.1106, 0.060, 1, 64, DELAY, 4) == pytest.approx(
        (4 * 64, 0.010 + DELAY)
    )


def test_a_late_sender_answered_soon_after_a_batch_is_not_a_straggler() -> None:
    # Sent after the batch began: it cannot have been in it, however close its answer.
    times = BatchTimes()
    key = ("t0", "m")
    times.answered(key, 0.100, 0.050, 1, 64, DELAY, 16)
    times.answered(key, 0.120, 0.060, 1, 64, DELAY, 16)
    times.answered(key, 0.1225, 0.105, 1, 64, DELAY, 16)  # 2.5 ms on: its own batch
    assert times.answered(key, 0.140, 0.130, 1, 64, DELAY, 16) is None  # 2.5 ms: too short


def test_one_stalled_batch_moves_the_curve_by_a_bounded_amount() -> None:
    model = CostModel()
    for i in range(40):
        cost = 500.0 * (1 + i % 4)
        model.observe_batch("m", cost, 0.005 + 2e-6 * cost)
    before = model.seconds("m", 1000.0) or 0.0
    model.observe_batch("m", 1000.0, 0.500)  # Triton's batcher stall: 500 ms
    after = model.seconds("m", 1000.0) or 0.0
    assert before == pytest.approx(0.007)
    # Unclipped, one sample of 40 (decayed weights) moves the line by ~ 0.5 / 30.
    assert after - before < 0.2 * before
    # A batch split by a busy proxy, timed from its first part: 2000 units in 0.3 ms.
    model.observe_batch("m", 2000.0, 0.0003)
    assert (model.seconds("m", 2000.0) or 0.0) > 0.95 * 0.009


@pytest.mark.parametrize("at", [0, 4, 9])
def test_a_stall_among_the_first_timings_does_not_bend_the_first_curve(at: int) -> None:
    # CI, with accel_sim (3 ms + 2 us per unit, 2 ms queue delay): a 500 ms batch among the
    # first ten timings, when no curve existed to clip it against, left the fit at 74 ms +
    # 0.8 us per unit.
    model = CostModel()
    costs = [8000.0] * 6 + [48000.0] * 4
    for i, cost in enumerate(costs):
        model.observe_batch("m", cost, 0.500 if i == at else 0.005 + 2e-6 * cost)
        assert (model.curve("m") is None) == (i < len(costs) - 1)
    base, per_unit = model.curve("m") or (0.0, 0.0)
    assert (base, per_unit) == pytest.approx((0.005, 2e-6), rel=0.01)


def test_theil_sen_ignores_a_few_points_far_off() -> None:
    from proxy.scheduling.cost import theil_sen

    points = [(float(x), 1.0 + 2.0 * x) for x in range(8)] + [(3.0, 100.0), (5.0, -50.0)]
    assert theil_sen(points) == pytest.approx((1.0, 2.0))
    assert theil_sen([(4.0, 1.0), (4.0, 9.0), (4.0, 3.0)]) == (3.0, 0.0)  # one x: flat
    assert theil_sen([(1.0, 5.0), (2.0, 3.0), (3.0, 1.0)]) == (3.0, 0.0)  # never falls


def test_a_batch_of_nearly_the_same_size_does_not_seed_a_slope() -> None:
    # CI's seed (session 44): one batch of 15 rows (7,500 units) among nine of 16
    # (8,000), timed with the noise of a busy machine. Pairs that close are one size to
    # Theil-Sen: a flat seed, which the fit then corrects from the 48,000-unit batches.
    from proxy.scheduling.cost import theil_sen

    seed = [(7500.0, 0.0063), (8000.0, 0.0194), (8000.0, 0.0242), (8000.0, 0.0294)]
    seed += [(8000.0, 0.0237), (8000.0, 0.0254), (8000.0, 0.0210), (8000.0, 0.0221)]
    seed += [(8000.0, 0.0199), (8000.0, 0.0230)]
    assert theil_sen(seed)[1] == 0.0
    model = CostModel()
    for cost, seconds in seed:
        model.observe_batch("m", cost, seconds)
    for _ in range(12):
        model.observe_batch("m", 48000.0, 0.005 + 2e-6 * 48000.0)
        model.observe_batch("m", 8000.0, 0.005 + 2e-6 * 8000.0)
    base, per_unit = model.curve("m") or (0.0, 0.0)
    assert 1.5e-6 <= per_unit <= 2.6e-6, (base, per_unit)


def test_a_curve_far_too_low_still_climbs_to_the_truth() -> None:
    model = CostModel()
    for _ in range(20):
        model.observe_batch("m", 64.0, 0.005)  # a flat 5 ms
    for _ in range(60):
        for cost in (500.0, 8000.0):
            model.observe_batch("m", cost, 0.005 + 10e-6 * cost)
    assert model.seconds("m", 8000.0) == pytest.approx(0.085, rel=0.05)
