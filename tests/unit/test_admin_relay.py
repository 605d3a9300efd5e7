"""The relay from follower workers to the leader's model control, over a real Unix socket."""

from __future__ import annotations

import grpc
import pytest

from proxy.errors import Code, ProxyError
from proxy.fleet.model_control import InstanceFailure
from proxy.frontends.admin_relay import Headers, LeaderClient, LeaderEndpoint, socket_path


async def test_a_call_reaches_the_leader_whole_and_its_answer_comes_back(tmp_path):
    seen: list[tuple[object, ...]] = []

    async def http(method: str, path: str, headers, body: bytes) -> tuple[int, bytes]:
        seen.append((method, path, list(headers), body))
        return 400, b'{"error":"failed to load \'m\'"}'

    async def grpc_fan_out(method: str, request: bytes, metadata: Headers) -> bytes:
        seen.append((method, request, list(metadata)))
        if method == "RepositoryModelUnload":
            raise InstanceFailure(grpc.StatusCode.NOT_FOUND, "no model 'm' (on instance 't1')")
        return b"\x0a\x01m"

    endpoint = LeaderEndpoint(http, grpc_fan_out)
    path = socket_path(tmp_path)
    await endpoint.start(path, 1 << 20)
    client = LeaderClient(path)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        status, data = await client.http(
            "POST", "/v2/repository/models/m/load", [("X-Trace", "é")], b'{"parameters":{}}'
        )
        assert (status, data) == (400, b'{"error":"failed to load \'m\'"}')
        meta: Headers = [("x-token-bin", b"\x00\xff"), ("x-id", "7")]
        assert await client.grpc("RepositoryModelLoad", b"\x0a\x01m", meta) == b"\x0a\x01m"
        with pytest.raises(InstanceFailure) as failed:
            await client.grpc("RepositoryModelUnload", b"", [])
        assert failed.value.code is grpc.StatusCode.NOT_FOUND
        assert failed.value.message == "no model 'm' (on instance 't1')"
    finally:
        await client.close()
        await endpoint.stop()
    assert seen == [
        ("POST", "/v2/repository/models/m/load", [("X-Trace", "é")], b'{"parameters":{}}'),
        ("RepositoryModelLoad", b"\x0a\x01m", [("x-token-bin", b"\x00\xff"), ("x-id", "7")]),
        ("RepositoryModelUnload", b"", []),
    ]


async def test_an_unreachable_leader_is_unavailable_and_nothing_is_called(tmp_path):
    client = LeaderClient(socket_path(tmp_path))  # no leader listens there
    try:
        with pytest.raises(ProxyError) as failed:
            await client.http("POST", "/v2/repository/models/m/load", [], b"")
        assert failed.value.code is Code.UNAVAILABLE
        with pytest.raises(ProxyError):
            await client.grpc("RepositoryModelLoad", b"", [])
    finally:
        await client.close()
