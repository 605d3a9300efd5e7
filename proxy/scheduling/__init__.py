"""Request classes, their queues, admission, anti-starvation and shedding.

``config`` holds the policy section, ``classify`` maps headers to a class, ``queues`` is the
pure scheduling core and ``gate`` its asyncio wrapper used by the frontends.
"""

from proxy.scheduling.classify import Classifier
from proxy.scheduling.config import (
    AgingConfig,
    ApiKeyConfig,
    ClassConfig,
    SchedulingConfig,
    derive_concurrency,
    load_scheduling,
)
from proxy.scheduling.gate import (
    Admission,
    DispatchRecord,
    Gate,
    GateObserver,
    RecordingObserver,
    Shed,
    Ticket,
)
from proxy.scheduling.queues import ClassQueues, Entry, PushResult, ShedReason

__all__ = [
    "Admission",
    "AgingConfig",
    "ApiKeyConfig",
    "ClassConfig",
    "ClassQueues",
    "Classifier",
    "DispatchRecord",
    "Entry",
    "Gate",
    "GateObserver",
    "PushResult",
    "RecordingObserver",
    "SchedulingConfig",
    "Shed",
    "ShedReason",
    "Ticket",
    "derive_concurrency",
    "load_scheduling",
]
