"""Where every finished request's outcome fans out from: telemetry, controllers, tests.

The dispatcher builds one :class:`RequestRecord` per request it finished (answered, failed or
shed) and hands it to the runtime's :class:`RequestObservers`, once. Subscribers are called
synchronously on the request path: keep them cheap and do not raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RequestRecord:
    model: str
    """The model's metric label (``other`` for models no instance knows)."""
    class_name: str
    instance: str
    """The instance that answered, or ``-`` when none did (shed, unknown model, no instance)."""
    outcome: str
    """``ok``, an error code's name (``unavailable``...), or ``shed_<reason>``."""
    latency_s: float
    """Arrival at the dispatcher to the end of the exchange."""
    queue_wait_s: float
    """Time spent in the proxy's class queue (0 without scheduling)."""
    cost: float
    """The request's cost estimate (:attr:`proxy.request.Call.cost`)."""
    ran_alone: bool
    """No other request of the model was in flight on the instance while it ran."""
    at: float
    """Clock time when it finished."""


class RequestObserver(Protocol):
    def on_request(self, record: RequestRecord) -> None: ...


class RequestObservers:
    """The runtime's one fan-out point; subscribe with :meth:`add`."""

    def __init__(self, observers: Sequence[RequestObserver] = ()) -> None:
        self._observers: list[RequestObserver] = list(observers)

    def add(self, observer: RequestObserver) -> None:
        self._observers.append(observer)

    def remove(self, observer: RequestObserver) -> None:
        self._observers.remove(observer)

    def on_request(self, record: RequestRecord) -> None:
        for o in self._observers:
            o.on_request(record)
