"""One pooled gRPC channel per Triton instance; messages pass through as bytes.

Calls are generic (no serializers): the client's message bytes go upstream untouched and the
server's bytes come back untouched. Errors are classified so the dispatcher can tell a request
that never left (retry elsewhere) from one lost on the way (report, do not retry); every other
status is Triton's own answer and is relayed as it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from proxy.errors import Code, ProxyError
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import (
    RETIRE_MAX_S,
    UpstreamConnectError,
    UpstreamLostError,
    UpstreamTimeoutError,
)

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str | bytes]]

# gRPC reports both "could not connect" and "connection broke" as UNAVAILABLE; only the text
# tells them apart from each other and from UNAVAILABLE that Triton itself answered
# ("Exceeds maximum queue size"...). A connect failure means no byte of the call was sent.
_CONNECT_FAILURE = "failed to connect to all addresses"
_TRANSPORT_FAILURES = (
    "Socket closed",
    "Stream removed",
    "Connection reset",
    "Broken pipe",
    "GOAWAY received",
    "keepalive watchdog timeout",
    "Connection timed out",
)


def upstream_error(exc: grpc.aio.AioRpcError) -> UpstreamConnectError | UpstreamLostError | None:
    """The transport failure behind ``exc``, or None when it is the server's own status."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = exc.details() or ""
    if details.startswith(_CONNECT_FAILURE):
        return UpstreamConnectError(details, refused="Connection refused" in details)
    if any(marker in details for marker in _TRANSPORT_FAILURES):
        # A unary answer arrives whole, so no byte of it had arrived; a stream's caller knows
        # better and says so itself.
        return UpstreamLostError(details, before_response=True)
    return None


def classified(exc: grpc.aio.AioRpcError, ours: bool) -> Exception:
    """What a failed upstream call raises: ``UpstreamTimeoutError`` when the deadline that
    passed was the proxy's own (``ours``), the transport failure behind ``exc``, or ``exc``
    itself (Triton's status, relayed)."""
    if ours and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeoutError(exc.details() or "deadline exceeded")
    return upstream_error(exc) or exc


def grpc_target(instance: Instance) -> str:
    """The instance's gRPC address; a proxy error if the policy gives it none."""
    target = instance.spec.grpc
    if target is None:
        raise ProxyError(
            Code.UNAVAILABLE,
            f"Triton instance '{instance.name}' has no gRPC address "
            "(instances[].grpc in the policy file)",
        )
    return target


def effective_timeout(client_remaining: float | None, limit: float | None) -> float | None:
    """The upstream call's timeout: the client's deadline, capped by the proxy's own limit."""
    if client_remaining is None:
        return limit
    if limit is None:
        return max(client_remaining, 0.0)
    return max(min(client_remaining, limit), 0.0)


class GrpcUpstreams:
    """Keeps one ``grpc.aio`` channel (one HTTP/2 connection, multiplexed) per instance."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        max_send_bytes: int,
        connect_timeout_s: float,
        request_timeout_s: float | None,
        reconnect_backoff_max_s: float = 1.0,
    ) -> None:
        self.fleet = fleet
        self.request_timeout_s = request_timeout_s
        self._options: list[tuple[str, int]] = [
            ("grpc.max_send_message_length", max_send_bytes),
            # Responses are bounded by Triton, not by the proxy (as over HTTP).
            ("grpc.max_receive_message_length", -1),
            # gRPC's name for the time one connection attempt may take.
            ("grpc.min_reconnect_backoff_ms", int(connect_timeout_s * 1000)),
            # gRPC's default backoff grows to 120 s: a restarted instance, found ready again by
            # the health checker, would keep refusing calls for that long.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(reconnect_backoff_max_s * 1000)),
        ]
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}
        """instance name -> (target, channel)"""
        self._unary: dict[
            tuple[str, str], tuple[grpc.aio.Channel, grpc.aio.UnaryUnaryMultiCallable]
        ] = {}
        """(instance name, method) -> (channel, its multi-callable): built once, not per call"""
        self._replaced: list[grpc.aio.Channel] = []
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    def channel(self, instance: Instance) -> grpc.aio.Channel:
        target = grpc_target(instance)
        entry = self._channels.get(instance.name)
        if entry is not None and entry[0] == target:
            return entry[1]
        if entry is not None:
            # The address changed on reload: the old channel closes at the next retire().
            self._replaced.append(entry[1])
        ch = grpc.aio.insecure_channel(target, options=self._options)
        self._channels[instance.name] = (target, ch)
        return ch

    async def unary(
        self,
        instance: Instance,
        method: str,
        request: bytes,
        metadata: Metadata,
        client_remaining: float | None,
    ) -> bytes:
        """One unary call; raises Upstream{Connect,Lost,Timeout}Error or Triton's
        ``AioRpcError``."""
        timeout = effective_timeout(client_remaining, self.request_timeout_s)
        ours = timeout is not None and timeout != client_remaining
        channel = self.channel(instance)
        cached = self._unary.get((instance.name, method))
        if cached is None or cached[0] is not channel:
            cached = self._unary[(instance.name, method)] = (channel, channel.unary_unary(method))
        call = cached[1](request, metadata=metadata, timeout=timeout)
        try:
            response: bytes = await call
        except asyncio.CancelledError:
            # The client went away: the instance should stop working on it too.
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            failure = classified(exc, ours)
            if failure is exc:
                raise
            raise failure from exc
        return response

    def stream(
        self,
        instance: Instance,
        method: str,
        metadata: Metadata,
        client_remaining: float | None,
    ) -> grpc.aio.StreamStreamCall:
        """Open a bidirectional call; the caller writes, reads and cancels it.

        Only the client's deadline applies: a stream may stay open for as long as its client
        wants (it holds no dispatch slot while idle).
        """
        return self.channel(instance).stream_stream(method)(
            metadata=metadata, timeout=effective_timeout(client_remaining, None)
        )

    async def retire(self, keep: set[str]) -> None:
        """Retire the channels of instances no longer in the fleet (or whose address
        changed): they take no new call and close when their calls have finished."""
        for name, (target, ch) in list(self._channels.items()):
            inst = self.fleet.instances.get(name)
            if name not in keep or inst is None or target != inst.spec.grpc:
                del self._channels[name]
                self._replaced.append(ch)
        self._unary = {k: v for k, v in self._unary.items() if k[0] in self._channels}
        replaced, self._replaced = self._replaced, []
        for ch in replaced:
            task = asyncio.get_running_loop().create_task(
                ch.close(grace=RETIRE_MAX_S), name="upstream-channel-retire"
            )
            self._retiring[task] = ch
            task.add_done_callback(lambda t: self._retiring.pop(t, None))

    def retiring(self) -> int:
        """Retired channels still waiting for their calls to finish."""
        return len(self._retiring)

    async def close(self) -> None:
        """Close every channel now (shutdown, after the drain)."""
        retiring = dict(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        channels = [ch for _, ch in self._channels.values()] + self._replaced
        channels += retiring.values()
        self._channels.clear()
        self._replaced = []
        for ch in channels:
            await ch.close()
