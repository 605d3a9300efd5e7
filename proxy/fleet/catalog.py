"""What the proxy needs to know about each model, read once from Triton's model config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from proxy.clock import Clock
from proxy.fleet.instances import Fleet
from proxy.fleet.upstream import HttpUpstreams


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


def model_info(config: dict[str, Any]) -> ModelInfo:
    """Pick the fields that matter out of Triton's JSON model config."""
    batching = config.get("dynamic_batching") or {}
    groups = config.get("instance_group") or []
    policy = config.get("model_transaction_policy") or {}
    return ModelInfo(
        max_batch_size=int(config.get("max_batch_size") or 0),
        priority_levels=int(batching.get("priority_levels") or 0),
        model_instances=sum(int(g.get("count") or 1) for g in groups) or 1,
        decoupled=bool(policy.get("decoupled")),
        corrid_type=_corrid_type(config),
    )


class ModelCatalog:
    """Caches :class:`ModelInfo` per model; an unknown model is remembered briefly."""

    def __init__(
        self,
        fleet: Fleet,
        upstreams: HttpUpstreams,
        clock: Clock,
        *,
        ttl_s: float = 60.0,
        negative_ttl_s: float = 2.0,
    ) -> None:
        self.fleet = fleet
        self.upstreams = upstreams
        self.clock = clock
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._cache: dict[str, tuple[ModelInfo | None, float]] = {}

    def cached(self, model: str) -> ModelInfo | None:
        entry = self._cache.get(model)
        return entry[0] if entry else None

    async def info(self, model: str) -> ModelInfo | None:
        """The model's info, or None when no ready instance knows the model."""
        entry = self._cache.get(model)
        now = self.clock.now()
        if entry is not None and entry[1] > now:
            return entry[0]
        info = await self._fetch(model)
        if info is None and entry is not None and entry[0] is not None:
            info = entry[0]  # a transient failure keeps what we knew
        self._cache[model] = (info, now + (self.ttl_s if info else self.negative_ttl_s))
        return info

    def known(self) -> list[str]:
        """Models some instance has described."""
        return [model for model, (info, _) in self._cache.items() if info is not None]

    def forget(self, model: str) -> None:
        self._cache.pop(model, None)

    async def _fetch(self, model: str) -> ModelInfo | None:
        timeout = aiohttp.ClientTimeout(total=self.fleet.health.timeout_s)
        for instance in self.fleet.healthy():
            try:
                async with self.upstreams.session(instance).get(
                    f"/v2/models/{quote(model, safe='')}/config", timeout=timeout
                ) as resp:
                    if resp.status != 200:
                        continue
                    return model_info(json.loads(await resp.read()))
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
        return None
