"""The little of a gRPC ``ModelInferRequest`` that routing reads, and the one edit it makes.

Requests are forwarded as the client's bytes. Routing needs ``model_name`` (field 1), a few
``parameters`` (field 4, ``map<string, InferParameter>``) and the inputs' shapes (field 5,
``inputs[].shape``, for the request's cost); the tensors (``raw_input_contents``...) can be
megabytes, so the top-level fields are walked on the wire and only fields 1 and 4 are handed to
the protobuf parser: tensor bytes are skipped, never copied.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from proxy.request import NO_PARAMS, InferParams, params_from_mapping

_MODEL_NAME = 1
_PARAMETERS = 4
_INPUTS = 5  # ModelInferRequest.inputs
_SHAPE = 3  # InferInputTensor.shape (packed int64)
_ROUTING_FIELDS = frozenset((_MODEL_NAME, _PARAMETERS))
_READ_FIELDS = frozenset((_MODEL_NAME, _PARAMETERS, _INPUTS))
_MEMO_BYTES = 1024
"""Largest set of a request's fields 1, 4 and 5 whose reading is memoised (1024 of them): a
client sends the same model, parameters and input shapes call after call; inputs that carry
their tensor inline (``contents``) are larger and read each time."""

Shapes = tuple[tuple[int, ...], ...]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(data: bytes) -> list[tuple[int, int, int, int, int]]:
    """``(field number, wire type, key start, value start, end)`` of each top-level field.

    One-byte keys and lengths (nearly all of a request's) are read inline, not by
    :func:`_varint`: this walk runs on every gRPC request (session 20)."""
    pos, end = 0, len(data)
    out = []
    while pos < end:
        key_start = pos
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos)
        wire = key & 7
        start = pos
        if wire == 2:
            length = data[pos]
            if length < 0x80:
                start = pos + 1
            else:
                length, start = _varint(data, pos)
            pos = start + length
        elif wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unexpected wire type {wire}")
        if pos > end:
            raise ValueError("truncated message")
        out.append((key >> 3, wire, key_start, start, pos))
    return out


def nested_fields(data: bytes, number: int, *, packed_ok: bool = False) -> list[bytes]:
    """The payloads of length-delimited field ``number`` of ``data`` (a message's bytes).

    With ``packed_ok``, a varint field ``number`` (an unpacked repeated integer) is returned as
    its own varint bytes, so packed and unpacked encodings read the same. Raises
    ``ValueError`` (or ``IndexError``) on malformed input.
    """
    out = []
    for field, wire, _, start, stop in _fields(data):
        if field != number:
            continue
        if wire == 2 or (packed_ok and wire == 0):
            out.append(data[start:stop])
    return out


def routing_fields(data: bytes, numbers: frozenset[int] = _ROUTING_FIELDS) -> bytes:
    """The encoded top-level fields ``numbers`` of ``data`` (by default ``model_name`` and
    ``parameters``), in their order.

    Raises ``ValueError`` (or ``IndexError``) when ``data`` is not a well-formed message.
    """
    return b"".join(
        data[key_start:stop] for number, _, key_start, _, stop in _fields(data) if number in numbers
    )


def input_shapes(request: bytes) -> Shapes:
    """The input shapes of a serialized ``ModelInferRequest`` (packed or not); tensor bytes
    are skipped. A message whose inputs cannot be walked has none that the proxy can read
    (``()``): Triton then parses it and says what is wrong."""
    try:
        return tuple(
            tuple(
                d
                for value in nested_fields(tensor, _SHAPE, packed_ok=True)
                for d in packed_varints(value)
            )
            for tensor in nested_fields(request, _INPUTS)
        )
    except (ValueError, IndexError):
        return ()


def read_request(data: bytes) -> tuple[str, InferParams, Shapes]:
    """Model name, routing parameters and input shapes of a serialized ``ModelInferRequest``
    (:func:`read_infer` and :func:`input_shapes` in one walk of the message, memoised by the
    bytes they read). An unreadable message yields ``("", NO_PARAMS, ())``."""
    try:
        fields = routing_fields(data, _READ_FIELDS)
    except (ValueError, IndexError):
        return "", NO_PARAMS, ()
    if len(fields) <= _MEMO_BYTES:
        return _read_memo(fields)
    return _read(fields)


def _read(fields: bytes) -> tuple[str, InferParams, Shapes]:
    model, params = read_infer(fields)
    return model, params, input_shapes(fields)


_read_memo = functools.lru_cache(maxsize=1024)(_read)


def packed_varints(data: bytes) -> list[int]:
    """The integers of a packed repeated ``int64`` field's payload (two's complement)."""
    out = []
    pos = 0
    while pos < len(data):
        value, pos = _varint(data, pos)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


def parameter_value(param: pb.InferParameter) -> Any:
    """The Python value of one ``InferParameter`` (None when unset)."""
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


def read_infer(data: bytes) -> tuple[str, InferParams]:
    """Model name and routing parameters of a serialized ``ModelInferRequest``.

    A message that cannot be read yields ``("", NO_PARAMS)``: it is still forwarded, and Triton
    answers with its own exact error.
    """
    try:
        request = pb.ModelInferRequest.FromString(routing_fields(data))
    except (ValueError, IndexError, DecodeError):
        return "", NO_PARAMS
    if not request.parameters:
        return request.model_name, NO_PARAMS
    values = {k: parameter_value(v) for k, v in request.parameters.items()}
    return request.model_name, params_from_mapping(values)


def with_parameters(data: bytes, values: Mapping[str, int]) -> bytes:
    """``data`` with each request parameter of ``values`` set (as ``int64_param``).

    Encoded ``parameters`` map entries are appended: protobuf parsers merge repeated fields
    and keep the last entry of a map key, so the original bytes need no re-serialisation and an
    existing value of a name is replaced whole. ``int64_param`` is what every Triton version
    accepts for ``priority`` and ``timeout`` (newer ones also take ``uint64_param``).
    """
    if not values:
        return data
    return data + b"".join(
        _parameter_entry(name, value) if name == "priority" else _encode_entry(name, value)
        for name, value in values.items()
    )


@functools.lru_cache(maxsize=256)
def _parameter_entry(name: str, value: int) -> bytes:
    # A class has one priority: the same few entries are encoded for every request.
    return _encode_entry(name, value)


def _encode_entry(name: str, value: int) -> bytes:
    entry = pb.ModelInferRequest(parameters={name: pb.InferParameter(int64_param=value)})
    encoded: bytes = entry.SerializeToString()
    return encoded
