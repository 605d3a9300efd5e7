"""The little of KServe v2 HTTP bodies that routing reads, and the one edit it makes.

Bodies are forwarded untouched, with two exceptions that security needs:

- a compressed inference body (``Content-Encoding: gzip`` or ``deflate``, which Triton
  accepts) arrives decompressed from the HTTP server, bounded by the body limit, and is forwarded
  uncompressed: otherwise the proxy could neither read its routing parameters nor enforce the
  class's priority; any other encoding is refused (:func:`check_content_encoding`);
- when the request's class sets a Triton ``priority`` (or the proxy hands on what is left of
  the client's deadline as ``timeout``), the JSON header gets that parameter, whatever the
  client put there. A body whose JSON header cannot be read is then refused with
  400 rather than passed through with the client's own priority.

Only the JSON header (the whole body, or its first ``Inference-Header-Content-Length`` bytes
when binary tensors follow) is ever looked at; binary tensor bytes are never touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from proxy.errors import Code, ProxyError
from proxy.request import NO_PARAMS, InferParams, params_from_mapping

HEADER_LENGTH = "Inference-Header-Content-Length"
_READABLE_ENCODINGS = frozenset(("identity", "gzip", "deflate"))
# The only ways a JSON object key can spell "parameters": literally, or with \u escapes.
_PARAMETERS_KEY = b'"parameters"'
_UNICODE_ESCAPE = b"\\u"


def _compact_json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _orjson_dumps(doc: Any) -> bytes:
    try:
        return orjson.dumps(doc)
    except orjson.JSONEncodeError:
        # orjson writes at most 254 levels of nesting but reads 1024: Python's json writes
        # what it can (deeper raises RecursionError, a 400 in with_parameters).
        return _compact_json(doc)


def _loads(header: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """The header's JSON, and the function that writes such a document back.

    orjson first: reading and re-writing tritonclient's 308-byte header took 4.5 µs with it
    against 21 µs with Python's json (`timeit`); with classes on, the proxy's CPU per request
    fell from 0.561 to 0.535 ms (`benchmarks/cpu_ab.py`, 6 alternated rounds, session 8;
    py-spy had put the rewrite at a tenth of the samples). What orjson refuses but Python's json
    reads (``NaN``, ``1e400``, lone surrogates, nesting past 1024) is read as before, so no
    body is refused that was forwarded before; such a document must then be written back by
    Python's json too (orjson writes ``NaN`` as ``null`` and refuses integers past 64 bits).
    Raises ``ValueError`` or ``RecursionError`` when neither reads it.
    """
    try:
        return orjson.loads(header), _orjson_dumps
    except orjson.JSONDecodeError:
        return json.loads(header), _compact_json


def check_content_encoding(content_encoding: str | None) -> None:
    """Refuse (400) an inference body in an encoding the proxy cannot read.

    The proxy's HTTP server (:mod:`proxy.frontends.http_server`) decodes ``gzip`` and
    ``deflate`` bodies as it reads them, bounded by the body limit (a zip bomb gets 413 once
    its decompressed bytes pass it), so the proxy sees, rewrites and forwards the decoded body.
    Any other encoding (``br`` included) arrives as sent and would leave the proxy blind to the
    body's parameters, so it is refused rather than passed through.
    """
    encoding = (content_encoding or "identity").strip().lower()
    if encoding not in _READABLE_ENCODINGS:
        raise ProxyError(
            Code.INVALID_ARG,
            f"unsupported Content-Encoding {encoding[:32]!r} for an inference request: "
            "use gzip, deflate or identity",
        )


def header_length_of(body: bytes, header_length: str | None) -> int:
    """Length of the JSON header within ``body`` (Triton's checks and its error message)."""
    if header_length is None:
        return len(body)
    try:
        n = int(header_length.strip())
    except ValueError:
        raise ProxyError(
            Code.INVALID_ARG,
            f"Unable to parse inference header size, got: {header_length[:32]}",
        ) from None
    if n < 0 or n > len(body):
        raise ProxyError(
            Code.INVALID_ARG,
            f"inference header size should be in range (0, {len(body)}), got: {n}",
        )
    return n


def json_header(body: bytes, header_length: str | None) -> bytes:
    """The JSON part of an infer body (all of it unless binary tensors follow)."""
    return body[: header_length_of(body, header_length)]


def _may_hold_parameters(header: bytes) -> bool:
    return _PARAMETERS_KEY in header or _UNICODE_ESCAPE in header


# The parameters routing reads (see proxy.request.params_from_mapping), as they must appear in
# the JSON unless spelt with \u escapes.
_ROUTING_KEYS = (b'"sequence_id"', b'"priority"', b'"timeout"')


def _may_hold_routing_parameters(header: bytes) -> bool:
    if _UNICODE_ESCAPE in header:
        return True
    return _PARAMETERS_KEY in header and any(key in header for key in _ROUTING_KEYS)


def read_params(body: bytes, header_length: str | None) -> InferParams:
    """Parameters from the request, or defaults when the body holds none.

    A body whose JSON cannot be parsed yields defaults and is still forwarded (unless a
    priority must be set, see :func:`with_parameters`): Triton answers with its own error.
    """
    header = json_header(body, header_length)
    # Most requests carry parameters (tritonclient sends binary_data_output) but none that
    # routing reads: parsing their JSON was 1 % of the proxy's CPU under load (py-spy).
    if not _may_hold_routing_parameters(header):
        return NO_PARAMS
    try:
        doc, _ = _loads(header)
    except (ValueError, RecursionError):
        return NO_PARAMS
    params = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(params, dict):
        return NO_PARAMS
    return params_from_mapping(params)


def _unreadable(why: str) -> ProxyError:
    return ProxyError(
        Code.INVALID_ARG,
        f"triton-proxy could not set the request's priority or timeout: {why}; "
        "send a KServe v2 inference request whose JSON header is an object",
    )


def with_parameters(
    body: bytes, header_length: str | None, values: Mapping[str, int]
) -> tuple[bytes, str | None]:
    """Set top-level request parameters in one rewrite; returns the new body and header length.

    Whatever the client sent for each name is replaced. When the JSON header cannot spell a
    ``parameters`` key (neither the literal key nor any ``\\u`` escape occurs in it), the object
    is spliced in after the opening brace, so a large JSON body is not re-serialised. Otherwise
    the header is parsed and re-written whole: duplicate keys collapse to the one the proxy set,
    so no parser, Python's or Triton's RapidJSON, can read another value. Binary tensor bytes
    after the header are never touched. Raises :class:`ProxyError` (400) when the header is
    not a JSON object.
    """
    header = json_header(body, header_length)
    tail = body[len(header) :]
    if not _may_hold_parameters(header):
        start = header.find(b"{")
        if start < 0 or header[:start].strip():
            raise _unreadable("the JSON header is not an object")
        rest = header[start + 1 :].lstrip()
        sep = b"" if rest.startswith(b"}") else b","
        entries = b",".join(b'"%s":%d' % (n.encode(), v) for n, v in values.items())
        insert = b'"parameters":{%s}%s' % (entries, sep)
        new_header = header[: start + 1] + insert + rest
    else:
        try:
            doc, dumps = _loads(header)
        except (ValueError, RecursionError) as exc:
            raise _unreadable(f"its JSON does not parse ({exc})") from exc
        if not isinstance(doc, dict):
            raise _unreadable("the JSON header is not an object")
        params = doc.get("parameters")
        if params is None:
            params = doc["parameters"] = {}
        if not isinstance(params, dict):
            raise _unreadable("'parameters' is not an object")
        params.update(values)
        try:
            new_header = dumps(doc)
        except RecursionError as exc:
            raise _unreadable("its JSON is nested too deeply") from exc
    new_length = str(len(new_header)) if header_length is not None else None
    return new_header + tail, new_length
