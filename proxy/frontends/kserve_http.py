"""The little of KServe v2 HTTP bodies that routing reads, and the one edit it makes.

Bodies are forwarded untouched. Only the JSON header (the whole body, or its first
``Inference-Header-Content-Length`` bytes when binary tensors follow) is looked at, and only
when it may hold what routing needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class InferParams:
    """Request parameters that steer routing."""

    sequence_id: int | str | None = None
    sequence_start: bool = False
    sequence_end: bool = False
    priority: int | None = None


NO_PARAMS = InferParams()


def json_header(body: bytes, header_length: str | None) -> bytes:
    """The JSON part of an infer body (all of it unless binary tensors follow)."""
    if header_length is None:
        return body
    try:
        n = int(header_length)
    except ValueError:
        return body
    return body[:n] if 0 < n <= len(body) else body


def read_params(body: bytes, header_length: str | None, encoded: bool) -> InferParams:
    """Parameters from the request, or defaults when the body can't or needn't be read.

    A body we cannot parse is still forwarded: Triton then answers with its own exact error.
    """
    if encoded:
        return NO_PARAMS
    header = json_header(body, header_length)
    if b'"parameters"' not in header:
        return NO_PARAMS
    try:
        doc = json.loads(header)
    except ValueError:
        return NO_PARAMS
    params = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(params, dict):
        return NO_PARAMS
    return params_from_mapping(params)


def params_from_mapping(params: dict[str, Any]) -> InferParams:
    seq = params.get("sequence_id")
    if isinstance(seq, bool) or not isinstance(seq, int | str) or seq in (0, ""):
        seq = None
    prio = params.get("priority")
    return InferParams(
        sequence_id=seq,
        sequence_start=params.get("sequence_start") is True,
        sequence_end=params.get("sequence_end") is True,
        priority=prio if isinstance(prio, int) and not isinstance(prio, bool) else None,
    )


def with_parameter(
    body: bytes, header_length: str | None, name: str, value: int
) -> tuple[bytes, str | None]:
    """Set one top-level request parameter; returns the new body and header length.

    When the header has no ``parameters`` yet, the object is spliced in after the opening
    brace, so a large JSON body is not re-serialised; otherwise only the JSON header is
    parsed and re-written. Binary tensor bytes after the header are never touched.
    """
    header = json_header(body, header_length)
    tail = body[len(header) :]
    if b'"parameters"' not in header:
        start = header.find(b"{")
        if start < 0:
            return body, header_length
        rest = header[start + 1 :].lstrip()
        sep = b"" if rest.startswith(b"}") else b","
        insert = b'"parameters":{"%s":%d}%s' % (name.encode(), value, sep)
        new_header = header[: start + 1] + insert + rest
    else:
        try:
            doc = json.loads(header)
        except ValueError:
            return body, header_length
        if not isinstance(doc, dict) or not isinstance(doc.get("parameters"), dict):
            return body, header_length
        doc["parameters"][name] = value
        new_header = json.dumps(doc, separators=(",", ":")).encode()
    new_length = str(len(new_header)) if header_length is not None else None
    return new_header + tail, new_length
