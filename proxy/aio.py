"""Small asyncio helpers shared by the proxy's components."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel every task given (None: skipped), then wait until each has unwound; their
    cancellation is not re-raised here (a task that ended with another error still raises)."""
    running = [t for t in tasks if t is not None]
    for t in running:
        t.cancel()
    for t in running:
        with contextlib.suppress(asyncio.CancelledError):
            await t
