"""Per-request logs of a comparison run, and where the waiting requests waited.

``triton-proxy bench --request-log`` writes one ``.npz`` per arm and repetition (schedule and
measurements, indexed alike) under each load's folder, and ``stalls.txt`` beside them. With a
model that reports when and where each batch ran (``accel_sim``'s ``BATCH_START_US`` and
``BATCH_SERVER``, on the generator's own monotonic clock), a request's time before its batch
splits into time while its server was running other batches and time while the server ran
nothing at all. The second is what Triton's batcher stall looks like from outside
(docs/triton-notes.md, "Dynamic batcher": a request queued while the model instance is busy, or
in the moment after a batch ends, can wait until another request for the model arrives), and
what a proxy that holds a request before sending it looks like too; a direct arm has no proxy,
so the two are told apart by comparing arms.

``python -m proxy.bench.request_log FOLDER...`` prints the analysis of logs written earlier.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from proxy.bench.runner import RunRecords
from proxy.bench.scenario import Arrival

IDLE_MS = 5.0
"""A request counts as stalled when its server ran nothing for more than this while it waited
(the proxy's hop, the HTTP exchange and the stub's hand-over take 1-2 ms at light load)."""
RELEASE_MS = 5.0
"""...and as released by an arrival when its batch holds a request sent this recently."""
TAIL = 0.01
"""The slowest share of each class's requests looked at on their own."""


@dataclass(frozen=True)
class RequestLog:
    """One arm's run: every array indexed like the schedule. Times are clock seconds."""

    arm: str
    repetition: int
    classes: tuple[str, ...]
    cls: NDArray[np.int16]
    """Index into ``classes``."""
    tokens: NDArray[np.int32]
    rows: NDArray[np.int32]
    warmup: NDArray[np.bool_]
    scheduled: NDArray[np.float64]
    started: NDArray[np.float64]
    finished: NDArray[np.float64]
    outcome: NDArray[np.int8]
    batch: NDArray[np.int32]
    """``(rows, padded length, cost us)`` of the batch each request ran in; -1 unknown."""
    batch_start: NDArray[np.float64]
    batch_server: NDArray[np.int64]

    @classmethod
    def of(
        cls, arm: str, repetition: int, schedule: Sequence[Arrival], rec: RunRecords
    ) -> RequestLog:
        names = tuple(dict.fromkeys(a.cls for a in schedule))
        index = {n: i for i, n in enumerate(names)}
        return cls(
            arm=arm,
            repetition=repetition,
            classes=names,
            cls=np.array([index[a.cls] for a in schedule], dtype=np.int16),
            tokens=np.array([a.tokens for a in schedule], dtype=np.int32),
            rows=np.array([a.rows for a in schedule], dtype=np.int32),
            warmup=np.array([a.warmup for a in schedule], dtype=np.bool_),
            scheduled=rec.scheduled,
            started=rec.started,
            finished=rec.finished,
            outcome=rec.outcome,
            batch=rec.batch,
            batch_start=rec.batch_start,
            batch_server=rec.batch_server,
        )

    def save(self, path: Path) -> None:
        np.savez_compressed(
            path,
            arm=np.array(self.arm),
            repetition=np.array(self.repetition),
            classes=np.array(self.classes),
            **{k: getattr(self, k) for k in _ARRAYS},
        )

    @classmethod
    def load(cls, path: Path) -> RequestLog:
        with np.load(path) as z:
            return cls(
                arm=str(z["arm"]),
                repetition=int(z["repetition"]),
                classes=tuple(str(c) for c in z["classes"]),
                **{k: z[k] for k in _ARRAYS},
            )


_ARRAYS = (
    "cls",
    "tokens",
    "rows",
    "warmup",
    "scheduled",
    "started",
    "finished",
    "outcome",
    "batch",
    "batch_start",
    "batch_server",
)


def file_name(arm: str, repetition: int) -> str:
    safe = "".join(c if c.isalnum() or c in "+-_." else "_" for c in arm)
    return f"{safe}#{repetition + 1}.npz"


@dataclass(frozen=True)
class Waits:
    """Where each request with a known batch spent its time before that batch (ms)."""

    wait: NDArray[np.float64]
    """From the generator's send to the batch's start: the proxy, the HTTP exchange and
    Triton's queue."""
    idle: NDArray[np.float64]
    """The part of ``wait`` during which the request's server ran no batch."""
    released: NDArray[np.bool_]
    """Its batch holds a request sent less than :data:`RELEASE_MS` before the batch began,
    other than itself."""
    since_answer: NDArray[np.float64]
    """From the end of the server's last batch before the send to the send; NaN when the server
    was running a batch at the send (or had run none)."""


def waits(log: RequestLog, sel: NDArray[np.bool_]) -> Waits:
    """:class:`Waits` of the requests ``sel`` picks among those with a known batch origin."""
    known = np.isfinite(log.batch_start) & (log.batch[:, 2] >= 0)
    pick = np.flatnonzero(sel & known)
    wait = np.empty(len(pick))
    idle = np.empty(len(pick))
    released = np.zeros(len(pick), dtype=np.bool_)
    since = np.full(len(pick), np.nan)
    starts = log.batch_start
    ends = starts + log.batch[:, 2] / 1e6
    by_server: dict[int, tuple[NDArray[np.float64], NDArray[np.float64]]] = {}
    for server in np.unique(log.batch_server[known]):
        on = known & (log.batch_server == server)
        b_start, first = np.unique(starts[on], return_index=True)
        by_server[int(server)] = (b_start, ends[on][first])
    for k, i in enumerate(pick):
        b_start, b_end = by_server[int(log.batch_server[i])]
        sent, begun = log.started[i], starts[i]
        wait[k] = (begun - sent) * 1e3
        # busy time of the server inside [sent, begun): batches are back to back, never overlap
        busy = np.clip(np.minimum(b_end, begun) - np.maximum(b_start, sent), 0.0, None).sum()
        idle[k] = max(0.0, (begun - sent) - busy) * 1e3
        mates = (log.batch_server == log.batch_server[i]) & (starts == begun)
        mates[i] = False
        released[k] = bool(np.any(mates & (log.started > begun - RELEASE_MS / 1e3)))
        before = np.flatnonzero(b_start <= sent)
        if before.size and b_end[before[-1]] <= sent:
            since[k] = (sent - b_end[before[-1]]) * 1e3
    return Waits(wait, idle, released, since)


def analyse(logs: Sequence[RequestLog]) -> str:
    """A table per arm and class: all requests with a known batch, then the slowest
    :data:`TAIL` of each repetition (by latency), pooled over repetitions."""
    if not logs:
        return "no request logs"
    lines = [
        f"wait = send to batch start; idle = part of it while the server ran no batch; stalled ="
        f" idle > {IDLE_MS:g} ms; released = its batch holds a request sent < {RELEASE_MS:g} ms"
        " before it began; after answer = send - end of the server's previous batch, when it"
        " was idle at the send (ms, medians)",
        "",
        f"{'arm':<34} {'class':<9} {'set':<8} {'n':>6} {'wait':>6} {'idle':>6} "
        f"{'stalled':>8} {'idle ms/s':>9} {'released':>9} {'after answer':>12}",
    ]
    arms = list(dict.fromkeys(log.arm for log in logs))
    classes = list(dict.fromkeys(c for log in logs for c in log.classes))
    for arm in arms:
        mine = [log for log in logs if log.arm == arm]
        span = sum(_span(log) for log in mine)
        for name in classes:
            for label, tail in (("all", False), (f"slow {TAIL:.0%}", True)):
                parts = [_class_waits(log, name, tail) for log in mine]
                found = [w for w in parts if w is not None]
                if found:
                    lines.append(_row(arm, name, label, _pool(found), span))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n\n" + anatomy(logs)


SEGMENTS = ("lag", "to batch", "run", "back")
"""Where a request's latency (from its scheduled send time) went: the generator's lag before
sending it, send to its batch's start (the arm, the HTTP exchange, Triton's queue), the
batch's device time, and the batch's end to the generator reading the answer (Triton's
answer, the arm relaying it, the generator's loop)."""


def segments(log: RequestLog, sel: NDArray[np.bool_]) -> NDArray[np.float64]:
    """``[n, 4]`` ms of :data:`SEGMENTS` for the requests ``sel`` picks with a known batch."""
    i = np.flatnonzero(sel & np.isfinite(log.batch_start) & (log.batch[:, 2] >= 0))
    run = log.batch[i, 2] / 1e6
    end = log.batch_start[i] + run
    parts = [
        log.started[i] - log.scheduled[i],
        log.batch_start[i] - log.started[i],
        run,
        log.finished[i] - end,
    ]
    out: NDArray[np.float64] = np.stack(parts, axis=1) * 1e3
    return out


def anatomy(logs: Sequence[RequestLog]) -> str:
    """Per arm and class: the median of each segment over each repetition's slowest
    :data:`TAIL` (pooled), and the P99 of each over all requests."""
    head = " ".join(f"{s:>8}" for s in SEGMENTS)
    lines = [
        f"where latency went (ms): median over the slowest {TAIL:.0%} of each repetition"
        " | P99 over all requests",
        f"{'arm':<34} {'class':<9} {head} | {head}",
    ]
    for arm in dict.fromkeys(log.arm for log in logs):
        mine = [log for log in logs if log.arm == arm]
        for name in dict.fromkeys(c for log in mine for c in log.classes):
            slow, every = [], []
            for log in mine:
                tail = _slowest(log, name)
                if tail is None:
                    continue
                every.append(segments(log, _measured(log, name)))
                slow.append(segments(log, tail))
            if not slow or not sum(len(x) for x in slow):
                continue
            med = np.median(np.concatenate(slow), axis=0)
            p99 = np.percentile(np.concatenate(every), 99, axis=0)
            cells = " ".join(f"{v:>8.1f}" for v in med)
            cells99 = " ".join(f"{v:>8.1f}" for v in p99)
            lines.append(f"{arm:<34} {name:<9} {cells} | {cells99}")
    return "\n".join(lines) + "\n"


def _measured(log: RequestLog, name: str) -> NDArray[np.bool_]:
    """The class's answered requests of the measured window."""
    sel: NDArray[np.bool_] = (log.cls == log.classes.index(name)) & ~log.warmup & (log.outcome == 0)
    return sel


def _slowest(log: RequestLog, name: str) -> NDArray[np.bool_] | None:
    """The slowest :data:`TAIL` (by latency, at least one) of the class's measured, answered
    requests; None when the log has no such class or request."""
    if name not in log.classes:
        return None
    sel = _measured(log, name)
    idx = np.flatnonzero(sel)
    if not idx.size:
        return None
    lat = log.finished - log.scheduled
    keep = max(1, round(TAIL * idx.size))
    out = np.zeros_like(sel)
    out[idx[np.argsort(lat[idx])[-keep:]]] = True
    return out


def _pool(parts: Sequence[Waits]) -> Waits:
    return Waits(
        np.concatenate([w.wait for w in parts]),
        np.concatenate([w.idle for w in parts]),
        np.concatenate([w.released for w in parts]),
        np.concatenate([w.since_answer for w in parts]),
    )


def _class_waits(log: RequestLog, name: str, tail: bool) -> Waits | None:
    if name not in log.classes:
        return None
    sel = _slowest(log, name) if tail else _measured(log, name)
    return None if sel is None else waits(log, sel)


def _span(log: RequestLog) -> float:
    measured = ~log.warmup & np.isfinite(log.started)
    if not measured.any():
        return 0.0
    return float(np.nanmax(log.started[measured]) - np.nanmin(log.started[measured]))


def _row(arm: str, name: str, label: str, w: Waits, span_s: float) -> str:
    n = len(w.wait)
    if not n:
        return f"{arm:<34} {name:<9} {label:<8} {0:>6}"
    stalled = w.idle > IDLE_MS
    after = w.since_answer[stalled & np.isfinite(w.since_answer)]
    idle_rate = w.idle[stalled].sum() / span_s if span_s > 0 and label == "all" else np.nan
    return (
        f"{arm:<34} {name:<9} {label:<8} {n:>6} {np.median(w.wait):>6.1f} "
        f"{np.median(w.idle):>6.1f} {stalled.mean():>8.1%} {_num(idle_rate):>9} "
        f"{_pct(w.released[stalled]):>9} {_num(np.median(after) if after.size else np.nan):>12}"
    )


def _num(v: float) -> str:
    return "-" if not np.isfinite(v) else f"{v:.1f}"


def _pct(flags: NDArray[np.bool_]) -> str:
    return "-" if not flags.size else f"{flags.mean():.0%}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="folders holding the .npz request logs")
    args = parser.parse_args(argv)
    logs = [
        RequestLog.load(p) for folder in args.folders for p in sorted(Path(folder).glob("*.npz"))
    ]
    sys.stdout.write(analyse(logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
