"""Leader election over a Kubernetes Lease, against a fake Lease API (client-go's algorithm)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest

from proxy.clock import FakeClock
from proxy.leadership import (
    LeadershipConfig,
    LeaseConflict,
    LeaseElection,
    LeaseRecord,
    StaticLeadership,
    build_leadership,
)


class FakeLeaseApi:
    """One Lease with resourceVersion checks, as the API server keeps it."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.down = False

    def get(self) -> LeaseRecord | None:
        if self.down:
            raise ConnectionError("API server unreachable")
        return self.record

    def create(self, record: LeaseRecord) -> LeaseRecord:
        if self.record is not None:
            raise LeaseConflict("exists")
        return self._store(record)

    def update(self, record: LeaseRecord) -> LeaseRecord:
        if self.down:
            raise ConnectionError("API server unreachable")
        if self.record is None or record.resource_version != self.record.resource_version:
            raise LeaseConflict("stale resourceVersion")
        return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        return self.record


def wall() -> dt.datetime:
    return dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def election(api: FakeLeaseApi, name: str, clock: FakeClock) -> LeaseElection:
    return LeaseElection(
        api,
        name,
        clock,
        lease_duration_s=15,
        renew_deadline_s=10,
        retry_period_s=2,
        wall_clock=wall,
    )


def test_first_replica_takes_the_lease_and_the_second_follows():
    api, clock = FakeLeaseApi(), FakeClock()
    a, b = election(api, "a", clock), election(api, "b", clock)
    assert a.step() is True
    assert b.step() is False
    for _ in range(20):  # a renews every retry period; b never takes over
        clock.advance(2)
        assert a.step() is True
        assert b.step() is False
    assert api.record is not None and api.record.holder == "a"
    assert api.record.transitions == 0


def test_a_dead_leaders_lease_is_taken_after_it_expires_on_the_followers_clock():
    api, clock = FakeLeaseApi(), FakeClock()
    a, b = election(api, "a", clock), election(api, "b", clock)
    a.step()
    b.step()  # b observes a's record now
    clock.advance(14)
    assert b.step() is False  # not expired yet: 14 s < 15 s since b saw it change
    clock.advance(1)
    assert b.step() is True
    assert api.record is not None and api.record.holder == "b"
    assert api.record.transitions == 1
    # a was silent (dead or partitioned): it already stopped acting at its renew deadline,
    # before b could take over, so the two never acted at once.
    assert a.is_leader() is False


def test_leader_stops_acting_when_it_cannot_renew():
    api, clock = FakeLeaseApi(), FakeClock()
    a = election(api, "a", clock)
    assert a.step() is True
    api.down = True
    clock.advance(9)
    with pytest.raises(ConnectionError):
        a.step()
    assert a.is_leader() is True  # within the renew deadline
    clock.advance(1)
    assert a.is_leader() is False


class ReadsBefore:
    """An API whose reads return the Lease as it was: a replica that read before another wrote."""

    def __init__(self, api: FakeLeaseApi, record: LeaseRecord | None) -> None:
        self.api, self.record = api, record

    def get(self) -> LeaseRecord | None:
        return self.record

    def create(self, record: LeaseRecord) -> LeaseRecord:
        return self.api.create(record)

    def update(self, record: LeaseRecord) -> LeaseRecord:
        return self.api.update(record)


def test_racing_replicas_one_wins_through_resource_version():
    api, clock = FakeLeaseApi(), FakeClock()
    dead = election(api, "dead", clock)
    dead.step()
    a, b = election(api, "a", clock), election(api, "b", clock)
    a.step(), b.step()
    clock.advance(16)  # the holder died: both see the lease expire
    before = api.get()
    assert a.step() is True
    b.api = ReadsBefore(api, before)  # b read the expired lease before a's write landed
    assert b.step() is False
    assert api.record is not None and api.record.holder == "a"


def test_release_lets_the_next_replica_take_over_at_once():
    api, clock = FakeLeaseApi(), FakeClock()
    a, b = election(api, "a", clock), election(api, "b", clock)
    a.step()
    b.step()
    a.release()
    assert a.is_leader() is False
    clock.advance(2)
    assert b.step() is True


def test_static_leadership_outside_kubernetes(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    clock = FakeClock()
    assert build_leadership(LeadershipConfig(), clock).is_leader() is True
    assert build_leadership(LeadershipConfig(leader=False), clock).is_leader() is False
    # A follower worker never leads, whatever the policy says.
    follower = build_leadership(LeadershipConfig(), clock, eligible=False)
    assert isinstance(follower, StaticLeadership) and follower.is_leader() is False


def test_config_checks_client_go_ordering():
    with pytest.raises(ValueError, match="renew_deadline_s"):
        LeadershipConfig(lease_duration_s=10, renew_deadline_s=10)


def test_kubernetes_lease_objects_round_trip():
    """The Lease body written through the real client's models reads back as written."""
    client = pytest.importorskip("kubernetes.client")
    from proxy.leadership import KubernetesLeaseApi

    api = KubernetesLeaseApi.__new__(KubernetesLeaseApi)  # no in-cluster config here
    api._client, api.name, api.namespace = client, "triton-proxy", "serving"
    record = LeaseRecord("pod-a", 15, wall(), wall(), 2, "17")
    body = api._body(record)
    assert body.metadata.name == "triton-proxy" and body.metadata.namespace == "serving"
    assert body.spec.lease_duration_seconds == 15
    assert api._record(body) == record
