"""The routing section of the policy file, as a frozen dataclass."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from proxy import strict
from proxy.routing.feedback import FeedbackParams
from proxy.routing.registry import build_policy
from proxy.routing.retry import RetryParams
from proxy.routing.wake import WakeParams


@dataclass(frozen=True)
class PolicySpec:
    name: str = "least_requests"
    """A key of :data:`proxy.routing.registry.POLICIES`. Without priority classes the default
    is the policy with the lowest tail latency in the benchmark without them
    (docs/benchmarks.md): the proxy's own in-flight counts are exact and immediate, while
    scraped metrics lag by up to a scrape interval. With classes, :data:`CLASS_POLICY`."""
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
    occupancy_depth: float = 0.0
    """Above 0: the long work of a class without ``max_per_instance`` is packed
    (``pack_above``) by the model's *fill* instead of its occupancy: the mean of its requests
    in flight per instance over this share of its ``max_batch_size`` (at least one request),
    at most 1 (``proxy.routing.occupancy``; with 0.25, full while the instances hold a quarter
    batch each on average), from ``fill_from_load`` on. A class with ``max_per_instance`` (a
    throughput lane) still reads the occupancy, the share of instances with anything in
    flight. 0 (the default where a file names a routing policy): every class reads the
    occupancy; with classes and no policy named, :data:`CLASS_FILL`. Measured
    (docs/benchmarks.md, issue 10, thirty-seventh round, 3 repetitions): 0.25 alone (no
    ``fill_from_load``) with the class default on six servers at half their capacity took
    online's P99 from 1.3-3.8x HAProxy's to 0.48-0.62x (the busy share hovered at 0.9 there,
    and each time it passed every long request went to one lane instance, which ran online's
    512-token rows in 15-row batches); on three servers at their FIFO capacity it cost
    real-time's tail (``case.yaml`` P99 47.6 against 37.0 ms, ``burst.yaml`` 134 against 85:
    online's long rows, replayed rather than packed, padded real-time's batches), which
    ``fill_from_load`` avoids."""
    fill_from_load: float = 0.0
    """With ``occupancy_depth``: the fill decides only while the model's *long load* (the
    device time per second that the long requests of classes without ``max_per_instance``
    would take in full batches, on its learned cost curve, in instances' worth;
    ``proxy.routing.occupancy.LongLoad``) is at least this; below it the occupancy decides,
    as without ``occupancy_depth``. 0 (the default where a file names a routing policy): the
    fill always decides. Why a load: the lane holds that long work on one instance until it
    is ``lane_depth`` deep, right while one instance runs it in its stride and wrong once it
    needs most of one (``proxy.routing.occupancy``)."""

    def __post_init__(self) -> None:
        if self.stale_after_s <= 0:
            raise ValueError("stale_after_s must be > 0")
        if not 0.0 < self.stale_weight <= 1.0:
            raise ValueError("stale_weight must be in (0, 1]")
        if not 0.0 <= self.occupancy_depth <= 1.0:
            raise ValueError("occupancy_depth must be within [0, 1]")
        if not 0.0 <= self.fill_from_load < float("inf"):
            raise ValueError("fill_from_load must be a finite number >= 0")
        if not self.session_header:
            raise ValueError("session_header must not be empty")
        if not self.session_metadata or self.session_metadata != self.session_metadata.lower():
            raise ValueError("session_metadata must be a non-empty lower-case gRPC metadata key")

    def policy_for(self, model: str) -> PolicySpec:
        return self.models.get(model, self.policy)


CLASS_POLICY = PolicySpec(
    "expected_finish",
    {
        "count_delays": True,
        "pack_above": 0.9,
        "pack_capped": "backlogged",
        "short_reserve": 1,
        "reserve_spread": True,
    },
)
"""The routing policy when priority classes are on and the file names none: the placement
issue 10's benchmark measured against round robin with Triton priorities and HAProxy
(docs/benchmarks.md, issue 10; ``policies/mixed-traffic.yaml`` is the same with the
throughput class's lane on top). ``short_reserve: 1`` since session 34 (the lane never takes
the last instance free of long work; the bench arm ``proxy_classes_default+adaptive+reserve``,
thirty-fourth round); ``reserve_spread`` since session 44 (the reserve holds the long work
the fill does not pack too; the arm ``...+starved2+rspread``, forty-fourth round). Without
classes the default stays :class:`PolicySpec`'s."""

CLASS_WAKE = WakeParams(
    scan_ms=3.0,
    nudge=True,
    expired_copy=True,
    real_copy=False,
    ring_after_ms=3.0,
)
"""The wake that goes with :data:`CLASS_POLICY` when the file gives neither a policy nor a
wake: the benchmark's doorbell (an expired copy after 3 ms of silence, a scan every 3 ms),
and no copy that runs is ever sent (``real_copy: false``). Only a model whose queue policy
honours a request's timeout (``allow_timeout_override`` and a
``default_timeout_microseconds``) gets expired copies; the others keep the redirect wake
with its own defaults (``margin``, ``min_quiet_ms``), as without classes: the benchmark's
tighter 1.5 batch times and 6 ms were measured only with copies on."""


CLASS_FILL: Mapping[str, Any] = {"occupancy_depth": 0.25, "fill_from_load": 0.5}
"""The fill that goes with :data:`CLASS_POLICY` (each key unless the file gives it): an
uncapped class's long work is packed by the fill (a quarter batch in flight per instance on
average) once it would keep half an instance busy in full batches, by the busy share below.
Measured (docs/benchmarks.md, issue 10, thirty-eighth round, 3 repetitions): on six servers
at ``long_share.yaml`` x2 online's P99 0.58x HAProxy's against 1.76x without it; on three
servers at ``case.yaml`` and ``burst.yaml`` x1, where the fill alone had cost real-time's
tail (thirty-seventh round), the long load stays near 0.1 and nothing changes."""


def with_class_defaults(config: RoutingConfig, data: Any) -> RoutingConfig:
    """``config`` for an arm with priority classes, loaded from ``data`` (the raw routing
    section, or None): where ``data`` names no ``policy`` the policy is :data:`CLASS_POLICY`,
    the fill's keys not given are :data:`CLASS_FILL`'s, and, unless ``data`` has a ``wake``,
    the wake is :data:`CLASS_WAKE`. Keys given in the file always win; a file that names a
    policy keeps every other default as it is."""
    given = data if isinstance(data, Mapping) else {}
    if "policy" in given:
        return config
    named = {str(k).replace("-", "_") for k in given}
    fill = {k: v for k, v in CLASS_FILL.items() if k not in named}
    wake = config.wake if "wake" in named else CLASS_WAKE
    return replace(config, policy=CLASS_POLICY, wake=wake, **fill)


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
