"""The one path every request takes from frontend to instance, whatever its protocol.

admission (class queue, when scheduling is on) → placement (sequence affinity, else the routing
policy) → in-flight token → send → outcome. Frontends supply only ``send``, the
protocol-specific forwarding, which receives the instance and the parameters to set (the class's
Triton priority, the rest of the client's deadline as Triton's ``timeout``). A request whose
client deadline has passed is shed before dispatch and cancelled in flight
(:mod:`proxy.scheduling.deadline`, docs/cancellation.md).

Retried elsewhere, under the retry budget and ``max_retries``: a request that never reached its
instance (refused, connect timeout); a stateless request (no sequence, model not decoupled)
whose connection broke before any byte of the answer; a request the instance answered with
"unknown model" for a model other instances serve (the model is then out of rotation on that
instance until a probe finds it ready). A read timeout is answered 504 / DEADLINE_EXCEEDED and
only asks for an early probe: one slow answer does not eject an instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from proxy.canary import CANARY, MAIN, Splitter
from proxy.errors import Code, ProxyError
from proxy.fleet.affinity import SequenceAffinity
from proxy.fleet.catalog import ModelCatalog, ModelInfo
from proxy.fleet.instances import Fleet, Instance, Resend, Work
from proxy.fleet.upstream import UpstreamConnectError, UpstreamLostError, UpstreamTimeoutError
from proxy.observer import RequestObserver, RequestRecord
from proxy.request import Call, Forward, InferParams
from proxy.routing.base import RouteRequest
from proxy.routing.batcher import BatcherModel
from proxy.routing.occupancy import NO_FILL, FillRule
from proxy.routing.wake import EXPIRED_US
from proxy.scheduling import Classifier, Shed, ShedReason, deadline
from proxy.scheduling.cost import BatchTimes, CostModel
from proxy.scheduling.overload import OverloadGuard

if TYPE_CHECKING:
    from proxy.scheduling.models import ModelGates
    from proxy.telemetry import Telemetry

T = TypeVar("T")
OTHER_MODEL = "other"
"""Metric label of requests for models no instance knows."""
Send = Callable[[Instance, Forward], Awaitable[T]]
"""Forward the request to the instance, setting the parameters that ``Forward`` gives."""


class ModelAbsentError(Exception):
    """The instance answered that the model is unknown or not ready there.

    ``answer`` is what the client gets if the request cannot go elsewhere: the frontend's
    relayed response, or an exception to raise (Triton's own gRPC status).
    """

    def __init__(self, message: str, answer: object) -> None:
        super().__init__(message)
        self.answer = answer


_MODEL_ABSENT = re.compile(
    r"Request for unknown model: '[^']*' (?:has no available versions|is not found|is not ready)"
    r"|Stub process '[^']*' is not healthy\.?"
)
"""Triton's words for "this model is not here" (2.51: 404 / NOT_FOUND "Request for unknown
model: 'm' has no available versions" after an unload). "... 'm' version 7 is not found" is
about a version the client asked for, not about the model, and does not match. Also a model
whose Python backend stub died (500 / INTERNAL "Stub process 'm_0_0' is not healthy."):
Triton still reports it ready and fails every request, so it is routed elsewhere like an
absent one (seen after SIGSTOP and SIGCONT of a server, session 8; the request did not run)."""


def says_model_absent(message: str) -> bool:
    """Whether Triton's error ``message`` (its text, or its HTTP error body
    ``{"error": ...}``) is, whole, one of the answers above. Whole: an error that merely
    quotes such words (an input name a client chose, echoed back) takes nothing out of
    rotation."""
    if message.startswith("{"):
        try:
            doc = json.loads(message)
        except ValueError:
            return False
        error = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(error, str):
            return False
        message = error
    return _MODEL_ABSENT.fullmatch(message) is not None


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
    fill: FillRule = NO_FILL
    """When its uncapped classes' long work reads the fill (its routing section's keys)."""


# Not frozen, though nothing changes it once built: a frozen dataclass's ``__init__`` sets each
# field through ``object.__setattr__``, and one is built per request (with nine fields, 4.5
# against 1.3 µs to build, ``timeit``, session 17).
@dataclass(slots=True)
class Placing:
    """One request as placement sees it, how it counts in flight, and its arm's placement."""

    request: RouteRequest
    work: Work
    placement: Placement


class RetryGate(Protocol):
    def record_request(self) -> None: ...

    def try_retry(self) -> bool: ...


# Not frozen, though nothing changes it once built: a frozen dataclass's ``__init__`` sets each
# field through ``object.__setattr__``, and one is built per request (with nine fields, 4.5
# against 1.3 µs to build, ``timeit``, session 17).
@dataclasses.dataclass(slots=True)
class _Request(Generic[T]):
    """One request on its way through :meth:`Dispatcher.run`: the call, where it goes and how it
    is sent (``run``'s arguments: see there)."""

    call: Call
    arm: Arm
    info: ModelInfo | None
    klass: str
    send: Send[T]
    stream: bool
    admit: bool
    upstream_cancels: bool
    holds_on_leave: bool = False
    deliver: Callable[[T], None] | None = None

    def runs_to_end(self) -> bool:
        """Whether the caller's own task may await the sent request to its end: nothing but
        Triton's answer ends it once sent (see :func:`_once_sent`)."""
        return self.upstream_cancels or (self.holds_on_leave and self.call.deadline is None)


class _Trace:
    """What one request's dispatch learnt on the way, for its :class:`RequestRecord`."""

    __slots__ = ("alone", "inside_s", "lingering", "queue_wait_s")

    def __init__(self) -> None:
        self.queue_wait_s = 0.0
        self.alone = False
        self.lingering = False
        """Holding its slot after its client left, while Triton may still run it."""
        self.inside_s = 0.0
        """Time from sending to the instance to its answer."""


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
        request_timeout_s: float | None = None,
        on_lost: Callable[[Instance], None] = lambda _: None,
        costs: CostModel | None = None,
        observer: RequestObserver | None = None,
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
        self.request_timeout_s = request_timeout_s
        self.on_lost = on_lost
        """Called when a connection to an instance failed or broke (reset its pool)."""
        self.costs = costs if costs is not None else CostModel()
        """Per-model request costs and service-time curves, learned from this traffic."""
        self._batchers: dict[str, tuple[tuple[float, float], ModelInfo, BatcherModel]] = {}
        """model -> (the curve and config it was built from, its batcher model): ``_batcher``."""
        self._batch_times = BatchTimes()
        """Back-to-back batches per (instance, model), timed for ``costs``: one entry per
        instance and model served (models the catalog knows)."""
        self.observer = observer
        """Told once about every finished request (telemetry and controllers subscribe)."""
        self.cancel_upstream = cancel_upstream
        """``limits.cancel_upstream``: honour client deadlines and departures."""
        self.nudge = False
        """``routing.wake.nudge``: keep a way to resend one short request per instance."""
        self.expired_copy = False
        """``routing.wake.expired_copy``: resend it as an expired copy, long ones too."""
        self.real_copy = True
        """``routing.wake.real_copy``: where no expired copy can be sent, a copy that runs."""
        self.fill = NO_FILL
        """The main arm's fill rule (``routing.occupancy_depth``, ``routing.fill_from_load``)."""
        self.overload: OverloadGuard | None = None
        """``scheduling.overload``: refuses the least important classes at arrival while the
        proxy's own event loop lags (set by the runtime; every arm's classes)."""
        self.canary: Arm | None = None
        """The canary arm; the attributes above are the main arm's."""
        self.splitter: Splitter | None = None
        self._main = Arm(MAIN, placement, admission, classifier)

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

    def arm_for(self, call: Call) -> Arm:
        if (
            self.canary is not None
            and self.splitter is not None
            and self.splitter.arm(call.session_key) == CANARY
        ):
            return self.canary
        # The main arm is rebuilt only when one of its parts was replaced (a reload, a test):
        # a frozen dataclass per request was about 1 µs of each request's CPU.
        main = self._main
        if (
            main.placement is not self.placement
            or main.admission is not self.admission
            or main.classifier is not self.classifier
            or main.fill is not self.fill
        ):
            main = self._main = Arm(
                MAIN, self.placement, self.admission, self.classifier, self.fill
            )
        return main

    def classify(self, call: Call, arm: Arm | None = None) -> str:
        """The request's class in ``arm`` (the main arm when None)."""
        classifier = arm.classifier if arm is not None else self.classifier
        return classifier.classify(call.headers) if classifier else "default"

    async def run(
        self,
        call: Call,
        send: Send[T],
        *,
        stream: bool = False,
        admit: bool = True,
        outcome: Callable[[T], str] = lambda _: "ok",
        upstream_cancels: bool = True,
        holds_on_leave: bool = False,
        deliver: Callable[[T], None] | None = None,
    ) -> T:
        """Place and send one request. ``admit=False``: no class gate for the call itself
        (a gRPC stream, whose messages pass the gate one by one through :meth:`admitted`).
        ``upstream_cancels=False``: cancelling ``send`` does not stop the work in Triton (HTTP,
        server issue #7077), so a sent request keeps its slot and token until Triton answers.
        ``holds_on_leave``: the frontend no longer cancels this handler when its client leaves
        once ``send`` was called (the HTTP server's ``Request.hold_on_leave``), so a sent
        request without a client deadline can run to its end in the caller's task.
        ``deliver``: called with the answer the moment ``send`` returns it (an answer returned
        is final: nothing retries it), before the proxy's own accounting of the request, so
        the frontend can write it to its client first; the same answer is returned as usual
        afterwards. At concurrency 1 that accounting was 0.03-0.05 ms of each request's
        latency (docs/benchmarks.md, session 20). So the request's gate slot, in-flight token
        and byte-budget hold are released a moment after its client has the answer (in the
        same step of the event loop, unless the send runs in a task of its own)."""
        arm = self.arm_for(call)
        klass = self.classify(call, arm)
        began = time.perf_counter()
        # Until the model is known, its metric label is "other": a client inventing names
        # must not create label values (or routing state, or gates).
        model_label = OTHER_MODEL
        instance_name = "-"
        result_label = "error"
        trace = _Trace()
        try:
            info = await self.catalog.info(call.model)
            if info is None:
                if admit:
                    raise ProxyError(
                        Code.NOT_FOUND, f"Request for unknown model: '{call.model}' is not found"
                    )
                # A stream whose first message names an unknown model: Triton answers that
                # message in the stream, as it would without the proxy; placement keys its
                # state by "other", never by the invented name.
                call = dataclasses.replace(call, model=OTHER_MODEL)
            else:
                model_label = call.model
                guard = self.overload
                if guard is not None and admit and guard.refuses(klass):
                    self.telemetry.shed.labels(klass, ShedReason.BUSY.value).inc()
                    raise Shed(ShedReason.BUSY, guard.retry_after_s, klass)
                self.costs.observe_cost(call.model, call.cost)
            seq = call.params.sequence_id
            if seq is not None and info is not None:
                problem = info.sequence_id_problem(seq)
                if problem is not None:
                    raise ProxyError(
                        Code.INVALID_ARG,
                        f"inference request for sequence {seq!r} to model '{call.model}' "
                        f"refused by triton-proxy: {problem}",
                    )
            request = _Request(
                call,
                arm,
                info,
                klass,
                send,
                stream,
                admit,
                upstream_cancels,
                holds_on_leave,
                deliver,
            )
            instance, result = await self._serve(request, trace)
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
            if self.observer is not None:
                self.observer.on_request(
                    RequestRecord(
                        model=model_label,
                        class_name=klass,
                        instance=instance_name,
                        outcome=result_label,
                        latency_s=time.perf_counter() - began,
                        queue_wait_s=trace.queue_wait_s,
                        cost=call.cost,
                        ran_alone=trace.alone,
                        at=self.fleet.clock.now(),
                        arm=arm.name,
                        slo_s=arm.classifier.slo_s(klass) if arm.classifier is not None else None,
                    )
                )

    async def _serve(self, r: _Request[T], trace: _Trace) -> tuple[Instance, T]:
        """Admission and sending, within the client's deadline (docs/cancellation.md)."""
        call = r.call
        if not self.cancel_upstream:
            # As behind a proxy that ignores deadlines and departures: everything runs.
            plain = dataclasses.replace(
                r, call=dataclasses.replace(call, deadline=None), upstream_cancels=True
            )
            return await deadline.detached(self._admit_and_send(plain, trace))
        if call.deadline is None or r.stream:
            # A stream's answer has begun once it is sent: its deadline is checked before
            # dispatch only (a gRPC stream's upstream call carries the client's deadline).
            # Awaited here, not through deadline.before: each coroutine layer a request passes
            # through costs its creation and one call per resumption (session 17).
            if call.deadline is not None:
                deadline.check(call.deadline, self.fleet.clock.now(), call.model)
            return await self._admit_and_send(r, trace)
        deadline.check(call.deadline, self.fleet.clock.now(), call.model)
        work = self._admit_and_send(r, trace)
        return await deadline.before(call.deadline, self.fleet.clock, call.model, work)

    async def _admit_and_send(self, r: _Request[T], trace: _Trace) -> tuple[Instance, T]:
        call, admission = r.call, r.arm.admission
        if admission is None or not r.admit or r.info is None:
            sending = self._send(r, None, self._placing(r, None), trace)
            return await _once_sent(sending, r.runs_to_end())
        queued_at = time.perf_counter()
        # Entered here (a client that leaves while queued leaves the queue at once), released
        # by whoever finishes the send: ``release`` in a ``finally`` rather than an
        # ``AsyncExitStack`` handed over, which was eight Python calls per request more
        # (cProfile, session 17).
        admitted = admission.admit(call.model, r.info, r.klass, call.deadline)
        priority = await admitted.__aenter__()
        trace.queue_wait_s = time.perf_counter() - queued_at

        linger = r.upstream_cancels and not r.stream

        async def dispatched() -> tuple[Instance, T]:
            try:
                # At the head of its class queue: a request whose deadline passed goes no
                # further.
                if call.deadline is not None:
                    deadline.check(call.deadline, self.fleet.clock.now(), call.model)
                placing = self._placing(r, priority, admitted.depth, admitted.backlog)
                sent = await self._send(r, priority, placing, trace, linger=linger)
                batcher = placing.request.batcher
                if batcher is not None:
                    # What it took of the device: pays a floored class's debt.
                    admitted.served(batcher.share_s(call.rows, call.cost))
                return sent
            finally:
                admitted.release()

        if linger:
            return await deadline.apart(dispatched(), lambda: trace.lingering)
        return await _once_sent(dispatched(), r.runs_to_end())

    async def _linger(self, r: _Request[T], sent_at: float, trace: _Trace) -> None:
        """A gRPC request cancelled in flight leaves Triton's queue, but a batch Triton is
        running finishes unless the model polls ``is_cancelled()``. Releasing its slot at once
        let the gate send more work than its limit into a Triton still busy with it (measured:
        up to 31 % of Triton's time at 2x load went to abandoned requests over gRPC, as over
        HTTP before ``_once_sent``): hold slot and token for the rest of the class's mean time
        inside Triton. A request Triton dropped holds them that long for nothing: the cost of
        not knowing which."""
        gates = r.arm.admission
        if gates is None:
            return
        expected = gates.expected_inside_s(r.call.model, r.klass)
        rest = expected - (time.perf_counter() - sent_at)
        if rest > 0:
            trace.lingering = True  # from here on, its client leaving does not cut this short
            await asyncio.sleep(rest)

    def _forward(self, call: Call, info: ModelInfo | None, priority: int | None) -> Forward:
        """The parameters to set upstream: the class's priority, and what is left of the
        client's deadline as Triton's ``timeout`` where the model's queue policy honours it."""
        timeout_us = None
        if (
            call.deadline is not None
            and info is not None
            and info.honours_timeout(_level(call, priority))
        ):
            timeout_us = deadline.Budget(call.deadline, True).triton_timeout_us(
                self.fleet.clock.now()
            )
        return Forward(priority, timeout_us)

    def _resend(
        self, r: _Request[T], instance: Instance, forward: Forward, work: Work
    ) -> Resend | None:
        """How ``routing.wake.nudge`` may send this request to ``instance`` again: an
        expired copy where ``expired_copy`` is on and the model's queue policy honours a
        timeout (Triton rejects it unrun), else a real copy of a short request (where
        ``real_copy`` allows one); None for what must not run twice (streams, sequences,
        decoupled models) or long work."""
        call = r.call
        if r.stream or call.params.sequence_id is not None or r.info is None or r.info.decoupled:
            return None
        if self.expired_copy and r.info.honours_timeout(_level(call, forward.priority)):
            copy = Forward(forward.priority, EXPIRED_US)
            return Resend(functools.partial(r.send, instance, copy), expired=True)
        if work.long or not self.real_copy:
            return None
        return Resend(functools.partial(r.send, instance, forward), expired=False)

    def _placing(
        self, r: _Request[T], priority: int | None, depth: int | None = None, backlog: int = 0
    ) -> Placing:
        """What placement needs to know about the request, and how to count it in flight.
        ``depth``: the class's per-instance cap its gate slot was given under (else the
        class's ``max_per_instance``); ``backlog``: its class's requests still queued."""
        call, arm, klass = r.call, r.arm, r.klass
        batch = r.info.max_batch_size if r.info is not None else 1
        cap = depth
        if cap is None and arm.admission is not None:
            cls = arm.admission.config_for(call.model).classes.get(klass)
            cap = cls.max_per_instance if cls is not None else None
        long = cap is not None or self.costs.is_long(call.model, call.cost)
        level = priority or 0
        batcher = self._batcher(call.model, r.info)
        load = self.fleet.long_load
        if load is not None and long and cap is None and batcher is not None:
            # its share of full batches' device time (proxy.routing.occupancy.LongLoad)
            load.add(call.model, batcher.share_s(call.rows, call.cost))
        request = RouteRequest.fast(
            {
                "model": call.model,
                "session_key": call.session_key,
                "cost": call.cost,
                "class_name": klass,
                "level": level if priority is not None else None,
                "long": long,
                "class_cap": cap,
                "class_queued": backlog,
                "batch": max(1, batch),
                "occupancy": self.fleet.occupancy_for(call.model, cap is not None, arm.fill),
                "busy": self.fleet.occupancy.get(call.model),
                "free_of_long": self.fleet.long_free.get(call.model),
                "rows": call.rows,
                "batcher": batcher,
                "now": self.fleet.clock.now(),
            }
        )
        work = Work(class_name=klass, level=level, long=long, cost=call.cost, rows=call.rows)
        return Placing(request, work, arm.placement)

    def _batcher(self, model: str, info: ModelInfo | None) -> BatcherModel | None:
        """The model's batcher and learned cost curve for the replay of
        ``proxy.routing.batcher``; None without a dynamic batcher or before the curve is
        learned. Rebuilt only when the curve changes (``CostModel.curve`` returns the same
        tuple until the model's next timing)."""
        if info is None or info.max_queue_delay_s is None:
            return None
        curve = self.costs.curve(model)
        if curve is None:
            return None
        cached = self._batchers.get(model)
        if cached is not None and cached[0] is curve and cached[1] is info:
            return cached[2]
        delay = info.max_queue_delay_s
        batcher = BatcherModel(
            max_batch=max(1, info.max_batch_size),
            delay_s=delay,
            # The curve is fit on requests that ran alone: each waited the queue delay first.
            base_s=max(0.0, curve[0] - delay),
            per_unit_s=curve[1],
            default_level=info.default_priority_level,
        )
        self._batchers[model] = (curve, info, batcher)
        return batcher

    async def _send(
        self,
        r: _Request[T],
        priority: int | None,
        placing: Placing,
        trace: _Trace,
        *,
        linger: bool = False,
    ) -> tuple[Instance, T]:
        """Place and send, retrying elsewhere where that is safe. ``linger``: when cancelled
        in flight, keep the slot and in-flight token for the time the request would still
        have run (:meth:`_linger`; only in a task of its own, :func:`deadline.apart`)."""
        call, stream = r.call, r.stream
        tried: set[str] = set()
        self.retries.record_request()
        request, work = placing.request, placing.work
        while True:
            instance = self._place(call, placing, frozenset(tried))
            try:
                # Ran alone: no other request of the model on the instance when it was sent
                # nor when it finished, so its time is one batch of itself (the cost model).
                alone = not instance.model_in_flight.get(call.model)
                sent_at = time.perf_counter()
                with self.fleet.track(instance, call.model, stream=stream, work=work):
                    # Sent beside long work (this request's own included): its time inside
                    # is a padded batch's, not the slots' (proxy.control.concurrency).
                    beside_long = instance.long_in_flight.get(call.model, 0) > 0
                    forward = self._forward(call, r.info, priority)
                    resend = self._resend(r, instance, forward, work) if self.nudge else None
                    if resend is not None:
                        instance.resend[call.model] = resend
                    try:
                        result = await r.send(instance, forward)
                    except (asyncio.CancelledError, Exception) as exc:
                        # The client left, or its deadline passed in flight: Triton cancelled
                        # the call, and may still be running it.
                        if linger and (
                            isinstance(exc, asyncio.CancelledError)
                            or deadline.passed(call.deadline, self.fleet.clock.now())
                        ):
                            await self._linger(r, sent_at, trace)
                        raise
                    finally:
                        if resend is not None and instance.resend.get(call.model) is resend:
                            del instance.resend[call.model]
                    # Timed before the answer is handed on: BatchTimes groups a batch's
                    # answers by when they came, and writing one to its client takes time.
                    trace.inside_s = time.perf_counter() - sent_at
                    if r.deliver is not None:
                        r.deliver(result)
                    trace.alone = alone and instance.model_in_flight.get(call.model) == 1
                    in_flight = instance.model_in_flight.get(call.model, 0)
                if not stream:
                    if trace.alone:
                        self.costs.observe_batch(call.model, call.cost, trace.inside_s)
                    info = r.info
                    # One model instance: with more, batches run side by side, not back to
                    # back.
                    if (
                        info is not None
                        and info.max_queue_delay_s is not None
                        and info.model_instances == 1
                    ):
                        batch = self._batch_times.answered(
                            (instance.name, call.model),
                            sent_at + trace.inside_s,
                            sent_at,
                            call.rows,
                            call.cost,
                            info.max_queue_delay_s,
                            info.max_batch_size,
                        )
                        if batch is not None:
                            self.costs.observe_batch(call.model, *batch)
                    # The gates that admitted it: a canary arm with classes of its own
                    # learns from its own answers, not the main arm's.
                    gates = r.arm.admission
                    if gates is not None:
                        gates.observe_inside(
                            instance.name,
                            call.model,
                            work.class_name,
                            trace.inside_s,
                            in_flight,
                            beside_long,
                            # Only adaptive concurrency reads it: not computed otherwise.
                            self.costs.batch_seconds(call.model, request.batch)
                            if gates.adaptive is not None
                            else None,
                        )
            except UpstreamConnectError as exc:
                self._failed(instance, f"connection failed: {exc}", immediate=exc.refused)
                if self._continues_sequence(call):
                    raise ProxyError(
                        Code.UNAVAILABLE,
                        f"instance '{instance.name}' holding sequence "
                        f"{call.params.sequence_id} of model '{call.model}' is unavailable",
                    ) from exc
                failure = ProxyError(
                    Code.UNAVAILABLE, f"Triton instance '{instance.name}' is unreachable ({exc})"
                )
            except UpstreamLostError as exc:
                self._failed(instance, f"connection lost: {exc}")
                failure = ProxyError(
                    Code.UNAVAILABLE,
                    f"connection to Triton instance '{instance.name}' was lost while it "
                    f"handled the request ({exc})",
                )
                if not (exc.before_response and await self._stateless(call)):
                    raise failure from exc
            except UpstreamTimeoutError as exc:
                # Busy is not dead: the probe decides whether the instance still answers.
                self.fleet.probe_soon(instance)
                limit = f"{self.request_timeout_s:g} s" if self.request_timeout_s else "its limit"
                raise ProxyError(
                    Code.DEADLINE_EXCEEDED,
                    f"Triton instance '{instance.name}' did not answer the request for model "
                    f"'{call.model}' within {limit} (limits.request_timeout_s)",
                ) from exc
            except ModelAbsentError as exc:
                tried.add(instance.name)
                others = [i for i in self.fleet.serving(call.model) if i.name not in tried]
                if (
                    not others
                    or self._continues_sequence(call)
                    or await self.catalog.info(call.model) is None
                ):
                    # Nowhere else to go (or the model is unknown everywhere): Triton's
                    # answer stands, and the last instance serving a model keeps it.
                    return instance, _answer(cast(T, exc.answer))
                self.fleet.exclude_model(instance, call.model, str(exc))
                if len(tried) > self.max_retries or not self.retries.try_retry():
                    return instance, _answer(cast(T, exc.answer))
                self.telemetry.retries.inc()
                continue
            else:
                self.fleet.report_answer(instance)
                seq = call.params.sequence_id
                if seq is not None and call.params.sequence_end:
                    self.affinity.end(call.model, seq)
                return instance, result
            tried.add(instance.name)
            if len(tried) > self.max_retries or not self.retries.try_retry():
                raise ProxyError(failure.code, f"{failure.message}; no retry left") from failure
            self.telemetry.retries.inc()

    @contextlib.asynccontextmanager
    async def admitted(self, model: str, klass: str) -> AsyncIterator[int | None]:
        """One message of a stream through the model's class gate; yields its Triton priority.

        The slot is held until the block exits (the caller exits it when the message's answer
        arrives), so an idle stream holds none.
        """
        info = await self.catalog.info(model) if self.admission is not None else None
        if self.admission is None or info is None:
            yield None
            return
        async with contextlib.AsyncExitStack() as stack:
            try:
                priority = await stack.enter_async_context(self.admission.admit(model, info, klass))
            except Shed as shed:
                # A stream's messages go through the main arm's gates (no canary split).
                label = f"shed_{shed.reason.value}"
                self.telemetry.requests_by.get(model, klass, "-", label, MAIN).inc()
                raise _shed_error(model, shed) from shed
            yield priority

    async def any_ready(self, send: Callable[[Instance], Awaitable[T]]) -> T:
        """Read-only calls (metadata, config, statistics): the first ready instance that
        answers. Such calls may go to the next instance when a connection fails or breaks."""
        last: Exception | None = None
        for instance in self.fleet.healthy():
            try:
                return await send(instance)
            except (UpstreamConnectError, UpstreamLostError) as exc:
                what = "lost" if isinstance(exc, UpstreamLostError) else "failed"
                refused = isinstance(exc, UpstreamConnectError) and exc.refused
                self._failed(instance, f"connection {what}: {exc}", immediate=refused)
                last = exc
            except UpstreamTimeoutError as exc:
                self.fleet.probe_soon(instance)
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

    def _failed(self, instance: Instance, reason: str, *, immediate: bool = False) -> None:
        self.fleet.report_failure(instance, reason, immediate=immediate)
        self.on_lost(instance)

    def _continues_sequence(self, call: Call) -> bool:
        return call.params.sequence_id is not None and not call.params.sequence_start

    async def _stateless(self, call: Call) -> bool:
        """Whether sending the request twice is harmless: no sequence, not decoupled."""
        if call.params.sequence_id is not None:
            return False
        info = await self.catalog.info(call.model)
        return info is not None and not info.decoupled

    def _place(self, call: Call, placing: Placing, exclude: frozenset[str]) -> Instance:
        seq = call.params.sequence_id
        if seq is not None and not call.params.sequence_start:
            name = self.affinity.lookup(call.model, seq)
            bound = self.fleet.instances.get(name) if name is not None else None
            if name is not None and bound is None:
                self.affinity.forget_instance(name, "was removed by a policy reload")
            elif bound is not None and bound.healthy:
                return bound
            why = self.affinity.orphaned(call.model, seq)
            if why is not None:
                # Its state lives (lived) on that instance alone: another one would start it
                # afresh or refuse it, so say what happened instead.
                raise ProxyError(
                    Code.INVALID_ARG,
                    f"inference request for sequence {seq!r} to model '{call.model}' refused "
                    f"by triton-proxy: the Triton instance holding the sequence {why}; its "
                    "state is gone, start the sequence again (sequence_start)",
                )
        picked = placing.placement.pick(placing.request, exclude)
        if picked is None:
            down = ", ".join(
                f"{i.name}: {i.ejected_reason or 'not ready'}"
                if not i.healthy
                else f"{i.name}: model out ({i.models_out[call.model].reason})"
                for i in self.fleet.all()
                if not i.serves(call.model)
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


def _level(call: Call, priority: int | None) -> int | None:
    """The Triton priority level a request runs at upstream: its class's, else as the
    client sent it (None: the model's default)."""
    return priority if priority is not None else call.params.priority


def _answer(answer: T) -> T:
    """Triton's own answer, relayed: a response, or its error status raised."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _once_sent(work: Coroutine[Any, Any, T], runs_to_end: bool) -> Awaitable[T]:
    """What to await for a dispatched request. When cancelling cannot stop it upstream (HTTP:
    Triton does not see a closed connection, server issue #7077), it runs to its end even if
    the client leaves:
    it still takes Triton's time, so its gate slot and in-flight token stay counted until
    Triton answers (measured: releasing them at once let the gate send more work than its
    limit, and 20 % of Triton's time went to abandoned requests at 2x load).

    ``runs_to_end``: nothing can cancel the caller once the request is sent (the upstream call
    itself is cancelled with it, or the frontend holds the handler, with no client deadline),
    so the caller awaits it. Otherwise it runs in a task of its own, which a cancelled caller
    stops waiting for (measured with ``benchmarks/cpu_ab.py``: that task and its shield were
    60-80 µs of CPU per HTTP request, 11-12 % of the proxy's cost, so the HTTP frontend holds
    its handler instead).

    Not a coroutine itself: it hands back what the caller awaits, one coroutine layer less on
    every request (session 17)."""
    if runs_to_end:
        return work
    return deadline.detached(work)


def _shed_error(model: str, shed: Shed) -> ProxyError:
    if shed.reason is ShedReason.SHUTDOWN:
        return ProxyError(Code.UNAVAILABLE, "triton-proxy is shutting down")
    why = {
        ShedReason.QUEUE_FULL: "its class queue is full",
        ShedReason.OVERLOAD: "the proxy is overloaded and sheds the lowest classes first",
        ShedReason.BUSY: "the proxy's own event loop lags (it is short of CPU) and it refuses "
        "the least important classes first (scheduling.overload)",
        ShedReason.TIMEOUT: "it waited longer than its class's queue_timeout_s",
        ShedReason.LATE: "it would be answered after its deadline (its class's slo_p99_ms, or "
        "the client's deadline when earlier)",
    }.get(shed.reason, shed.reason.value)
    return ProxyError(
        Code.RESOURCE_EXHAUSTED,
        f"request for model '{model}' of class '{shed.class_name}' was shed: {why}; "
        f"retry after {shed.retry_after_s:g} s",
        retry_after_s=shed.retry_after_s,
    )
