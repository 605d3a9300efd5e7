"""Two proxy replicas side by side in front of one fleet, each seeing part of the traffic.

What holds and what does not is written up in docs/benchmarks.md ("Workers and replicas");
these tests pin the behaviours that section relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from proxy import config as config_mod
from proxy.app import ProxyServer
from tests.unit.fake_triton import FakeTriton, fake_triton


@contextlib.asynccontextmanager
async def fleet(n: int) -> AsyncIterator[list[tuple[FakeTriton, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(fake_triton(f"t{i}")) for i in range(n)]


@contextlib.asynccontextmanager
async def replica(
    servers: list[tuple[FakeTriton, str]], **sections: Any
) -> AsyncIterator[ProxyServer]:
    doc = {
        "instances": [
            {"name": fake.name, "http": url, "metrics": url + "/metrics"} for fake, url in servers
        ],
        "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
        **sections,
    }
    server = ProxyServer(config_mod.parse(doc, "<replica>"))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def infer(session: aiohttp.ClientSession, proxy: ProxyServer, key: str = "") -> int:
    assert proxy.ports is not None
    headers = {"x-session-id": key} if key else {}
    url = f"http://127.0.0.1:{proxy.ports.http}/v2/models/m/infer"
    async with session.post(url, data=b'{"inputs":[]}', headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_each_replica_balances_only_its_own_requests():
    """In-flight counts are per replica: B does not see the requests A holds open."""
    async with fleet(2) as servers, replica(servers) as a, replica(servers) as b:
        gate = asyncio.Event()
        for fake, _ in servers:
            fake.hold = gate
        async with aiohttp.ClientSession() as session:
            held = [asyncio.create_task(infer(session, a)) for _ in range(4)]
            while sum(f.hits["infer"] for f, _ in servers) < 4:
                await asyncio.sleep(0.01)
            # A spread its own four exactly (least requests); B saw none of them.
            assert [a.runtime.fleet.get(f.name).in_flight for f, _ in servers] == [2, 2]
            assert [b.runtime.fleet.get(f.name).in_flight for f, _ in servers] == [0, 0]
            gate.set()
            assert await asyncio.gather(*held) == [200] * 4


async def test_session_keys_land_on_the_same_instance_from_either_replica():
    """consistent_hash rings are built from names alone, so replicas agree on every key."""
    routing = {"policy": {"name": "consistent_hash"}}
    async with (
        fleet(3) as servers,
        replica(servers, routing=routing) as a,
        replica(servers, routing=routing) as b,
        aiohttp.ClientSession() as session,
    ):
        keys = [f"user-{i}" for i in range(30)]
        for key in keys:
            assert await infer(session, a, key) == 200
            assert await infer(session, b, key) == 200
        owner: dict[str, set[str]] = {}
        for fake, _ in servers:
            for key in fake.sessions:
                owner.setdefault(key, set()).add(fake.name)
        assert set(owner) == set(keys)
        assert all(len(names) == 1 for names in owner.values()), owner
        assert len({next(iter(n)) for n in owner.values()}) > 1  # keys do spread


async def test_class_limits_are_per_replica():
    """Each replica fills its own slots: two replicas hold twice one replica's limit."""
    scheduling = {"concurrency": 1, "classes": {"all": {"rank": 0}}, "default_class": "all"}
    async with (
        fleet(1) as servers,
        replica(servers, scheduling=scheduling) as a,
        replica(servers, scheduling=scheduling) as b,
        aiohttp.ClientSession() as session,
    ):
        gate = asyncio.Event()
        servers[0][0].hold = gate
        tasks = [asyncio.create_task(infer(session, p)) for p in (a, b, a, b)]
        while servers[0][0].hits["infer"] < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        # One slot per replica: 2 requests reach the instance, 1 waits in each replica.
        assert servers[0][0].hits["infer"] == 2
        gate.set()
        assert await asyncio.gather(*tasks) == [200] * 4


async def test_only_the_replica_set_as_leader_leads():
    async with (
        fleet(1) as servers,
        replica(servers, leadership={"mode": "static", "leader": True}) as a,
        replica(servers, leadership={"mode": "static", "leader": False}) as b,
    ):
        assert a.runtime.is_leader() is True
        assert b.runtime.is_leader() is False
