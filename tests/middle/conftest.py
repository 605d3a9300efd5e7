"""The middle ring: the real proxy (in-process, its own thread) in front of fake Triton
servers that record what they receive. Runs in seconds; no tritonserver needed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.triton import FakeFleet
from tests.integration.harness import ProxyThread, running_proxy

# Fast health reactions: the fakes answer in microseconds.
FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.middle)


@pytest.fixture
def fakes() -> Iterator[FakeFleet]:
    with FakeFleet(3) as fleet:
        yield fleet


def with_defaults(policy: dict[str, Any] | None) -> dict[str, Any]:
    doc = dict(policy or {})
    doc.setdefault("health", FAST_HEALTH)
    doc.setdefault("limits", {"connect_timeout_s": 1.0})
    return doc


ProxyFactory = Callable[..., contextlib.AbstractContextManager[ProxyThread]]


@pytest.fixture
def proxy_on(fakes: FakeFleet) -> ProxyFactory:
    """``with proxy_on(policy) as proxy:`` the real proxy in front of ``fakes``."""

    def make(policy: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return running_proxy(fakes.servers, with_defaults(policy), **kwargs)

    return make


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s} s"
        time.sleep(0.02)
