"""Which proxy replica may change the fleet's configuration (batching windows, issue 11).

Several proxy replicas in front of one fleet (a Kubernetes Deployment with ``replicas: 2``)
each route their own share of the traffic; that needs no coordination. Changing a Triton
model's ``max_queue_delay_microseconds`` does: it reloads the model, and two replicas doing it
at once would undo each other and stall requests twice. So exactly one replica is the leader,
and the batching-window controller acts only while :meth:`Leadership.is_leader` is true.

- **In Kubernetes** the platform's own leader election decides: a ``coordination.k8s.io/v1``
  Lease, with the algorithm of client-go's ``leaderelection`` package (no consensus of ours).
  The Lease is read and written through the ``kubernetes`` Python client
  (``pip install 'triton-proxy[k8s]'``), used only when the process runs in a pod.
- **Elsewhere** a policy setting decides: ``leadership: {mode: static, leader: true}`` on one
  replica and ``leader: false`` on the others.

The election itself (:class:`LeaseElection`) is pure apart from an injected Lease API and
clock, so it is tested against a fake API.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from proxy.aio import cancel_and_wait
from proxy.clock import Clock

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class LeadershipConfig:
    """The policy file's ``leadership:`` section."""

    mode: Literal["auto", "lease", "static"] = "auto"
    """``auto``: a Lease when running in a Kubernetes pod, else ``static``."""
    leader: bool = True
    """``static`` mode: whether this replica is the leader (set false on all replicas but one)."""
    lease_name: str = "triton-proxy"
    namespace: str | None = None
    """The Lease's namespace; default: the pod's own (from its service account)."""
    identity: str | None = None
    """This replica's name in the Lease; default: the pod name (``HOSTNAME``)."""
    lease_duration_s: float = 15.0
    """How long a leader's claim lasts without renewal (client-go ``LeaseDuration``)."""
    renew_deadline_s: float = 10.0
    """A leader that has not renewed for this long stops acting (client-go ``RenewDeadline``)."""
    retry_period_s: float = 2.0
    """Time between two tries to acquire or renew (client-go ``RetryPeriod``)."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "need 0 < retry_period_s < renew_deadline_s < lease_duration_s "
                "(as client-go's leader election)"
            )


class Leadership(Protocol):
    def is_leader(self) -> bool:
        """True while this replica may change the fleet's configuration."""
        ...


class StaticLeadership:
    """Leadership decided by the policy file (``mode: static``), or never (a follower worker)."""

    def __init__(self, leader: bool) -> None:
        self._leader = leader

    def is_leader(self) -> bool:
        return self._leader

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


# -- the Lease election ----------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseRecord:
    """The fields of a ``coordination.k8s.io/v1`` Lease that the election reads and writes."""

    holder: str | None
    lease_duration_s: float
    acquire_time: dt.datetime | None
    renew_time: dt.datetime | None
    transitions: int = 0
    resource_version: str | None = None
    """Optimistic concurrency: an update carrying an old version is refused (Conflict)."""


class LeaseConflict(Exception):
    """The Lease changed (or appeared) since it was read: someone else wrote it."""


class LeaseApi(Protocol):
    """Reads and writes one Lease; the real one is :class:`KubernetesLeaseApi`."""

    def get(self) -> LeaseRecord | None:
        """The Lease, or None when it does not exist."""
        ...

    def create(self, record: LeaseRecord) -> LeaseRecord:
        """Create it; :class:`LeaseConflict` if it exists."""
        ...

    def update(self, record: LeaseRecord) -> LeaseRecord:
        """Replace it if ``record.resource_version`` is current; else :class:`LeaseConflict`."""
        ...


class LeaseElection:
    """client-go's ``tryAcquireOrRenew`` over a Lease, one step at a time.

    Each :meth:`step` (every ``retry_period_s``): read the Lease. When another holder's record
    has not changed for ``lease_duration_s`` *as observed on this replica's own clock* (other
    replicas' clocks are never compared with ours), it has expired and may be taken; a record
    held by us is renewed. Writes carry the read ``resourceVersion``, so of two replicas
    racing for an expired Lease the API server accepts one and refuses the other. A leader
    that has not renewed for ``renew_deadline_s`` stops being leader on its own, before its
    Lease can expire and be taken (``renew_deadline_s < lease_duration_s``): two leaders never
    act at once while clocks run at the same rate.
    """

    def __init__(
        self,
        api: LeaseApi,
        identity: str,
        clock: Clock,
        *,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.api = api
        self.identity = identity
        self.clock = clock
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._wall = wall_clock
        self._observed: LeaseRecord | None = None
        self._observed_at = float("-inf")
        self._renewed_at: float | None = None
        """Local clock time of our last successful acquire or renew."""
        self._task: asyncio.Task[None] | None = None

    def is_leader(self) -> bool:
        if self._renewed_at is None:
            return False
        return self.clock.now() - self._renewed_at < self.renew_deadline_s

    def step(self) -> bool:
        """One try to acquire or renew; returns :meth:`is_leader` after it."""
        now = self.clock.now()
        wall = self._wall()
        try:
            current = self.api.get()
        except LeaseConflict:
            return self.is_leader()
        if current is None:
            mine = LeaseRecord(self.identity, self.lease_duration_s, wall, wall, 0)
            with contextlib.suppress(LeaseConflict):  # another replica created it first
                self._won(self.api.create(mine), now)
            return self.is_leader()
        if self._observed is None or _changed(self._observed, current):
            self._observed, self._observed_at = current, now
        held_by_other = current.holder not in (None, "", self.identity)
        expired = now >= self._observed_at + current.lease_duration_s
        if held_by_other and not expired:
            self._renewed_at = None
            return False
        ours = current.holder == self.identity
        mine = replace(
            current,
            holder=self.identity,
            lease_duration_s=self.lease_duration_s,
            acquire_time=current.acquire_time if ours else wall,
            renew_time=wall,
            transitions=current.transitions if ours else current.transitions + 1,
        )
        # A conflict: someone wrote it since we read it; look again next step.
        with contextlib.suppress(LeaseConflict):
            self._won(self.api.update(mine), now)
        return self.is_leader()

    def _won(self, record: LeaseRecord, now: float) -> None:
        if self._renewed_at is None:
            log.info("leader election: %s now holds the lease", self.identity)
        self._observed, self._observed_at, self._renewed_at = record, now, now

    def release(self) -> None:
        """Give the Lease up on shutdown so another replica need not wait for it to expire."""
        if self._renewed_at is None or self._observed is None:
            return
        self._renewed_at = None
        with contextlib.suppress(LeaseConflict):
            self.api.update(replace(self._observed, holder="", renew_time=self._wall()))

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.step)
            except Exception:
                # The API server may be unreachable for a while: not leader until it answers.
                log.exception("leader election step failed")
            await asyncio.sleep(self.retry_period_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="leader-election")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await asyncio.to_thread(self.release)


def _changed(a: LeaseRecord, b: LeaseRecord) -> bool:
    if a.resource_version is not None and b.resource_version is not None:
        return a.resource_version != b.resource_version
    return (a.holder, a.renew_time, a.transitions) != (b.holder, b.renew_time, b.transitions)


# -- Kubernetes ------------------------------------------------------------------------------


def in_cluster() -> bool:
    """Running in a Kubernetes pod with a service account (what in-cluster config needs)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (SERVICE_ACCOUNT / "token").exists()


class KubernetesLeaseApi:
    """:class:`LeaseApi` over the ``kubernetes`` client's ``CoordinationV1Api`` (sync calls)."""

    def __init__(self, name: str, namespace: str) -> None:
        from kubernetes import client, config

        # Through Any: the client is untyped, and may not be installed where mypy runs.
        cast(Any, config).load_incluster_config()
        self._client = client
        self._api = client.CoordinationV1Api()
        self.name = name
        self.namespace = namespace

    def _record(self, lease: Any) -> LeaseRecord:
        spec = lease.spec
        return LeaseRecord(
            holder=spec.holder_identity,
            lease_duration_s=float(spec.lease_duration_seconds or 0),
            acquire_time=spec.acquire_time,
            renew_time=spec.renew_time,
            transitions=int(spec.lease_transitions or 0),
            resource_version=lease.metadata.resource_version,
        )

    def _body(self, record: LeaseRecord) -> Any:
        c = self._client
        return c.V1Lease(
            metadata=c.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                resource_version=record.resource_version,
            ),
            spec=c.V1LeaseSpec(
                holder_identity=record.holder,
                lease_duration_seconds=round(record.lease_duration_s),
                acquire_time=record.acquire_time,
                renew_time=record.renew_time,
                lease_transitions=record.transitions,
            ),
        )

    def _call(self, fn: Callable[[], Any]) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn()
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(str(exc.reason)) from exc
            raise

    def get(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self._record(lease)

    def create(self, record: LeaseRecord) -> LeaseRecord:
        body = self._body(replace(record, resource_version=None))
        return self._record(
            self._call(lambda: self._api.create_namespaced_lease(self.namespace, body))
        )

    def update(self, record: LeaseRecord) -> LeaseRecord:
        body = self._body(record)
        return self._record(
            self._call(lambda: self._api.replace_namespaced_lease(self.name, self.namespace, body))
        )


def build_leadership(
    config: LeadershipConfig, clock: Clock, *, eligible: bool = True
) -> StaticLeadership | LeaseElection:
    """The leadership this process runs under. ``eligible`` is false in follower workers:
    only a replica's leader worker takes part (its control loops are the ones that act)."""
    if not eligible:
        return StaticLeadership(False)
    use_lease = config.mode == "lease" or (config.mode == "auto" and in_cluster())
    if not use_lease:
        return StaticLeadership(config.leader)
    namespace = config.namespace
    if namespace is None:
        try:
            namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        except OSError:
            namespace = "default"
    identity = config.identity or os.environ.get("POD_NAME") or socket.gethostname()
    try:
        api = KubernetesLeaseApi(config.lease_name, namespace)
    except ImportError as exc:
        raise RuntimeError(
            "leadership needs a Kubernetes Lease here, but the kubernetes client is not "
            "installed: pip install 'triton-proxy[k8s]' (or set leadership.mode: static)"
        ) from exc
    log.info("leader election: Lease %s/%s as %s", namespace, config.lease_name, identity)
    return LeaseElection(
        api,
        identity,
        clock,
        lease_duration_s=config.lease_duration_s,
        renew_deadline_s=config.renew_deadline_s,
        retry_period_s=config.retry_period_s,
    )
