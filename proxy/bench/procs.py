"""Child processes of the benchmark (HAProxy, a proxy under test): stopping them."""

from __future__ import annotations

import asyncio
import contextlib
import signal


async def stop_process(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; a process already gone is fine."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
