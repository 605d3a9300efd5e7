"""Model control by the leader worker only (``serve --workers N``).

With several workers on the same ports, a load / unload / settings call reaches whichever worker
the kernel gave the client's connection. Only the leader worker fans such calls out to the
fleet, as it alone runs the control loops (the batching-window loop reloads models too), so a
follower hands the call, whole, to the leader:

- the leader serves :data:`SOCKET_NAME` in the workers' state directory: a Unix socket that
  only the proxy's own user can reach (the directory is ``mkdtemp``'s, mode 0700);
- a follower checks the caller's admin credential itself (the leader trusts the socket: nothing
  a client sends reaches it unchecked), sends the call's protocol, method, target, forwarded
  headers (credentials already removed) and body there, and answers its client with the
  leader's answer;
- when the leader cannot be reached (it is being restarted), the follower answers 503 /
  UNAVAILABLE: the call was not made, and the client may retry.

One exchange per client call, over HTTP on the socket: ``POST /http`` carries an HTTP call
(``X-Relay-Method``, ``X-Relay-Path``, ``X-Relay-Headers`` as a JSON list of pairs; the answer
is the fan-out's status and body), ``POST /grpc`` a gRPC one (``X-Relay-Method``, the
serialized request; the answer is the response message, or ``X-Relay-Grpc-Code`` and the error
message as the body).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp
import grpc
from aiohttp import web

from proxy.errors import Code, ProxyError
from proxy.fleet.model_control import InstanceFailure

log = logging.getLogger(__name__)

SOCKET_NAME = "admin.sock"
Headers = Sequence[tuple[str, str | bytes]]
"""HTTP headers, or gRPC metadata (whose ``-bin`` values are bytes)."""
HttpFanOut = Callable[[str, str, Sequence[tuple[str, str]], bytes], Awaitable[tuple[int, bytes]]]
"""(method, upstream path, forwarded headers, body) -> (status, body) of the fan-out."""
GrpcFanOut = Callable[[str, bytes, Headers], Awaitable[bytes]]
"""(method, request, forwarded metadata) -> response; raises ``InstanceFailure[StatusCode]``."""

_METHOD, _PATH, _HEADERS, _CODE = (
    "X-Relay-Method",
    "X-Relay-Path",
    "X-Relay-Headers",
    "X-Relay-Grpc-Code",
)
_TIMEOUT_S = 300.0
"""A model load can take minutes (Triton answers when the model is ready)."""


def socket_path(state_dir: Path) -> Path:
    return state_dir / SOCKET_NAME


def _encode(headers: Headers) -> str:
    return json.dumps(
        [
            [k, v] if isinstance(v, str) else [k, base64.b64encode(v).decode(), "b64"]
            for k, v in headers
        ]
    )


def _decode(text: str) -> list[tuple[str, str | bytes]]:
    return [
        (str(item[0]), base64.b64decode(item[1]) if len(item) > 2 else str(item[1]))
        for item in json.loads(text)
    ]


class LeaderEndpoint:
    """The leader worker's side: serves the socket, runs the fan-outs it is handed."""

    def __init__(self, http: HttpFanOut, grpc_fan_out: GrpcFanOut | None) -> None:
        self._http = http
        self._grpc = grpc_fan_out
        self._runner: web.AppRunner | None = None

    async def start(self, path: Path, max_body_bytes: int) -> None:
        """Serve ``path``; a relayed body is at most ``max_body_bytes`` (the follower already
        refused larger ones: ``limits.max_body_bytes``)."""
        app = web.Application(client_max_size=max_body_bytes)
        app.router.add_post("/http", self._on_http)
        app.router.add_post("/grpc", self._on_grpc)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        path.unlink(missing_ok=True)  # a socket left by a leader that died
        await web.UnixSite(runner, str(path)).start()
        path.chmod(0o600)
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _on_http(self, request: web.Request) -> web.Response:
        headers = [(k, v) for k, v in _decode(request.headers[_HEADERS]) if isinstance(v, str)]
        status, data = await self._http(
            request.headers[_METHOD], request.headers[_PATH], headers, await request.read()
        )
        return web.Response(status=status, body=data, content_type="application/json")

    async def _on_grpc(self, request: web.Request) -> web.Response:
        if self._grpc is None:
            return web.Response(status=404)
        metadata = _decode(request.headers[_HEADERS])
        try:
            data = await self._grpc(request.headers[_METHOD], await request.read(), metadata)
        except InstanceFailure as failure:
            code = failure.code if isinstance(failure.code, grpc.StatusCode) else None
            name = code.name if code is not None else grpc.StatusCode.INTERNAL.name
            return web.Response(body=failure.message.encode(), headers={_CODE: name})
        return web.Response(body=data)


class LeaderClient:
    """A follower worker's side: hands a call to the leader and returns its answer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(self.path)),
                timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(
        self, kind: str, method: str, path: str, headers: Headers, body: bytes
    ) -> tuple[int, bytes, str | None]:
        relay = {_METHOD: method, _PATH: path, _HEADERS: _encode(headers)}
        try:
            async with self._client().post(
                f"http://leader/{kind}", data=body, headers=relay
            ) as resp:
                return resp.status, await resp.read(), resp.headers.get(_CODE)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("model control: the leader worker is unreachable: %s", exc)
            raise ProxyError(
                Code.UNAVAILABLE,
                "triton-proxy: the worker that runs model control is unavailable (restarting?); "
                "the call was not made, retry",
            ) from exc

    async def http(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> tuple[int, bytes]:
        status, data, _ = await self._post("http", method, path, headers, body)
        return status, data

    async def grpc(self, method: str, request: bytes, metadata: Headers) -> bytes:
        status, data, code = await self._post("grpc", method, "", metadata, request)
        if code is not None:
            raise InstanceFailure(grpc.StatusCode[code], data.decode(errors="replace"))
        if status != 200:
            raise InstanceFailure(grpc.StatusCode.INTERNAL, f"leader worker answered {status}")
        return data
