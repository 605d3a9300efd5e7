"""Errors in Triton's own format, so a client cannot tell the proxy from a server.

Triton answers HTTP errors with ``{"error": "<message>"}`` and maps its status codes as
NOT_FOUND→404, UNAVAILABLE→503, INTERNAL→500, UNSUPPORTED→501, others→400; gRPC carries the
same message with the matching ``grpc.StatusCode``.
"""

from __future__ import annotations

import enum
import json


class Code(enum.Enum):
    """Triton error codes with their HTTP status and gRPC status name."""

    INVALID_ARG = (400, "INVALID_ARGUMENT")
    NOT_FOUND = (404, "NOT_FOUND")
    UNAVAILABLE = (503, "UNAVAILABLE")
    INTERNAL = (500, "INTERNAL")
    UNSUPPORTED = (501, "UNIMPLEMENTED")
    RESOURCE_EXHAUSTED = (429, "RESOURCE_EXHAUSTED")
    PAYLOAD_TOO_LARGE = (413, "RESOURCE_EXHAUSTED")
    PERMISSION_DENIED = (403, "PERMISSION_DENIED")
    METHOD_NOT_ALLOWED = (405, "UNIMPLEMENTED")
    UNAUTHENTICATED = (401, "UNAUTHENTICATED")
    DEADLINE_EXCEEDED = (504, "DEADLINE_EXCEEDED")
    CLIENT_DEADLINE = (429, "DEADLINE_EXCEEDED")
    """The client's own deadline passed before the request was served (not sent to Triton)."""

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def grpc_name(self) -> str:
        return self.value[1]


class ProxyError(Exception):
    """An error the proxy itself answers with (rather than one relayed from Triton)."""

    def __init__(self, code: Code, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        return error_body(self.message)


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()
