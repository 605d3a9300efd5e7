import json

import pytest

from proxy.errors import Code, ProxyError
from proxy.frontends.kserve_http import (
    check_content_encoding,
    json_header,
    read_params,
    with_parameters,
)
from proxy.request import InferParams

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
    assert read_params(body, None) == expected
    bbody, length = binary_body(header)
    assert read_params(bbody, length) == expected


def test_read_params_sees_escaped_keys_and_leaves_unparseable_bodies_to_triton() -> None:
    assert read_params(b'{"parameters": {bad', None) == InferParams()
    escaped = b'{"param\\u0065ters": {"sequence_id": 9}}'
    assert read_params(escaped, None) == InferParams(sequence_id=9)


@pytest.mark.parametrize("length", ["abc", "-1", "9999"])
def test_bad_header_length_is_refused_as_triton_would(length: str) -> None:
    body, _ = binary_body({"inputs": []})
    with pytest.raises(ProxyError) as info:
        json_header(body, length)
    assert info.value.code is Code.INVALID_ARG
    assert "inference header size" in info.value.message


@pytest.mark.parametrize(
    "header",
    [
        {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]},
        {},
        {"parameters": {"sequence_id": 5}, "inputs": []},
        {"parameters": {"priority": 1}, "inputs": []},
        {"parameters": {"priority": 1, "timeout": 5}, "inputs": []},
    ],
)
def test_with_parameters_keeps_everything_else(header: dict[str, object]) -> None:
    for binary in (False, True):
        if binary:
            body, length = binary_body(header)
        else:
            body, length = json.dumps(header).encode(), None
        new_body, new_length = with_parameters(body, length, {"priority": 2, "timeout": 700})
        if binary:
            assert new_length is not None
            n = int(new_length)
            assert new_body[n:] == BINARY_TAIL
            doc = json.loads(new_body[:n])
        else:
            assert new_length is None
            doc = json.loads(new_body)
        expected = json.loads(json.dumps(header))
        expected.setdefault("parameters", {}).update(priority=2, timeout=700)
        assert doc == expected


def _keys(raw: bytes, name: str) -> list[object]:
    """Every value of top-level key ``name``, duplicates included, in order."""
    found: list[object] = []

    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        found.extend(v for k, v in pairs if k == name)
        return dict(pairs)

    json.loads(raw, object_pairs_hook=hook)
    return found


@pytest.mark.parametrize(
    "header",
    [
        # Duplicate top-level keys: Python keeps the last, Triton's RapidJSON finds the first.
        b'{"parameters":{"priority":1},"inputs":[],"parameters":{"priority":1}}',
        # A key spelt with escapes is the same key to every JSON parser.
        b'{"inputs":[],"param\\u0065ters":{"priority":1}}',
        b'{"inputs":[],"parameters":{"prior\\u0069ty":1}}',
        # "parameters" only inside an input: the top level has none yet.
        b'{"inputs":[{"name":"X","parameters":{"binary_data_size":4}}]}',
    ],
)
def test_the_class_priority_wins_over_any_spelling(header: bytes) -> None:
    new_body, _ = with_parameters(header, None, {"priority": 3})
    params = _keys(new_body, "parameters")
    top = [p for p in params if isinstance(p, dict) and "binary_data_size" not in p]
    assert top == [{"priority": 3}] or (len(top) == 1 and top[0]["priority"] == 3)  # type: ignore[index]
    assert all(v == 3 for v in _keys(new_body, "priority"))


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        # What orjson refuses but Python's json reads, and Triton may accept: read and written
        # back as before, never refused by the proxy nor changed in value.
        (b'{"parameters":{"x":NaN},"inputs":[]}', b'"x":NaN'),
        (b'{"parameters":{"x":1e400},"inputs":[]}', b'"x":Infinity'),
        (b'{"parameters":{"x":"\\ud800"},"inputs":[]}', b'"x":"\\ud800"'),
        # Read by orjson as the double Triton's RapidJSON reads from it too.
        (
            b'{"parameters":{"x":123456789012345678901234567890},"inputs":[]}',
            b'"x":1.2345678901234568e+29',
        ),
        # Read by orjson: integers up to 64 bits unsigned stay exact.
        (b'{"parameters":{"x":18446744073709551615},"inputs":[]}', b'"x":18446744073709551615'),
        (b'{"parameters":{"x":-9223372036854775808},"inputs":[]}', b'"x":-9223372036854775808'),
        (b'{"parameters":{"x":"\xc3\xa9"},"inputs":[]}', b'"x":"\xc3\xa9"'),
    ],
)
def test_the_rewrite_keeps_values_either_parser_reads(header: bytes, kept: bytes) -> None:
    new_body, _ = with_parameters(header, None, {"priority": 2})
    assert json.loads(new_body)["parameters"]["priority"] == 2
    assert kept in new_body


@pytest.mark.parametrize("depth", [100, 300, 1000, 5000])
def test_deeply_nested_parameters_are_rewritten_or_refused_never_a_crash(depth: int) -> None:
    # orjson reads 1024 levels and writes 254; Python's json has its own limits. Either the
    # priority is set or the request is refused with 400, never an internal error.
    header = b'{"parameters":{"a":' + b"[" * depth + b"]" * depth + b'},"inputs":[]}'
    try:
        new_body, _ = with_parameters(header, None, {"priority": 2})
    except ProxyError as exc:
        assert exc.code is Code.INVALID_ARG
    else:
        assert json.loads(new_body)["parameters"]["priority"] == 2


# A body such as '{not json' gets the splice (nothing in it can name a parameter) and Triton
# refuses it; one that might hold parameters but does not parse is refused here.
@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b'{"parameters": {', b"garbage {"])
def test_a_body_that_cannot_carry_the_priority_is_refused(body: bytes) -> None:
    with pytest.raises(ProxyError) as info:
        with_parameters(body, None, {"priority": 1})
    assert info.value.code is Code.INVALID_ARG


@pytest.mark.parametrize("encoding", [None, "identity", "gzip", " Deflate "])
def test_readable_encodings_pass(encoding: str | None) -> None:
    check_content_encoding(encoding)


@pytest.mark.parametrize("encoding", ["br", "compress", "gzip, br", "x" * 100])
def test_unreadable_encodings_are_refused(encoding: str) -> None:
    with pytest.raises(ProxyError) as info:
        check_content_encoding(encoding)
    assert info.value.code is Code.INVALID_ARG
