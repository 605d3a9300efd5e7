"""Runs the real proxy in front of real Triton servers, for integration tests.

The proxy gets its own thread and event loop, like a separate server process: the blocking
``tritonclient`` clients then work from test code, and so do the aio ones on the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from proxy import config as config_mod
from proxy.app import BoundPorts, ProxyServer
from proxy.cli import local_policy
from proxy.local import TritonServer

T = TypeVar("T")


class ProxyThread:
    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.ports: BoundPorts | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> BoundPorts:
        self._thread.start()
        self.ports = self.call(self.proxy.start())
        return self.ports

    def stop(self) -> list[str]:
        """Stops the proxy; returns the names of tasks it left running (should be none)."""
        try:
            self.call(self.proxy.stop())
            return self.call(_leftover_tasks())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    @property
    def http(self) -> str:
        assert self.ports
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc(self) -> str:
        assert self.ports and self.ports.grpc
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def runtime(self) -> Any:
        return self.proxy.runtime


def policy_for(servers: Sequence[Any], policy: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = local_policy(servers, policy or {}, (0, 0, 0))
    doc["listen"]["host"] = "127.0.0.1"
    return doc


@contextlib.contextmanager
def running_proxy(
    servers: Sequence[Any], policy: dict[str, Any] | None = None, **kwargs: Any
) -> Iterator[ProxyThread]:
    """A proxy on free ports in front of ``servers``; asserts at exit that nothing leaked."""
    proxy = ProxyServer(config_mod.parse(policy_for(servers, policy), "<test>"), **kwargs)
    thread = ProxyThread(proxy)
    thread.start()
    try:
        yield thread
    finally:
        tasks = thread.stop()
        leaked = {i.name: i.in_flight for i in proxy.runtime.fleet.all() if i.in_flight}
        assert not leaked, f"in-flight tokens leaked: {leaked}"
        assert not tasks, f"tasks left running after stop: {tasks}"


async def _leftover_tasks() -> list[str]:
    await asyncio.sleep(0.05)  # let cancelled handlers finish unwinding
    me = asyncio.current_task()
    return [t.get_name() for t in asyncio.all_tasks() if t is not me and not t.done()]


async def until(
    condition: Callable[[], bool], timeout_s: float = 10.0, failure: str = "condition not reached"
) -> None:
    """Wait (polling every 10 ms) until ``condition()`` holds; fail with ``failure`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.01)


def triton_successes(server: TritonServer, model: str) -> int:
    """What Triton itself counted: successful inferences of ``model`` on this server."""
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/stats", timeout=5) as r:
        stats = json.loads(r.read())
    return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])


def settled_successes(servers: Sequence[TritonServer], model: str) -> dict[str, int]:
    """Each server's count once it has stopped moving. Triton counts a success after it has
    sent the answer, so a request just answered (this test's last, or an earlier test's) may
    not be counted yet: one such request moved a count by one in CI (``a55dcc6``)."""
    counts = {s.name: triton_successes(s, model) for s in servers}
    for _ in range(50):
        time.sleep(0.1)
        again = {s.name: triton_successes(s, model) for s in servers}
        if again == counts:
            return counts
        counts = again
    raise AssertionError(f"Triton's success counts for {model!r} kept moving: {counts}")


def sleeper_body(delay_ms: int, parameters: dict[str, Any] | None = None) -> bytes:
    """A KServe JSON request for model ``sleeper``: sleep ``delay_ms``, with ``parameters``."""
    doc: dict[str, Any] = {
        "inputs": [{"name": "DELAY_MS", "shape": [1, 1], "datatype": "INT32", "data": [delay_ms]}]
    }
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()
