"""The policy file: strict parse, defaults in one place, frozen result.

Each subsystem owns the dataclass of its own section; this module only composes them, loads
YAML and reports errors with the file, the path inside it and a hint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from proxy import strict
from proxy.canary import CanaryConfig
from proxy.control.config import ControlConfig
from proxy.fleet.instances import HealthConfig, InstanceSpec
from proxy.leadership import LeadershipConfig
from proxy.routing.config import RoutingConfig, check_policies, with_class_defaults
from proxy.scheduling.config import SchedulingConfig
from proxy.strict import ConfigError


@dataclass(frozen=True)
class ListenConfig:
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    """The proxy's own Prometheus metrics (``/metrics``), on Triton's usual metrics port."""
    backlog: int = 4096
    """Connections the kernel completes and holds before the proxy accepts them (the HTTP and
    gRPC ports' listen queues, with the ``h2`` engine; the kernel caps it at
    ``net.core.somaxconn``). aiohttp's default of 128 overflowed when many clients connected at
    once, and every overflow costs the client a SYN retransmission (1 s, then 3 s): measured,
    the issue 10 benchmark's proxy arms collapsed to P50s of seconds at 2x load with the
    machine 60% idle (``TcpExtListenOverflows``). The queue must also be emptied as fast as it
    fills: :mod:`proxy.listener` says why the ports do not use uvloop's own listener."""
    grpc_engine: str = "h2"
    """What speaks gRPC, to clients and to Triton: ``h2``, the proxy's own HTTP/2 relay
    (:mod:`proxy.h2`, about a fifth of the CPU per call), or ``grpcio`` (``grpc.aio``, the
    reference implementation). Read at start-up; a reload keeps the running one."""

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be a port number (0 picks a free one)")
        if self.backlog < 1:
            raise ValueError("backlog must be >= 1")
        if self.grpc_engine not in ("h2", "grpcio"):
            raise ValueError("grpc_engine must be 'h2' or 'grpcio'")


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted (HTTP and gRPC messages alike)."""
    max_buffered_bytes: int = 1024 * 1024 * 1024
    """Request bodies held in memory at once (queued and in flight); beyond: 429."""
    connect_timeout_s: float = 2.0
    """A connection not made in this time counts as "never reached": retried elsewhere."""
    request_timeout_s: float | None = 120.0
    """Longest wait for an instance's answer (HTTP: for its next bytes, so a stream may run
    longer as long as events keep coming; gRPC unary: the whole call, or the client's deadline
    if sooner). Past it the client gets 504 / DEADLINE_EXCEEDED. None: no limit."""
    connections_per_instance: int = 512
    drain_timeout_s: float = 10.0
    """On shutdown, how long queued and in-flight requests may finish before they get 503 or
    are cancelled."""
    cancel_upstream: bool = True
    """Stop work nobody waits for: a client that leaves (or whose deadline passes) cancels its
    request in the proxy's queue and upstream, and the rest of a client deadline is handed to
    Triton as the request's ``timeout``. ``false`` ignores deadlines and lets such requests run
    to the end (their answers are dropped): only for comparison (docs/cancellation.md)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError("max_buffered_bytes must be >= max_body_bytes")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0 (or null for no limit)")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.connections_per_instance < 1:
            raise ValueError("connections_per_instance must be >= 1")


@dataclass(frozen=True)
class AdminConfig:
    """Model control (repository load/unload/index, trace and log settings) is off by default."""

    enabled: bool = False
    token: str | None = field(default=None, metadata=strict.SECRET)
    token_env: str | None = None
    """Name of an environment variable holding the token (keeps secrets out of the file)."""

    def __post_init__(self) -> None:
        if self.token is None and self.token_env:
            object.__setattr__(self, "token", os.environ.get(self.token_env))
        if self.enabled and not self.token:
            raise ValueError("admin.enabled needs a token (admin.token or admin.token_env)")


@dataclass(frozen=True)
class SequencesConfig:
    max_entries: int = 100_000
    idle_timeout_s: float = 600.0


@dataclass(frozen=True)
class ScrapeConfig:
    """Polling of each instance's Triton ``/metrics``."""

    interval_s: float = 1.0
    window_s: float = 10.0
    """Sliding window over which queue/compute times and rates are averaged."""
    timeout_s: float | None = None
    """Per-scrape timeout; None means the interval."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s < self.interval_s:
            raise ValueError("need interval_s > 0 and window_s >= interval_s")


@dataclass(frozen=True)
class ProxyConfig:
    instances: tuple[InstanceSpec, ...]
    listen: ListenConfig = field(default_factory=ListenConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    sequences: SequencesConfig = field(default_factory=SequencesConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    scheduling: SchedulingConfig | None = None
    """Priority classes; without this section every request is dispatched at once."""
    control: ControlConfig = field(default_factory=ControlConfig)
    """The SLO feedback loops (class limits, batching window); all off by default."""
    leadership: LeadershipConfig = field(default_factory=LeadershipConfig)
    """Which replica may change the fleet's configuration (proxy.leadership)."""
    canary: CanaryConfig | None = None
    """A second routing and/or scheduling configuration serving a share of the traffic."""

    def __post_init__(self) -> None:
        if not self.instances:
            raise ValueError("instances: at least one Triton instance is needed")
        names = [i.name for i in self.instances]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"instances: duplicate names {', '.join(dupes)}")


def parse(data: Any, source: str | None = None) -> ProxyConfig:
    config = _class_defaults(strict.load(ProxyConfig, data, "", source), data)
    # Policy parameters are checked at load, not on a model's first request.
    check_policies(config.routing, "routing", source)
    if config.canary is not None and config.canary.routing is not None:
        check_policies(config.canary.routing, "canary.routing", source)
    return config


def _class_defaults(config: ProxyConfig, data: Any) -> ProxyConfig:
    """With priority classes, the routing an arm's file leaves out is the measured one
    (:func:`proxy.routing.config.with_class_defaults`): for the main arm when it has a
    ``scheduling`` section, for a canary with its own ``routing`` section when its classes
    (its own, or the main arm's) are on."""
    raw = data if isinstance(data, Mapping) else {}
    if config.scheduling is not None:
        routing = with_class_defaults(config.routing, raw.get("routing"))
        config = replace(config, routing=routing)
    canary = config.canary
    if canary is None or canary.routing is None:
        return config
    if (canary.scheduling or config.scheduling) is None:
        return config
    raw_canary = raw.get("canary")
    raw_routing = raw_canary.get("routing") if isinstance(raw_canary, Mapping) else None
    routing = with_class_defaults(canary.routing, raw_routing)
    return replace(config, canary=replace(canary, routing=routing))


def read_document(path: str | Path) -> Any:
    """The YAML document in ``path``; errors name the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("", f"cannot read policy file: {exc.strerror}", str(path)) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"invalid YAML: {exc}", str(path)) from exc


def load_file(path: str | Path) -> ProxyConfig:
    return parse(read_document(path), str(path))
