"""The one path every request takes from frontend to instance, whatever its protocol.

admission (class queue, when scheduling is on) → placement (sequence affinity, else the routing
policy) → in-flight token → send → outcome. A request that failed before any byte reached an
instance is retried elsewhere, under the retry budget; frontends supply only ``send``, the
protocol-specific forwarding, which receives the instance and the Triton priority to set.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from proxy.canary import CANARY, MAIN, Splitter
from proxy.errors import Code, ProxyError
from proxy.fleet.affinity import SequenceAffinity
from proxy.fleet.catalog import ModelCatalog
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import UpstreamConnectError, UpstreamLostError
from proxy.frontends.kserve_http import NO_PARAMS, InferParams
from proxy.routing.base import RouteRequest
from proxy.scheduling import Classifier, Shed, ShedReason

if TYPE_CHECKING:
    from proxy.scheduling.models import ModelGates
    from proxy.telemetry import Telemetry

T = TypeVar("T")
Send = Callable[[Instance, int | None], Awaitable[T]]
"""Forward the request to the instance, setting this Triton priority when not None."""


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


@dataclass(frozen=True)
class Arm:
    """What serves a request in one arm of a canary rollout: its routing and its classes."""

    name: str
    placement: Placement
    admission: ModelGates | None
    classifier: Classifier | None


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
        catalog: ModelCatalog,
        telemetry: Telemetry,
        *,
        admission: ModelGates | None = None,
        classifier: Classifier | None = None,
        max_retries: int = 1,
    ) -> None:
        self.fleet = fleet
        self.placement = placement
        self.affinity = affinity
        self.retries = retries
        self.catalog = catalog
        self.telemetry = telemetry
        self.admission = admission
        self.classifier = classifier
        self.max_retries = max_retries
        self.canary: Arm | None = None
        """The canary arm; the attributes above are the main arm's."""
        self.splitter: Splitter | None = None

    def arm_for(self, call: Call) -> Arm:
        if (
            self.canary is not None
            and self.splitter is not None
            and self.splitter.arm(call.session_key) == CANARY
        ):
            return self.canary
        return Arm(MAIN, self.placement, self.admission, self.classifier)

    @staticmethod
    def classify(arm: Arm, call: Call) -> str:
        return arm.classifier.classify(call.headers) if arm.classifier else "default"

    async def run(
        self,
        call: Call,
        send: Send[T],
        *,
        stream: bool = False,
        outcome: Callable[[T], str] = lambda _: "ok",
    ) -> T:
        arm = self.arm_for(call)
        klass = self.classify(arm, call)
        began = time.perf_counter()
        instance_name = "-"
        result_label = "error"
        try:
            seq = call.params.sequence_id
            info = None
            if arm.admission is not None or isinstance(seq, str):
                info = await self.catalog.info(call.model)
            if info is not None and seq is not None:
                problem = info.sequence_id_problem(seq)
                if problem is not None:
                    raise ProxyError(
                        Code.INVALID_ARG,
                        f"inference request for sequence {seq!r} to model '{call.model}' "
                        f"refused by triton-proxy: {problem}",
                    )
            if arm.admission is None or info is None:
                # Without classes, or for a model no ready instance knows (Triton answers).
                instance, result = await self._send(call, arm, None, send, stream)
            else:
                async with arm.admission.admit(call.model, info, klass) as priority:
                    instance, result = await self._send(call, arm, priority, send, stream)
            instance_name = instance.name
            result_label = outcome(result)
            return result
        except Shed as shed:
            result_label = f"shed_{shed.reason.value}"
            raise _shed_error(call.model, shed) from shed
        except ProxyError as exc:
            result_label = exc.code.name.lower()
            raise
        finally:
            elapsed = time.perf_counter() - began
            t = self.telemetry
            t.requests.labels(call.model, klass, instance_name, result_label, arm.name).inc()
            t.latency.labels(call.model, klass, arm.name).observe(elapsed)
            slo = arm.classifier.slo_s(klass) if arm.classifier is not None else None
            if slo is not None:
                met = elapsed <= slo and not result_label.startswith("shed_")
                t.slo.labels(call.model, klass, "met" if met else "missed", arm.name).inc()

    async def _send(
        self, call: Call, arm: Arm, priority: int | None, send: Send[T], stream: bool
    ) -> tuple[Instance, T]:
        tried: set[str] = set()
        self.retries.record_request()
        while True:
            instance = self._place(call, arm.placement, frozenset(tried))
            try:
                with self.fleet.track(instance, call.model, stream=stream):
                    result = await send(instance, priority)
            except UpstreamLostError as exc:
                self._failed(instance, f"connection lost: {exc}")
                raise ProxyError(
                    Code.UNAVAILABLE,
                    f"connection to Triton instance '{instance.name}' was lost while it "
                    f"handled the request ({exc})",
                ) from exc
            except UpstreamConnectError as exc:
                self._failed(instance, f"connection failed: {exc}")
                tried.add(instance.name)
                if self._continues_sequence(call):
                    raise ProxyError(
                        Code.UNAVAILABLE,
                        f"instance '{instance.name}' holding sequence "
                        f"{call.params.sequence_id} of model '{call.model}' is unavailable",
                    ) from exc
                if len(tried) > self.max_retries or not self.retries.try_retry():
                    raise ProxyError(
                        Code.UNAVAILABLE,
                        f"Triton instance '{instance.name}' is unreachable ({exc}); no retry left",
                    ) from exc
                self.telemetry.retries.inc()
                continue
            instance.last_answer_at = self.fleet.clock.now()
            seq = call.params.sequence_id
            if seq is not None and call.params.sequence_end:
                self.affinity.end(call.model, seq)
            return instance, result

    async def any_ready(self, send: Callable[[Instance], Awaitable[T]]) -> T:
        """Read-only calls (metadata, config, statistics): the first ready instance that
        answers. Such calls may go to the next instance when a connection fails or breaks."""
        last: Exception | None = None
        for instance in self.fleet.healthy():
            try:
                return await send(instance)
            except (UpstreamConnectError, UpstreamLostError) as exc:
                what = "lost" if isinstance(exc, UpstreamLostError) else "failed"
                self._failed(instance, f"connection {what}: {exc}")
                last = exc
        raise ProxyError(
            Code.UNAVAILABLE,
            "no ready Triton instance" + (f" (last error: {last})" if last else ""),
        )

    def note_sequence(self, model: str, params: InferParams, instance: Instance) -> None:
        """A request of a stream already placed on ``instance``: keep its sequence there."""
        seq = params.sequence_id
        if seq is None:
            return
        if params.sequence_end:
            self.affinity.end(model, seq)
        else:
            self.affinity.bind(model, seq, instance.name)

    def _failed(self, instance: Instance, reason: str) -> None:
        self.fleet.report_failure(instance, reason)
        self.affinity.forget_instance(instance.name)

    def _continues_sequence(self, call: Call) -> bool:
        return call.params.sequence_id is not None and not call.params.sequence_start

    def _place(self, call: Call, placement: Placement, exclude: frozenset[str]) -> Instance:
        seq = call.params.sequence_id
        if seq is not None and not call.params.sequence_start:
            name = self.affinity.lookup(call.model, seq)
            if name is not None:
                instance = self.fleet.get(name)
                if instance.healthy:
                    return instance
        request = RouteRequest(model=call.model, session_key=call.session_key, cost=call.cost)
        picked = placement.pick(request, exclude)
        if picked is None:
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
        instance = picked
        if seq is not None:
            # Bound before the send: the sequence's next request may be sent before this
            # one answers.
            self.affinity.bind(call.model, seq, instance.name)
        return instance


def _shed_error(model: str, shed: Shed) -> ProxyError:
    if shed.reason is ShedReason.SHUTDOWN:
        return ProxyError(Code.UNAVAILABLE, "triton-proxy is shutting down")
    why = {
        ShedReason.QUEUE_FULL: "its class queue is full",
        ShedReason.OVERLOAD: "the proxy is overloaded and sheds the lowest classes first",
        ShedReason.TIMEOUT: "it waited longer than its class's queue_timeout_s",
    }.get(shed.reason, shed.reason.value)
    return ProxyError(
        Code.RESOURCE_EXHAUSTED,
        f"request for model '{model}' of class '{shed.class_name}' was shed: {why}; "
        f"retry after {shed.retry_after_s:g} s",
        retry_after_s=shed.retry_after_s,
    )
