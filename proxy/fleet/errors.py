"""How a forwarded request failed on the way, as the dispatcher needs to tell it.

(Here rather than in :mod:`proxy.fleet.upstream`, which re-exports them, so that both upstream
clients, aiohttp's and :mod:`proxy.fleet.http1`, can raise them without an import cycle.)
"""

from __future__ import annotations


class UpstreamConnectError(Exception):
    """No byte of the request reached the instance: safe to retry elsewhere."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        """The instance's host refused the connection: nothing listens there (eject at once)."""


class UpstreamLostError(Exception):
    """The connection broke while the instance had the request."""

    def __init__(self, message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response
        """No byte of the answer had arrived: a stateless request may be retried elsewhere."""


class UpstreamTimeoutError(Exception):
    """The instance did not answer within ``limits.request_timeout_s``."""
