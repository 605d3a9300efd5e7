"""Stateful sequences through the proxy: every request of a sequence reaches the one instance
holding its state, while other sequences run concurrently, and the affinity entry goes at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

MODEL = "accumulator"
LENGTH = 50
# The concurrent sequences' lengths: multiples of 3, doubling; LENGTH is not a multiple of 3.
# The number of requests an instance served then says exactly which sequences it served: it is
# LENGTH (if it had the main sequence) plus 3 * k, where bit i of k stands for OTHERS[i].
OTHERS = (3, 6, 12, 24, 48)
assert LENGTH % 3 and all(n == 3 << i for i, n in enumerate(OTHERS))

_ids = itertools.count(random.randrange(1_000, 100_000) * 1_000)


def fresh_id(id_kind: str) -> int | str:
    return next(_ids) if id_kind == "int" else f"seq-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def proxy(triton_fleet: Any) -> Iterator[ProxyThread]:
    with running_proxy(triton_fleet.servers) as p:
        yield p


@asynccontextmanager
async def aio_client(protocol: str, address: str) -> AsyncIterator[Any]:
    client: Any
    if protocol == "http":
        client = aiohttpclient.InferenceServerClient(address)
    else:
        client = aiogrpcclient.InferenceServerClient(address)
    try:
        yield client
    finally:
        await client.close()


def address(protocol: str, target: Any) -> str:
    if isinstance(target, ProxyThread):
        return target.http if protocol == "http" else target.grpc
    return (
        str(target.http_url).removeprefix("http://") if protocol == "http" else target.grpc_address
    )


async def send_sequence(
    client: Any,
    protocol: str,
    seq: int | str,
    values: list[int],
    after_each: Any = None,
) -> list[int]:
    """The running sums the model returns for ``values`` sent as one sequence, in order."""
    module = aiohttpclient if protocol == "http" else aiogrpcclient
    sums = []
    for n, value in enumerate(values):
        tensor = module.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        result = await client.infer(
            MODEL,
            [tensor],
            sequence_id=seq,
            sequence_start=n == 0,
            sequence_end=n == len(values) - 1,
        )
        sums.append(int(result.as_numpy("OUTPUT").reshape(-1)[0]))
        if after_each is not None:
            await after_each()
    return sums


def served_counts(triton_fleet: Any) -> dict[str, int]:
    """Requests of the model each Triton server has executed (Triton's own statistics)."""
    counts = {}
    for server in triton_fleet.servers:
        with httpclient.InferenceServerClient(address("http", server)) as c:
            stats = c.get_inference_statistics(MODEL)["model_stats"][0]
            counts[server.name] = int(stats["inference_count"])
    return counts


def decode(served: int) -> tuple[bool, set[int]]:
    """(has the main sequence, indices into OTHERS) that add up to ``served`` requests."""
    main = served % 3 == LENGTH % 3
    k, rest = divmod(served - (LENGTH if main else 0), 3)
    assert rest == 0 and 0 <= k < 1 << len(OTHERS), f"{served} requests is no set of sequences"
    return main, {i for i in range(len(OTHERS)) if k >> i & 1}


def in_proxy(proxy: ProxyThread, fn: Any) -> Any:
    """Run ``fn`` on the proxy's loop (its tables are not thread-safe); awaitable from ours."""

    async def call() -> Any:
        return fn()

    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), proxy.loop))


@pytest.mark.parametrize("id_kind", ["int", "string"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_sequence_stays_on_one_instance_among_others(
    proxy: ProxyThread, triton_fleet: Any, protocol: str, id_kind: str
) -> None:
    rng = np.random.default_rng(LENGTH + len(id_kind) + len(protocol))
    main_id = fresh_id(id_kind)
    main_values = [int(v) for v in rng.integers(-1000, 1000, size=LENGTH)]
    others = [(fresh_id(id_kind), [int(v) for v in rng.integers(-9, 9, size=n)]) for n in OTHERS]
    affinity = proxy.runtime.affinity
    decisions = proxy.runtime.router.stats.decisions
    before = served_counts(triton_fleet)
    decided_before = sum(n for (m, _, _), n in decisions.items() if m == MODEL)
    entries_before = await in_proxy(proxy, lambda: len(affinity))

    bound: list[str | None] = []

    async def watch_main() -> None:
        bound.append(await in_proxy(proxy, lambda: affinity.lookup(MODEL, main_id)))

    async with aio_client(protocol, address(protocol, proxy)) as client:
        sums = await asyncio.gather(
            send_sequence(client, protocol, main_id, main_values, watch_main),
            *(send_sequence(client, protocol, seq, values) for seq, values in others),
        )
    after = served_counts(triton_fleet)

    assert sums[0] == list(np.cumsum(main_values))
    for (_, values), got in zip(others, sums[1:], strict=True):
        assert got == list(np.cumsum(values))

    # The affinity table named one instance after each request of the sequence, and none after
    # its last one (sequence_end).
    assert bound[-1] is None
    assert len(set(bound[:-1])) == 1 and None not in bound[:-1], bound
    # Triton agrees: each instance executed whole sequences only, the main one on that instance.
    holders: dict[str, list[str]] = {}
    for name in after:
        has_main, indices = decode(after[name] - before[name])
        for label in {f"other {i}" for i in indices} | ({"main"} if has_main else set()):
            holders.setdefault(label, []).append(name)
    assert sorted(holders) == sorted(["main", *(f"other {i}" for i in range(len(OTHERS)))])
    assert all(len(names) == 1 for names in holders.values()), holders
    assert holders["main"] == [bound[0]]
    # The router was asked once per sequence (its start); continuations followed the table.
    decided = sum(n for (m, _, _), n in decisions.items() if m == MODEL) - decided_before
    assert decided == 1 + len(OTHERS)
    # sequence_end removed every entry this test made.
    assert await in_proxy(proxy, lambda: len(affinity)) == entries_before

    # The same sequence sent straight to one Triton server accumulates the same state.
    server = triton_fleet.server(1)
    async with aio_client(protocol, address(protocol, server)) as client:
        direct = await send_sequence(client, protocol, main_id, main_values)
    assert direct == sums[0]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_affinity_entry_lives_until_sequence_end(proxy: ProxyThread, protocol: str) -> None:
    affinity = proxy.runtime.affinity
    seq = fresh_id("string" if protocol == "grpc" else "int")
    module = aiohttpclient if protocol == "http" else aiogrpcclient

    async def send(value: int, **flags: bool) -> int:
        tensor = module.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        result = await client.infer(MODEL, [tensor], sequence_id=seq, **flags)
        return int(result.as_numpy("OUTPUT").reshape(-1)[0])

    async with aio_client(protocol, address(protocol, proxy)) as client:
        assert await send(5, sequence_start=True) == 5
        holder = await in_proxy(proxy, lambda: affinity.lookup(MODEL, seq))
        assert holder is not None
        assert await send(6) == 11
        assert await in_proxy(proxy, lambda: affinity.lookup(MODEL, seq)) == holder
        assert await send(7, sequence_end=True) == 18
        assert await in_proxy(proxy, lambda: affinity.lookup(MODEL, seq)) is None


async def test_affinity_entry_gone_after_sequence_end_in_a_stream(proxy: ProxyThread) -> None:
    affinity = proxy.runtime.affinity
    seq = fresh_id("int")
    values = [1, 2, 3]
    entries_before = await in_proxy(proxy, lambda: len(affinity))

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for n, value in enumerate(values):
            tensor = aiogrpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            yield {
                "model_name": MODEL,
                "inputs": [tensor],
                "sequence_id": seq,
                "sequence_start": n == 0,
                "sequence_end": n == len(values) - 1,
            }

    sums = []
    async with aio_client("grpc", proxy.grpc) as client:
        async for result, error in client.stream_infer(requests(), stream_timeout=30):
            assert error is None, error
            sums.append(int(result.as_numpy("OUTPUT").reshape(-1)[0]))
    assert sums == [1, 3, 6]
    assert await in_proxy(proxy, lambda: affinity.lookup(MODEL, seq)) is None
    assert await in_proxy(proxy, lambda: len(affinity)) == entries_before
