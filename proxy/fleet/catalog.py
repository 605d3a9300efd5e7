"""What the proxy needs to know about each model, read once from Triton's model config."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from proxy.clock import Clock
from proxy.errors import Code, ProxyError
from proxy.fleet.instances import Fleet, Instance
from proxy.fleet.upstream import HttpUpstreams
from proxy.frontends.routes import check_model_name


@dataclass(frozen=True)
class ModelInfo:
    max_batch_size: int
    priority_levels: int
    """``dynamic_batching.priority_levels`` (0 without priorities)."""
    model_instances: int
    """Total ``instance_group`` count: batches a Triton server executes at once."""
    decoupled: bool
    corrid_type: str | None = None
    """Data type of the sequence batcher's ``CONTROL_SEQUENCE_CORRID`` input, if declared."""
    default_priority_level: int = 0
    """``dynamic_batching.default_priority_level``: the level of a request without priority."""
    timeout_override: bool = False
    """Whether ``dynamic_batching.default_queue_policy`` honours a request's ``timeout``
    (:func:`_honours_timeout`)."""
    level_timeout_override: tuple[tuple[int, bool], ...] = ()
    """The same for each level with its own ``priority_queue_policy``."""
    max_queue_delay_s: float | None = None
    """``dynamic_batching.max_queue_delay_microseconds`` in seconds; None without a dynamic
    batcher."""

    def honours_timeout(self, priority: int | None) -> bool:
        """Whether Triton applies a request's ``timeout`` at this priority (None: unset).

        Triton reads ``timeout`` only in the dynamic batcher's queue, and only where that
        level's queue policy allows overrides *and* has a default timeout, which a request
        may only shorten (:func:`_honours_timeout`); priority 0, unset or above
        ``priority_levels`` means the default level.
        """
        level = priority or 0
        if not 0 < level <= self.priority_levels:
            level = self.default_priority_level
        return dict(self.level_timeout_override).get(level, self.timeout_override)

    def sequence_id_problem(self, sequence_id: int | str) -> str | None:
        """Why ``sequence_id`` must not reach this model, or None if it may.

        Triton 2.51 copies a string id into a numeric CORRID input's 8-byte buffer: short ids
        arrive as garbage numbers and long ones crash the whole server (measured).
        """
        if isinstance(sequence_id, str) and self.corrid_type not in (None, "TYPE_STRING"):
            return (
                f"this model's sequence batcher takes numeric correlation ids "
                f"(CONTROL_SEQUENCE_CORRID is {self.corrid_type}); send sequence_id as an "
                "integer (a string id corrupts or crashes Triton 2.51)"
            )
        return None


def _corrid_type(config: dict[str, Any]) -> str | None:
    for control_input in (config.get("sequence_batching") or {}).get("control_input") or []:
        for control in control_input.get("control") or []:
            if control.get("kind") == "CONTROL_SEQUENCE_CORRID":
                return str(control.get("data_type") or "TYPE_INVALID")
    return None


def _honours_timeout(policy: dict[str, Any] | None) -> bool:
    """Whether a queue policy applies a request's ``timeout``: it must allow overrides and
    have a ``default_timeout_microseconds``. Triton takes the request's value only when it
    is below the default (``PriorityQueue::PolicyQueue::Enqueue`` in Triton's core; the
    model config docs: a request "may not increase the timeout"), and no default (0) is
    never below: measured, a request with ``timeout`` 1 µs queued behind a running one on
    ``sleeper`` without a default ran (tests/integration/test_cancellation.py)."""
    policy = policy or {}
    default_us = int(policy.get("default_timeout_microseconds") or 0)
    return bool(policy.get("allow_timeout_override")) and default_us > 0


def _timeout_overrides(batching: dict[str, Any]) -> tuple[tuple[int, bool], ...]:
    levels = batching.get("priority_queue_policy") or {}
    return tuple(sorted((int(level), _honours_timeout(policy)) for level, policy in levels.items()))


def model_info(config: dict[str, Any]) -> ModelInfo:
    """Pick the fields that matter out of Triton's JSON model config."""
    dynamic = config.get("dynamic_batching")
    batching = dynamic or {}
    groups = config.get("instance_group") or []
    policy = config.get("model_transaction_policy") or {}
    return ModelInfo(
        max_batch_size=int(config.get("max_batch_size") or 0),
        priority_levels=int(batching.get("priority_levels") or 0),
        model_instances=sum(int(g.get("count") or 1) for g in groups) or 1,
        decoupled=bool(policy.get("decoupled")),
        corrid_type=_corrid_type(config),
        default_priority_level=int(batching.get("default_priority_level") or 0),
        # Without a dynamic batcher no queue policy applies, whatever the config says.
        timeout_override=dynamic is not None
        and _honours_timeout(batching.get("default_queue_policy")),
        level_timeout_override=_timeout_overrides(batching) if dynamic is not None else (),
        max_queue_delay_s=int(batching.get("max_queue_delay_microseconds") or 0) / 1e6
        if dynamic is not None
        else None,
    )


class _Unknown:
    """Every ready instance that answered said it has no such model."""


UNKNOWN = _Unknown()


class ModelCatalog:
    """Caches :class:`ModelInfo` per model, as one ready instance's config describes it.

    - Lookups are single-flight: concurrent requests for a model not yet cached share one
      config fetch, so a burst of requests costs one round trip, not one each.
    - A model no instance knows is remembered for ``negative_ttl_s`` in a cache of at most
      ``max_unknown`` names (oldest dropped first): invented names cannot grow memory, and
      each costs at most one fetch per TTL while it is cached.
    - Only models an instance has described enter the positive cache, so its size is bounded
      by what the fleet serves, not by what clients send.
    """

    def __init__(
        self,
        fleet: Fleet,
        upstreams: HttpUpstreams,
        clock: Clock,
        *,
        ttl_s: float = 60.0,
        negative_ttl_s: float = 2.0,
        max_unknown: int = 1024,
    ) -> None:
        self.fleet = fleet
        self.upstreams = upstreams
        self.clock = clock
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_unknown = max_unknown
        self._cache: dict[str, tuple[ModelInfo, float]] = {}
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._pending: dict[str, asyncio.Future[ModelInfo | None]] = {}
        self.fetches = 0
        """Config fetches started (each may try several instances)."""

    def cached(self, model: str) -> ModelInfo | None:
        entry = self._cache.get(model)
        return entry[0] if entry else None

    def unknown_count(self) -> int:
        return len(self._unknown)

    async def info(self, model: str) -> ModelInfo | None:
        """The model's info, or None when every ready instance says it has no such model.

        Raises :class:`ProxyError` (UNAVAILABLE) when no ready instance could be asked, and
        (INVALID_ARG) for a name the proxy does not relay (it would not be one path segment).
        """
        check_model_name(model)
        now = self.clock.now()
        entry = self._cache.get(model)
        if entry is not None and entry[1] > now:
            return entry[0]
        until = self._unknown.get(model)
        if until is not None and until > now:
            return None
        pending = self._pending.get(model)
        if pending is None:
            # The fetch is its own task: a requester that gives up does not cancel it for
            # the others waiting on it.
            pending = asyncio.ensure_future(self._refresh(model, entry))
            self._pending[model] = pending
            pending.add_done_callback(lambda task: self._settled(model, task))
        return await asyncio.shield(pending)

    def _settled(self, model: str, task: asyncio.Future[ModelInfo | None]) -> None:
        self._pending.pop(model, None)
        if not task.cancelled():
            task.exception()  # retrieved, so a fetch whose requesters all left logs no warning

    async def close(self) -> None:
        """Cancel fetches still running (shutdown)."""
        pending = list(self._pending.values())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _refresh(self, model: str, entry: tuple[ModelInfo, float] | None) -> ModelInfo | None:
        self.fetches += 1
        found = await self._fetch(model)
        now = self.clock.now()
        if isinstance(found, ModelInfo):
            self._cache[model] = (found, now + self.ttl_s)
            self._unknown.pop(model, None)
            return found
        if found is UNKNOWN:
            self._cache.pop(model, None)
            self._unknown[model] = now + self.negative_ttl_s
            self._unknown.move_to_end(model)
            while len(self._unknown) > self.max_unknown:
                self._unknown.popitem(last=False)
            return None
        if entry is not None:
            # No instance could be asked: a transient failure keeps what we knew.
            self._cache[model] = (entry[0], now + self.negative_ttl_s)
            return entry[0]
        raise ProxyError(
            Code.UNAVAILABLE,
            f"no ready Triton instance could describe model '{model}'",
        )

    def known(self) -> list[str]:
        """Models some instance has described."""
        return list(self._cache)

    def forget(self, model: str) -> None:
        self._cache.pop(model, None)
        self._unknown.pop(model, None)

    async def _fetch(self, model: str) -> ModelInfo | _Unknown | None:
        """The first ready instance's description; UNKNOWN when all that answered lack the
        model; None when none could be asked."""
        answered = False
        for instance in self.fleet.healthy():
            try:
                config = await self.describe(instance, model)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            answered = True
            if config is not None:
                return model_info(config)
        return UNKNOWN if answered else None

    async def describe(self, instance: Instance, model: str) -> dict[str, Any] | None:
        """The model's JSON config on ``instance``; None when Triton answers that it has no
        such model (4xx)."""
        timeout = aiohttp.ClientTimeout(total=self.fleet.health.timeout_s)
        async with self.upstreams.session(instance).get(
            f"/v2/models/{quote(model, safe='')}/config", timeout=timeout
        ) as resp:
            if 400 <= resp.status < 500:
                return None
            if resp.status != 200:
                raise ValueError(f"config of '{model}' answered {resp.status}")
            config = json.loads(await resp.read())
            if not isinstance(config, dict):
                raise ValueError(f"config of '{model}' is not a JSON object")
            return config
