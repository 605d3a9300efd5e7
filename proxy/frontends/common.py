"""Decisions that the HTTP and gRPC frontends make alike: admin access and shared memory."""

from __future__ import annotations

import hmac
from typing import Literal

from proxy.config import AdminConfig, ProxyConfig
from proxy.errors import Code, ProxyError

SHARED_MEMORY_MESSAGE = (
    "shared memory is not supported through triton-proxy: the proxy forwards requests over "
    "the network to several Triton servers, so a region registered on this host cannot be "
    "read by them; send tensors in the request body (binary tensor extension) instead"
)

SharedMemoryKind = Literal["system", "cuda"]
SharedMemoryAction = Literal["status", "register", "unregister"]


def private_headers(config: ProxyConfig) -> frozenset[str]:
    """Header (and gRPC metadata) names the proxy consumes and never forwards, lower-case:
    ``Authorization`` (API keys and the admin token), the configured API-key header and the
    class header."""
    names = {"authorization", "proxy-authorization"}
    if config.scheduling is not None:
        names |= {config.scheduling.api_key_header.lower(), config.scheduling.class_header.lower()}
    return frozenset(names)


def check_admin(admin: AdminConfig, authorization: str | None) -> None:
    """Allow a model-control call only with admin enabled and ``Bearer <token>`` matching."""
    if not admin.enabled or not admin.token:
        raise ProxyError(
            Code.PERMISSION_DENIED,
            "model control through triton-proxy is disabled; enable it with admin.enabled "
            "and admin.token in the policy file",
        )
    given = (authorization or "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), admin.token.encode()):
        raise ProxyError(
            Code.PERMISSION_DENIED,
            "model control needs the admin token: send 'Authorization: Bearer <token>'",
        )


def shared_memory_call(kind: SharedMemoryKind, action: SharedMemoryAction, region: str) -> None:
    """Answer a shared-memory call as a Triton that can never hold a region would.

    Registering is refused with the reason. Status and unregister succeed the way Triton
    answers them with nothing registered (an empty list; unregister is a no-op), so clients
    that clean up regions before or after their work keep running. Returns when the call
    succeeds with an empty answer; raises :class:`ProxyError` otherwise.
    """
    if action == "register":
        raise ProxyError(Code.UNSUPPORTED, SHARED_MEMORY_MESSAGE)
    if action == "status" and region:
        # Triton's own message first, so clients matching on it still recognise it.
        raise ProxyError(
            Code.NOT_FOUND,
            f"Unable to find {kind} shared memory region: '{region}' ({SHARED_MEMORY_MESSAGE})",
        )
