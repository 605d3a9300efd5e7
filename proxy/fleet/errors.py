"""How a forwarded request failed on the way, as the dispatcher needs to tell it."""

from __future__ import annotations


class UpstreamConnectError(Exception):
    """No byte of the request reached the instance: safe to retry elsewhere."""


class UpstreamLostError(Exception):
    """The instance received the request, then the connection broke: not retried."""
