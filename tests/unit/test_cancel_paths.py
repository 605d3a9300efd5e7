"""Client deadlines and departures through the real proxy, against fake Tritons (HTTP).

What real Triton does with them is in tests/integration/test_cancellation.py; here the fast
checks: slots and tokens come back exactly once, the deadline is shed or handed on.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from proxy.app import ProxyServer
from tests.unit.faketriton import fakes, policy, proxy_for

HONOURS = {
    "max_batch_size": 8,
    "dynamic_batching": {
        "default_queue_policy": {
            "allow_timeout_override": True,
            "default_timeout_microseconds": "300000000",
        }
    },
}
IGNORES = {"max_batch_size": 8, "dynamic_batching": {}}
ONE_SLOT = {"default_class": "online", "concurrency": 1, "classes": {"online": {"rank": 0}}}


def body(**parameters: Any) -> bytes:
    doc: dict[str, Any] = {"inputs": []}
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


async def post(
    proxy: ProxyServer, model: str = "m", data: bytes | None = None, **headers: str
) -> tuple[int, dict[str, Any]]:
    assert proxy.ports is not None
    url = f"http://127.0.0.1:{proxy.ports.http}/v2/models/{model}/infer"
    async with aiohttp.ClientSession() as s, s.post(url, data=data or body(), headers=headers) as r:
        return r.status, json.loads(await r.read())


async def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def sent_parameters(raw: bytes) -> dict[str, Any]:
    params: dict[str, Any] = json.loads(raw).get("parameters", {})
    return params


async def test_the_rest_of_the_deadline_goes_to_models_that_honour_it() -> None:
    async with fakes(1) as (f,):
        f.models = {"m": HONOURS, "n": IGNORES}
        async with proxy_for(policy([f])) as proxy:
            assert (await post(proxy, "m", **{"Triton-Timeout-Ms": "5000"}))[0] == 200
            assert 0 < sent_parameters(f.bodies[-1])["timeout"] <= 5_000_000
            assert (await post(proxy, "m", body(timeout=3_000_000)))[0] == 200
            assert 0 < sent_parameters(f.bodies[-1])["timeout"] <= 3_000_000
            # No queue policy allows overrides: the body goes as it came.
            assert (await post(proxy, "n", **{"Triton-Timeout-Ms": "5000"}))[0] == 200
            assert f.bodies[-1] == body()
            assert (await post(proxy, "m"))[0] == 200
            assert f.bodies[-1] == body()


async def test_priority_and_timeout_are_set_in_one_rewrite() -> None:
    async with fakes(1) as (f,):
        f.models = {
            "m": {
                **HONOURS,
                "dynamic_batching": {**HONOURS["dynamic_batching"], "priority_levels": 3},
            }
        }
        classes = {**ONE_SLOT, "classes": {"online": {"rank": 0, "triton_priority": 1}}}
        async with proxy_for(policy([f], scheduling=classes)) as proxy:
            assert (await post(proxy, data=body(priority=3), **{"Triton-Timeout-Ms": "800"}))[
                0
            ] == 200
            params = sent_parameters(f.bodies[-1])
            assert params["priority"] == 1
            assert 0 < params["timeout"] <= 800_000


async def test_a_bad_deadline_header_is_refused() -> None:
    async with fakes(1) as (f,), proxy_for(policy([f])) as proxy:
        status, answer = await post(proxy, **{"Triton-Timeout-Ms": "soon"})
        assert status == 400
        assert "Triton-Timeout-Ms" in answer["error"]
        assert f.infers == 0


async def test_deadline_in_flight_answers_429_and_frees_token_and_slot() -> None:
    async with fakes(1) as (f,):
        f.delay_s = 2.0
        async with proxy_for(policy([f], scheduling=ONE_SLOT)) as proxy:
            status, answer = await post(proxy, **{"Triton-Timeout-Ms": "100"})
            assert status == 429
            assert "deadline" in answer["error"]
            gate = proxy.runtime.gates.gates["m"]
            # Triton still works on it (HTTP cannot cancel it there): still counted, until its
            # answer comes back, then released once.
            assert (gate.in_flight(), proxy.runtime.fleet.total_in_flight()) == (1, 1)
            await wait_for(lambda: gate.in_flight() == 0)
            assert proxy.runtime.fleet.total_in_flight() == 0
            f.delay_s = 0.0
            assert (await post(proxy))[0] == 200


async def test_departures_release_slots_and_tokens_exactly_once() -> None:
    async with fakes(1) as (f,):
        f.delay_s = 1.0
        async with proxy_for(policy([f], scheduling=ONE_SLOT)) as proxy:
            running = asyncio.ensure_future(post(proxy))
            await wait_for(lambda: proxy.runtime.fleet.total_in_flight() == 1)
            gate = proxy.runtime.gates.gates["m"]
            queued = asyncio.ensure_future(post(proxy))
            await wait_for(lambda: gate.queued() == 1)
            # A third waits out its deadline in the queue.
            status, _ = await post(proxy, **{"Triton-Timeout-Ms": "50"})
            assert status == 429
            for task in (queued, running):
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_for(lambda: proxy.runtime.fleet.total_in_flight() == 0)
            await wait_for(lambda: gate.in_flight() == 0 and gate.queued() == 0)
            assert f.infers == 1  # the queued and the expired ones never left the proxy
            f.delay_s = 0.0
            # The one slot is free again, once: two requests still pass one at a time.
            results = await asyncio.gather(post(proxy), post(proxy))
            assert [r[0] for r in results] == [200, 200]
            assert gate.in_flight() == 0


async def test_without_cancel_upstream_a_departed_request_still_runs() -> None:
    async with fakes(1) as (f,):
        f.delay_s = 0.3
        doc = policy([f], limits={"cancel_upstream": False})
        async with proxy_for(doc) as proxy:
            task = asyncio.ensure_future(post(proxy, **{"Triton-Timeout-Ms": "50"}))
            await wait_for(lambda: f.infers == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert proxy.runtime.fleet.total_in_flight() == 1  # still running upstream
            await wait_for(lambda: proxy.runtime.fleet.total_in_flight() == 0)
            assert "timeout" not in sent_parameters(f.bodies[-1])
