"""The one path every request takes from frontend to instance, whatever its protocol.

admission (class queue, when scheduling is on) → placement (sequence affinity, else the routing
policy) → in-flight token → send → outcome. A request that failed before any byte reached an
instance is retried elsewhere, under the retry budget; frontends supply only ``send``, the
protocol-specific forwarding, which receives the instance and the parameters to set (the class's
Triton priority, the rest of the client's deadline as Triton's ``timeout``). A request whose client
deadline has passed is shed before dispatch and cancelled in flight (:mod:`.scheduling.deadline`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from proxy.errors import Code, ProxyError
from proxy.fleet.affinity import SequenceAffinity
from proxy.fleet.catalog import ModelCatalog, ModelInfo
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import UpstreamConnectError, UpstreamLostError
from proxy.request import Call, Forward, InferParams
from proxy.routing.base import RouteRequest
from proxy.scheduling import Classifier, Shed, ShedReason, deadline

if TYPE_CHECKING:
    from proxy.scheduling.models import ModelGates
    from proxy.telemetry import Telemetry

T = TypeVar("T")
OTHER_MODEL = "other"
"""Metric label of requests for models no instance knows."""
Send = Callable[[Instance, Forward], Awaitable[T]]
"""Forward the request to the instance, setting the parameters that ``Forward`` gives."""


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
        catalog: ModelCatalog,
        telemetry: Telemetry,
        *,
        admission: ModelGates | None = None,
        classifier: Classifier | None = None,
        max_retries: int = 1,
        cancel_upstream: bool = True,
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
        self.cancel_upstream = cancel_upstream

    def reconfigure(
        self,
        *,
        admission: ModelGates | None,
        classifier: Classifier | None,
        retries: RetryGate,
        max_retries: int,
    ) -> None:
        """Adopt a reloaded policy's admission, classes and retry rules (one swap each)."""
        self.admission = admission
        self.classifier = classifier
        self.retries = retries
        self.max_retries = max_retries

    def classify(self, call: Call) -> str:
        return self.classifier.classify(call.headers) if self.classifier else "default"

    async def run(
        self,
        call: Call,
        send: Send[T],
        *,
        stream: bool = False,
        outcome: Callable[[T], str] = lambda _: "ok",
    ) -> T:
        klass = self.classify(call)
        began = time.perf_counter()
        # Until the model is known, its metric label is "other": a client inventing names
        # must not create label values (or routing state, or gates).
        model_label = OTHER_MODEL
        instance_name = "-"
        result_label = "error"
        try:
            info = await self.catalog.info(call.model)
            if info is None:
                raise ProxyError(
                    Code.NOT_FOUND, f"Request for unknown model: '{call.model}' is not found"
                )
            model_label = call.model
            seq = call.params.sequence_id
            if seq is not None:
                problem = info.sequence_id_problem(seq)
                if problem is not None:
                    raise ProxyError(
                        Code.INVALID_ARG,
                        f"inference request for sequence {seq!r} to model '{call.model}' "
                        f"refused by triton-proxy: {problem}",
                    )
            instance, result = await self._serve(call, info, klass, send, stream)
            instance_name = instance.name
            result_label = outcome(result)
            return result
        except Shed as shed:
            result_label = f"shed_{shed.reason.value}"
            raise _shed_error(call.model, shed) from shed
        except ProxyError as exc:
            result_label = exc.code.name.lower()
            raise
        except asyncio.CancelledError:
            result_label = "cancelled"  # the client left
            raise
        finally:
            self.telemetry.requests.labels(model_label, klass, instance_name, result_label).inc()
            self.telemetry.latency.labels(model_label, klass).observe(time.perf_counter() - began)

    async def _serve(
        self, call: Call, info: ModelInfo, klass: str, send: Send[T], stream: bool
    ) -> tuple[Instance, T]:
        """Admission and sending, within the client's deadline (docs/cancellation.md)."""
        if not self.cancel_upstream:
            # As behind a proxy that ignores deadlines and departures: everything runs.
            plain = dataclasses.replace(call, deadline=None)
            return await deadline.detached(self._admit_and_send(plain, info, klass, send, stream))
        deadline.check(call.deadline, self.fleet.clock.now(), call.model)
        work = self._admit_and_send(call, info, klass, send, stream)
        if stream:
            # A stream's answer has begun once it is sent: its deadline is checked before
            # dispatch only (a gRPC stream's upstream call carries the client's deadline).
            return await work
        return await deadline.before(call.deadline, self.fleet.clock, call.model, work)

    async def _admit_and_send(
        self, call: Call, info: ModelInfo, klass: str, send: Send[T], stream: bool
    ) -> tuple[Instance, T]:
        if self.admission is None:
            return await self._send(call, info, None, send, stream)
        async with self.admission.admit(call.model, info, klass) as priority:
            # At the head of its class queue: a request whose deadline passed goes no further.
            deadline.check(call.deadline, self.fleet.clock.now(), call.model)
            return await self._send(call, info, priority, send, stream)

    def _forward(self, call: Call, info: ModelInfo, priority: int | None) -> Forward:
        """The parameters to set upstream: the class's priority, and what is left of the
        client's deadline as Triton's ``timeout`` where the model's queue policy honours it."""
        timeout_us = None
        if call.deadline is not None:
            level = priority if priority is not None else call.params.priority
            if info.honours_timeout(level):
                timeout_us = deadline.Budget(call.deadline, True).triton_timeout_us(
                    self.fleet.clock.now()
                )
        return Forward(priority, timeout_us)

    async def _send(
        self, call: Call, info: ModelInfo, priority: int | None, send: Send[T], stream: bool
    ) -> tuple[Instance, T]:
        tried: set[str] = set()
        self.retries.record_request()
        while True:
            instance = self._place(call, frozenset(tried))
            try:
                with self.fleet.track(instance, call.model, stream=stream):
                    result = await send(instance, self._forward(call, info, priority))
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

    def _place(self, call: Call, exclude: frozenset[str]) -> Instance:
        seq = call.params.sequence_id
        if seq is not None and not call.params.sequence_start:
            name = self.affinity.lookup(call.model, seq)
            if name is not None:
                instance = self.fleet.get(name)
                if instance.healthy:
                    return instance
        request = RouteRequest(model=call.model, session_key=call.session_key, cost=call.cost)
        picked = self.placement.pick(request, exclude)
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
