"""The one model-control client: Triton's repository API on one instance or on all of them.

Two users share it. The admin frontends (HTTP and gRPC) forward a client's load / unload /
settings call to every instance through :func:`to_every_instance`, each with its own protocol
encoding of one exchange, and answer the first failure as :func:`FanOut.failure` words it. The
batching-window controller uses :class:`ModelControl` to read a model's current config and
reload it with an override, on one instance at a time.

A config override replaces the whole config (Triton does not merge), so
:meth:`ModelControl.load` is always given a complete config read from the same instance.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import aiohttp

from proxy.fleet.instances import Instance
from proxy.fleet.upstream import HttpUpstreams

R = TypeVar("R")
C = TypeVar("C")


def failure_message(message: str, instance: str, failed: int, total: int) -> str:
    """The error of a call sent to every instance, naming where it failed."""
    if total <= 1:
        return message
    return f"{message} (on instance '{instance}'; {failed} of {total} instances failed)"


class InstanceFailure(Exception, Generic[C]):
    """One instance refused or could not be reached; ``code`` is the protocol's own code."""

    def __init__(self, code: C, message: str, raw: bytes | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.raw = raw
        """The instance's answer as it came, for a frontend that passes it through."""


@dataclass
class FanOut(Generic[R, C]):
    answers: list[tuple[str, R]] = field(default_factory=list)
    failures: list[tuple[str, InstanceFailure[C]]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.answers) + len(self.failures)

    def failure(self) -> tuple[InstanceFailure[C], str] | None:
        """The first failure and its message naming the instance, or None if all succeeded."""
        if not self.failures:
            return None
        name, first = self.failures[0]
        return first, failure_message(first.message, name, len(self.failures), self.total)


async def to_every_instance(
    instances: Iterable[Instance],
    call: Callable[[Instance], Awaitable[R]],
) -> FanOut[R, Any]:
    """Run ``call`` on each instance in turn (sequentially: a repository change is heavy).

    ``call`` raises :class:`InstanceFailure` for an instance that refused or was unreachable;
    every instance is tried whatever the others answered, as Triton's users expect a load
    sent "to the fleet" to reach every server that can take it.
    """
    out: FanOut[R, Any] = FanOut()
    for instance in instances:
        try:
            out.answers.append((instance.name, await call(instance)))
        except InstanceFailure as exc:
            out.failures.append((instance.name, exc))
    return out


class ModelControlError(Exception):
    """A repository call failed; ``refused`` when the server does not allow model control."""

    def __init__(self, instance: str, message: str, *, status: int, refused: bool) -> None:
        super().__init__(f"{instance}: {message}")
        self.instance = instance
        self.message = message
        self.status = status
        self.refused = refused


# Triton's answer to a load/unload when it was not started with --model-control-mode=explicit
# ("explicit model load / unload is not allowed if polling is enabled", and the same wording in
# 'none' mode).
_REFUSED_MARKERS = ("not allowed",)


def _path(model: str, suffix: str = "") -> str:
    return f"/v2/models/{quote(model, safe='')}{suffix}"


def _repo_path(model: str, action: str) -> str:
    return f"/v2/repository/models/{quote(model, safe='')}/{action}"


class ModelControl:
    """Triton's repository API over the proxy's pooled HTTP clients (one per instance)."""

    def __init__(self, upstreams: HttpUpstreams, *, timeout_s: float = 120.0) -> None:
        self.upstreams = upstreams
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(
        self, instance: Instance, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> tuple[int, bytes]:
        session = self.upstreams.session(instance)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            async with session.request(
                method, path, data=data, headers=headers, timeout=self.timeout
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ModelControlError(
                instance.name, f"unreachable: {exc!r}", status=503, refused=False
            ) from exc

    def _check(self, instance: Instance, status: int, data: bytes) -> None:
        if status < 400:
            return
        try:
            message = str(json.loads(data).get("error", "")) if data else ""
        except (ValueError, AttributeError):
            message = data[:200].decode(errors="replace")
        refused = any(m in message for m in _REFUSED_MARKERS)
        raise ModelControlError(instance.name, message or f"HTTP {status}", status=status,
                                refused=refused)  # fmt: skip

    async def config(self, instance: Instance, model: str) -> dict[str, Any]:
        """The model's config as the instance runs it (``GET /v2/models/NAME/config``)."""
        status, data = await self._call(instance, "GET", _path(model, "/config"))
        self._check(instance, status, data)
        parsed = json.loads(data)
        if not isinstance(parsed, dict):
            raise ModelControlError(instance.name, "config is not an object", status=500,
                                    refused=False)  # fmt: skip
        return parsed

    async def ready(self, instance: Instance, model: str) -> bool:
        try:
            status, _ = await self._call(instance, "GET", _path(model, "/ready"))
        except ModelControlError:
            return False
        return status == 200

    async def load(self, instance: Instance, model: str, config: Mapping[str, Any] | None) -> None:
        """Load (or reload) ``model``; with ``config``, that whole config replaces the file's."""
        body: dict[str, Any] | None = None
        if config is not None:
            body = {"parameters": {"config": json.dumps(config)}}
        status, data = await self._call(instance, "POST", _repo_path(model, "load"), body)
        self._check(instance, status, data)

    async def unload(self, instance: Instance, model: str) -> None:
        status, data = await self._call(instance, "POST", _repo_path(model, "unload"), {})
        self._check(instance, status, data)

    async def index(self, instance: Instance) -> list[dict[str, Any]]:
        status, data = await self._call(instance, "POST", "/v2/repository/index", {})
        self._check(instance, status, data)
        parsed = json.loads(data)
        return parsed if isinstance(parsed, list) else []

    async def wait_ready(self, instance: Instance, model: str, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if await self.ready(instance, model):
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.1)

    async def load_everywhere(
        self, instances: Iterable[Instance], model: str, config: Mapping[str, Any] | None
    ) -> FanOut[None, int]:
        """Load ``model`` on every instance in turn; failures are collected, not raised."""

        async def one(instance: Instance) -> None:
            try:
                await self.load(instance, model, config)
            except ModelControlError as exc:
                raise InstanceFailure(exc.status, exc.message) from exc

        return await to_every_instance(instances, one)


def batching_window_us(config: Mapping[str, Any]) -> int | None:
    """``dynamic_batching.max_queue_delay_microseconds`` of a config as Triton returns it."""
    batching = config.get("dynamic_batching")
    if not isinstance(batching, dict):
        return None
    value = batching.get("max_queue_delay_microseconds", 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def with_batching_window(config: Mapping[str, Any], window_us: int) -> dict[str, Any]:
    """A copy of ``config`` where only the batching window differs."""
    out = json.loads(json.dumps(config))
    batching = out.get("dynamic_batching")
    if not isinstance(batching, dict):
        raise ValueError("the model has no dynamic_batching section")
    batching["max_queue_delay_microseconds"] = int(window_us)
    return dict(out)
