"""The models in ``model_repository/`` against real Triton, through the real ``tritonclient``."""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from proxy.local import LocalFleet, TritonServer, group_members
from proxy.local.fleet import SHM_DIR
from tests.integration.conftest import MODELS

pytestmark = pytest.mark.integration

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def _host(server: TritonServer) -> str:
    return server.http_url.removeprefix("http://")


@pytest.fixture
def http(triton_server: TritonServer) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(_host(triton_server), concurrency=16)
    yield client
    client.close()


@pytest.fixture
def grpc(triton_server: TritonServer) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(triton_server.grpc_address)
    yield client
    client.close()


def _input(module: Any, name: str, array: np.ndarray[Any, Any], datatype: str) -> Any:
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _ids(rows: int, length: int, seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 1000, size=(rows, length), dtype=np.int64)


def _params(config: dict[str, Any]) -> dict[str, str]:
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def test_numeric_tensors_cross_triton_through_dlpack() -> None:
    """Triton's python backend stub misreads numpy 2 arrays (model_repository/README.md), so
    numeric tensors go through DLPack; only text_generator's BYTES tensors may use numpy."""
    models = sorted(MODEL_REPOSITORY.glob("*/1/model.py"))
    assert len(models) == len(MODELS)
    for model in models:
        source = model.read_text()
        assert "to_dlpack()" in source and "Tensor.from_dlpack(" in source, model
        if model.parts[-3] != "text_generator":
            for numpy_use in ("import numpy", ".as_numpy()", "pb_utils.Tensor("):
                assert numpy_use not in source, (model, numpy_use)


# -- simple ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_simple_sum_and_difference(
    protocol: str,
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
) -> None:
    module, client = (httpclient, http) if protocol == "http" else (grpcclient, grpc)
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    b = np.full((3, 16), 7, dtype=np.int32) - a
    result = client.infer(
        "simple", [_input(module, "INPUT0", a, "INT32"), _input(module, "INPUT1", b, "INT32")]
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_simple_contract_matches_triton_quickstart(
    http: httpclient.InferenceServerClient,
) -> None:
    meta = http.get_model_metadata("simple")
    tensors = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"] + meta["outputs"]}
    assert tensors == {
        name: ("INT32", [-1, 16]) for name in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")
    }
    assert http.get_model_config("simple")["max_batch_size"] == 8


# -- text_encoder ---------------------------------------------------------------------------


def test_text_encoder_shapes(grpc: grpcclient.InferenceServerClient) -> None:
    for rows, length in ((1, 8), (3, 40)):
        ids = _ids(rows, length, seed=length)
        result = grpc.infer("text_encoder", [_input(grpcclient, "INPUT_IDS", ids, "INT64")])
        embedding = result.as_numpy("EMBEDDING")
        assert embedding.shape == (rows, 64)
        assert embedding.dtype == np.float32
        assert np.isfinite(embedding).all()
        assert (result.as_numpy("PADDED_LENGTH") >= length).all()


def test_text_encoder_rejects_out_of_vocabulary_ids(
    http: httpclient.InferenceServerClient,
) -> None:
    ids = np.array([[1, 2, 1000]], dtype=np.int64)
    with pytest.raises(InferenceServerException, match=r"\[0, 1000\)"):
        http.infer("text_encoder", [_input(httpclient, "INPUT_IDS", ids, "INT64")])


def test_short_sequence_embedding_does_not_depend_on_its_batch(
    http: httpclient.InferenceServerClient,
) -> None:
    short = _ids(1, 8, seed=1)
    alone = http.infer("text_encoder", [_input(httpclient, "INPUT_IDS", short, "INT64")])
    assert alone.as_numpy("PADDED_LENGTH")[0, 0] == 8

    # Send long requests and the short one together until the batcher pads the short one to
    # 512 tokens: the first long request occupies the model while the rest queue up.
    tries = 20
    for attempt in range(tries):
        longs = [
            http.async_infer(
                "text_encoder",
                [_input(httpclient, "INPUT_IDS", _ids(1, 512, seed=100 + i), "INT64")],
            )
            for i in range(4)
        ]
        # Let the long ones reach the server first (the client sends from greenlets, in no
        # fixed order); a little longer each try, whatever the machine's speed.
        time.sleep(0.005 * (attempt + 1))
        mixed = http.async_infer("text_encoder", [_input(httpclient, "INPUT_IDS", short, "INT64")])
        batched = mixed.get_result()
        for pending in longs:
            pending.get_result()
        if batched.as_numpy("PADDED_LENGTH")[0, 0] == 512:
            break
    else:
        pytest.fail(f"the short request was never batched with a long one in {tries} tries")
    assert batched.as_numpy("BATCH_SIZE")[0, 0] > 1
    np.testing.assert_allclose(
        batched.as_numpy("EMBEDDING"), alone.as_numpy("EMBEDDING"), rtol=1e-4, atol=1e-5
    )


def test_text_encoder_priorities_configured(http: httpclient.InferenceServerClient) -> None:
    batching = http.get_model_config("text_encoder")["dynamic_batching"]
    assert batching["priority_levels"] == 3
    assert batching["default_priority_level"] == 2
    assert batching["default_queue_policy"]["allow_timeout_override"] is True
    result = http.infer(
        "text_encoder",
        [_input(httpclient, "INPUT_IDS", _ids(1, 8, seed=3), "INT64")],
        priority=1,
        timeout=10_000_000,
    )
    assert result.as_numpy("EMBEDDING").shape == (1, 64)


# -- accel_sim ------------------------------------------------------------------------------


def test_accel_sim_cost_follows_its_config(
    grpc: grpcclient.InferenceServerClient, triton_server: TritonServer
) -> None:
    config = grpc.get_model_config("accel_sim", as_json=True)["config"]
    params = _params(config)
    base_ms, per_token_us = float(params["base_ms"]), float(params["per_token_us"])
    assert base_ms > 0 and per_token_us > 0
    # Protobuf's JSON form writes 64-bit integers as strings.
    assert int(config["dynamic_batching"]["priority_levels"]) == 3

    ids = _ids(2, 100, seed=5)
    sent = time.monotonic()
    result = grpc.infer("accel_sim", [_input(grpcclient, "INPUT_IDS", ids, "INT64")])
    answered = time.monotonic()
    out = result.as_numpy("OUTPUT")
    assert out.shape == (2, 8) and out.dtype == np.float32
    assert not np.allclose(out[0], out[1])
    batch = int(result.as_numpy("BATCH_SIZE")[0, 0])
    padded = int(result.as_numpy("PADDED_LENGTH")[0, 0])
    assert batch >= 2 and padded >= 100
    expected_us = base_ms * 1e3 + per_token_us * batch * padded
    assert int(result.as_numpy("BATCH_COST_US")[0, 0]) == round(expected_us)
    # When and where the batch ran: on this host's monotonic clock, in this server.
    started_us = int(result.as_numpy("BATCH_START_US")[0, 0])
    assert sent * 1e6 <= started_us <= answered * 1e6 - expected_us
    assert int(result.as_numpy("BATCH_SERVER")[0, 0]) == triton_server.pid


# -- text_generator -------------------------------------------------------------------------


def _generator_inputs(prompt: str, max_tokens: int, stream: bool | None = None) -> list[Any]:
    inputs = [
        _input(grpcclient, "text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        _input(grpcclient, "max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
    ]
    if stream is not None:
        inputs.append(_input(grpcclient, "stream", np.array([stream]), "BOOL"))
    return inputs


def _stream(
    client: grpcclient.InferenceServerClient, inputs: list[Any], timeout_s: float = 30
) -> list[str]:
    """Run one ModelStreamInfer request; the text of each non-empty response, in order."""
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("text_generator", inputs, enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            text = result.as_numpy("text_output")
            if text is not None:
                pieces.append(text[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return pieces
    finally:
        client.stop_stream()


def _post(url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def _sse_events(body: str) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in body.splitlines()
        if line.startswith("data: ")
    ]


def test_text_generator_streams_one_response_per_token_over_grpc(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    pieces = _stream(grpc, _generator_inputs("hello", 6))
    assert len(pieces) == 6
    assert all(len(p) == 1 for p in pieces)
    # stream=false: the same greedy text, in one response.
    assert _stream(grpc, _generator_inputs("hello", 6, stream=False)) == ["".join(pieces)]


def test_text_generator_generate_stream_and_generate(triton_server: TritonServer) -> None:
    base = f"{triton_server.http_url}/v2/models/text_generator"
    status, content_type, body = _post(
        f"{base}/generate_stream", {"text_input": "hello", "max_tokens": 5}
    )
    assert status == 200 and content_type.startswith("text/event-stream")
    events = _sse_events(body)
    assert len(events) == 5
    text = "".join(e["text_output"] for e in events)

    status, _, body = _post(
        f"{base}/generate", {"text_input": "hello", "max_tokens": 5, "stream": False}
    )
    assert status == 200
    assert json.loads(body)["text_output"] == text

    # Triton 2.51's non-streaming generate wants exactly one response, and reports more as an
    # error body under status 200.
    status, _, body = _post(f"{base}/generate", {"text_input": "hello", "max_tokens": 5})
    assert status == 200
    assert "exactly 1 response" in json.loads(body)["error"]


def test_text_generator_reports_bad_input_in_the_stream(triton_server: TritonServer) -> None:
    status, _, body = _post(
        f"{triton_server.http_url}/v2/models/text_generator/generate_stream",
        {"text_input": "hello", "max_tokens": 0},
    )
    assert status == 400
    assert "max_tokens" in _sse_events(body)[0]["error"]


# -- accumulator ----------------------------------------------------------------------------


def _accumulate(module: Any, client: Any, sequence_id: int | str, values: list[int]) -> list[int]:
    sums = []
    for k, value in enumerate(values):
        result = client.infer(
            "accumulator",
            [_input(module, "INPUT", np.array([[value]], dtype=np.int32), "INT32")],
            sequence_id=sequence_id,
            sequence_start=k == 0,
            sequence_end=k == len(values) - 1,
        )
        sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
    return sums


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    "sequence_id",
    [17, 2**40 + 3, "session-a", "a-string-id-longer-than-any-fixed-buffer-0123456789"],
)
def test_accumulator_running_sum(
    protocol: str,
    sequence_id: int | str,
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
) -> None:
    module, client = (httpclient, http) if protocol == "http" else (grpcclient, grpc)
    assert _accumulate(module, client, sequence_id, [3, 4, 5, -2]) == [3, 7, 12, 10]
    # END dropped the state: the same id starts from zero again.
    assert _accumulate(module, client, sequence_id, [1, 1]) == [1, 2]


def test_accumulator_keeps_interleaved_sequences_apart(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    def step(sequence_id: int | str, value: int, start: bool = False, end: bool = False) -> int:
        result = grpc.infer(
            "accumulator",
            [_input(grpcclient, "INPUT", np.array([[value]], dtype=np.int32), "INT32")],
            sequence_id=sequence_id,
            sequence_start=start,
            sequence_end=end,
        )
        return int(result.as_numpy("OUTPUT")[0, 0])

    assert step(101, 1, start=True) == 1
    assert step("s-102", 100, start=True) == 100
    assert step(101, 2) == 3
    assert step("s-102", 200) == 300
    assert step(101, 3, end=True) == 6
    assert step("s-102", 300, end=True) == 600


def test_accumulator_needs_start(grpc: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="START"):
        grpc.infer(
            "accumulator",
            [_input(grpcclient, "INPUT", np.array([[1]], dtype=np.int32), "INT32")],
            sequence_id=987654,
        )


# -- the launcher: kill and restart ---------------------------------------------------------


def test_kill_and_restart_on_the_same_ports(tmp_path: Path) -> None:
    """Its own one-server fleet (only `simple`), so the shared fleet is left alone."""
    fleet = LocalFleet(1, MODEL_REPOSITORY, ["simple"], tmp_path)
    regions = f"{fleet.shm_prefix(0)}*"
    try:
        before = fleet.start()[0]
        # The python backend names its shared memory after the server: killed, the server
        # cannot remove it, so the fleet does (SIGKILL left it in /dev/shm for good before).
        assert list(SHM_DIR.glob(regions)), "the server's regions carry its prefix"
        fleet.kill(0)
        assert group_members(before.pid) == []
        assert not list(SHM_DIR.glob(regions))
        with pytest.raises(LookupError):
            fleet.server(0)
        after = fleet.restart(0)
        assert after.pid != before.pid
        assert (after.http_url, after.grpc_address, after.metrics_url) == (
            before.http_url,
            before.grpc_address,
            before.metrics_url,
        )
        with httpclient.InferenceServerClient(_host(after)) as client:
            a = np.ones((1, 16), dtype=np.int32)
            result = client.infer(
                "simple",
                [
                    _input(httpclient, "INPUT0", a, "INT32"),
                    _input(httpclient, "INPUT1", a, "INT32"),
                ],
            )
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
        assert list(SHM_DIR.glob(regions))
    finally:
        fleet.stop()
    assert not list(SHM_DIR.glob(regions))
    for pgid in fleet.started_pgids:
        assert group_members(pgid) == []
