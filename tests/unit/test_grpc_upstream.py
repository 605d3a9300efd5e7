"""Telling transport failures from Triton's own statuses, and the upstream deadline."""

from __future__ import annotations

import grpc
import pytest

from proxy.fleet.grpc_upstream import effective_timeout, upstream_error
from proxy.fleet.upstream import UpstreamConnectError, UpstreamLostError


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: "
            "Failed to connect to remote host: Connection refused",
            UpstreamConnectError,
        ),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", UpstreamLostError),
        (grpc.StatusCode.UNAVAILABLE, "recvmsg:Connection reset by peer", UpstreamLostError),
        # Triton's own answers are relayed as they are.
        (grpc.StatusCode.UNAVAILABLE, "Exceeds maximum queue size", None),
        (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", None),
        (grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'x' is not found", None),
        (grpc.StatusCode.INTERNAL, "Socket closed", None),
    ],
)
def test_upstream_error(code: grpc.StatusCode, details: str, expected: type | None) -> None:
    got = upstream_error(rpc_error(code, details))
    assert type(got) is expected if expected else got is None


@pytest.mark.parametrize(
    ("remaining", "limit", "expected"),
    [(None, None, None), (None, 5.0, 5.0), (2.0, None, 2.0), (2.0, 5.0, 2.0), (9.0, 5.0, 5.0)],
)
def test_effective_timeout(
    remaining: float | None, limit: float | None, expected: float | None
) -> None:
    assert effective_timeout(remaining, limit) == expected


def test_expired_deadline_stays_expired() -> None:
    assert effective_timeout(-0.5, None) == 0.0
