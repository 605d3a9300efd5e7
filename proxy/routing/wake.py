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

Why, as read in Triton's source (docs/triton-notes.md, "Dynamic batcher"): the end of a batch
notifies the batcher before the model instance thread is back waiting for the next one, so a
batcher that looks in that window finds no free instance and sleeps; only a new request for
the model (or the 0.5 s timeout) wakes it again.

The remedy: an instance with requests of a model in flight, none of them long, that has been
sent nothing of that model and has answered nothing for longer than ``margin`` times the
expected time of one batch of those requests (never less than ``min_quiet_ms``) is *quiet*;
the next short request of the model goes there instead of where the policy chose, if the
instance has a free slot (unless the request has a session key and the model's policy places
by session key). Its arrival wakes the batcher, and it joins work that should have finished
long ago. The expected time is the learned cost curve (proxy.scheduling.cost) at the summed
estimated cost of the requests in flight there (``by_work``); a model without a learned curve
is judged by one full batch of its typical requests, or by Triton's own compute time
(:func:`scraped_batch_s`) before even that is known, and never judged when neither is known
(an instance legitimately running a long batch must not be sent short work). An instance
that has not answered anything since it was last woken is not woken again: a stalled batcher
answers within a batch time of the wake, and a frozen server (``SIGSTOP``, a hung backend)
would otherwise draw a short request every ``min_quiet_ms`` until the health checker ejects
it. A periodic scan finds quiet instances (:func:`quiet_instances`), so the request path only
looks up a usually empty set.

Instances with long work in flight (a long lane) stall the same way
(``benchmarks/triton_lane_stall.py``: one Triton fed only a lane's traffic, no proxy), but
are not judged. Judging them by the expected time of what they hold was built and measured
(commit ``5c0ffc7``, docs/benchmarks.md, issue 10, fourteenth round): it halved offline's
P99.9 at light load, but left online's long rows where they were and cost real-time a few
milliseconds at P99 (the short request that wakes a lane instance joins its padded batch),
so it was removed.

The nudge (``nudge``, opt-in): a quiet instance whose requests stay stalled until the next
arrival gets that arrival from the proxy itself, at once, rather than from the next request of
the fleet that placement redirects there (every 9 ms at ``case.yaml`` x0.25, by which time a
stall has lasted a median 20 ms: docs/benchmarks.md, issue 10, nineteenth round). The
dispatcher keeps, per instance and model, a way to send again one short, stateless request in
flight there (``Instance.resend``: not a sequence, not a decoupled model, not a stream, not
long); at each scan every quiet instance holding one is sent that copy (:func:`nudge_targets`),
whose answer is dropped, and counts as woken (not judged again until it answers). Triton runs
the copy in the batch it releases: one more row of a short request, and one more inference in
Triton's own statistics. **A model whose requests must not run twice must not be nudged**:
that is why it is off by default. With ``expired_copy`` the copy carries a Triton ``timeout``
of 1 µs where the model's queue policy honours one (``ModelInfo.honours_timeout``: an
override allowed and a default timeout it is below): Triton's batcher wakes for it and
rejects it as expired when it forms the batch, so it does not run (only a batch formed within
1 µs of its arrival would take it), counts as a failure in Triton's statistics, and costs no
device time; an instance holding long work is then judged and nudged as well, but only
while its copy to send is an expired one (``Resend.expired``: for a model that ignores
timeouts the copy would run, and a short request redirected there would join the padded
batch). Measured:
docs/benchmarks.md, issue 10, twentieth round (the nudge) and twenty-fourth (``expired_copy``).

The doorbell (``ring_after_ms``, with ``expired_copy``): the proxy cannot tell a stalled
request from one whose batch is still running before ``margin`` batch times have passed, but
an expired copy costs no device time, so it need not tell them apart: an instance holding an
expired copy to send is judged after a fixed silence (3 ms in the benchmark) since its last
send or answer. A running batch then gets one copy that expires in Triton's queue; a stalled
request waits that silence plus at most one scan, not 1.5 batch times (23 ms for a 512-token
row in ``long_share.yaml``). Measured: docs/benchmarks.md, issue 10, twenty-sixth round.

``by_work`` (issue 10, fifteenth round) replaced the full-batch rule, which judged every
instance by twice a full batch of the model's typical requests (about 36 ms in
``long_share.yaml``), while a stalled instance usually holds one to three short requests (a
6-8 ms batch). On three servers the slowest real-time requests waited 7-10 ms less with it
and the P99s moved within the noise; on six servers, where placement leaves a stalled
instance without arrivals for longer because other instances are idle, the slowest real-time
requests waited 20 ms less at x1 and x2 of ``long_share.yaml`` (33 against 55 ms, 40 against
62), real-time's P99 at x2 fell from 63.4 to 45.7 ms and online's at x1 from 77.2 to 66.0 ms
(docs/benchmarks.md, issue 10, fifteenth round). ``by_work: false`` restores the old rule.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
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
    nudge: bool = False
    """Send each quiet instance a copy of one short, stateless request it holds (its answer
    dropped): its arrival wakes the batcher at once (module doc). Runs some requests twice in
    Triton, hence opt-in; the ``+nudge`` arms of the benchmark set it with a 6 ms floor,
    margin 1.5 and a 3 ms scan."""
    expired_copy: bool = False
    """With ``nudge``: the copy carries Triton's ``timeout`` of 1 µs (:data:`EXPIRED_US`)
    where the model's queue policy honours it (``allow_timeout_override``): its arrival
    wakes the batcher like any other, and the batcher rejects it as expired when it forms
    the batch (``PriorityQueue::PolicyQueue::ApplyPolicy`` in Triton's core), so it does not
    run and pads nothing. Instances holding long work are then judged and nudged too,
    while their copy is an expired one (a copy of a long request costs no device time
    either); otherwise they are not judged (module doc). Opt-in."""
    real_copy: bool = True
    """With ``nudge``: where no expired copy can be sent (``expired_copy`` off, or the
    model's queue policy ignores a request's timeout), send a copy that runs. False: only
    expired copies are sent, so nothing runs twice (a model that ignores timeouts gets the
    redirect of the next short request only, as without ``nudge``). The defaults with
    classes (:data:`proxy.routing.config.CLASS_WAKE`) set it false."""
    by_work: bool = True
    """Judge an instance without long work by the expected time of what it has in flight
    rather than by a full batch of the model's typical requests (module doc)."""
    ring_after_ms: float | None = None
    """With ``expired_copy``: an instance whose copy to send is an expired one is quiet after
    this long without a send or an answer, whatever the expected time of what it holds (the
    *doorbell*). The copy costs no device time, so it can be sent before the proxy could
    tell a stall from a batch still running: a stalled request then waits this long plus at
    most one scan, not ``margin`` batch times. A running batch gets at most one copy (an
    instance is not woken again before it answers), which expires in Triton's queue. Other
    instances keep ``margin`` and ``min_quiet_ms`` (a short request redirected to an
    instance judged this early would join batches that are running normally). None: off.
    Measured (docs/benchmarks.md, issue 10, twenty-sixth round): at ``long_share.yaml``
    x0.5, 3 ms cut the real-time P99 from 25.9 to 16.0 ms, online's from 29.9 to 25.2 and
    online's 512-token rows' from 47.8 to 31.0, for 0.02 cores of the proxy's and 0.02 of
    Triton's. The price is copies: nearly every batch longer than this with nothing else
    sent to its instance gets one (0.98 copies per request at x0.25, 0.70 at x1, 0.17 at
    x2), each a full copy of a held request that Triton counts as a failed one."""

    def __post_init__(self) -> None:
        if self.margin < 1.0:
            raise ValueError(f"margin must be >= 1, got {self.margin}")
        if self.min_quiet_ms <= 0 or self.scan_ms <= 0:
            raise ValueError("min_quiet_ms and scan_ms must be > 0")
        if self.ring_after_ms is not None and self.ring_after_ms <= 0:
            raise ValueError(f"ring_after_ms must be > 0 or null, got {self.ring_after_ms}")

    def ring_after_s(self) -> float | None:
        """``ring_after_ms`` in seconds where the doorbell applies (the wake, ``nudge`` and
        ``expired_copy`` on), else None."""
        if self.ring_after_ms is None or not (self.enabled and self.nudge and self.expired_copy):
            return None
        return self.ring_after_ms / 1e3

    def quiet_after_s(self, batch_s: float | None) -> float | None:
        """How long an instance running a model whose full batch takes ``batch_s`` (None:
        unknown) must go without a send or an answer before it is quiet (None: never)."""
        if batch_s is None:
            return None
        return max(self.min_quiet_ms / 1e3, self.margin * batch_s)


EXPIRED_US = 1
"""``expired_copy``: the nudge's Triton ``timeout`` in microseconds (0 would mean none)."""


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
    instances: Iterable[Instance],
    now: float,
    quiet_after_s: Callable[[str], float | None],
    quiet_after_work: Callable[[str, float], float | None] | None = None,
    ring_after_s: float | None = None,
) -> dict[str, set[str]]:
    """model -> names of the healthy instances that are quiet for it at clock time ``now``
    (``quiet_after_s`` is asked once per model per scan, not once per instance). With
    ``quiet_after_work`` (``by_work``) each instance is judged by it first, asked with the
    model and the estimated cost in flight there; where it answers None (no learned curve),
    by ``quiet_after_s``. With ``ring_after_s`` (``ring_after_ms``) an instance whose copy to
    send is an expired one is judged by that alone."""
    quiet: dict[str, set[str]] = {}
    afters: dict[str, float | None] = {}
    for inst in instances:
        if not inst.healthy or inst.woken_at > inst.last_answer_at:
            continue
        for model, n in inst.model_in_flight.items():
            if n <= 0:
                continue
            resend = inst.resend.get(model)
            expired = resend is not None and resend.expired
            if inst.long_in_flight.get(model) and not expired:
                # Sending a short request there joins a padded batch, a real copy runs
                # again: judged only with an expired copy to send (routing.wake.expired_copy).
                continue
            after = ring_after_s if expired else None
            if after is None and quiet_after_work is not None:
                after = quiet_after_work(model, inst.cost_in_flight.get(model, 0.0))
            if after is None:
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


def nudge_targets(
    quiet: Mapping[str, set[str]], instances: Mapping[str, Instance]
) -> list[tuple[Instance, str, Callable[[], Awaitable[object]]]]:
    """(instance, model, resend) for each quiet instance that holds a short, stateless
    request of the model it is quiet for (``Instance.resend``, kept by the dispatcher while
    ``nudge`` is on), in name order; an instance quiet for several models is nudged for one."""
    out = []
    seen: set[str] = set()
    for model in sorted(quiet):
        for name in sorted(quiet[model]):
            inst = instances.get(name)
            resend = inst.resend.get(model) if inst is not None else None
            if inst is not None and resend is not None and name not in seen:
                seen.add(name)
                out.append((inst, model, resend.send))
    return out
