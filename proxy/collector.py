"""The cyclic garbage collector's settings for a process that serves or measures requests.

One place for what the proxy learned about CPython's collector under load, used by the proxy
once it serves (:func:`settle`) and by the benchmark's load generator for each measured run
(:func:`quiet_while`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

THRESHOLDS = (50_000, 20, 10)
"""The collector's thresholds under load (CPython's default: 700, 10, 10).

A request's objects (coroutine frames, futures, header dicts) live until its answer, so with
the default a young collection ran every ~25 ms under load, found the objects of the
requests in flight still alive, and promoted them; they died in the old generations, whose
growth then set off full collections over everything alive. Measured in the proxy at issue
10's x1.5 load (650 req/s, docs/benchmarks.md): 40 young collections a second, 60-80 ms of
collector time a second (12-15% of the process's CPU); at x2, with a thousand requests
queued, 80-300 ms a second and full collections of 100-216 ms, each one a stall of every
request in flight. With 50,000 the young generation fills only when that many more objects
are alive than at the last collection: at x1.5 no collection ran in 12 s, and with a
thousand requests queued one ran every ~5 s for 44-68 ms. Garbage in cycles (exceptions
and their tracebacks) still counts towards the threshold, so it stays bounded."""


def settle() -> None:
    """For a process that now serves until it exits: what exists now (imported modules,
    protobuf descriptors, the policy) lives as long as the process, so it moves out of the
    collector's sight, and every full collection scans only what requests allocate."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


@contextmanager
def quiet_while() -> Iterator[None]:
    """:func:`settle` for one stretch of work (a benchmark run), then the settings before it.

    The load generator is the measuring instrument: a full collection over its schedule and
    records (tens of thousands of objects) stopped its event loop for 90-150 ms every 6-9 s
    at issue 10's x1.5 load (measured with ``gc.callbacks``, 2 December), and every request in
    flight or due in that pause was charged the stall. What is frozen here is thawed after."""
    before = gc.get_threshold()
    gc.collect()
    settle()
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
