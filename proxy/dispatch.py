"""The one path every request takes from frontend to instance, whatever its protocol.

placement (sequence affinity, else the routing policy) → in-flight token → send → outcome.
A request that failed before any byte reached an instance is retried once elsewhere, under the
retry budget; frontends supply only ``send``, the protocol-specific forwarding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from proxy.errors import Code, ProxyError
from proxy.fleet.affinity import SequenceAffinity
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import UpstreamConnectError, UpstreamLostError
from proxy.frontends.kserve_http import NO_PARAMS, InferParams
from proxy.routing.base import RouteRequest

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """What a frontend learned about one request: enough to place it, nothing more."""

    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    """Request headers or gRPC metadata, keys lower-case."""
    params: InferParams = NO_PARAMS
    session_key: str | None = None
    cost: float = 1.0


class Placement(Protocol):
    def pick(self, request: RouteRequest, exclude: frozenset[str]) -> Instance | None:
        """The instance for ``request`` among healthy ones not in ``exclude``; None if none."""
        ...


class RetryGate(Protocol):
    def record_request(self) -> None: ...

    def try_retry(self) -> bool: ...


class Dispatcher:
    def __init__(
        self,
        fleet: Fleet,
        placement: Placement,
        affinity: SequenceAffinity,
        retries: RetryGate,
        *,
        retry_attempts: int = 1,
    ) -> None:
        self.fleet = fleet
        self.placement = placement
        self.affinity = affinity
        self.retries = retries
        self.retry_attempts = retry_attempts

    async def run(
        self, call: Call, send: Callable[[Instance], Awaitable[T]], *, stream: bool = False
    ) -> T:
        tried: set[str] = set()
        self.retries.record_request()
        while True:
            instance = self._place(call, frozenset(tried))
            try:
                with self.fleet.track(instance, call.model, stream=stream):
                    result = await send(instance)
            except UpstreamLostError as exc:
                self.fleet.report_failure(instance, f"connection lost: {exc}")
                raise ProxyError(
                    Code.UNAVAILABLE,
                    f"connection to Triton instance '{instance.name}' was lost while it "
                    f"handled the request ({exc})",
                ) from exc
            except UpstreamConnectError as exc:
                self.fleet.report_failure(instance, f"connection failed: {exc}")
                self.affinity.forget_instance(instance.name)
                tried.add(instance.name)
                if self._continues_sequence(call):
                    raise ProxyError(
                        Code.UNAVAILABLE,
                        f"instance '{instance.name}' holding sequence "
                        f"{call.params.sequence_id} of model '{call.model}' is unavailable",
                    ) from exc
                if len(tried) > self.retry_attempts or not self.retries.try_retry():
                    raise ProxyError(
                        Code.UNAVAILABLE,
                        f"Triton instance '{instance.name}' is unreachable ({exc}); no retry left",
                    ) from exc
                continue
            self._after(call, instance)
            return result

    def _continues_sequence(self, call: Call) -> bool:
        return call.params.sequence_id is not None and not call.params.sequence_start

    def _place(self, call: Call, exclude: frozenset[str]) -> Instance:
        seq = call.params.sequence_id
        if seq is not None and not call.params.sequence_start:
            name = self.affinity.lookup(call.model, seq)
            if name is not None:
                instance = self.fleet.get(name)
                if instance.healthy:
                    return instance
        request = RouteRequest(model=call.model, session_key=call.session_key, cost=call.cost)
        instance = self.placement.pick(request, exclude)
        if instance is None:
            down = ", ".join(
                f"{i.name}: {i.ejected_reason or 'not ready'}"
                for i in self.fleet.all()
                if not i.healthy
            )
            raise ProxyError(
                Code.UNAVAILABLE,
                f"no ready Triton instance for model '{call.model}'"
                + (f" (ejected: {down})" if down else ""),
            )
        if seq is not None:
            # Bound before the send: the sequence's next request may be sent before this
            # one answers.
            self.affinity.bind(call.model, seq, instance.name)
        return instance

    def _after(self, call: Call, instance: Instance) -> None:
        seq = call.params.sequence_id
        if seq is not None and call.params.sequence_end:
            self.affinity.end(call.model, seq)
