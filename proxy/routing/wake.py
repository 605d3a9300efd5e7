"""Waking quiet instances: Triton's dynamic batcher can leave a queued request waiting until
another request for the model arrives.

Measured on Triton 2.51 without the proxy (``benchmarks/triton_quiet_stall.py``): a request
that reaches the queue while the model instance is busy sometimes waits for the batcher
thread's 500 ms sleep (``default_wait_microseconds`` in ``dynamic_batch_scheduler.cc``),
unless any new request for the model arrives, which wakes the thread (5 of 40 trials stalled
510-514 ms; none with a request 50 ms later). Round robin feeds every instance, so the next
arrival frees such a request at once; load-aware placement stops sending to an instance whose
requests look slow and so keeps them stuck (issue 10: the proxy arms' real-time P99.9 of
0.2-0.5 s at light load, docs/benchmarks.md, fifth round).

The remedy: an instance with requests of a model in flight, none of them long, that has been
sent nothing of that model and has answered nothing for longer than ``margin`` times the
model's learned full-batch time (never less than ``min_quiet_ms``) is *quiet*; the next short
request of the model goes there instead of where the policy chose, if the instance has a free
slot (unless the request has a session key and the model's policy places by session key).
Its arrival wakes the batcher, and it joins work that should have finished long ago. A model
whose batch time is neither learned (the cost curve) nor reported by Triton's metrics
(:func:`scraped_batch_s`) is never judged quiet (an instance legitimately running a
long batch must not be sent short work). An instance that has not answered anything since it
was last woken is not woken again: a stalled batcher answers within a batch time of the wake,
and a frozen server (``SIGSTOP``, a hung backend) would otherwise draw a short request every
``min_quiet_ms`` until the health checker ejects it. A periodic scan finds quiet instances
(:func:`quiet_instances`), so the request path only looks up a usually empty set.

Instances with long work in flight (a long lane) stall the same way
(``benchmarks/triton_lane_stall.py``: one Triton fed only a lane's traffic, no proxy), but
are not judged. Judging them by the expected time of what they hold was built and measured
(commit ``5c0ffc7``, docs/benchmarks.md, issue 10, fourteenth round): it halved offline's
P99.9 at light load, but left online's long rows where they were and cost real-time a few
milliseconds at P99 (the short request that wakes a lane instance joins its padded batch),
so it was removed.

Judging the other instances by what they hold too (``by_work``, commit ``11ea244``: quiet
after twice the expected time of one batch of their requests in flight, at least 20 ms,
rather than twice a full batch of typical requests, about 36 ms in ``long_share.yaml``) was
measured the same way (docs/benchmarks.md, issue 10, fifteenth round): the slowest real-time
requests waited 7-10 ms less at x0.5 and x1, but the pooled P99s moved within the noise
between repetitions (real-time 34.1 against 32.9 ms at x0.5, 40.2 against 41.6 at x1) and
online's was unchanged (1.68x against 1.69x ``rr_priority``'s at x0.5): removed, as it
moved no target and added work to every request's accounting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.fleet.instances import Instance


@dataclass(frozen=True)
class WakeParams:
    enabled: bool = True
    margin: float = 2.0
    """An instance is quiet after this many of the model's full-batch times without a send
    or an answer. A busy, healthy instance answers once per batch; one that was idle answers
    within one batch time of a send. The stall also hits a request sent to an idle instance
    within a few milliseconds of its last answer (session 6's request log), so the wake must
    come soon after one batch time to matter: round robin's next arrival frees such a request
    after about 30 ms at x0.25."""
    min_quiet_ms: float = 20.0
    """...and never before this. Session 5's wake counted sends only, with a margin of 4 and a
    100 ms floor: with a 20 ms floor (about 60 ms in effect, 4 learned batch times) it sent
    real-time work at x1 to lane instances between two offline batches (real-time P99 133
    against 96 ms). Counting answers too keeps an instance that just finished a batch out,
    and margin 3 with this floor cut the real-time P99 at x0.25 from 56.6 to 41.7 ms with the
    same P99 at x1 (docs/benchmarks.md, issue 10, sixth round)."""
    scan_ms: float = 10.0
    """How often the proxy looks for quiet instances."""

    def __post_init__(self) -> None:
        if self.margin < 1.0:
            raise ValueError(f"margin must be >= 1, got {self.margin}")
        if self.min_quiet_ms <= 0 or self.scan_ms <= 0:
            raise ValueError("min_quiet_ms and scan_ms must be > 0")

    def quiet_after_s(self, batch_s: float | None) -> float | None:
        """How long an instance running a model whose full batch takes ``batch_s`` (None:
        unknown) must go without a send or an answer before it is quiet (None: never)."""
        if batch_s is None:
            return None
        return max(self.min_quiet_ms / 1e3, self.margin * batch_s)


def scraped_batch_s(compute_us: Iterable[float | None]) -> float | None:
    """A model's batch time from Triton's own metrics, when the proxy has not learned its cost
    curve (None: no instance reported one). ``compute_us`` is each instance's mean compute time
    per request over the scrape window (``ModelLoad.compute_us``); every request of a batch is
    charged the batch's compute time, so this is the mean batch time there; the largest one
    is taken. The proxy learns the curve from requests that ran alone, which under sustained
    load (x1 of issue 10's benchmark) never happens: without this fallback the wake never
    judged an instance there, and stalled requests waited the full 0.5 s."""
    known = [us for us in compute_us if us is not None and us > 0]
    return max(known) / 1e6 if known else None


def quiet_instances(
    instances: Iterable[Instance], now: float, quiet_after_s: Callable[[str], float | None]
) -> dict[str, set[str]]:
    """model -> names of the healthy instances that are quiet for it at clock time ``now``
    (``quiet_after_s`` is asked once per model per scan, not once per instance)."""
    quiet: dict[str, set[str]] = {}
    afters: dict[str, float | None] = {}
    for inst in instances:
        if not inst.healthy or inst.woken_at > inst.last_answer_at:
            continue
        for model, n in inst.model_in_flight.items():
            if n <= 0 or inst.long_in_flight.get(model):
                continue
            if model in afters:
                after = afters[model]
            else:
                after = afters[model] = quiet_after_s(model)
            sent = inst.last_sent.get(model)
            if after is None or sent is None:
                continue
            if now - max(sent, inst.last_answer_at) >= after:
                quiet.setdefault(model, set()).add(inst.spec.name)
    return quiet
