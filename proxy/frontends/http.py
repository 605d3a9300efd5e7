"""Triton's HTTP/REST protocol (KServe v2), served by the proxy.

Inference bodies are forwarded byte for byte through the instance's pooled client; the proxy
reads only the JSON header, and only when it may hold a routing parameter. Everything the proxy
does not handle itself is relayed to a ready instance, so Triton answers it exactly as it would.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.budget import Hold
from proxy.dispatch import Call, ModelAbsentError, says_model_absent
from proxy.errors import Code, ProxyError, error_body
from proxy.fleet.instances import Instance
from proxy.fleet.upstream import http_failure
from proxy.frontends.common import (
    SHARED_MEMORY_MESSAGE,
    SharedMemoryAction,
    SharedMemoryKind,
    admin_failure_message,
    check_admin,
    shared_memory_call,
)
from proxy.frontends.kserve_http import HEADER_LENGTH, read_params, with_parameter
from proxy.runtime import Runtime

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
_SHARED_MEMORY_PATH = re.compile(
    r"^(?:/region/(?P<region>[^/]+))?/(?P<action>status|register|unregister)$"
)
_SHARED_MEMORY_ACTIONS: dict[str, SharedMemoryAction] = {
    "status": "status",
    "register": "register",
    "unregister": "unregister",
}


_BODY_HOLD = web.RequestKey("body_hold", Hold)


def _forward_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def error_response(exc: ProxyError) -> web.Response:
    headers = {"Content-Type": "application/json"}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return web.Response(status=exc.code.http_status, body=exc.body(), headers=headers)


class HttpFrontend:
    """Builds the aiohttp application serving Triton's HTTP protocol for one :class:`Runtime`."""

    def __init__(self, runtime_ref: Callable[[], Runtime]) -> None:
        # A callable, not a Runtime: the server outlives any one runtime object (tests and
        # reloads may hand it another).
        self._rt = runtime_ref

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_post(base + "/infer", self.infer)
            r.add_post(base + "/generate", self.generate)
            r.add_post(base + "/generate_stream", self.generate_stream)
        r.add_post("/v2/repository/index", self.admin_first)
        r.add_post("/v2/repository/models/{model}/load", self.admin_all)
        r.add_post("/v2/repository/models/{model}/unload", self.admin_all)
        for kind in ("systemsharedmemory", "cudasharedmemory"):
            r.add_route("*", f"/v2/{kind}" + "{tail:.*}", self.shared_memory)
        for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting", "/v2/logging"):
            r.add_post(path, self.admin_all)
        r.add_route("*", "/{tail:.*}", self.relay)
        return app

    # --- middleware -----------------------------------------------------------------------
    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as exc:
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                ProxyError(
                    Code.PAYLOAD_TOO_LARGE,
                    "Request content size exceeds the maximum allowed input size of "
                    f"{self._rt().config.limits.max_body_bytes} bytes. Raise "
                    "limits.max_body_bytes in the proxy's policy file to increase the limit.",
                )
            )
        finally:
            hold = request.get(_BODY_HOLD)
            if hold is not None:
                hold.release()

    # --- health ---------------------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        # Triton answers 400 (with an empty body) when not ready.
        return web.Response(status=200 if self._rt().ready() else 400)

    # --- inference ------------------------------------------------------------------------
    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, held against the byte budget until the request ends."""
        rt = self._rt()
        limit = rt.config.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        # Released by the middleware, whatever way the request ends.
        hold = request[_BODY_HOLD] = rt.budget.hold(request.content_length or 0)
        if request.content_length is not None:
            return await request.read()
        chunks: list[bytes] = []
        async for chunk in request.content.iter_chunked(1 << 16):
            if hold.nbytes + len(chunk) > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=hold.nbytes)
            hold.grow(len(chunk))
            chunks.append(chunk)
        return b"".join(chunks)

    def _call(self, request: web.Request, body: bytes) -> Call:
        headers = {k.lower(): v for k, v in request.headers.items()}
        params = read_params(
            body, headers.get(HEADER_LENGTH.lower()), encoded="content-encoding" in headers
        )
        rt = self._rt()
        return Call(
            model=request.match_info["model"],
            headers=headers,
            params=params,
            session_key=rt.session_key(headers),
        )

    async def infer(self, request: web.Request) -> web.StreamResponse:
        return await self._dispatch(request, stream=False)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._dispatch(request, stream=False)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._dispatch(request, stream=True)

    async def _dispatch(self, request: web.Request, *, stream: bool) -> web.StreamResponse:
        body = await self._read_body(request)
        call = self._call(request, body)
        headers = _forward_headers(request.headers)
        infer = request.path.endswith("/infer")

        async def send(instance: Instance, priority: int | None) -> web.StreamResponse:
            data, hdrs = body, headers
            if priority is not None and infer and "content-encoding" not in call.headers:
                data, length = with_parameter(
                    body, call.headers.get(HEADER_LENGTH.lower()), "priority", priority
                )
                if length is not None:
                    hdrs = headers.copy()
                    hdrs[HEADER_LENGTH] = length
            return await self._exchange(
                instance, request, data, hdrs, stream=stream, dispatched=True
            )

        return await self._rt().dispatcher.run(
            call, send, stream=stream, outcome=lambda r: str(r.status)
        )

    async def _exchange(
        self,
        instance: Instance,
        request: web.Request,
        body: bytes,
        headers: CIMultiDict[str],
        *,
        stream: bool = False,
        dispatched: bool = False,
    ) -> web.StreamResponse:
        """Send one request to ``instance`` and relay its answer to the client.

        ``dispatched``: an inference request, whose "unknown model" answer from this one
        instance raises :class:`ModelAbsentError` (the dispatcher may go elsewhere).
        """
        rt = self._rt()
        with rt.upstreams.using(instance) as session:
            try:
                upstream = await session.request(
                    request.method, request.rel_url.path_qs, data=body or None, headers=headers
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise http_failure(exc, before_response=True) from exc
            async with upstream:
                return await self._relay_answer(
                    instance, request, upstream, stream=stream, dispatched=dispatched
                )

    async def _relay_answer(
        self,
        instance: Instance,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        *,
        stream: bool,
        dispatched: bool,
    ) -> web.StreamResponse:
        if upstream.status >= 500:
            self._rt().health.check_soon(instance)
        out_headers = _forward_headers(upstream.headers)
        if not stream or upstream.status >= 400:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise http_failure(exc, before_response=False) from exc
            answer = web.Response(status=upstream.status, body=data, headers=out_headers)
            if dispatched and upstream.status in (400, 404):
                text = data.decode(errors="replace")
                if says_model_absent(text):
                    raise ModelAbsentError(text, answer)
            return answer
        response = web.StreamResponse(status=upstream.status, headers=out_headers)
        await response.prepare(request)
        try:
            # Relay each chunk as it arrives: server-sent events must not be buffered.
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, TimeoutError) as exc:
            # Headers are sent, so no error response can follow: the client sees the
            # stream cut short, as it would from the server itself.
            log.warning("stream from %s broke off: %s", instance.name, exc)
            self._rt().health.check_soon(instance)
            return response
        await response.write_eof()
        return response

    # --- everything else ------------------------------------------------------------------
    async def relay(self, request: web.Request) -> web.StreamResponse:
        """Metadata, config, statistics...: any ready instance answers as Triton would."""
        body = await self._read_body(request)
        headers = _forward_headers(request.headers)
        return await self._rt().dispatcher.any_ready(
            lambda instance: self._exchange(instance, request, body, headers)
        )

    async def shared_memory(self, request: web.Request) -> web.Response:
        match = _SHARED_MEMORY_PATH.match(request.match_info["tail"])
        if match is None:
            raise ProxyError(Code.UNSUPPORTED, SHARED_MEMORY_MESSAGE)
        action = _SHARED_MEMORY_ACTIONS[match["action"]]
        kind: SharedMemoryKind = "cuda" if request.path.startswith("/v2/cuda") else "system"
        shared_memory_call(kind, action, match["region"] or "")
        # What Triton answers with no region registered.
        return web.json_response([]) if action == "status" else web.Response(status=200)

    def _check_admin(self, request: web.Request) -> None:
        check_admin(self._rt().config.admin, request.headers.get("Authorization"))

    async def admin_first(self, request: web.Request) -> web.StreamResponse:
        self._check_admin(request)
        return await self.relay(request)

    async def admin_all(self, request: web.Request) -> web.Response:
        """Load/unload/settings go to every instance; the first failure is returned."""
        self._check_admin(request)
        body = await self._read_body(request)
        headers = _forward_headers(request.headers)
        headers.pop("Authorization", None)
        rt = self._rt()
        answers: list[tuple[str, int, bytes]] = []
        for instance in rt.fleet.all():
            session = rt.upstreams.session(instance)
            try:
                async with session.request(
                    request.method, request.rel_url.path_qs, data=body or None, headers=headers
                ) as resp:
                    answers.append((instance.name, resp.status, await resp.read()))
            except aiohttp.ClientError as exc:
                answers.append((instance.name, 503, error_body(f"{instance.name}: {exc}")))
        failed = [a for a in answers if a[1] >= 400]
        name, status, data = failed[0] if failed else answers[0]
        if failed and len(answers) > 1:
            message = json.loads(data).get("error", "") if data.startswith(b"{") else ""
            data = error_body(admin_failure_message(message, name, len(failed), len(answers)))
        return web.Response(status=status, body=data, content_type="application/json")
