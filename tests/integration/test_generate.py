"""Streams are relayed as they are produced: the first token reaches the client while the model
is still generating, over HTTP ``generate_stream`` (server-sent events) and gRPC
``ModelStreamInfer``.

Asserted by order, never by timing. A long generation A is started through the proxy; when the
client has parsed A's first event, a short generation B is started through the proxy, and B must
end before A's last event is parsed. A proxy that buffered A until it completed fails this: A's
remaining events would already be in the client's buffer when the first is parsed, and all be
parsed at once before B even starts (over gRPC, where B goes on A's stream, it would deadlock
instead). When A's first event is parsed, the proxy must also still hold A in flight, and (HTTP)
the response must still be open.

Triton's own statistics cannot witness "still generating" here: the Python backend counts a
decoupled request as a success when ``execute`` returns, which this model does before its
first token (the tokens come from a worker thread), and it reports no per-response statistics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc.aio as aiogrpcclient

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

MODEL = "text_generator"
LONG = 60  # tokens; 30 ms apart (the model's token_delay_ms), so A lasts 1.8 s at least
SHORT = 2
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def proxy(triton_fleet: Any) -> Iterator[ProxyThread]:
    with running_proxy(triton_fleet.servers) as p:
        yield p


def in_flight(proxy: ProxyThread) -> int:
    """Requests the proxy holds in flight to instances of the model, read on its own loop."""

    async def read() -> int:
        return sum(i.model_in_flight.get(MODEL, 0) for i in proxy.runtime.fleet.all())

    return proxy.call(read())


async def sse(content: aiohttp.StreamReader) -> AsyncIterator[Any]:
    """Server-sent events' ``data:`` payloads, each yielded as soon as its line is parsed."""
    async for line in content:
        if line.startswith(b"data:"):
            yield json.loads(line[5:])


async def test_generate_stream_relays_events_as_generated(proxy: ProxyThread) -> None:
    url = f"http://{proxy.http}/v2/models/{MODEL}/generate_stream"
    log: list[str] = []
    first = asyncio.Event()
    still_open: list[bool] = []

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:

        async def read_a() -> list[Any]:
            async with session.post(url, json={"text_input": "long one", "max_tokens": LONG}) as a:
                assert a.status == 200
                assert a.headers["Content-Type"].startswith("text/event-stream")
                events = []
                async for event in sse(a.content):
                    events.append(event)
                    log.append(f"A{len(events)}")
                    if len(events) == 1:
                        # Read before this task yields to any other.
                        still_open.append(not a.content.is_eof())
                        first.set()
                return events

        reader = asyncio.create_task(read_a())
        started = asyncio.create_task(first.wait())
        await asyncio.wait({reader, started}, return_when=asyncio.FIRST_COMPLETED)
        assert first.is_set(), await reader  # raises the reader's error, if that was it
        assert still_open == [True], "the whole response had arrived with its first event"
        assert in_flight(proxy) == 1, "the proxy no longer held A when its first event came"
        async with session.post(url, json={"text_input": "short", "max_tokens": SHORT}) as b:
            assert b.status == 200
            b_events = [e async for e in sse(b.content)]
        log.append("B end")
        a_events = await reader

    assert len(a_events) == LONG and len(b_events) == SHORT
    assert all(set(e) == {"model_name", "model_version", "text_output"} for e in a_events)
    # B started after A's first event and ended before A's last one.
    assert log.index("A1") < log.index("B end") < log.index(f"A{LONG}"), log
    assert in_flight(proxy) == 0


def text_inputs(prompt: str, max_tokens: int) -> list[aiogrpcclient.InferInput]:
    text = aiogrpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    tokens = aiogrpcclient.InferInput("max_tokens", [1], "INT32")
    tokens.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    return [text, tokens]


async def test_stream_infer_relays_responses_as_generated(proxy: ProxyThread) -> None:
    log: list[str] = []
    first = asyncio.Event()
    at_first: list[int] = []

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": MODEL, "inputs": text_inputs("long one", LONG), "request_id": "A"}
        # B goes on the same stream, once A's first response has reached the client.
        await first.wait()
        yield {"model_name": MODEL, "inputs": text_inputs("short", SHORT), "request_id": "B"}

    async def read() -> dict[str, int]:
        counts = {"A": 0, "B": 0}
        async with aiogrpcclient.InferenceServerClient(proxy.grpc) as client:
            async for result, error in client.stream_infer(requests(), stream_timeout=TIMEOUT_S):
                assert error is None, error
                rid = result.get_response().id
                counts[rid] += 1
                log.append(f"{rid}{counts[rid]}")
                if log == ["A1"]:
                    at_first.append(in_flight(proxy))
                    first.set()
        return counts

    counts = await asyncio.wait_for(read(), TIMEOUT_S)

    assert counts == {"A": LONG, "B": SHORT}
    assert at_first == [1], "the proxy no longer held A when its first response came"
    # B was sent after A's first response and was answered in full before A's last one.
    assert log.index("A1") < log.index(f"B{SHORT}") < log.index(f"A{LONG}"), log
    assert in_flight(proxy) == 0
