"""HAProxy as a benchmark arm: write its config, start it, wait until it answers, stop it.

HAProxy from Debian's package (``apt-get install haproxy``) is the well-known baseline:

- ``leastconn``: the server with the fewest open connections (per-request in HTTP mode);
- ``random(2)``: power of two random choices on the same connection count;
- ``session``: ``balance hdr(x-session-id)`` with ``hash-type consistent`` and
  ``hash-balance-factor 150`` (consistent hashing with bounded loads: a server above 1.5x the
  average load is skipped); requests without the header are balanced round robin.

Every response carries ``x-served-by: <server name>`` so the client can attribute load to
instances. As root, HAProxy here cannot raise its file-descriptor limit past 20000, and exits
at start if ``maxconn`` asks for more; the defaults keep ``maxconn`` well under that.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import aiohttp

from proxy.bench.procs import stop_process
from proxy.local.fleet import log_tail

Balance = Literal["leastconn", "random2", "session"]
BALANCES: tuple[Balance, ...] = ("leastconn", "random2", "session")

_BALANCE_LINES: dict[Balance, tuple[str, ...]] = {
    "leastconn": ("balance leastconn",),
    "random2": ("balance random(2)",),
    "session": (
        "balance hdr(x-session-id)",
        "hash-type consistent",
        "hash-balance-factor 150",
    ),
}


class HAProxyError(RuntimeError):
    pass


@dataclass(frozen=True)
class Backend:
    name: str
    http_url: str
    """``http://host:port`` of a Triton server's HTTP endpoint."""


def render_config(
    backends: Sequence[Backend],
    balance: Balance,
    port: int,
    *,
    maxconn: int = 4000,
    server_maxconn: int = 1000,
    timeout_s: float = 120.0,
    nbthread: int | None = None,
) -> str:
    """The whole ``haproxy.cfg`` text for one arm."""
    if not backends:
        raise ValueError("HAProxy needs at least one backend")
    if balance not in _BALANCE_LINES:
        raise ValueError(f"unknown balance {balance!r}; known: {', '.join(BALANCES)}")
    servers = []
    for b in backends:
        parts = urlsplit(b.http_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"backend {b.name}: expected http://host:port, got {b.http_url!r}")
        servers.append(
            f"    server {b.name} {parts.hostname}:{parts.port} maxconn {server_maxconn}"
        )
    t = f"{int(timeout_s * 1000)}ms"
    lines = [
        "global",
        f"    maxconn {maxconn}",
        *([f"    nbthread {nbthread}"] if nbthread else []),
        "",
        "defaults",
        "    mode http",
        "    option http-keep-alive",
        "    timeout connect 5s",
        f"    timeout client {t}",
        f"    timeout server {t}",
        "    timeout http-keep-alive 60s",
        f"    timeout queue {t}",
        "",
        "frontend bench",
        f"    bind 127.0.0.1:{port}",
        "    default_backend triton",
        "",
        "backend triton",
        *(f"    {line}" for line in _BALANCE_LINES[balance]),
        "    http-response set-header x-served-by %[srv_name]",
        *servers,
        "",
    ]
    return "\n".join(lines)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def haproxy_binary() -> str:
    path = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    if path is None:
        raise HAProxyError("haproxy is not installed; on Debian/Ubuntu: apt-get install -y haproxy")
    return path


@contextlib.asynccontextmanager
async def run_haproxy(
    backends: Sequence[Backend],
    balance: Balance,
    *,
    workdir: str | Path | None = None,
    port: int | None = None,
    ready_path: str = "/v2/health/ready",
    start_timeout_s: float = 10.0,
    maxconn: int = 4000,
    server_maxconn: int = 1000,
    nbthread: int | None = None,
) -> AsyncIterator[str]:
    """Start HAProxy in front of ``backends``; yields its base URL; stops it on exit.

    The config and HAProxy's output go to ``workdir`` (a temporary folder when None).
    """
    binary = haproxy_binary()
    with contextlib.ExitStack() as stack:
        folder = (
            Path(workdir)
            if workdir is not None
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="haproxy-")))
        )
        folder.mkdir(parents=True, exist_ok=True)
        listen = port if port is not None else free_port()
        cfg = folder / f"haproxy-{balance}.cfg"
        cfg.write_text(
            render_config(
                backends,
                balance,
                listen,
                maxconn=maxconn,
                server_maxconn=server_maxconn,
                nbthread=nbthread,
            )
        )
        log = folder / f"haproxy-{balance}.log"
        await _check_config(binary, cfg)
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                binary, "-f", str(cfg), "-db", stdout=out, stderr=asyncio.subprocess.STDOUT
            )
            try:
                url = f"http://127.0.0.1:{listen}"
                await _wait_ready(proc, url + ready_path, start_timeout_s, log)
                yield url
            finally:
                await stop_process(proc, 5.0)


async def _check_config(binary: str, cfg: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        binary,
        "-c",
        "-f",
        str(cfg),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise HAProxyError(f"haproxy rejected {cfg}:\n{out.decode(errors='replace')}")


async def _wait_ready(
    proc: asyncio.subprocess.Process, url: str, timeout_s: float, log: Path
) -> None:
    """Until HAProxy answers any HTTP response on ``url`` (the backend's own status is moot)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while True:
            if proc.returncode is not None:
                raise HAProxyError(
                    f"haproxy exited with {proc.returncode} at start:\n{log_tail(log, 20)}"
                )
            try:
                async with session.get(url) as resp:
                    await resp.read()
                    return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass  # not listening yet
            if loop.time() > deadline:
                raise HAProxyError(
                    f"haproxy did not answer on {url} in {timeout_s}s:\n{log_tail(log, 20)}"
                )
            await asyncio.sleep(0.05)
