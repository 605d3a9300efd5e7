"""Several proxy processes on the same ports: ``triton-proxy serve --workers N``.

Shape (the simplest one we could make honest):

- A **supervisor** process loads the policy, resolves free ports, forks ``N`` workers before
  any event loop or gRPC object exists, forwards SIGTERM/SIGINT/SIGHUP to them, restarts a
  worker that dies, and prints the banner once every worker is ready. It serves nothing.
- Every **worker** is a whole :class:`~proxy.app.ProxyServer` with its own event loop, its own
  in-flight counts and class queues, listening on the same HTTP and gRPC ports with
  ``SO_REUSEPORT``: the kernel spreads *connections* (not requests) over the workers.
- Worker 0 is the **leader**. Only it runs the control loops that talk to the fleet: the
  metrics scraper and the readiness prober (and the SLO controllers to come). After each
  scrape round it publishes the snapshots and its health verdicts in one small file
  (``fleet.pickle``, written to a temporary name and renamed, so a reader sees a whole file).
  **Followers** read that file every half scrape interval; Triton's ``/metrics`` is fetched
  once per interval, not N times. Snapshot times are ``CLOCK_MONOTONIC`` seconds, which are
  the same in every process of the machine, so staleness is judged alike everywhere.
- A follower still reacts at once to what its own requests see: a refused connection ejects
  the instance locally, and a leader verdict older than that failure does not bring it back.
- The same file carries the leader's **control state**: the class-limit loop's factors (each
  follower applies them to its own gates) and the batching-window loop's **drain marks**
  (each follower stops placing the model's new requests on the instance). A follower answers
  in its own small file (``worker-I.control.pickle``): the drain epoch it has applied and its
  own requests still in flight on every drained (instance, model). The leader reloads an
  instance only once every follower has applied the mark and has none of the model's requests
  in flight there (:class:`FollowerReports`).
- The leader alone serves the configured metrics port; followers serve theirs on a loopback
  port named in their ready file, and the leader's ``/metrics`` merges them, adding a
  ``worker`` label to every series (sum over ``worker`` for proxy-wide figures).
- Model control (load/unload, trace and log settings) is fanned out by the leader alone, as
  it alone runs the loops that reload models: a follower checks the caller's admin token and
  hands the call to the leader over a Unix socket in the state directory
  (:mod:`proxy.frontends.admin_relay`); while the leader is being restarted such a call gets
  503 / UNAVAILABLE and was not made.

Class limits stay correct in total because each worker enforces ``1/N`` of them: see
:func:`per_worker_scheduling` for the arithmetic and its error bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from proxy.config import ProxyConfig
from proxy.fleet.instances import Fleet
from proxy.fleet.snapshot import InstanceSnapshot
from proxy.scheduling.config import SchedulingConfig

log = logging.getLogger(__name__)

STATE_FILE = "fleet.pickle"
FORWARDED = frozenset((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
"""The signals the supervisor forwards to its workers."""
DRAIN_POLL_S = 0.05
"""How often a follower reads the state and answers while a drain mark is set."""


@dataclass(frozen=True)
class WorkerRole:
    """Which worker this process is, of how many, and where they share state."""

    index: int
    count: int
    state_dir: Path

    @property
    def leader(self) -> bool:
        return self.index == 0

    def ready_file(self, index: int | None = None) -> Path:
        return self.state_dir / f"worker-{self.index if index is None else index}.json"

    def report_file(self, index: int | None = None) -> Path:
        """A follower's answer to the leader's control state (see :class:`FollowerReport`)."""
        i = self.index if index is None else index
        return self.state_dir / f"worker-{i}.control.pickle"


# -- class limits across workers ------------------------------------------------------------


def per_worker(limit: int, workers: int) -> int:
    """One worker's part of a limit: ``ceil(limit / workers)``, never below 1."""
    return max(1, math.ceil(limit / workers))


def per_worker_scheduling(config: SchedulingConfig, workers: int) -> SchedulingConfig:
    """The scheduling section one of ``workers`` workers enforces.

    Every count that is a limit on the whole proxy is divided: each class's
    ``max_concurrency`` and ``max_queue``, and ``max_queued_total`` here; the slots per Triton
    instance (``concurrency``, or the one derived from the model) by
    :class:`~proxy.scheduling.models.ModelGates`, which knows the model. Each worker
    takes ``ceil(limit / N)``, so the total over the workers is at most
    ``N * ceil(limit / N) <= limit + N - 1``: with 4 workers and 32 slots per instance, exactly
    32; with 3 workers, at most 33. Shares (``min_share``, ``max_share``) are fractions of
    each worker's own capacity: ``max_share`` caps hold in total (the sum of the per-worker
    caps is the total cap, up to the same rounding), while a ``min_share`` reservation only
    holds where the class's traffic is: the kernel spreads connections, not requests, so a
    class whose requests all arrive on one connection is served by one worker and can use
    only that worker's ``1/N`` of the slots.
    """
    if workers <= 1:
        return config
    classes = {
        name: dataclasses.replace(
            c,
            max_concurrency=(
                per_worker(c.max_concurrency, workers) if c.max_concurrency is not None else None
            ),
            max_queue=per_worker(c.max_queue, workers),
        )
        for name, c in config.classes.items()
    }
    return dataclasses.replace(
        config,
        classes=classes,
        max_queued_total=(
            per_worker(config.max_queued_total, workers)
            if config.max_queued_total is not None
            else None
        ),
    )


# -- the shared fleet view -------------------------------------------------------------------


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    reason: str
    at: float
    """Clock time of the verdict (the leader's last probe or failure report)."""


@dataclass(frozen=True)
class SharedFleetState:
    written_at: float
    snapshots: Mapping[str, InstanceSnapshot]
    health: Mapping[str, HealthVerdict]
    draining: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Instance -> models the leader drains there (a batching-window reload is under way)."""
    drain_epoch: int = 0
    """Raised by the leader whenever its drain marks change; followers echo it back."""
    class_scales: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Model -> class -> the class-limit loop's factor on ``max_share`` (absent: 1)."""


@dataclass(frozen=True)
class FollowerReport:
    """A follower's answer to the leader's control state."""

    epoch: int
    """The ``drain_epoch`` of the last state this worker applied."""
    in_flight: Mapping[tuple[str, str], int]
    """(instance, model) -> this worker's requests in flight there, for every drained pair."""


def write_state(path: Path, state: SharedFleetState | FollowerReport) -> None:
    """Write atomically: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(tmp, path)


def read_state(path: Path) -> SharedFleetState | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    # The file lives in a 0700 directory this process tree created: it is our own data.
    state = pickle.loads(data)
    return state if isinstance(state, SharedFleetState) else None


def leader_state(
    fleet: Fleet,
    snapshots: Mapping[str, InstanceSnapshot],
    now: float,
    *,
    drain_epoch: int = 0,
    class_scales: Mapping[str, Mapping[str, float]] | None = None,
) -> SharedFleetState:
    health = {
        inst.name: HealthVerdict(inst.healthy, inst.ejected_reason, inst.verdict_at)
        for inst in fleet.all()
    }
    draining = {i.name: frozenset(i.draining) for i in fleet.all() if i.draining}
    return SharedFleetState(
        now, dict(snapshots), health, draining, drain_epoch, dict(class_scales or {})
    )


def adopt_draining(fleet: Fleet, marks: Mapping[str, frozenset[str]]) -> bool:
    """Make this worker's drain marks the leader's; True when any changed."""
    changed = False
    for inst in fleet.all():
        want = set(marks.get(inst.name, frozenset()))
        if inst.draining != want:
            inst.draining.clear()
            inst.draining.update(want)
            changed = True
    return changed


def follower_report(fleet: Fleet, epoch: int) -> FollowerReport:
    in_flight = {
        (inst.name, model): inst.model_in_flight.get(model, 0)
        for inst in fleet.all()
        for model in inst.draining
    }
    return FollowerReport(epoch, in_flight)


def read_report(path: Path) -> FollowerReport | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    report = pickle.loads(data)  # our own 0700 directory, as read_state
    return report if isinstance(report, FollowerReport) else None


class FollowerReports:
    """The leader's view of its followers' answers (one file each, re-read when it changes)."""

    def __init__(self, role: WorkerRole) -> None:
        self.paths = [role.report_file(i) for i in range(role.count) if i != role.index]
        self._cache: dict[Path, tuple[tuple[int, int], FollowerReport | None]] = {}

    def _read(self, path: Path) -> FollowerReport | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            report = read_report(path)
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            log.warning("could not read a follower's control report %s: %s", path, exc)
            report = None
        self._cache[path] = (stamp, report)
        return report

    def in_flight(self, instance: str, model: str, epoch: int) -> int | None:
        """The followers' requests of ``model`` in flight on ``instance``; None while one of
        them has not applied the drain marks of ``epoch`` yet."""
        total = 0
        for path in self.paths:
            report = self._read(path)
            if report is None or report.epoch < epoch:
                return None
            total += report.in_flight.get((instance, model), 0)
        return total


def adopt_health(fleet: Fleet, verdicts: Mapping[str, HealthVerdict]) -> None:
    """Take the leader's verdicts, except where this worker saw a failure after the verdict."""
    for name, verdict in verdicts.items():
        inst = fleet.instances.get(name)
        if inst is None or verdict.at < inst.failed_at:
            continue
        if verdict.healthy and not inst.healthy:
            fleet.report_success(inst)
        elif not verdict.healthy and inst.healthy:
            fleet.eject(inst, verdict.reason or "ejected by the leader worker")


class SharedSnapshots:
    """A follower's stand-in for the scraper: the leader's snapshots, read from the file.

    Same reading interface as :class:`~proxy.fleet.scraper.Scraper` (``snapshot``,
    ``snapshots``, ``set_targets``, ``start``, ``stop``); it also applies the leader's health
    verdicts to this worker's fleet.
    """

    def __init__(
        self,
        path: Path,
        fleet: Fleet,
        interval_s: float,
        *,
        report_path: Path | None = None,
        on_state: Callable[[SharedFleetState, bool], None] = lambda state, drains: None,
    ) -> None:
        self.path = path
        self.fleet = fleet
        self.interval_s = interval_s
        self.report_path = report_path
        """Where this follower answers the leader's drain marks (None: it does not)."""
        self.on_state = on_state
        """Called with each new state the leader wrote, and whether the drain marks changed
        (the runtime applies the class factors and pokes its gates)."""
        self.epoch = 0
        self._snapshots: dict[str, InstanceSnapshot] = {}
        self._seen: tuple[int, int] | None = None
        self._task: object = None
        self.on_change: Callable[[str], None] = fleet.touch
        """Called with an instance's name when its snapshot is replaced or dropped."""

    def snapshot(self, instance: str) -> InstanceSnapshot | None:
        return self._snapshots.get(instance)

    def snapshots(self) -> Mapping[str, InstanceSnapshot]:
        return dict(self._snapshots)

    def set_targets(self, targets: Mapping[str, str]) -> None:
        for name in set(self._snapshots) - set(targets):
            del self._snapshots[name]
            self.on_change(name)

    def refresh(self) -> bool:
        """Read the file if it changed; True when something new was applied."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._seen:
            return False
        state = read_state(self.path)
        if state is None:
            return False
        self._seen = stamp
        known = set(self.fleet.instances)
        changed = set(self._snapshots) | set(state.snapshots)
        self._snapshots = {k: v for k, v in state.snapshots.items() if k in known}
        for name in sorted(changed & known):
            self.on_change(name)
        adopt_health(self.fleet, state.health)
        drains = adopt_draining(self.fleet, state.draining)
        self.epoch = state.drain_epoch
        self.on_state(state, drains)
        return True

    def report(self) -> None:
        """Answer the leader: the drain epoch applied and this worker's requests still in
        flight on every drained (instance, model)."""
        if self.report_path is not None:
            write_state(self.report_path, follower_report(self.fleet, self.epoch))

    async def _run(self) -> None:
        import asyncio

        while True:
            try:
                if self.refresh() or any(i.draining for i in self.fleet.all()):
                    self.report()
            except (OSError, pickle.UnpicklingError, EOFError) as exc:
                log.warning("could not read the leader's fleet state: %s", exc)
            await asyncio.sleep(self._period())

    def _period(self) -> float:
        """Half the scrape interval; while a drain is under way, often enough that the leader
        waits little for this worker's answer."""
        if any(i.draining for i in self.fleet.all()):
            return min(self.interval_s / 2, DRAIN_POLL_S)
        return self.interval_s / 2

    async def start(self) -> None:
        import asyncio

        self.refresh()
        self.report()
        self._task = asyncio.create_task(self._run(), name="shared-fleet-reader")

    async def stop(self) -> None:
        import asyncio

        task = self._task
        self._task = None
        if isinstance(task, asyncio.Task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- the supervisor --------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGTERM this worker (it drains) when the supervisor goes away."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A bound (not listening) ``SO_REUSEPORT`` socket on ``port`` (0: a free one).

    Held while the workers start, so no other program takes a port picked as free; a socket
    that does not listen receives no connections.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s, int(s.getsockname()[1])


def with_ports(config: ProxyConfig, http_port: int, grpc_port: int) -> ProxyConfig:
    listen = dataclasses.replace(config.listen, http_port=http_port, grpc_port=grpc_port)
    return dataclasses.replace(config, listen=listen)


WorkerMain = Callable[[WorkerRole, ProxyConfig], int]


class Supervisor:
    """Forks and watches ``count`` workers (see the module docstring)."""

    def __init__(
        self,
        count: int,
        config: ProxyConfig,
        worker_main: WorkerMain,
        *,
        restart_delay_s: float = 1.0,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if count < 1:
            raise ValueError("--workers must be >= 1")
        self.count = count
        self.config = config
        self.worker_main = worker_main
        self.restart_delay_s = restart_delay_s
        self.ready_timeout_s = ready_timeout_s
        self.children: dict[int, int] = {}
        """pid -> worker index"""
        self._stopping = False

    def _fork(self, role: WorkerRole, config: ProxyConfig) -> int:
        """Fork one worker. The forwarded signals stay blocked across the fork until the child
        has reset them to their defaults: before, a SIGTERM that reached a worker just forked
        (a restart, then a stop) ran the supervisor's handler inherited by the child, which
        forwarded it and swallowed it; the worker then served on, and the supervisor waited
        for it forever (CI, ``test_workers``)."""
        sys.stdout.flush()
        sys.stderr.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            raise
        if pid == 0:  # the worker
            code = 1
            try:
                for sig in FORWARDED:
                    signal.signal(sig, signal.SIG_DFL)
                # One that came in the meantime now takes its default action.
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
                _die_with_parent()
                code = self.worker_main(role, config)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("worker %d failed", role.index)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children[pid] = role.index
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # now a forward reaches it too
        return pid

    def _signal_all(self, sig: int) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def run(self, banner: Callable[[Mapping[str, int]], str]) -> int:
        listen = self.config.listen
        state_dir = Path(tempfile.mkdtemp(prefix="triton-proxy-workers-"))
        held: list[socket.socket] = []
        http_sock, http_port = reserve_port(listen.host, listen.http_port)
        grpc_sock, grpc_port = reserve_port(listen.host, listen.grpc_port)
        held += [http_sock, grpc_sock]
        config = with_ports(self.config, http_port, grpc_port)

        def forward(signum: int, frame: FrameType | None) -> None:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self._stopping = True
            self._signal_all(signum)

        for sig in FORWARDED:
            signal.signal(sig, forward)
        roles = [WorkerRole(i, self.count, state_dir) for i in range(self.count)]
        try:
            for role in roles:
                self._fork(role, config)
            ports = self._wait_ready(roles)
            for s in held:
                s.close()
            held.clear()
            if ports is None:
                self._stopping = True
                self._signal_all(signal.SIGTERM)
            else:
                print(banner({"http": http_port, "grpc": grpc_port, **ports}), flush=True)
            return self._watch(roles, config)
        finally:
            for s in held:
                s.close()
            self._stopping = True
            self._signal_all(signal.SIGTERM)
            self._reap_all()
            with contextlib.suppress(OSError):
                for f in state_dir.iterdir():
                    f.unlink()
                state_dir.rmdir()

    def _wait_ready(self, roles: list[WorkerRole]) -> dict[str, int] | None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if all(r.ready_file().exists() for r in roles):
                info = json.loads(roles[0].ready_file().read_text())
                return {"metrics": int(info.get("metrics_port") or 0)}
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                index = self.children.pop(pid, -1)
                log.error("worker %d exited at start (status %d)", index, status)
                return None
            time.sleep(0.05)
        log.error("workers not ready after %g s", self.ready_timeout_s)
        return None

    def _watch(self, roles: list[WorkerRole], config: ProxyConfig) -> int:
        code = 0
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            index = self.children.pop(pid, None)
            if index is None:
                continue
            exit_code = os.waitstatus_to_exitcode(status)
            if self._stopping:
                code = code or (exit_code if exit_code > 0 else 0)
                continue
            log.error("worker %d exited (%d); restarting it", index, exit_code)
            time.sleep(self.restart_delay_s)
            if not self._stopping:
                roles[index].ready_file().unlink(missing_ok=True)
                self._fork(roles[index], config)
        return code

    def _reap_all(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                self.children.pop(pid, None)
            else:
                time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.children.clear()
