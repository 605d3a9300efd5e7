"""The model catalog's cache: single-flight lookups, a bounded negative cache, and the
difference between 'no instance has this model' and 'no instance could be asked'."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.errors import Code, ProxyError
from proxy.fleet.catalog import ModelCatalog
from proxy.fleet.instances import Fleet, HealthConfig, Instance, InstanceSpec


class ScriptedCatalog(ModelCatalog):
    """A catalog whose instances answer from a table (pure logic under test, no HTTP)."""

    def __init__(self, fleet: Fleet, clock: FakeClock, models: dict[str, dict[str, Any]]) -> None:
        super().__init__(fleet, None, clock, max_unknown=4)  # type: ignore[arg-type]
        self.models = models
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.down: set[str] = set()

    async def describe(self, instance: Instance, model: str) -> dict[str, Any] | None:
        self.calls.append((instance.name, model))
        if self.gate is not None:
            await self.gate.wait()
        if instance.name in self.down:
            raise TimeoutError
        return self.models.get(model)


def make(models: dict[str, dict[str, Any]] | None = None) -> tuple[ScriptedCatalog, FakeClock]:
    clock = FakeClock()
    specs = (InstanceSpec("a", "http://a"), InstanceSpec("b", "http://b"))
    fleet = Fleet(specs, HealthConfig(), clock)
    return ScriptedCatalog(fleet, clock, models or {"m": {"max_batch_size": 8}}), clock


async def test_concurrent_lookups_share_one_fetch() -> None:
    catalog, _ = make()
    catalog.gate = asyncio.Event()
    lookups = [asyncio.ensure_future(catalog.info("m")) for _ in range(50)]
    await asyncio.sleep(0)
    catalog.gate.set()
    infos = await asyncio.gather(*lookups)
    assert {i.max_batch_size for i in infos if i} == {8}
    assert catalog.fetches == 1 and catalog.calls == [("a", "m")]


async def test_a_requester_that_gives_up_does_not_cancel_the_shared_fetch() -> None:
    catalog, _ = make()
    catalog.gate = asyncio.Event()
    first = asyncio.ensure_future(catalog.info("m"))
    second = asyncio.ensure_future(catalog.info("m"))
    await asyncio.sleep(0)
    first.cancel()
    catalog.gate.set()
    info = await second
    assert info is not None and catalog.fetches == 1


async def test_unknown_models_are_remembered_briefly_and_in_bounded_number() -> None:
    catalog, clock = make()
    for i in range(10):
        assert await catalog.info(f"x{i}") is None
    assert catalog.unknown_count() == 4  # max_unknown
    asked = len(catalog.calls)
    assert await catalog.info("x9") is None  # still cached: no new fetch
    assert len(catalog.calls) == asked
    clock.advance(catalog.negative_ttl_s + 0.1)
    assert await catalog.info("x9") is None
    assert len(catalog.calls) == asked + 2  # asked both instances again
    assert catalog.known() == []


async def test_no_instance_to_ask_is_unavailable_not_unknown() -> None:
    catalog, _ = make()
    catalog.down = {"a", "b"}
    with pytest.raises(ProxyError) as info:
        await catalog.info("m")
    assert info.value.code is Code.UNAVAILABLE
    assert catalog.unknown_count() == 0


async def test_a_transient_failure_keeps_what_was_known() -> None:
    catalog, clock = make()
    assert await catalog.info("m") is not None
    clock.advance(catalog.ttl_s + 1)
    catalog.down = {"a", "b"}
    info = await catalog.info("m")
    assert info is not None and info.max_batch_size == 8


async def test_a_model_found_on_the_second_instance_is_known() -> None:
    catalog, _ = make()

    async def only_b(instance: Instance, model: str) -> dict[str, Any] | None:
        return {"max_batch_size": 2} if instance.name == "b" else None

    catalog.describe = only_b  # type: ignore[method-assign]
    info = await catalog.info("m")
    assert info is not None and info.max_batch_size == 2
