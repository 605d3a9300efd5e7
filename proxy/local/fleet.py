"""Start, stop, kill and restart local Triton servers from the wheel's binary.

Each server runs in its own process group (its python backend stubs are its children), with
``PR_SET_PDEATHSIG`` so it dies with the thread that spawned it; its stubs then notice their
parent is gone and exit within seconds. A server that crashes leaves its stubs running until
it is reaped (measured), which is why ``stop`` and ``kill`` end with SIGKILL to the group.

All spawning happens on one long-lived thread owned by the fleet: the kernel delivers
PDEATHSIG when the *thread* that forked exits, so spawning from a short-lived worker thread
would kill the server with it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from proxy.local.install import (
    LocalTritonError,
    TritonInstall,
    default_backend_cache,
    find_install,
    libpython_error,
    libpython_soname,
    prepare_backend_dir,
    resolve_server_env,
)

_PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 40
DEFAULT_ARGS: tuple[str, ...] = (
    "--model-control-mode=explicit",
    "--metrics-interval-ms=500",
    "--exit-timeout-secs=5",
    "--log-verbose=0",
)


SHM_DIR = Path("/dev/shm")
_FLEETS = itertools.count()
"""Numbers the fleets of this process: each server's shared-memory prefix is its own."""


def remove_shm_regions(prefix: str, shm_dir: Path = SHM_DIR) -> int:
    """Delete the python backend's shared-memory regions named ``prefix...``; how many.

    A server and stubs that exit cleanly remove their regions; killed ones (SIGKILL, a
    crash) leave them in ``/dev/shm`` for good. 577 of them (578 MB) had piled up on the
    benchmark machine when three servers died at once in the python backend
    (``boost::interprocess::lock_exception``; docs/benchmarks.md, thirty-fifth round).
    """
    removed = 0
    for path in shm_dir.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


class ServerStartError(LocalTritonError):
    """A server exited or did not become ready; the message carries its log tail."""


@dataclass(frozen=True)
class TritonServer:
    """Endpoints of one started server."""

    name: str
    http_url: str
    grpc_address: str
    metrics_url: str
    log_path: Path
    pid: int


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel had free a moment ago (bound together, then freed)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: SIGKILL the child when its parent (``parent_pid``) goes away."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(125)
        # The parent may have died between fork and prctl: then nobody would ever signal us.
        # (Compared by pid, not with 1: the launcher itself may be a container's init.)
        if os.getppid() != parent_pid:
            os._exit(125)

    return preexec


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``, read from ``/proc``.

    Zombies are left out: an orphaned stub that has exited waits for init to reap it, and
    init in a container may never do so.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = text[text.rindex(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def group_alive(pgid: int) -> bool:
    """Whether any live process is left in process group ``pgid``."""
    return bool(group_members(pgid))


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def server_command(
    binary: Path,
    *,
    model_repository: Path,
    backend_dir: Path,
    ports: tuple[int, int, int],
    models: Sequence[str],
    extra_args: Sequence[str] = (),
) -> list[str]:
    """A ``tritonserver`` command line; ``extra_args`` come last, so they override defaults."""
    http, grpc, metrics = ports
    return [
        str(binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={backend_dir}",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        *DEFAULT_ARGS,
        *(f"--load-model={m}" for m in models),
        *extra_args,
    ]


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)


@dataclass
class _Slot:
    index: int
    ports: tuple[int, int, int]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"triton-{self.index}"

    def server(self) -> TritonServer:
        assert self.proc is not None
        http, grpc, metrics = self.ports
        return TritonServer(
            name=self.name,
            http_url=f"http://127.0.0.1:{http}",
            grpc_address=f"127.0.0.1:{grpc}",
            metrics_url=f"http://127.0.0.1:{metrics}/metrics",
            log_path=self.log_path,
            pid=self.proc.pid,
        )


class LocalFleet:
    """``count`` local Triton servers over one model repository; a context manager.

    Servers load ``models`` explicitly (``--model-control-mode=explicit``) on free ports (or
    ``ports``: one ``(http, grpc, metrics)`` triple per server) and log to ``log_dir``.
    """

    def __init__(
        self,
        count: int,
        model_repository: Path,
        models: Sequence[str],
        log_dir: Path,
        *,
        ports: Sequence[tuple[int, int, int]] | None = None,
        extra_args: Sequence[str] = (),
        install: TritonInstall | None = None,
        backend_dir: Path | None = None,
        stop_grace_s: float = 15.0,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if ports is not None and len(ports) != count:
            raise ValueError(f"ports has {len(ports)} triples for {count} servers")
        self.model_repository = Path(model_repository).resolve()
        self.models = tuple(models)
        self.log_dir = Path(log_dir)
        self.extra_args = tuple(extra_args)
        self.stop_grace_s = stop_grace_s
        self._install = install
        self._backend_dir = backend_dir
        self._env: dict[str, str] | None = None
        self._fixed_ports = ports is not None
        self._slots = [
            _Slot(
                index=i,
                ports=tuple(ports[i]) if ports is not None else (0, 0, 0),  # type: ignore[arg-type]
                log_path=self.log_dir / f"triton-{i}.log",
            )
            for i in range(count)
        ]
        self._lock = threading.Lock()
        self._spawner: ThreadPoolExecutor | None = None
        self._atexit_registered = False
        self.started_pgids: set[int] = set()
        """Every process group this fleet ever started (for leak checks)."""
        self._tag = f"{os.getpid()}_{next(_FLEETS)}"

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def servers(self) -> list[TritonServer]:
        """The servers running now, in index order."""
        return [s.server() for s in self._slots if s.proc is not None]

    def server(self, index: int) -> TritonServer:
        """Server ``index``; raises ``LookupError`` when it is not running."""
        slot = self._slots[index]
        if slot.proc is None:
            raise LookupError(f"{slot.name} is not running")
        return slot.server()

    def start(self, timeout_s: float = 120) -> list[TritonServer]:
        """Start every server in parallel and wait until each (and each model) is ready."""
        if not self.model_repository.is_dir():
            raise LocalTritonError(f"model repository {self.model_repository} does not exist")
        missing = [m for m in self.models if not (self.model_repository / m).is_dir()]
        if missing:
            raise LocalTritonError(f"models {missing} are not in {self.model_repository}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        try:
            for slot in self._slots:
                if slot.proc is None or slot.proc.poll() is not None:
                    self._spawn(slot)
            self._wait_ready(self._slots, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.servers

    def stop(self) -> None:
        """SIGTERM every server, wait, then SIGKILL whatever is left in its process group.

        SIGTERM goes to the server alone, not to its group: Triton then unloads each model and
        its stub exits cleanly (about 2 s here). Stubs that get SIGTERM themselves stall the
        unload until ``--exit-timeout-secs`` runs out and may outlive the server (measured).
        """
        with self._lock:
            procs = [(s.proc, s.index) for s in self._slots if s.proc is not None]
            for slot in self._slots:
                slot.proc = None
        for proc, _ in procs:
            _terminate(proc)
        deadline = time.monotonic() + self.stop_grace_s
        for proc, index in procs:
            self._reap_group(proc, index, deadline)
        if self._spawner is not None:
            self._spawner.shutdown(wait=True)
            self._spawner = None
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False

    def kill(self, index: int) -> None:
        """SIGKILL server ``index`` and its stubs at once, as a crash would."""
        slot = self._slots[index]
        with self._lock:
            proc, slot.proc = slot.proc, None
        if proc is None:
            return
        _killpg(proc.pid, signal.SIGKILL)
        self._reap_group(proc, index, time.monotonic() + self.stop_grace_s)

    def restart(self, index: int, timeout_s: float = 120) -> TritonServer:
        """Stop server ``index`` if it runs, start it again on the same ports, wait for ready."""
        slot = self._slots[index]
        with self._lock:
            proc, slot.proc = slot.proc, None
        if proc is not None:
            _terminate(proc)
            self._reap_group(proc, index, time.monotonic() + self.stop_grace_s)
        self._prepare()
        self._spawn(slot, reuse_ports=True)
        try:
            self._wait_ready([slot], timeout_s)
        except BaseException:
            self.kill(index)
            raise
        return slot.server()

    def revive(self, timeout_s: float = 120) -> list[str]:
        """Restart every server whose process has exited (a crash, or a kill nobody undid);
        returns the log tails of those that died on their own, for the caller to report."""
        dead: list[tuple[int, str]] = []
        for slot in self._slots:
            with self._lock:
                proc = slot.proc
            if proc is None:
                dead.append((slot.index, f"{slot.name}: stopped and not restarted"))
            elif proc.poll() is not None:
                tail = log_tail(slot.log_path, 15)
                dead.append((slot.index, f"{slot.name} exited with {proc.returncode}:\n{tail}"))
        for index, _ in dead:
            self.restart(index, timeout_s)
        return [why for _, why in dead]

    # -- internals ---------------------------------------------------------------------------

    def _prepare(self) -> None:
        if self._env is not None:
            return
        install = self._install or find_install()
        backend_dir = prepare_backend_dir(
            install, self._backend_dir or default_backend_cache(install)
        )
        self._backend_dir = backend_dir
        self._env = resolve_server_env(
            install, backend_dir / "python" / "triton_python_backend_stub"
        )
        self._install = install
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(1, thread_name_prefix="triton-spawner")

    def command(self, index: int) -> list[str]:
        """The ``tritonserver`` command line of server ``index``."""
        assert self._install is not None and self._backend_dir is not None
        return server_command(
            self._install.binary,
            model_repository=self.model_repository,
            backend_dir=self._backend_dir,
            ports=self._slots[index].ports,
            models=self.models,
            extra_args=(
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix(index)}",
                *self.extra_args,
            ),
        )

    def _spawn(self, slot: _Slot, *, reuse_ports: bool = False) -> None:
        assert self._spawner is not None and self._env is not None
        if not (reuse_ports or self._fixed_ports):
            slot.ports = tuple(free_ports(3))  # type: ignore[assignment]
        cmd = self.command(slot.index)
        env = self._env

        def popen() -> subprocess.Popen[bytes]:
            with slot.log_path.open("ab") as log:
                log.write(f"\n=== {time.strftime('%F %T')} {' '.join(cmd)}\n".encode())
                log.flush()
                return subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.log_dir,
                    start_new_session=True,
                    preexec_fn=_die_with_parent(os.getpid()),
                )

        proc = self._spawner.submit(popen).result()
        with self._lock:
            slot.proc = proc
            self.started_pgids.add(proc.pid)

    def _wait_ready(self, slots: Sequence[_Slot], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(slots)
        while pending:
            for slot in list(pending):
                proc = slot.proc
                if proc is None:
                    raise ServerStartError(f"{slot.name} was stopped while starting")
                if proc.poll() is not None:
                    raise self._start_error(slot, f"exited with code {proc.returncode}")
                if self._ready(slot):
                    pending.remove(slot)
            if pending:
                if time.monotonic() > deadline:
                    raise self._start_error(pending[0], f"not ready after {timeout_s:.0f} s")
                time.sleep(0.2)

    def _ready(self, slot: _Slot) -> bool:
        base = f"http://127.0.0.1:{slot.ports[0]}"
        if not _http_ok(f"{base}/v2/health/ready"):
            return False
        return all(_http_ok(f"{base}/v2/models/{m}/ready") for m in self.models)

    def _start_error(self, slot: _Slot, what: str) -> LocalTritonError:
        tail = log_tail(slot.log_path)
        if libpython_soname() in tail and "cannot open shared object" in tail:
            assert self._backend_dir is not None
            return libpython_error(self._backend_dir / "python" / "triton_python_backend_stub")
        return ServerStartError(
            f"{slot.name} (ports http/grpc/metrics {slot.ports}) {what}; "
            f"log {slot.log_path}, last lines:\n{tail}"
        )

    def shm_prefix(self, index: int) -> str:
        """The name prefix of server ``index``'s shared-memory regions (python backend)."""
        return f"triton_proxy_{self._tag}_{index}_"

    def _reap_group(self, proc: subprocess.Popen[bytes], index: int, deadline: float) -> None:
        """Wait for server ``index`` (``proc``, the leader of its group) and its group until
        ``deadline``, then SIGKILL the group; then remove the shared memory it left."""
        pgid = proc.pid
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # The stubs may outlive the server briefly; they belong to its group.
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None or group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
            proc.wait()
            # SIGKILL cannot be ignored; this only waits for the kernel to deliver it.
            kill_deadline = time.monotonic() + 5.0
            while group_alive(pgid) and time.monotonic() < kill_deadline:
                time.sleep(0.01)
        remove_shm_regions(self.shm_prefix(index))


@contextlib.contextmanager
def sigterm_raises_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` in the main thread, so context
    managers (a ``LocalFleet``) unwind and stop their servers; the old handler comes back."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        # Only the main thread may set signal handlers; elsewhere this is a no-op.
        yield
        return
    previous: Callable[[int, FrameType | None], object] | int | None = signal.signal(
        signal.SIGTERM, handler
    )
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
