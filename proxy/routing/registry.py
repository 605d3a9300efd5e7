"""The explicit list of routing policies, by the name the policy file uses."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final

from proxy.routing import (
    consistent_hash,
    expected_finish,
    expected_start,
    least_connections,
    least_requests,
    p2c,
    random_choice,
    round_robin,
    weighted_score,
)
from proxy.routing.base import Policy, PolicyFactory
from proxy.strict import ConfigError

POLICIES: Final[Mapping[str, PolicyFactory]] = {
    "round_robin": round_robin.factory,
    "random": random_choice.factory,
    "least_connections": least_connections.factory,
    "least_requests": least_requests.factory,
    "weighted_score": weighted_score.factory,
    "p2c": p2c.factory,
    "consistent_hash": consistent_hash.factory,
    "expected_start": expected_start.factory,
    "expected_finish": expected_finish.factory,
}


def build_policy(
    name: str,
    params: Mapping[str, Any] | None,
    rng: random.Random,
    *,
    path: str = "",
    source: str | None = None,
) -> Policy:
    """A new policy ``name`` with validated ``params``.

    Errors are :class:`ConfigError` naming ``path`` (where the policy sits in the policy file):
    an unknown name lists the known ones; a bad parameter names its key.
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(
            f"{path}.name" if path else "name",
            f"unknown routing policy {name!r}; known policies: {', '.join(sorted(POLICIES))}",
            source,
        )
    try:
        return factory(dict(params or {}), rng)
    except ConfigError as exc:
        inner = exc.path
        prefix = f"{inner or '<root>'}: "
        message = str(exc)
        message = message[len(prefix) :] if message.startswith(prefix) else message
        where = f"{path}.params" if path else "params"
        raise ConfigError(f"{where}.{inner}" if inner else where, message, source) from exc
