import json

import pytest

from proxy.frontends.kserve_http import InferParams, read_params, with_parameter

BINARY_TAIL = b"\x00\x01\x02\x03" * 4


def binary_body(header: dict[str, object]) -> tuple[bytes, str]:
    h = json.dumps(header).encode()
    return h + BINARY_TAIL, str(len(h))


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ({"inputs": []}, InferParams()),
        ({"parameters": {"sequence_id": 7, "sequence_start": True}}, InferParams(7, True)),
        (
            {"parameters": {"sequence_id": "abc", "sequence_end": True}},
            InferParams("abc", sequence_end=True),
        ),
        ({"parameters": {"sequence_id": 0}}, InferParams()),
        ({"parameters": {"priority": 2}}, InferParams(priority=2)),
        ({"parameters": {"priority": True}}, InferParams()),
        ({"parameters": "nonsense"}, InferParams()),
    ],
)
def test_read_params_json_and_binary(header: dict[str, object], expected: InferParams) -> None:
    body = json.dumps(header).encode()
    assert read_params(body, None, encoded=False) == expected
    bbody, length = binary_body(header)
    assert read_params(bbody, length, encoded=False) == expected


def test_unparseable_or_compressed_bodies_are_left_to_triton() -> None:
    assert read_params(b'{"parameters": {bad', None, encoded=False) == InferParams()
    body = json.dumps({"parameters": {"sequence_id": 3}}).encode()
    assert read_params(body, None, encoded=True) == InferParams()


@pytest.mark.parametrize(
    "header",
    [
        {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]},
        {},
        {"parameters": {"sequence_id": 5}, "inputs": []},
    ],
)
def test_with_parameter_keeps_everything_else(header: dict[str, object]) -> None:
    for binary in (False, True):
        if binary:
            body, length = binary_body(header)
        else:
            body, length = json.dumps(header).encode(), None
        new_body, new_length = with_parameter(body, length, "priority", 2)
        if binary:
            assert new_length is not None
            n = int(new_length)
            assert new_body[n:] == BINARY_TAIL
            doc = json.loads(new_body[:n])
        else:
            assert new_length is None
            doc = json.loads(new_body)
        expected = json.loads(json.dumps(header))
        expected.setdefault("parameters", {})["priority"] = 2
        assert doc == expected
