"""The routing section of the policy file, as a frozen dataclass."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy import strict
from proxy.routing.feedback import FeedbackParams
from proxy.routing.registry import build_policy
from proxy.routing.retry import RetryParams
from proxy.routing.wake import WakeParams


@dataclass(frozen=True)
class PolicySpec:
    name: str = "least_requests"
    """A key of :data:`proxy.routing.registry.POLICIES`. The default is the policy with the
    lowest tail latency in our benchmark (docs/benchmarks.md): the proxy's own in-flight counts
    are exact and immediate, while scraped metrics lag by up to a scrape interval."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The policy's own parameters (validated by the policy's params dataclass)."""


@dataclass(frozen=True)
class RoutingConfig:
    policy: PolicySpec = field(default_factory=PolicySpec)
    """Policy for every model without an override."""
    models: Mapping[str, PolicySpec] = field(default_factory=dict)
    """Per-model overrides: model name -> policy."""
    session_header: str = "x-session-id"
    """HTTP header carrying the session key (affinity for ``consistent_hash``)."""
    session_metadata: str = "x-session-id"
    """gRPC metadata key carrying the session key (lower-case, as gRPC requires)."""
    stale_after_s: float = 5.0
    """A snapshot older than this is stale: still used, but penalised."""
    stale_weight: float = 0.5
    """Multiplies ``Candidate.weight`` of an instance with a stale snapshot."""
    feedback: FeedbackParams = field(default_factory=FeedbackParams)
    retry: RetryParams = field(default_factory=RetryParams)
    wake: WakeParams = field(default_factory=WakeParams)
    """Send the next short request to an instance whose queued requests Triton may have left
    waiting (``proxy.routing.wake``)."""

    def __post_init__(self) -> None:
        if self.stale_after_s <= 0:
            raise ValueError("stale_after_s must be > 0")
        if not 0.0 < self.stale_weight <= 1.0:
            raise ValueError("stale_weight must be in (0, 1]")
        if not self.session_header:
            raise ValueError("session_header must not be empty")
        if not self.session_metadata or self.session_metadata != self.session_metadata.lower():
            raise ValueError("session_metadata must be a non-empty lower-case gRPC metadata key")

    def policy_for(self, model: str) -> PolicySpec:
        return self.models.get(model, self.policy)


def load_routing_config(
    data: Any, path: str = "routing", source: str | None = None
) -> RoutingConfig:
    """Strictly load the routing section, including every policy's name and parameters."""
    config = strict.load(RoutingConfig, data, path, source)
    check_policies(config, path, source)
    return config


def check_policies(config: RoutingConfig, path: str = "routing", source: str | None = None) -> None:
    """Build every named policy once and throw it away: bad names or parameters fail at load."""
    specs = [(f"{path}.policy", config.policy)]
    specs += [(f"{path}.models.{model}", spec) for model, spec in config.models.items()]
    for where, spec in specs:
        build_policy(spec.name, spec.params, random.Random(0), path=where, source=source)
