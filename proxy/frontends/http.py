"""Triton's HTTP/REST protocol (KServe v2), served by the proxy.

Every request's raw target is canonicalised and matched against the explicit route table in
:mod:`proxy.frontends.routes`; the upstream path is built from the match. Inference bodies are
forwarded byte for byte through the instance's pooled client (decompressed first when the client
compressed them); the proxy reads only the JSON header, and edits only the class's ``priority``
and the ``timeout`` left of the client's deadline (KServe ``timeout`` or ``Triton-Timeout-Ms``).
Read-only routes are relayed to a ready instance, so Triton answers them exactly as it would.
Credentials (the API-key header, the admin token) and the class header stay at the proxy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.budget import Hold
from proxy.dispatch import ModelAbsentError, says_model_absent
from proxy.errors import Code, ProxyError, error_body
from proxy.fleet.http1 import Http1Pool
from proxy.fleet.instances import Instance
from proxy.fleet.model_control import InstanceFailure, to_every_instance
from proxy.fleet.upstream import UpstreamTimeoutError, http_failure
from proxy.frontends import routes
from proxy.frontends.common import (
    SharedMemoryAction,
    SharedMemoryKind,
    check_admin,
    shared_memory_call,
)
from proxy.frontends.http_server import Request, Response, Stream
from proxy.frontends.kserve_http import (
    HEADER_LENGTH,
    check_content_encoding,
    json_header,
    read_params,
    with_parameters,
)
from proxy.frontends.routes import ADMIN_KINDS, INFERENCE_KINDS, Kind, Route
from proxy.request import Call, Forward
from proxy.runtime import Runtime
from proxy.scheduling import deadline
from proxy.scheduling.cost import check_shapes, cost_of, http_shapes, rows_of

log = logging.getLogger(__name__)

_SHARED_MEMORY_ACTIONS: dict[str, SharedMemoryAction] = {
    "status": "status",
    "register": "register",
    "unregister": "unregister",
}

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
        # The proxy reads the whole body before it sends anything upstream, so it answers the
        # client's Expect itself; forwarded, Triton's interim 100 would be taken for its answer.
        "Expect",
    )
)

_JSON = (("Content-Type", "application/json"),)
# Statuses of Triton's "model not servable here" answers (proxy.dispatch.says_model_absent):
# 400/404 for an unknown or unloaded model, 500 for a dead Python backend stub.
_MAYBE_ABSENT = frozenset((400, 404, 500))


def _raise_if_absent(status: int, body: bytes, answer: Response) -> None:
    """Raise :class:`ModelAbsentError` (with ``answer`` for the client if nowhere else
    serves) when Triton's answer says the model is not servable on that instance."""
    if status in _MAYBE_ABSENT:
        text = body.decode(errors="replace")
        if says_model_absent(text):
            raise ModelAbsentError(text, answer)


def _forward_headers(
    headers: CIMultiDictProxy[str],
    private: frozenset[str] = frozenset(),
    also: str | None = None,
) -> CIMultiDict[str]:
    """Headers to send upstream: all but hop-by-hop ones, ``private`` (lower-case names:
    credentials and the class header, consumed by the proxy) and ``also``."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        low = k.lower()
        if low not in HOP_BY_HOP and low not in private and low != also:
            out.add(k, v)
    return out


class _BodyHold:
    """A request body held against the byte budget, refused past ``limits.max_body_bytes``."""

    __slots__ = ("_hold", "_limit", "_too_large")

    def __init__(self, hold: Hold, limit: int, too_large: Callable[[int], ProxyError]) -> None:
        self._hold = hold
        self._limit = limit
        self._too_large = too_large

    @property
    def nbytes(self) -> int:
        return self._hold.nbytes

    def grow(self, nbytes: int) -> None:
        if self._hold.nbytes + nbytes > self._limit:
            raise self._too_large(self._limit)
        self._hold.grow(nbytes)

    def release(self) -> None:
        self._hold.release()


def _too_large(limit: int) -> ProxyError:
    return ProxyError(
        Code.PAYLOAD_TOO_LARGE,
        f"Request content size exceeds the maximum allowed input size of {limit} bytes. "
        "Raise limits.max_body_bytes in the proxy's policy file to increase the limit.",
    )


class HttpFrontend:
    """Serves Triton's HTTP protocol for one :class:`Runtime`, as the application of the
    proxy's lean HTTP/1.1 server (:mod:`proxy.frontends.http_server`)."""

    def __init__(self, runtime_ref: Callable[[], Runtime]) -> None:
        # A callable, not a Runtime: the server outlives any one runtime object (tests and
        # reloads may hand it another).
        self._rt = runtime_ref

    def open_body(self, request: Request) -> _BodyHold:
        """Hold the body against the byte budget from its head on, refused (413) past the body
        limit: by its ``Content-Length`` before any of it is read, else as it arrives (chunked,
        or decompressed). The server releases the hold whatever way the request ends.

        What the head alone decides is refused before a byte of the body is read: a target
        the route table refuses, a model-control call without the admin token, an inference
        body in an encoding the proxy cannot read (:meth:`handle` matches again, memoised)."""
        rt = self._rt()
        route = routes.match(request.method, request.target)
        if route.kind in INFERENCE_KINDS:
            check_content_encoding(request.headers.get("Content-Encoding"))
        elif route.kind in ADMIN_KINDS:
            self._check_admin(request)
        limit = rt.config.limits.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise _too_large(limit)
        return _BodyHold(rt.budget.hold(length or 0), limit, _too_large)

    async def handle(self, request: Request) -> Response | Stream:
        # The raw target is canonicalised and matched against the explicit route table.
        route = routes.match(request.method, request.target)
        kind = route.kind
        if kind is Kind.LIVE:
            return Response(200)
        if kind is Kind.READY:
            # Triton answers 400 (with an empty body) when not ready.
            return Response(200 if self._rt().ready() else 400)
        if kind in INFERENCE_KINDS:
            return await self._dispatch(request, route)
        if kind is Kind.READ:
            return await self.relay(request, route)
        if kind is Kind.SHARED_MEMORY:
            return self.shared_memory(route)
        self._check_admin(request)
        if kind is Kind.ADMIN_FIRST:
            return await self.relay(request, route)
        return await self.admin_all(request, route)

    # --- inference ------------------------------------------------------------------------
    async def _dispatch(self, request: Request, route: Route) -> Response | Stream:
        rt = self._rt()
        assert route.model is not None
        check_content_encoding(request.headers.get("Content-Encoding"))
        body = request.body
        # The server hands the body over decoded, so its encoding header must not go upstream.
        headers = _forward_headers(request.headers, rt.private_headers, "content-encoding")
        infer = route.kind is Kind.INFER
        header_length = request.headers.get(HEADER_LENGTH) if infer else None
        shapes = http_shapes(json_header(body, header_length)) if infer else []
        check_shapes(shapes, len(body))
        # The server's headers are case-insensitive already: no lower-cased copy is needed.
        params = read_params(body, header_length)
        timeout_header = request.headers.get(deadline.TIMEOUT_HEADER)
        call = Call(
            model=route.model,
            headers=request.headers,
            params=params,
            session_key=rt.session_key(request.headers),
            cost=cost_of(shapes),
            rows=rows_of(shapes),
            # Most requests carry no deadline: no clock read then.
            deadline=None
            if params.timeout_us is None and timeout_header is None
            else deadline.client_deadline(
                rt.clock.now(),
                timeout_us=params.timeout_us,
                header_s=deadline.parse_timeout_ms(timeout_header),
            ),
        )
        stream = route.kind is Kind.GENERATE_STREAM

        async def send(instance: Instance, forward: Forward) -> Response | Stream:
            # Sent, Triton runs it to its end whatever the client does (server issue #7077):
            # so does the proxy, holding its slot (Dispatcher.run's holds_on_leave).
            request.hold_on_leave = not stream
            data, hdrs = body, headers
            # Triton's generate extension has no request priority or timeout (such keys there
            # are only custom parameters): its class order is the proxy's queue alone.
            values = forward.parameters()
            if values and infer:
                data, length = with_parameters(body, header_length, values)
                if length is not None:
                    hdrs = headers.copy()
                    hdrs[HEADER_LENGTH] = length
            return await self._exchange(
                instance, request, route.upstream_path, data, hdrs, stream=stream, dispatched=True
            )

        return await rt.dispatcher.run(
            call,
            send,
            stream=stream,
            # A client that left once its request was sent is counted as cancelled, as one that
            # left before.
            outcome=lambda r: "cancelled" if request.client_left else str(r.status),
            # Triton's HTTP frontend does not notice a closed connection (#7077): once sent,
            # the request holds its slot and token until Triton answers.
            upstream_cancels=stream,
            holds_on_leave=not stream,
            deliver=request.answer_now,
        )

    def _exchange(
        self,
        instance: Instance,
        request: Request,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        *,
        stream: bool = False,
        dispatched: bool = False,
    ) -> Awaitable[Response | Stream]:
        """Send one request for ``path`` (built by the route table) to ``instance`` and relay
        its answer to the client.

        ``dispatched``: an inference request, whose "unknown model" answer from this one
        instance raises :class:`ModelAbsentError` (the dispatcher may go elsewhere).

        Not a coroutine: it hands back the exchange to await, one coroutine layer less per
        request (session 17).
        """
        rt = self._rt()
        pool = None if stream else rt.upstreams.http1(instance)
        if pool is not None:
            return self._exchange_http1(
                instance, pool, request.method, path, body, headers, dispatched=dispatched
            )
        return self._exchange_aiohttp(
            instance, request, path, body, headers, stream=stream, dispatched=dispatched
        )

    async def _exchange_aiohttp(
        self,
        instance: Instance,
        request: Request,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        *,
        stream: bool,
        dispatched: bool,
    ) -> Response | Stream:
        """A request through aiohttp's client: streamed answers, ``https://`` instances."""
        rt = self._rt()
        with rt.upstreams.using(instance) as session:
            try:
                upstream = await session.request(
                    request.method, path, data=body or None, headers=headers
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
        request: Request,
        upstream: aiohttp.ClientResponse,
        *,
        stream: bool,
        dispatched: bool,
    ) -> Response | Stream:
        if upstream.status >= 500:
            self._rt().health.check_soon(instance)
        out_headers = _forward_headers(upstream.headers)
        if not stream or upstream.status >= 400:
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise http_failure(exc, before_response=False) from exc
            answer = Response(upstream.status, data, out_headers.items())
            if dispatched:
                _raise_if_absent(upstream.status, data, answer)
            return answer
        response = request.start_stream(upstream.status, out_headers.items())
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
        await response.end()
        return response

    async def _exchange_http1(
        self,
        instance: Instance,
        pool: Http1Pool,
        method: str,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        *,
        dispatched: bool,
    ) -> Response:
        """A non-streaming exchange through the lean HTTP/1.1 pool (proxy.fleet.http1); the
        same answers and failures as :meth:`_relay_answer` gives for aiohttp's client."""
        rt = self._rt()
        timeout = rt.upstreams.request_timeout_s
        try:
            answer = await pool.request(method, path, list(headers.items()), body, timeout)
        except TimeoutError as exc:
            raise UpstreamTimeoutError(f"no answer within {timeout:g} s") from exc
        if answer.status >= 500:
            rt.health.check_soon(instance)
        out = [(k, v) for k, v in answer.headers if k.lower() not in HOP_BY_HOP]
        response = Response(answer.status, answer.body, out)
        if dispatched:
            _raise_if_absent(answer.status, answer.body, response)
        return response

    # --- everything else ------------------------------------------------------------------
    async def relay(self, request: Request, route: Route) -> Response | Stream:
        """Metadata, config, statistics...: any ready instance answers as Triton would."""
        rt = self._rt()
        body = request.body if request.method == "POST" else b""
        headers = _forward_headers(request.headers, rt.private_headers)
        return await rt.dispatcher.any_ready(
            lambda instance: self._exchange(instance, request, route.upstream_path, body, headers)
        )

    def shared_memory(self, route: Route) -> Response:
        kind: SharedMemoryKind = "cuda" if route.shm_kind == "cuda" else "system"
        action = _SHARED_MEMORY_ACTIONS[route.shm_action]
        shared_memory_call(kind, action, route.shm_region)
        # What Triton answers with no region registered.
        return Response(200, b"[]", _JSON) if action == "status" else Response(200)

    def _check_admin(self, request: Request) -> None:
        check_admin(self._rt().config.admin, request.headers.get("Authorization"))

    async def admin_all(self, request: Request, route: Route) -> Response:
        """Load/unload/settings go to every instance; the first failure is returned. With
        several workers, only the leader fans out (:mod:`proxy.frontends.admin_relay`)."""
        rt = self._rt()
        body = request.body
        headers = list(_forward_headers(request.headers, rt.private_headers).items())
        if rt.admin_leader is not None:
            rt.telemetry.model_control_calls.labels("http", "relayed_to_leader").inc()
            fan_out = rt.admin_leader.http
        else:
            fan_out = self.fan_out
        status, data = await fan_out(request.method, route.upstream_path, headers, body)
        return Response(status, data, _JSON)

    async def fan_out(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> tuple[int, bytes]:
        """Send one model-control call to every instance: the first failure, or the first
        instance's answer."""
        rt = self._rt()
        rt.telemetry.model_control_calls.labels("http", "fanned_out").inc()

        async def one(instance: Instance) -> tuple[int, bytes]:
            session = rt.upstreams.session(instance)
            try:
                async with session.request(
                    method, path, data=body or None, headers=list(headers)
                ) as resp:
                    status, data = resp.status, await resp.read()
            except aiohttp.ClientError as exc:
                raise InstanceFailure(503, f"{instance.name}: {exc}") from exc
            if status >= 400:
                message = json.loads(data).get("error", "") if data.startswith(b"{") else ""
                raise InstanceFailure(status, message, raw=data)
            return status, data

        fan = await to_every_instance(rt.fleet.all(), one)
        failed = fan.failure()
        if failed is None:
            return fan.answers[0][1]
        first, message = failed
        data = first.raw if fan.total == 1 and first.raw is not None else error_body(message)
        return first.code, data
