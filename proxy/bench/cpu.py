"""Where the CPU went during each arm: generator, the arm's own process, Triton, the rest.

The benchmark's model sleeps its device time, but the load generator, the proxy or HAProxy,
Triton's servers and their Python backend stubs all burn real CPU on the same small machine.
When that machine is short of CPU, latency grows for reasons that are not scheduling; these
figures say how close to that each arm ran.

Read from ``/proc`` (Linux): user + system time of

- ``generator``: this process (with ``--proxy-mode inprocess`` it includes the proxy);
- ``arm``: this process's direct children outside the Triton process groups (the proxy's
  child process, HAProxy);
- ``triton``: every process in the fleet's process groups (servers and backend stubs);
- ``other``: everything else busy on the machine (``/proc/stat`` minus the above), e.g. other
  users' jobs.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path

from proxy.bench.compare import ArmSpec
from proxy.bench.runner import TargetSpec

GROUPS = ("generator", "arm", "triton", "other")
BUSY_OTHER_CORES = 0.25
"""More than this much CPU used by unrelated work flags the arm's run as contended."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    pgrp: int
    cpu_s: float


def parse_stat(text: str) -> ProcStat:
    """One ``/proc/<pid>/stat`` line (``comm`` may hold spaces and parentheses)."""
    head, rest = text[: text.index(" ")], text[text.rindex(")") + 2 :].split()
    # rest[0] is the state; fields 4.. of stat(5) start at rest[1]
    ppid, pgrp = int(rest[1]), int(rest[2])
    utime, stime = int(rest[11]), int(rest[12])
    return ProcStat(int(head), ppid, pgrp, (utime + stime) / _TICK)


def read_procs(proc: Path = Path("/proc")) -> list[ProcStat]:
    out = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            out.append(parse_stat(stat.read_text()))
        except (OSError, ValueError, IndexError):
            continue  # gone, or unreadable
    return out


def machine_busy_s(proc: Path = Path("/proc")) -> float:
    """CPU seconds the whole machine spent busy (all cores, everything but idle and iowait)."""
    first = (proc / "stat").read_text().splitlines()[0].split()
    ticks = [int(x) for x in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    # guest time is already counted in user
    total = sum(ticks[:8])
    return (total - idle) / _TICK


def attribute(
    procs: Sequence[ProcStat], me: int, triton_groups: Collection[int]
) -> dict[str, float]:
    """CPU seconds so far of the generator, the arm process(es) and Triton (pure).

    The arm is every direct child of ``me`` outside Triton's groups, with its descendants
    (``serve --workers N``: a supervisor and its N workers).
    """
    out = {"generator": 0.0, "arm": 0.0, "triton": 0.0}
    parent = {p.pid: p.ppid for p in procs}

    def in_arm(pid: int) -> bool:
        seen = 0
        while pid in parent and seen < 64:  # bounded: pids are reused, cycles are not ours
            if parent[pid] == me:
                return True
            pid, seen = parent[pid], seen + 1
        return False

    for p in procs:
        if p.pgrp in triton_groups:
            out["triton"] += p.cpu_s
        elif p.pid == me:
            out["generator"] += p.cpu_s
        elif in_arm(p.pid):
            out["arm"] += p.cpu_s
    return out


@dataclass
class CpuUse:
    """Cores used on average over one arm's run (CPU seconds / wall seconds)."""

    arm: str
    wall_s: float
    cores: dict[str, float]
    machine_cores: float
    """Busy cores of the whole machine (everything, ``other`` included)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "arm": self.arm,
            "wall_s": self.wall_s,
            "cores": self.cores,
            "machine_cores": self.machine_cores,
        }


Snapshot = tuple[float, float, Mapping[str, float]]
"""(wall clock s, machine busy CPU s, CPU s per group)."""


def cpu_use(arm: str, before: Snapshot, after: Snapshot) -> CpuUse:
    """Cores per group between two snapshots, and the machine's busy cores (pure).

    The arm's process is started before the first snapshot and stopped after the second, so
    its start-up and shutdown are not charged to the run.
    """
    t0, m0, g0 = before
    t1, m1, g1 = after
    wall = max(t1 - t0, 1e-9)
    cores = {k: max(g1.get(k, 0.0) - g0.get(k, 0.0), 0.0) / wall for k in g1}
    machine = max(m1 - m0, 0.0) / wall
    cores["other"] = max(machine - sum(cores.values()), 0.0)
    return CpuUse(arm, wall, cores, machine)


@dataclass
class CpuMeter:
    """Wraps arms so each run records where the CPU went (one :class:`CpuUse` per run)."""

    triton_groups: Callable[[], Collection[int]]
    runs: list[CpuUse] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def snapshot(self) -> Snapshot:
        groups = attribute(read_procs(), os.getpid(), set(self.triton_groups()))
        return self.clock(), machine_busy_s(), groups

    def wrap(self, arm: ArmSpec) -> ArmSpec:
        """The same arm; its run (from started to about to stop) is measured."""
        inner = arm.open

        @contextlib.asynccontextmanager
        async def open_() -> AsyncIterator[TargetSpec]:
            async with inner() as spec:
                before = self.snapshot()
                try:
                    yield spec
                finally:
                    self.runs.append(cpu_use(arm.name, before, self.snapshot()))

        opener: Callable[[], AbstractAsyncContextManager[TargetSpec]] = open_
        return replace(arm, open=opener)

    def summary(self) -> dict[str, dict[str, float]]:
        """Median cores per group and arm over its runs, plus the machine's."""
        out: dict[str, dict[str, float]] = {}
        names = list(dict.fromkeys(r.arm for r in self.runs))
        for name in names:
            runs = [r for r in self.runs if r.arm == name]
            row = {g: statistics.median(r.cores.get(g, 0.0) for r in runs) for g in GROUPS}
            row["machine"] = statistics.median(r.machine_cores for r in runs)
            out[name] = row
        return out

    def render(self) -> str:
        summary = self.summary()
        w = max([22, *(len(a) for a in summary)])
        lines = [
            f"CPU during each arm's run, cores (median over runs; machine has {os.cpu_count()})",
            f"{'arm':<{w}} " + " ".join(f"{g:>10}" for g in (*GROUPS, "machine")),
        ]
        busy = []
        for arm, row in summary.items():
            flag = ""
            if row["other"] > BUSY_OTHER_CORES:
                flag = "  *"
                busy.append(arm)
            lines.append(
                f"{arm:<{w}} " + " ".join(f"{row[g]:>10.2f}" for g in (*GROUPS, "machine")) + flag
            )
        if busy:
            lines.append(
                f"* other work used more than {BUSY_OTHER_CORES:g} cores during this arm: its "
                "latencies include CPU contention that has nothing to do with the arm"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {"summary": self.summary(), "runs": [r.to_dict() for r in self.runs]}
