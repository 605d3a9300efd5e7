"""The arms of ``triton-proxy bench``: what each one is, and how it is started.

Every arm sends the same schedule to the same local Triton servers:

- ``round_robin``: client round robin straight to the servers (a Kubernetes Service);
- ``rr_priority``: the same with each class's Triton ``priority`` on the request, which any
  Triton user can do without a proxy (a strong baseline);
- ``haproxy_leastconn`` / ``haproxy_random2`` / ``haproxy_session``: HAProxy from Debian;
- ``proxy_<policy>``: triton-proxy with routing policy ``<policy>`` and no classes (every
  request dispatched at once);
- ``proxy_rr_priority``: ``rr_priority`` through the proxy (``round_robin``, no classes, the
  client's priority passed on as sent): the same decisions as ``rr_priority``, so the
  difference between the two is what the proxy itself costs at that load (the sweep reports
  it, :mod:`proxy.bench.sweep`); ``+no_feedback`` with instance feedback off (the weight
  cut for an instance whose queue wait stays high, on by default); ``+nudge`` with
  ``routing.wake.nudge`` (:data:`NUDGE_WAKE`);
- ``proxy_<policy>+classes``: the same with a ``scheduling:`` section built from the
  scenario's classes (:func:`scheduling_section`): class queues, Triton priority per class,
  API keys deciding the class, everything else the policy file's defaults;
- ``proxy_previous_best``: the best proxy configuration before issue 10, pinned:
  ``least_requests`` + classes with a fixed ``concurrency`` of 2 x ``max_batch_size`` (32),
  no deadline admission (``shed_late: false``), adaptive concurrency off;
- ``proxy_classes_default``: the scenario's classes and the routing a policy file with
  classes and no routing policy got in sessions 28-33 (pinned: :data:`MEASURED_CLASS_POLICY`,
  :data:`MEASURED_CLASS_WAKE`), every scheduling default of session 30 (fixed slots derived
  from ``max_batch_size``); ``+slots64`` with 64 fixed slots per instance;
  ``+adaptive`` with adaptive concurrency (every default since session 31),
  ``+adaptive+late`` also with deadline admission, ``+adaptive_fast+late`` the same with a
  shorter window for the adaptive law (:data:`FAST_WINDOW_S`); ``+by_rank`` with
  ``slot_sharing: by_rank``; ``+by_rank+adaptive`` also with adaptive concurrency,
  ``+by_rank+late`` with deadline admission (``shed_late``); ``+adaptive+depth64`` and
  ``+adaptive+reserve`` with one lane parameter more. :data:`SHARED_DEFAULT_ARM` was the
  class default of sessions 38-39; its ``+by_rank`` counts slots by rank, its
  ``+placed_by_rank`` only in placement (the gate's pool shared, :data:`PLACED_DEFAULT_ARM`,
  session 40's default), whose ``+starved1`` (``+starved2``, ``+starved3``) starts the floor
  boost once a class owes 1 s (2 s, 3 s) of its share (``+starved2``, sessions 41-43's
  default); its ``+rspread`` keeps the long work the fill does not pack off the short
  reserve too (``reserve_spread``): :data:`CLASS_DEFAULT_ARM`, the one whose routing and
  scheduling a policy file with classes and no routing section gets today, whose ``+lend1``
  (``+lend2``, ``+lend4``) lets each spare of the throughput class's lane hold 1 (2, 4) of
  its requests while kept and the class is behind (``spare_per_instance``,
  :data:`SPARE_LENT`); ``+no_copy``
  (of :data:`SHARED_DEFAULT_ARM`) sends no doorbell copies (the redirect wake);
- ``proxy_class_aware``: issue 10's configuration: ``expected_start`` + classes, the lowest
  class (the throughput class) capped at ``max_per_instance: 1``, and the defaults (slots
  derived from ``max_batch_size``; adaptive concurrency and deadline admission are opt-in);
- ``proxy_class_aware+adaptive``: the same with adaptive concurrency and deadline admission on
  (both measured to shed real-time traffic at light load in issue 10's case, so off by default);
- ``proxy_long_lane``: ``expected_start`` packing long work into a lane of instances, the
  lowest class at ``max_per_instance: 8`` with ``spare_instances: 1`` (one instance kept free
  of it for short work) and 64 slots per instance; ``+adaptive`` has adaptive concurrency
  instead of the 64 fixed slots;
- ``proxy_rank_lane``: ``proxy_long_lane`` with ``slot_sharing: by_rank`` (a class counts only
  the slots held by classes at least as important as itself); ``+idle`` also sends the long
  requests of uncapped classes to an idle instance while another one stays idle
  (``long_to_idle``, ``idle_reserve: 1``);
- ``proxy_shallow_lane``: ``proxy_rank_lane+idle`` whose lane runs the lowest class at
  ``shallow_per_instance: 2`` per instance while its queue moves, and at 8 once its oldest
  queued request has waited ``deepen_after_s`` (1 s); ``+quiet`` also lets online's long rows
  take a quiet instance before the lane (``quiet_depth``, :data:`QUIET_DEPTH`); ``+alone``: a
  quiet instance must also have nothing of a more important level in flight
  (``quiet_alone``), so those rows pad no real-time batch; ``+alone2`` the same with a
  ``quiet_depth`` of 2 (at most one short row in the long row's batch); ``+wake_full``: the
  wake judges every instance by a full batch (``routing.wake.by_work: false``, the rule
  before the fifteenth round); ``+wake_work10``: its floor at 10 ms; ``+light``: the lane
  packs only while the fleet's occupancy is at least :data:`PACK_ABOVE` (``pack_above``);
  ``+light_alone``: below it, long work also avoids more important work (``spread_alone``);
  ``+light_wake10``: ``+light`` with ``+wake_work10``'s wake; ``+nudge``: the wake sends a
  quiet instance a copy of a short request it holds (:data:`NUDGE_WAKE`);
- ``proxy_expected_finish``: ``expected_finish`` (``proxy.routing.batcher``: each request
  where a replay of the instance's Triton batcher over the proxy's requests in flight there
  finishes it soonest) + classes, the lowest class at ``max_per_instance`` 8, 64 slots per
  instance counted by rank; ``+delays`` with ``count_delays`` (the delay a request adds to
  those in flight counts too); ``+nudge`` with :data:`NUDGE_WAKE`; ``+lane``: ``+delays+nudge``
  behind ``proxy_shallow_lane``'s gate (offline shallow, one instance kept spare of it);
  ``+lane+pack``: ``+lane`` whose long work is packed into a lane (``pack_above`` 0);
  ``+lane+pack90``: packed only at an occupancy of :data:`FINISH_PACK_ABOVE` or more;
  ``proxy_expected_finish+pack`` and ``+pack90``: the same without ``count_delays``;
  ``+lane+pack90+capped``: ``+lane+pack90`` whose capped class is packed at any occupancy
  (``pack_capped: always``); ``+lane+pack90+backlog``: at any occupancy while that class has
  requests queued at the gate (``pack_capped: backlogged``); ``+backlog+expired``: its
  nudge sends an expired copy, to instances holding long work too
  (``routing.wake.expired_copy``); ``+expired+ring``: that copy goes after
  :data:`RING_AFTER_MS` of silence, not 1.5 batch times (``routing.wake.ring_after_ms``);
  it is ``policies/mixed-traffic.yaml``, and ``+ring+adaptive``, ``+ring+late`` and
  ``+ring+adaptive+late`` add adaptive concurrency (instead of its 64 fixed slots) and
  deadline admission (``shed_late``) to it; ``+ring+adaptive+late_tail`` (and
  ``proxy_classes_default+adaptive+late_tail``) with ``late_by: tail``.

Proxy arms run ``triton-proxy serve`` in a child process by default, so the proxy does not
share the load generator's event loop and CPU time slice (HAProxy is a separate process too);
``inprocess`` runs a :class:`~proxy.app.ProxyServer` in the generator's own loop, which is
cheaper to start but charges the proxy's work to the generator's schedule.

Adaptive concurrency is on by default since session 31. An arm turns it on only by name
(``+adaptive``, or a ``policies/mixed-traffic.yaml`` arm): every other arm runs the fixed slots
(its ``concurrency``, else ``2 x max_batch_size``) it was first measured with.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import aiohttp
import yaml

from proxy.bench.capacity import ACCEL_SIM_MAX_BATCH
from proxy.bench.compare import ArmSpec
from proxy.bench.haproxy import Backend, Balance, run_haproxy
from proxy.bench.procs import stop_process
from proxy.bench.results import PROXY_BOOSTED, PROXY_COPIES, PROXY_RSS
from proxy.bench.runner import LoadProbe, OneScrapeProbe, PrometheusGaugeProbe, TargetSpec
from proxy.bench.scenario import ModelSpec, Scenario
from proxy.bench.trace import class_probe, model_probes, with_counters
from proxy.local.fleet import log_tail
from proxy.routing.config import PolicySpec
from proxy.routing.wake import WakeParams
from proxy.scheduling.config import load_scheduling

ROOT = Path(__file__).resolve().parents[2]

ProxyMode = Literal["subprocess", "inprocess"]
PROXY_MODES: tuple[ProxyMode, ...] = ("subprocess", "inprocess")

PROXY_POLICIES = ("round_robin", "least_requests", "weighted_score", "p2c", "consistent_hash")
CLASS_POLICIES = ("least_requests", "weighted_score")
"""Policies also measured with classes (the ones that read load, where queues pay off)."""

PREVIOUS_CONCURRENCY = 32
"""The fixed per-instance concurrency before issue 10: 2 x ``max_batch_size`` (16 for
``accel_sim``), what ``derive_concurrency`` gave for one model instance."""


SPARE_LENT = (1, 2, 4)
"""``spare_per_instance`` of the ``+lend`` arms (session 47)."""
OVERLOAD_LAG_MS = (10, 20, 40)
"""``scheduling.overload.lag_ms`` of the ``+guard`` arms (session 49)."""
LANE_DEPTH = 8
"""``max_per_instance`` of the throughput class in the long-lane arms: two batches of the
issue 10 scenarios' offline requests (4 rows each, ``max_batch_size`` 16) per lane instance,
one running and one forming."""


SHALLOW_DEPTH = 2
"""``shallow_per_instance`` of the throughput class in ``proxy_shallow_lane``: half a batch of
the issue 10 scenarios' offline requests per lane instance (2 x 4 rows of ``max_batch_size``
16), so online's long rows join batches of at most 9 rows (5 + 0.010 x 9 x 512 = 51 ms)
instead of 13 (72 ms). Measured at x1 (2 repetitions): online P99 92 against 170 ms with
the full depth; depth 1 gave 68 ms but lost a fifth of offline's completions at x1."""


QUIET_DEPTH = 4
"""``quiet_depth`` in ``proxy_shallow_lane+quiet``: an online 512-token row may take an instance
with fewer than 4 requests in flight and no long work, where its batch pads at most 3 short
rows (5 + 0.010 x 4 x 512 = 25 ms in ``case.yaml``), rather than wait in the lane for an
offline batch (up to 46 ms at the shallow depth) and run in one filled with offline rows."""


PACK_ABOVE = 0.5
"""``pack_above`` of ``proxy_shallow_lane+light``: the lane packs long work only while at
least half of the model's instances hold work (``proxy.routing.occupancy``)."""


FINISH_PACK_ABOVE = 0.9
"""``pack_above`` of ``proxy_expected_finish+lane+pack90``: near capacity, where the
occupancy (any of the proxy's requests in flight on an instance) is close to 1 and mixed
batches would hold the fleet to its FIFO capacity; below it the replay mixes them."""

NUDGE_WAKE = {"min_quiet_ms": 6, "scan_ms": 3, "margin": 1.5, "nudge": True}
"""``routing.wake`` of the ``+nudge`` arms: quiet after 1.5 expected batch times of what the
instance holds (never under 6 ms), looked for every 3 ms; stalled requests waited a median
20 ms idle without it (docs/benchmarks.md, nineteenth round)."""

FAST_WINDOW_S = 0.25
"""``adaptive_concurrency.window_s`` of the ``+adaptive_fast`` arm: at the default decrease of
0.8 per window a limit falls from 4 batches to 1 in about 1.5 s instead of 6 s, within a
2 s real-time surge (``benchmarks/issue10/surge.yaml``)."""

RING_AFTER_MS = 3.0
"""``routing.wake.ring_after_ms`` of the ``+ring`` arm: a 3 ms scan finds an instance silent
for 3 ms, so a stalled request waits 3-6 ms (docs/benchmarks.md, issue 10, twenty-sixth
round)."""

UNCAPPED_LANE_DEPTHS = (2, 4)
"""``lane_depth`` of the ``proxy_shallow_lane+depth<N>`` arms. The default, 2 x
``max_batch_size`` (32 long requests), never opens a second instance for online's long rows at
x0.5 in ``long_share.yaml``; there they queue behind each other and the offline batches."""

MEASURED_CLASS_POLICY = PolicySpec(
    "expected_finish",
    {"count_delays": True, "pack_above": 0.9, "pack_capped": "backlogged"},
)
"""The routing of every ``proxy_classes_default`` arm, pinned: what a policy file with classes
and no routing policy got from session 28 (``158dd69``) to session 33
(:data:`proxy.routing.config.CLASS_POLICY` before ``short_reserve``). Pinned so that a change
of the default does not change what an arm measured under its name; the arm that is today's
default is the one ``tests/unit/test_bench_issue10.py`` ties to it."""

MEASURED_CLASS_WAKE = WakeParams(
    scan_ms=3.0, nudge=True, expired_copy=True, real_copy=False, ring_after_ms=3.0
)
"""The wake that goes with :data:`MEASURED_CLASS_POLICY` (:data:`proxy.routing.config.CLASS_WAKE`
since session 29, ``a124a8f``), pinned with it."""

BOOST_ARM = "proxy_classes_default+adaptive+reserve+lane+late+spare_third+boost5"
"""The class default of session 36 (the floor boost after 5 s): the arm the lane and fill
variants below vary."""

SHARED_DEFAULT_ARM = f"{BOOST_ARM}+busy4+from5"
"""The class default of sessions 38-39: its lowest class's lane is the one
:func:`proxy.scheduling.config.derived_lane` gives the benchmark's model (``max_batch_size``
16), its fill :data:`proxy.routing.config.CLASS_FILL` (session 38), its slots shared."""

PLACED_DEFAULT_ARM = f"{SHARED_DEFAULT_ARM}+placed_by_rank"
"""The class default of session 40: :data:`SHARED_DEFAULT_ARM` whose placement counts slots by
rank (``slot_sharing`` left null resolves to ``placed_by_rank`` there since session 40)."""

STARVED_DEFAULT_ARM = f"{PLACED_DEFAULT_ARM}+starved2"
"""The class default of sessions 41-43: :data:`PLACED_DEFAULT_ARM` whose floor boost starts
once a class owes 2 s of its share (``starved_after_s`` 2, the default since session 41)."""

CLASS_DEFAULT_ARM = f"{STARVED_DEFAULT_ARM}+rspread"
"""The catalog arm that is today's class default (routing and scheduling; a unit test parses
both and compares): :data:`STARVED_DEFAULT_ARM` whose short reserve holds the long work the
fill does not pack too (``expected_finish``'s ``reserve_spread``, the default since session
44)."""

SHIPPED_LANE_DEPTHS = (64,)
"""``lane_depth`` of the shipped arm's ``+depth<N>`` variants."""

CLASS_LANE_DEPTHS = (4, 8, 16)
"""``lane_depth`` of the ``...+boost5`` arm's ``+depth<N>`` variants (the default is
``2 x max_batch_size``, 32 for the benchmark's model)."""

CLASS_OCCUPANCY_DEPTHS = (0.25,)
"""``routing.occupancy_depth`` of the ``...+boost5`` arm's ``+busy<N>`` variants (N: the
mean requests in flight per instance at which the fleet is fully occupied for the benchmark's
model, ``max_batch_size`` 16)."""

RESERVE_ARM = "proxy_expected_finish+lane+pack90+backlog+expired+ring+adaptive+late+reserve"
"""The arm ``policies/mixed-traffic.yaml`` was from the thirty-third round to session 37."""

FILL_SHIPPED_ARM = f"{RESERVE_ARM}+busy4+from5"
"""The arm ``policies/mixed-traffic.yaml`` was in sessions 38-39: :data:`RESERVE_ARM` with the
class default's fill."""

PLACED_SHIPPED_ARM = f"{FILL_SHIPPED_ARM}+placed_by_rank"
"""The arm ``policies/mixed-traffic.yaml`` was in sessions 40-43: :data:`FILL_SHIPPED_ARM`
whose gate counts one pool of slots, placement by rank."""

SHIPPED_ARM = f"{PLACED_SHIPPED_ARM}+rspread"
"""The arm ``policies/mixed-traffic.yaml`` is since session 44: :data:`PLACED_SHIPPED_ARM`
whose short reserve holds the long work the fill does not pack too (``reserve_spread``; a
unit test compares the two)."""

CLASS_STARVED_AFTER = (1, 2, 3)
"""``starved_after_s`` of the class default's ``+starved<N>`` variants (session 41: the floor
boost's debt threshold, in seconds of the class's share)."""

CLASS_FILL_LOADS = (0.5,)
"""``routing.fill_from_load`` of the ``...+boost5+busy4`` arm's ``+from<N>`` variants (N: the
long load in tenths of an instance): the fill decides only while an uncapped class's long
work would keep at least that share of an instance busy in full batches."""

LANE_CONCURRENCY = 64
"""Slots per instance in ``proxy_long_lane``: 4 x ``max_batch_size``. The spare instance
serves all the short work while the lane runs long work; with 2 x ``max_batch_size`` (32)
its slots filled under bursts and short requests spilled onto the lane, into padded batches
(measured, burst x1.5: every instance at 32, 24 of them short on each lane instance).
Triton orders the deeper queue by priority, and it holds short work only, so it pads
nothing."""


@dataclass(frozen=True)
class ArmPlan:
    """What one arm is, before anything is started (pure data, for tests and ``--list-arms``)."""

    name: str
    kind: Literal["direct", "haproxy", "proxy"]
    description: str
    priority: bool = False
    """The client sets each class's Triton priority itself (direct arms; a proxy without
    classes passes it on as sent)."""
    balance: Balance | None = None
    policy: str | None = None
    classes: bool = False
    scheduling: Mapping[str, Any] | None = None
    """Keys set on the ``scheduling:`` section over the ones built from the scenario."""
    lowest_max_per_instance: int | None = None
    """``max_per_instance`` of the lowest-ranked class (the throughput class)."""
    lowest_spare_instances: int = 0
    """``spare_instances`` of the lowest-ranked class (its long lane leaves these free)."""
    lowest_spare_fraction: float = 0.0
    """``spare_fraction`` of the lowest-ranked class (at least this share of the instances
    left free)."""
    lowest_shallow_per_instance: int | None = None
    """``shallow_per_instance`` of the lowest-ranked class (its lane's depth while it keeps
    up)."""
    lowest_spare_per_instance: int = 0
    """``spare_per_instance`` of the lowest-ranked class (what each spare of its lane may
    hold while the spares are kept and the class is behind)."""
    lowest_shares_level: bool = False
    """The lowest-ranked class is sent at the Triton priority of the class ranked just above
    it (Triton serves the two in arrival order) instead of its own lower one."""
    policy_params: Mapping[str, Any] | None = None
    """The routing policy's parameters (none: its defaults)."""
    routing: Mapping[str, Any] | None = None
    """Keys set on the ``routing:`` section beside the policy (e.g. ``feedback``)."""


def _vary(plan: ArmPlan, name: str, description: str, **params: Any) -> ArmPlan:
    """``plan`` renamed, with ``params`` set on its routing policy's parameters."""
    policy_params = {**(plan.policy_params or {}), **params}
    return replace(plan, name=name, description=description, policy_params=policy_params)


def _class_default(
    name: str,
    description: str,
    scheduling: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> ArmPlan:
    """A ``proxy_classes_default`` arm: classes, and the class default's routing pinned as
    measured (:data:`MEASURED_CLASS_POLICY` with ``params`` on top, its wake)."""
    return ArmPlan(
        name,
        "proxy",
        description,
        classes=True,
        scheduling=scheduling,
        policy=MEASURED_CLASS_POLICY.name,
        policy_params={**MEASURED_CLASS_POLICY.params, **(params or {})},
        routing={"wake": asdict(MEASURED_CLASS_WAKE)},
    )


SHARING_WHAT: Mapping[str, str] = {
    "by_rank": "a class counts only the slots held by classes at least as important: "
    "placement's free-slot filter reads the requests ahead of it in Triton's priority queue",
    "placed_by_rank": "the gate counts one pool; placement's free-slot filter counts an "
    "instance's slots by rank",
}
"""What each ``slot_sharing`` of a ``+<sharing>`` arm does, for its description."""


def _sharing(plan: ArmPlan, sharing: str) -> ArmPlan:
    """``plan`` with ``slot_sharing: <sharing>``, named ``<plan>+<sharing>``."""
    return replace(
        plan,
        name=f"{plan.name}+{sharing}",
        description=f"{plan.name} with slot_sharing {sharing} ({SHARING_WHAT[sharing]})",
        scheduling={**(plan.scheduling or {}), "slot_sharing": sharing},
    )


def _catalog() -> dict[str, ArmPlan]:
    plans = [
        ArmPlan("round_robin", "direct", "client round robin to Triton (a Kubernetes Service)"),
        ArmPlan(
            "rr_priority",
            "direct",
            "client round robin, each class's Triton priority on the request",
            priority=True,
        ),
        ArmPlan("haproxy_leastconn", "haproxy", "HAProxy balance leastconn", balance="leastconn"),
        ArmPlan("haproxy_random2", "haproxy", "HAProxy balance random(2)", balance="random2"),
        ArmPlan(
            "haproxy_session",
            "haproxy",
            "HAProxy hdr(x-session-id), consistent hash, hash-balance-factor 150",
            balance="session",
        ),
    ]
    plans += [
        ArmPlan(f"proxy_{p}", "proxy", f"triton-proxy, {p}, no classes", policy=p)
        for p in PROXY_POLICIES
    ]
    rr_through = ArmPlan(
        "proxy_rr_priority",
        "proxy",
        "rr_priority through triton-proxy: round_robin, no classes, the client's Triton "
        "priority passed on as sent (what the proxy itself costs at a load)",
        priority=True,
        policy="round_robin",
    )
    plans += [
        rr_through,
        replace(
            rr_through,
            name="proxy_rr_priority+no_feedback",
            description="proxy_rr_priority with instance feedback off (no weight cut for an "
            "instance whose queue wait stays high)",
            routing={"feedback": {"enabled": False}},
        ),
        replace(
            rr_through,
            name="proxy_rr_priority+nudge",
            description="proxy_rr_priority whose wake sends a quiet instance a copy of a "
            "short request it holds (routing.wake.nudge)",
            routing={"wake": NUDGE_WAKE},
        ),
    ]
    plans += [
        ArmPlan(
            f"proxy_{p}+classes",
            "proxy",
            f"triton-proxy, {p}, scenario classes (queues, priority, API keys)",
            policy=p,
            classes=True,
        )
        for p in CLASS_POLICIES
    ]
    plans += [
        ArmPlan(
            "proxy_least_requests+classes+lane",
            "proxy",
            "proxy_least_requests+classes with the lane scheduling.throughput_lane derives "
            "for the benchmark's model under a policy that packs (8 per instance, 2 while "
            "the queue moves, 1 spare); set in the file: since session 35 a policy that does "
            "not pack gets none",
            policy="least_requests",
            classes=True,
            lowest_max_per_instance=8,
            lowest_shallow_per_instance=2,
            lowest_spare_instances=1,
        ),
    ]
    plans += [
        ArmPlan(
            "proxy_previous_best",
            "proxy",
            "triton-proxy before issue 10: least_requests + classes, fixed concurrency "
            f"{PREVIOUS_CONCURRENCY}/instance, no deadline admission, no adaptive concurrency",
            policy="least_requests",
            classes=True,
            scheduling={
                "concurrency": PREVIOUS_CONCURRENCY,
                "shed_late": False,
                "adaptive_concurrency": {"enabled": False},
            },
        ),
        _class_default(
            "proxy_classes_default",
            "triton-proxy with the scenario's classes and nothing else: the routing a policy "
            "file with classes got when it named no policy in sessions 28-33 (pinned: "
            "MEASURED_CLASS_POLICY and its wake), the scheduling defaults of session 30 (fixed "
            "slots derived from max_batch_size; +adaptive is today's scheduling defaults)",
        ),
        _class_default(
            "proxy_classes_default+slots64",
            "proxy_classes_default with 64 fixed slots per instance (adaptive concurrency's "
            "ceiling for max_batch_size 16) instead of the derived 2 x max_batch_size",
            scheduling={"concurrency": 64},
        ),
        _class_default(
            "proxy_classes_default+adaptive",
            "proxy_classes_default with adaptive concurrency instead of the derived fixed slots "
            "(every default since session 31)",
            scheduling={"adaptive_concurrency": {"enabled": True}},
        ),
        *(
            _class_default(
                f"proxy_classes_default+adaptive+{suffix}",
                f"proxy_classes_default+adaptive whose long lane {what} (the default routing "
                f"with expected_finish's {', '.join(f'{k}: {v}' for k, v in params.items())})",
                params=params,
                scheduling={"adaptive_concurrency": {"enabled": True}},
            )
            for suffix, what, params in (
                (
                    f"depth{SHIPPED_LANE_DEPTHS[0]}",
                    f"holds {SHIPPED_LANE_DEPTHS[0]} long requests per instance before it "
                    "opens another instance to them",
                    {"lane_depth": SHIPPED_LANE_DEPTHS[0]},
                ),
                (
                    "reserve",
                    "never opens the last instance free of long work to online's long requests",
                    {"short_reserve": 1},
                ),
            )
        ),
        *(
            replace(
                _class_default(
                    f"proxy_classes_default+adaptive+reserve+lane{suffix}",
                    "proxy_classes_default+adaptive+reserve whose lowest class runs in a lane "
                    f"(max_per_instance {depth}, spare_instances {spare}, shallow_per_instance "
                    f"{shallow}){what}",
                    params={"short_reserve": 1},
                    scheduling={"adaptive_concurrency": {"enabled": True}, **scheduling},
                ),
                lowest_max_per_instance=depth,
                lowest_spare_instances=spare,
                lowest_spare_fraction=fraction,
                lowest_shallow_per_instance=shallow,
            )
            for suffix, depth, shallow, (spare, fraction), what, scheduling in (
                ("", LANE_DEPTH, SHALLOW_DEPTH, (1, 0.0), ": policies/mixed-traffic.yaml's", {}),
                (
                    "+by_rank",
                    LANE_DEPTH,
                    SHALLOW_DEPTH,
                    (1, 0.0),
                    ": policies/mixed-traffic.yaml's, slot_sharing by_rank",
                    {"slot_sharing": "by_rank"},
                ),
                (
                    "16",
                    16,
                    4,
                    (1, 0.0),
                    ": a full batch of requests per lane instance, for a throughput class of "
                    "one-row requests a full batch of rows",
                    {},
                ),
                (
                    "+late",
                    LANE_DEPTH,
                    SHALLOW_DEPTH,
                    (1, 0.0),
                    ": policies/mixed-traffic.yaml's, deadline admission (shed_late)",
                    {"shed_late": True},
                ),
                (
                    "+late+spare2",
                    LANE_DEPTH,
                    SHALLOW_DEPTH,
                    (2, 0.0),
                    ", deadline admission (shed_late); on six servers a third of the fleet "
                    "free of long work, as one spare of three",
                    {"shed_late": True},
                ),
                (
                    "+late+spare_third",
                    LANE_DEPTH,
                    SHALLOW_DEPTH,
                    (1, 1 / 3),
                    ", spare_fraction 1/3, deadline admission (shed_late): the class default "
                    "of session 35 (as +late on three servers, as +late+spare2 on six)",
                    {"shed_late": True},
                ),
                (
                    "+late+spare_third+boost",
                    LANE_DEPTH,
                    SHALLOW_DEPTH,
                    (1, 1 / 3),
                    ", spare_fraction 1/3, deadline admission (shed_late) and the floor boost "
                    "after 2 s (starved_after_s 2; it fired in surge.yaml x1's surges, where "
                    "the floor held without it, and cost online there)",
                    {"shed_late": True, "starved_after_s": 2.0},
                ),
                (
                    "+late+spare_third+boost5",
                    LANE_DEPTH,
                    SHALLOW_DEPTH,
                    (1, 1 / 3),
                    ", spare_fraction 1/3, deadline admission (shed_late) and the floor boost "
                    "after 5 s (starved_after_s 5): the class default since session 36",
                    {"shed_late": True, "starved_after_s": 5.0},
                ),
            )
        ),
        _class_default(
            "proxy_classes_default+adaptive+late",
            "proxy_classes_default with adaptive concurrency instead of the derived fixed slots "
            "and deadline admission (shed_late)",
            scheduling={"adaptive_concurrency": {"enabled": True}, "shed_late": True},
        ),
        _class_default(
            "proxy_classes_default+adaptive_fast+late",
            "proxy_classes_default+adaptive+late whose adaptive law judges every "
            f"{FAST_WINDOW_S:g} s instead of every 1 s (adaptive_concurrency.window_s)",
            scheduling={
                "adaptive_concurrency": {"enabled": True, "window_s": FAST_WINDOW_S},
                "shed_late": True,
            },
        ),
        _class_default(
            "proxy_classes_default+adaptive+late_tail",
            "proxy_classes_default+adaptive+late whose class SLOs hold a request that waited "
            "to a slow answer (scheduling.late_by: tail)",
            scheduling={
                "adaptive_concurrency": {"enabled": True},
                "shed_late": True,
                "late_by": "tail",
            },
        ),
        _class_default(
            "proxy_classes_default+by_rank",
            "proxy_classes_default with slot_sharing by_rank (a class counts only the slots of "
            "classes at least as important)",
            scheduling={"slot_sharing": "by_rank"},
        ),
        _class_default(
            "proxy_classes_default+by_rank+adaptive",
            "proxy_classes_default+by_rank with adaptive concurrency instead of the derived "
            "fixed slots",
            scheduling={"slot_sharing": "by_rank", "adaptive_concurrency": {"enabled": True}},
        ),
        _class_default(
            "proxy_classes_default+by_rank+late",
            "proxy_classes_default+by_rank with deadline admission (shed_late: a request "
            "predicted past its class's SLO is shed at once)",
            scheduling={"slot_sharing": "by_rank", "shed_late": True},
        ),
        ArmPlan(
            "proxy_class_aware",
            "proxy",
            "triton-proxy, issue 10: expected_start + classes, lowest class max_per_instance 1",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=1,
            # as measured in the first round, before long requests were packed into a lane
            policy_params={"long_placement": "spread"},
        ),
        ArmPlan(
            "proxy_long_lane",
            "proxy",
            "triton-proxy, expected_start packing long work into a lane; lowest class "
            f"max_per_instance {LANE_DEPTH}, spare_instances 1; concurrency {LANE_CONCURRENCY}",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=LANE_DEPTH,
            lowest_spare_instances=1,
            policy_params={"long_placement": "pack"},
            scheduling={"concurrency": LANE_CONCURRENCY},
        ),
        ArmPlan(
            "proxy_rank_lane",
            "proxy",
            "proxy_long_lane with slot_sharing by_rank (a class counts only the slots of "
            "classes at least as important)",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=LANE_DEPTH,
            lowest_spare_instances=1,
            policy_params={"long_placement": "pack"},
            scheduling={"concurrency": LANE_CONCURRENCY, "slot_sharing": "by_rank"},
        ),
        ArmPlan(
            "proxy_rank_lane+idle",
            "proxy",
            "proxy_rank_lane with long_to_idle and idle_reserve 1 (online's long rows to an "
            "idle instance while another one stays idle)",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=LANE_DEPTH,
            lowest_spare_instances=1,
            policy_params={"long_placement": "pack", "long_to_idle": True, "idle_reserve": 1},
            scheduling={"concurrency": LANE_CONCURRENCY, "slot_sharing": "by_rank"},
        ),
        ArmPlan(
            "proxy_shallow_lane",
            "proxy",
            "proxy_rank_lane+idle with a shallow lane: the lowest class at "
            f"{SHALLOW_DEPTH} per instance, {LANE_DEPTH} once its queue has waited 1 s",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=LANE_DEPTH,
            lowest_spare_instances=1,
            lowest_shallow_per_instance=SHALLOW_DEPTH,
            policy_params={"long_placement": "pack", "long_to_idle": True, "idle_reserve": 1},
            scheduling={"concurrency": LANE_CONCURRENCY, "slot_sharing": "by_rank"},
        ),
        ArmPlan(
            "proxy_expected_finish",
            "proxy",
            "triton-proxy, expected_finish (each request where a replay of the instance's "
            "batcher finishes it soonest) + classes; lowest class max_per_instance "
            f"{LANE_DEPTH}; concurrency {LANE_CONCURRENCY}, slot_sharing by_rank",
            policy="expected_finish",
            classes=True,
            lowest_max_per_instance=LANE_DEPTH,
            scheduling={"concurrency": LANE_CONCURRENCY, "slot_sharing": "by_rank"},
        ),
        ArmPlan(
            "proxy_long_lane+adaptive",
            "proxy",
            "proxy_long_lane with adaptive concurrency on (from 32 slots, up to 64)",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=LANE_DEPTH,
            lowest_spare_instances=1,
            policy_params={"long_placement": "pack"},
            scheduling={"adaptive_concurrency": {"enabled": True}},
        ),
        ArmPlan(
            "proxy_class_aware+adaptive",
            "proxy",
            "proxy_class_aware with adaptive concurrency and deadline admission on",
            policy="expected_start",
            classes=True,
            lowest_max_per_instance=1,
            policy_params={"long_placement": "spread"},
            scheduling={"shed_late": True, "adaptive_concurrency": {"enabled": True}},
        ),
    ]
    shallow = next(p for p in plans if p.name == "proxy_shallow_lane")
    quiet = _vary(
        shallow,
        "proxy_shallow_lane+quiet",
        "proxy_shallow_lane whose uncapped long requests take a quiet instance "
        f"(no long work, under {QUIET_DEPTH} in flight) before they join the lane",
        quiet_depth=QUIET_DEPTH,
    )
    alone = _vary(
        quiet,
        "proxy_shallow_lane+alone",
        "proxy_shallow_lane+quiet where a quiet instance also has no request of a "
        "more important priority level in flight (quiet_alone)",
        quiet_alone=True,
    )
    alone2 = _vary(
        alone,
        "proxy_shallow_lane+alone2",
        "proxy_shallow_lane+alone with quiet_depth 2: a quiet instance has at "
        "most one request in flight, so the long row's batch holds at most one short row",
        quiet_depth=2,
    )
    depths = [
        _vary(
            shallow,
            f"proxy_shallow_lane+depth{depth}",
            f"proxy_shallow_lane with lane_depth {depth}: an uncapped long request "
            f"opens another instance once the lane holds {depth} long requests",
            lane_depth=depth,
        )
        for depth in UNCAPPED_LANE_DEPTHS
    ]
    shallow1 = replace(
        shallow,
        name="proxy_shallow_lane+shallow1",
        description="proxy_shallow_lane whose lane runs one offline request per instance while "
        "its queue moves (a long online row waits for, and joins, a smaller offline batch)",
        lowest_shallow_per_instance=1,
    )
    wake_full = replace(
        shallow,
        name="proxy_shallow_lane+wake_full",
        description="proxy_shallow_lane whose wake judges every instance by a full batch of "
        "the model's typical requests (routing.wake by_work off, the rule before the "
        "fifteenth round)",
        routing={"wake": {"by_work": False}},
    )
    wake_work10 = replace(
        shallow,
        name="proxy_shallow_lane+wake_work10",
        description="proxy_shallow_lane with the wake's floor at 10 ms, scanned every 5 ms",
        routing={"wake": {"by_work": True, "min_quiet_ms": 10, "scan_ms": 5}},
    )
    light = _vary(
        shallow,
        "proxy_shallow_lane+light",
        "proxy_shallow_lane that packs long work into its lane only while the fleet's "
        f"occupancy is at least {PACK_ABOVE} (pack_above), and spreads it below",
        pack_above=PACK_ABOVE,
    )
    light_alone = _vary(
        light,
        "proxy_shallow_lane+light_alone",
        "proxy_shallow_lane+light whose spread long work avoids instances with more "
        "important work in flight (spread_alone)",
        spread_alone=True,
    )
    light_wake10 = replace(
        light,
        name="proxy_shallow_lane+light_wake10",
        description="proxy_shallow_lane+light with the wake's floor at 10 ms, scanned every 5 ms",
        routing=wake_work10.routing,
    )
    nudge = replace(
        shallow,
        name="proxy_shallow_lane+nudge",
        description="proxy_shallow_lane whose wake sends a quiet instance a copy of a short "
        "request it holds (routing.wake.nudge)",
        routing={"wake": NUDGE_WAKE},
    )
    finish = next(p for p in plans if p.name == "proxy_expected_finish")
    delays = _vary(
        finish,
        "proxy_expected_finish+delays",
        "proxy_expected_finish that also counts the delay a request adds to those in flight "
        "(count_delays, weighted by level)",
        count_delays=True,
    )
    at = plans.index(finish) + 1
    plans[at:at] = [
        replace(
            arm,
            name=f"{arm.name}+nudge",
            description=f"{arm.name} whose wake sends a quiet instance a copy of a short "
            "request it holds (routing.wake.nudge)",
            routing={"wake": NUDGE_WAKE},
        )
        for arm in (finish, delays)
    ]
    plans.insert(at + 1, delays)
    shallow_gate = next(p for p in plans if p.name == "proxy_shallow_lane")
    lane = replace(
        shallow_gate,
        name="proxy_expected_finish+lane",
        description="expected_finish with count_delays and the nudge, behind "
        "proxy_shallow_lane's gate (the lowest class shallow, one instance spare of it)",
        policy="expected_finish",
        policy_params={"count_delays": True},
        routing={"wake": NUDGE_WAKE},
    )
    packed = [
        replace(
            lane,
            name=f"proxy_expected_finish{'+lane' if count else ''}+pack{suffix}",
            description=f"expected_finish{' with count_delays' if count else ''} and the "
            "nudge behind proxy_shallow_lane's gate, long work packed into a lane "
            f"(pack_above {above}: {when}), short work replayed",
            policy_params={"count_delays": True, "pack_above": above}
            if count
            else {"pack_above": above},
        )
        for count in (True, False)
        for suffix, above, when in (
            ("", 0.0, "always"),
            (
                str(round(100 * FINISH_PACK_ABOVE)),
                FINISH_PACK_ABOVE,
                "while the fleet's occupancy is at least that",
            ),
        )
    ]
    pack90 = next(p for p in packed if p.name == "proxy_expected_finish+lane+pack90")
    capped = [
        replace(
            pack90,
            name=f"{pack90.name}+{suffix}",
            description=f"{pack90.name} whose capped class (offline) is packed at any "
            f"occupancy {when} (pack_capped: {mode})",
            policy_params={**(pack90.policy_params or {}), "pack_capped": mode},
        )
        for suffix, mode, when in (
            ("capped", "always", "always"),
            ("backlog", "backlogged", "while its requests queue at the gate"),
        )
    ]
    backlog = capped[1]
    expired = replace(
        backlog,
        name=f"{backlog.name}+expired",
        description=f"{backlog.name} whose nudge sends an expired copy (Triton timeout 1 us: "
        "it wakes the batcher and never runs), to instances holding long work too "
        "(routing.wake.expired_copy)",
        routing={"wake": {**NUDGE_WAKE, "expired_copy": True}},
    )
    ring = replace(
        expired,
        name=f"{expired.name}+ring",
        description=f"{expired.name} whose expired copy goes to any instance silent for "
        f"{RING_AFTER_MS:g} ms, without waiting for its batch time (routing.wake.ring_after_ms)",
        routing={"wake": {**NUDGE_WAKE, "expired_copy": True, "ring_after_ms": RING_AFTER_MS}},
    )
    # The shipped arm (policies/mixed-traffic.yaml) with issue 10's opt-in mechanisms on top.
    fixed = dict(ring.scheduling or {})
    adaptive = {k: v for k, v in fixed.items() if k != "concurrency"}
    adaptive["adaptive_concurrency"] = {"enabled": True}
    on_ring = [
        replace(
            ring,
            name=f"{ring.name}+{suffix}",
            description=f"{ring.name} (policies/mixed-traffic.yaml) with {what}",
            scheduling=scheduling,
        )
        for suffix, what, scheduling in (
            ("adaptive", "adaptive concurrency instead of its 64 fixed slots (up to 64)", adaptive),
            ("late", "deadline admission (shed_late)", {**fixed, "shed_late": True}),
            (
                "adaptive+late",
                "adaptive concurrency and deadline admission",
                {**adaptive, "shed_late": True},
            ),
            (
                "adaptive+late_tail",
                "adaptive concurrency and deadline admission holding a request that waited to "
                "a slow answer (scheduling.late_by: tail)",
                {**adaptive, "shed_late": True, "late_by": "tail"},
            ),
        )
    ]
    shipped = next(p for p in on_ring if p.name.endswith("+adaptive+late"))
    shared = replace(
        shipped,
        name=f"{shipped.name}+shared_level",
        description=f"{shipped.name} whose throughput class (offline) is sent at the Triton "
        "priority of the class above it, so Triton serves the two in arrival order: the "
        "lane's cap, not Triton's priority, keeps it from delaying online",
        lowest_shares_level=True,
    )
    reserve = _vary(
        shipped,
        f"{shipped.name}+reserve",
        f"{shipped.name} whose long lane never opens the last instance free of long work "
        "to online's long requests (expected_finish's short_reserve: 1; "
        "policies/mixed-traffic.yaml since the thirty-third round)",
        short_reserve=1,
    )
    on_ring += [shared, reserve]
    on_ring += [
        _vary(
            plan,
            f"{plan.name}+depth{depth}",
            f"{plan.name} whose long lane holds {depth} of online's long requests per instance "
            "before it opens another instance to them (expected_finish's lane_depth; "
            "default 2 x max_batch_size)",
            lane_depth=depth,
        )
        for plan in (shipped, reserve, shared)
        for depth in SHIPPED_LANE_DEPTHS
    ]
    at = plans.index(delays) + 3
    plans[at:at] = [lane, *packed, *capped, expired, ring, *on_ring]
    default = next(p for p in plans if p.name == BOOST_ARM)
    plans += [
        _vary(
            default,
            f"{default.name}+depth{depth}",
            f"{default.name} whose long lane holds {depth} long requests per instance before "
            "it opens another instance to an uncapped class's long requests (expected_finish's "
            "lane_depth; default 2 x max_batch_size)",
            lane_depth=depth,
        )
        for depth in CLASS_LANE_DEPTHS
    ]
    plans += [
        replace(
            default,
            name=f"{default.name}+busy{round(share * ACCEL_SIM_MAX_BATCH)}",
            description=f"{default.name} whose occupancy is the mean requests in flight per "
            f"instance over {share:g} x max_batch_size, at most 1 (routing.occupancy_depth), "
            "so long work is packed while batches form, not whenever most instances have "
            "something to run",
            routing={**(default.routing or {}), "occupancy_depth": share},
        )
        for share in CLASS_OCCUPANCY_DEPTHS
    ]
    busy = plans[-1]  # the last +busy arm
    plans += [
        replace(
            busy,
            name=f"{busy.name}+from{round(load * 10)}",
            description=f"{busy.name} whose fill decides only while the long work of classes "
            f"without max_per_instance would keep {load:g} of an instance busy in full batches "
            "(routing.fill_from_load); below, the busy share",
            routing={**(busy.routing or {}), "fill_from_load": load},
        )
        for load in CLASS_FILL_LOADS
    ]
    # The class default with slots counted by rank (session 39: its real-time requests
    # spilled onto the long lanes when shared slots filled the short instance); counted so in
    # placement only, today's class default (session 40).
    class_default = next(p for p in plans if p.name == SHARED_DEFAULT_ARM)
    plans += (
        _sharing(class_default, "by_rank"),
        # Session 40: counted by rank in placement only (the gate's pool stays shared).
        _sharing(class_default, "placed_by_rank"),
        # Issue 13 (session 40): what the doorbell's expired copies cost per request.
        replace(
            class_default,
            name=f"{class_default.name}+no_copy",
            description=f"{class_default.name} without the doorbell: the redirect wake with "
            "its own defaults, no copies sent (routing.wake as without classes)",
            routing={**(class_default.routing or {}), "wake": asdict(WakeParams())},
        ),
    )
    # Session 41: the floor boost's threshold (seconds of the class's share owed).
    placed = next(p for p in plans if p.name == PLACED_DEFAULT_ARM)
    plans += [
        replace(
            placed,
            name=f"{placed.name}+starved{after}",
            description=f"{placed.name} whose floor boost starts once a class is owed {after} s "
            "of its share (starved_after_s)",
            scheduling={**(placed.scheduling or {}), "starved_after_s": float(after)},
        )
        for after in CLASS_STARVED_AFTER
    ]
    # Session 44: the short reserve holds the long work the fill does not pack as well.
    starved = next(p for p in plans if p.name == STARVED_DEFAULT_ARM)
    plans.append(
        _vary(
            starved,
            CLASS_DEFAULT_ARM,
            f"{starved.name} whose short reserve (one instance kept free of long work) holds "
            "online's long rows while the fill replays them instead of packing them "
            "(expected_finish reserve_spread)",
            reserve_spread=True,
        )
    )
    # Session 47: the lane's spare lent a few of the throughput class's requests.
    rspread = next(p for p in plans if p.name == CLASS_DEFAULT_ARM)
    plans += [
        replace(
            rspread,
            name=f"{rspread.name}+lend{lent}",
            description=f"{rspread.name} whose lane's spare holds up to {lent} of the "
            "throughput class's requests while it is kept for the classes above and the "
            "class is behind (spare_per_instance)",
            lowest_spare_per_instance=lent,
        )
        for lent in SPARE_LENT
    ]
    # Session 49: the least important classes refused while the proxy's own loop lags.
    plans += [
        replace(
            rspread,
            name=f"{rspread.name}+guard{lag}",
            description=f"{rspread.name} refusing the least important classes at arrival "
            f"while its event loop lags more than {lag} ms on average (scheduling.overload)",
            scheduling={**(rspread.scheduling or {}), "overload": {"lag_ms": float(lag)}},
        )
        for lag in OVERLOAD_LAG_MS
    ]
    # The shipped file's arm: the reserve arm with the class default's fill (session 38).
    shipped_reserve = next(p for p in plans if p.name == RESERVE_ARM)
    plans.append(
        replace(
            shipped_reserve,
            name=FILL_SHIPPED_ARM,
            description=f"{RESERVE_ARM} with the class default's fill "
            "(policies/mixed-traffic.yaml since session 38): an SLO class's long work is "
            "packed by the mean requests in flight per instance over 0.25 x max_batch_size "
            "once it would keep half an instance busy in full batches "
            "(routing.occupancy_depth, routing.fill_from_load)",
            # pinned as measured, not read from CLASS_FILL (a later default must not change it)
            routing={
                **(shipped_reserve.routing or {}),
                "occupancy_depth": 0.25,
                "fill_from_load": 0.5,
            },
        )
    )
    plans.append(_sharing(plans[-1], "placed_by_rank"))  # the shipped file's (session 40)
    plans.append(  # the shipped file's (session 44)
        _vary(
            plans[-1],
            SHIPPED_ARM,
            f"{PLACED_SHIPPED_ARM} whose short reserve holds online's long rows while the "
            "fill replays them (expected_finish reserve_spread)",
            reserve_spread=True,
        )
    )
    at = plans.index(shallow) + 1
    plans[at:at] = [
        nudge,
        quiet,
        alone,
        alone2,
        *depths,
        shallow1,
        wake_full,
        wake_work10,
        light,
        light_alone,
        light_wake10,
    ]
    return {p.name: p for p in plans}


CATALOG: Mapping[str, ArmPlan] = _catalog()

PRESETS: Mapping[str, tuple[str, ...]] = {
    # About 10 minutes with benchmarks/mixed.yaml on 2 cores.
    "default": (
        "round_robin",
        "rr_priority",
        "haproxy_leastconn",
        "proxy_least_requests",
        "proxy_weighted_score",
        "proxy_least_requests+classes",
        "proxy_weighted_score+classes",
    ),
    "quick": ("round_robin", "rr_priority", "proxy_least_requests+classes"),
    # Issue 10's comparison (point 6): four baselines, the proxy's previous best, the shallow
    # lane (the best of the eighth to twentieth rounds) and the new configuration, the batcher
    # replay with long work packed near capacity (twenty-second round) and the throughput
    # class's backlog packed at any load and Triton's stall ended by expired copies
    # (twenty-fourth round), sent after a fixed silence (twenty-sixth round), with adaptive
    # concurrency and deadline admission (twenty-ninth round), and the reserve of one
    # instance free of long work (thirty-third round), and the fill for online's long work
    # where it needs half an instance (thirty-eighth round), placement's slots by rank and
    # the gate's shared (fortieth round), and the reserve holding the long rows the fill
    # does not pack (forty-fourth round; it is policies/mixed-traffic.yaml).
    # The earlier rounds' arms stay in the catalog by name.
    "issue10": (
        "round_robin",
        "rr_priority",
        "haproxy_leastconn",
        "haproxy_random2",
        "proxy_previous_best",
        "proxy_shallow_lane",
        SHIPPED_ARM,
    ),
    "baselines": tuple(n for n, p in CATALOG.items() if p.kind != "proxy"),
    "proxy": tuple(n for n, p in CATALOG.items() if p.kind == "proxy"),
    "all": tuple(CATALOG),
}


def resolve_arms(spec: str) -> list[ArmPlan]:
    """Arms named by a comma list of arm names and presets, in order, without repeats."""
    names: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if item in PRESETS:
            expanded: Sequence[str] = PRESETS[item]
        elif item in CATALOG:
            expanded = (item,)
        else:
            raise ValueError(
                f"unknown arm {item!r}; presets: {', '.join(PRESETS)}; arms: {', '.join(CATALOG)}"
            )
        names += [n for n in expanded if n not in names]
    if not names:
        raise ValueError("no arms named")
    return [CATALOG[n] for n in names]


# -- proxy policy documents ----------------------------------------------------------------


def scheduling_section(scenario: Scenario) -> dict[str, Any]:
    """The policy's ``scheduling:`` section for the scenario's classes.

    Rank follows the SLO (tightest first; classes without one last), ties broken by Triton
    priority (1 first, 0 = unset last) and then file order. Each class keeps its Triton
    priority, SLO and ``min_share``; each class's ``api_key`` maps to it. Unknown callers get
    the least important class, never the most.
    """
    names = list(scenario.class_names)

    def order(name: str) -> tuple[float, int, int]:
        spec = scenario.classes[name]
        slo = spec.slo_p99_ms if spec.slo_p99_ms is not None else float("inf")
        prio = spec.triton_priority if spec.triton_priority > 0 else sys.maxsize
        return (slo, prio, names.index(name))

    ranked = sorted(names, key=order)
    classes: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    for rank, name in enumerate(ranked):
        spec = scenario.classes[name]
        entry: dict[str, Any] = {"rank": rank, "triton_priority": spec.triton_priority}
        if spec.slo_p99_ms is not None:
            entry["slo_p99_ms"] = spec.slo_p99_ms
        if spec.min_share:
            entry["min_share"] = spec.min_share
        classes[name] = entry
        if spec.api_key:
            if spec.api_key in keys:
                raise ValueError(
                    f"classes {keys[spec.api_key]['class_name']!r} and {name!r} share an api_key"
                )
            keys[spec.api_key] = {"class_name": name}
    # ranked[-1], the least important class, is also where unknown callers go
    return {"default_class": ranked[-1], "classes": classes, "api_keys": keys}


class Server(Protocol):
    """What the bench needs of a Triton server (``proxy.local.TritonServer`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def http_url(self) -> str: ...
    @property
    def metrics_url(self) -> str: ...
    @property
    def grpc_address(self) -> str: ...


def proxy_policy(
    servers: Sequence[Server],
    plan: ArmPlan,
    scenario: Scenario | None,
    *,
    grpc_addresses: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The policy document of a proxy arm: free ports, the arm's routing/classes.

    HTTP only, unless ``grpc_addresses`` (one per server) turns the gRPC frontend on.
    """
    if plan.kind != "proxy" or (plan.policy is None and not plan.classes):
        raise ValueError(f"{plan.name} is not a proxy arm")
    instances: list[dict[str, Any]] = [
        {"name": s.name, "http": s.http_url, "metrics": s.metrics_url} for s in servers
    ]
    if grpc_addresses is not None:
        for entry, address in zip(instances, grpc_addresses, strict=True):
            entry["grpc"] = address
    doc: dict[str, Any] = {
        "instances": instances,
        "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
        "routing": dict(plan.routing or {}),
    }
    if plan.policy is not None:  # None: the proxy's default with classes
        policy = {"name": plan.policy, "params": dict(plan.policy_params or {})}
        doc["routing"]["policy"] = policy
    if plan.classes:
        if scenario is None:
            raise ValueError(f"{plan.name} needs the scenario's classes")
        section = scheduling_section(scenario)
        if plan.lowest_max_per_instance is not None:
            lowest = section["default_class"]
            section["classes"][lowest]["max_per_instance"] = plan.lowest_max_per_instance
            if plan.lowest_spare_instances:
                section["classes"][lowest]["spare_instances"] = plan.lowest_spare_instances
            if plan.lowest_spare_fraction:
                section["classes"][lowest]["spare_fraction"] = plan.lowest_spare_fraction
            if plan.lowest_shallow_per_instance is not None:
                shallow = plan.lowest_shallow_per_instance
                section["classes"][lowest]["shallow_per_instance"] = shallow
            if plan.lowest_spare_per_instance:
                lent = plan.lowest_spare_per_instance
                section["classes"][lowest]["spare_per_instance"] = lent
        if plan.lowest_shares_level:
            classes = section["classes"]
            *_, above, lowest = sorted(classes, key=lambda n: classes[n]["rank"])
            classes[lowest]["triton_priority"] = classes[above]["triton_priority"]
        # Adaptive concurrency is the default since session 31; the arms measured before then
        # keep the fixed slots derived from max_batch_size (2 x 16 = 32 per instance) unless
        # they name it (``+adaptive``) or a fixed ``concurrency``, so a name means one thing.
        section["adaptive_concurrency"] = {"enabled": False}
        # Likewise the derived lane of throughput classes (the default since session 34): an
        # arm has it only by name (its own lane, above, or ``throughput_lane`` in its
        # scheduling). Written only where it would derive one, so an older --baseline-tree
        # reads the document.
        if load_scheduling(section).lane_classes():
            section["throughput_lane"] = False
        # And deadline admission (on by default where routing packs, since session 35).
        section["shed_late"] = False
        # And the floor boost (on by default since session 36), written only where it could
        # act (an older --baseline-tree does not know the key).
        if load_scheduling(section).boosted_classes():
            section["starved_after_s"] = None
        # And placement's slots counted by rank (``placed_by_rank``, by default where routing
        # packs and the model has priority levels, since session 40).
        section["slot_sharing"] = "shared"
        section.update(dict(plan.scheduling or {}))
        doc["scheduling"] = section
    return doc


# -- starting a proxy ----------------------------------------------------------------------


@dataclass
class ProxyEndpoints:
    http_url: str
    metrics_url: str | None
    grpc_address: str | None = None
    pid: int | None = None
    """The proxy's process (its workers are its children), when it runs in one of its own;
    for its memory. None in-process."""


class ProxyStartError(RuntimeError):
    pass


def _die_with_parent() -> Callable[[], None]:
    # Reused from the local launcher: a killed benchmark must not leave proxies behind.
    from proxy.local.fleet import _die_with_parent as die

    return die(os.getpid())


def _banner_ports(text: str) -> tuple[int, int | None] | None:
    http = metrics = None
    for line in text.splitlines():
        if "triton-proxy ready: HTTP localhost:" in line:
            http = int(line.rsplit(":", 1)[1])
        elif line.strip().startswith("metrics http://localhost:"):
            metrics = int(line.strip().split(":")[2].split("/")[0])
    if http is None:
        return None
    return http, metrics


def _banner_grpc(text: str) -> int | None:
    for line in text.splitlines():
        if line.strip().startswith("gRPC localhost:"):
            return int(line.strip().rsplit(":", 1)[1])
    return None


@contextlib.asynccontextmanager
async def proxy_subprocess(
    doc: Mapping[str, Any],
    workdir: Path,
    name: str,
    start_timeout_s: float = 30.0,
    *,
    workers: int = 1,
    root: Path = ROOT,
) -> AsyncIterator[ProxyEndpoints]:
    """``triton-proxy serve`` on ``doc`` in a child process; yields its endpoints once ready.

    ``root``: the checkout whose ``proxy`` package runs (``python -m`` imports from the working
    directory), e.g. an older commit to compare with in the same run.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    stem = name.replace("+", "_")
    policy = workdir / f"{stem}.yaml"
    policy.write_text(yaml.safe_dump(dict(doc), sort_keys=False))
    log_path = workdir / f"{stem}.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--policy",
            str(policy),
            *(["--workers", str(workers)] if workers != 1 else []),
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            cwd=str(root),
            preexec_fn=_die_with_parent(),
        )
        try:
            endpoints = await _wait_banner(proc, log_path, start_timeout_s)
            endpoints.pid = proc.pid
            await wait_ready(endpoints.http_url, start_timeout_s, proc=proc, log=log_path)
            yield endpoints
        finally:
            await stop_process(proc, 15.0)


async def _wait_banner(
    proc: asyncio.subprocess.Process, log: Path, timeout_s: float
) -> ProxyEndpoints:
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text(errors="replace")
        ports = _banner_ports(text)  # the banner is one flushed print: whole once seen
        if ports is not None:
            http, metrics = ports
            grpc_port = _banner_grpc(text)
            return ProxyEndpoints(
                f"http://127.0.0.1:{http}",
                f"http://127.0.0.1:{metrics}/metrics" if metrics else None,
                f"127.0.0.1:{grpc_port}" if grpc_port else None,
            )
        if proc.returncode is not None:
            raise ProxyStartError(
                f"proxy exited with {proc.returncode} at start:\n{log_tail(log, 20)}"
            )
        if time.monotonic() > deadline:
            raise ProxyStartError(f"proxy did not start in {timeout_s}s:\n{log_tail(log, 20)}")
        await asyncio.sleep(0.05)


async def wait_ready(
    base_url: str,
    timeout_s: float,
    *,
    proc: asyncio.subprocess.Process | None = None,
    log: Path | None = None,
) -> None:
    """Until ``/v2/health/ready`` answers 200 (the proxy has a healthy instance)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(base_url + "/v2/health/ready") as resp:
                    if resp.status == 200:
                        return
            if proc is not None and proc.returncode is not None:
                tail = log_tail(log, 20) if log else ""
                raise ProxyStartError(f"proxy exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise ProxyStartError(f"{base_url} not ready after {timeout_s}s")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def proxy_inprocess(
    doc: Mapping[str, Any], start_timeout_s: float = 30.0
) -> AsyncIterator[ProxyEndpoints]:
    """A :class:`~proxy.app.ProxyServer` in this event loop (shares it with the generator)."""
    from proxy import config as config_mod
    from proxy.app import ProxyServer

    server = ProxyServer(config_mod.parse(dict(doc), "<bench>"))
    ports = await server.start()
    try:
        url = f"http://127.0.0.1:{ports.http}"
        metrics = f"http://127.0.0.1:{ports.metrics}/metrics" if ports.metrics else None
        await wait_ready(url, start_timeout_s)
        yield ProxyEndpoints(url, metrics)
    finally:
        await server.stop()


# -- load probes ---------------------------------------------------------------------------


class MergedProbe:
    """Several probes sampled together; each one's names get its suffix."""

    def __init__(self, parts: Sequence[tuple[LoadProbe, str]]) -> None:
        self.parts = list(parts)

    async def sample(self) -> Mapping[str, float]:
        samples = await asyncio.gather(*(p.sample() for p, _ in self.parts))
        out: dict[str, float] = {}
        for (_, suffix), sample in zip(self.parts, samples, strict=True):
            out.update({f"{k}{suffix}": v for k, v in sample.items()})
        return out

    async def aclose(self) -> None:
        for p, _ in self.parts:
            await p.aclose()


class RssProbe:
    """The resident memory of one process (``VmRSS`` in ``/proc/<pid>/status``), MiB."""

    def __init__(self, pid: int, key: str = PROXY_RSS) -> None:
        self.pid = pid
        self.key = key

    async def sample(self) -> Mapping[str, float]:
        rss = read_rss_mib(self.pid)
        return {} if rss is None else {self.key: rss}

    async def aclose(self) -> None:
        return None


def read_rss_mib(pid: int, proc_root: Path = Path("/proc")) -> float | None:
    """``VmRSS`` of ``pid`` in MiB, None when the process is gone (or no procfs)."""
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    return parse_vm_rss_mib(text)


def parse_vm_rss_mib(status: str) -> float | None:
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            return int(parts[1]) / 1024.0 if len(parts) >= 2 and parts[1].isdigit() else None
    return None


TRITON_PENDING = "nv_inference_pending_request_count"
PROXY_IN_FLIGHT = "triton_proxy_instance_in_flight"
PROXY_OCCUPANCY = "triton_proxy_model_occupancy"
PROXY_NUDGES = "triton_proxy_quiet_nudges_total"
PROXY_BOOSTS = "triton_proxy_boosted_total"


def triton_pending_probe(servers: Sequence[Server], model: str, trace: bool = False) -> LoadProbe:
    """Requests queued in each Triton server for ``model`` (any arm); with ``trace``, also
    the batch counters :mod:`proxy.bench.trace` reads, from the same scrape."""
    pending = _pending(servers, model)
    return with_counters(pending, model) if trace else pending


def _pending(servers: Sequence[Server], model: str) -> PrometheusGaugeProbe:
    """Triton's queue gauge for ``model`` on each server's page, keyed by server name."""
    return PrometheusGaugeProbe(
        {s.name: s.metrics_url for s in servers}, TRITON_PENDING, {"model": model}
    )


def proxy_probe(
    servers: Sequence[Server], model: str, endpoints: ProxyEndpoints, trace: bool = False
) -> LoadProbe:
    """Triton's queued requests plus the proxy's own in-flight count per instance (and its
    model occupancy, wake copies, floor boosts and memory); with ``trace``, Triton's batch
    counters and the proxy's in-flight count by class too (:mod:`proxy.bench.trace`)."""
    pending = _pending(servers, model)
    parts: list[tuple[LoadProbe, str]] = (
        [(with_counters(pending, model, " queued"), "")] if trace else [(pending, " queued")]
    )
    if endpoints.metrics_url is not None:
        page = {"proxy": endpoints.metrics_url}
        in_flight = PrometheusGaugeProbe(page, PROXY_IN_FLIGHT, split_label="instance")
        occupancy = PrometheusGaugeProbe(page, PROXY_OCCUPANCY, {"model": model})
        copies = PrometheusGaugeProbe(page, PROXY_NUDGES)  # summed: key "proxy"
        scrape = [(in_flight, " proxy in flight"), (occupancy, " occupancy")]
        scrape.append((copies, PROXY_COPIES.removeprefix("proxy")))
        boosted = PrometheusGaugeProbe(page, PROXY_BOOSTS)  # summed over classes
        scrape.append((boosted, PROXY_BOOSTED.removeprefix("proxy")))
        if trace:
            scrape.append(class_probe(page, model))
            scrape += model_probes(page, model)
        parts.append((OneScrapeProbe(scrape), ""))
    if endpoints.pid is not None:
        parts.append((RssProbe(endpoints.pid), ""))
    if len(parts) == 1:
        return pending
    return MergedProbe(parts)


# -- ArmSpecs ------------------------------------------------------------------------------


def build_arm(
    plan: ArmPlan,
    servers: Sequence[Server],
    scenario: Scenario | None,
    *,
    model: ModelSpec,
    workdir: Path,
    mode: ProxyMode = "subprocess",
    name: str | None = None,
    workers: int = 1,
    root: Path = ROOT,
    trace: bool = False,
) -> ArmSpec:
    """An :class:`ArmSpec` for ``plan`` over ``servers``; nothing starts until it is opened.
    ``trace``: its load probe also keeps what ``bench --trace`` reads (:mod:`proxy.bench.trace`)."""
    if workers != 1 and mode != "subprocess":
        raise ValueError("proxy workers run only in a child process (--proxy-mode subprocess)")
    arm_name = name or plan.name
    urls = [s.http_url for s in servers]
    names = [s.name for s in servers]
    if plan.kind == "direct":
        return ArmSpec.direct(
            arm_name,
            urls,
            priority=plan.priority,
            instance_names=names,
            description=plan.description,
        )
    if plan.kind == "haproxy":
        assert plan.balance is not None
        backends = [Backend(s.name, s.http_url) for s in servers]
        balance = plan.balance

        def start_haproxy() -> contextlib.AbstractAsyncContextManager[str]:
            return run_haproxy(backends, balance, workdir=workdir / "haproxy")

        return ArmSpec.started(arm_name, start_haproxy, description=plan.description)
    doc = proxy_policy(servers, plan, scenario)
    current: dict[str, ProxyEndpoints] = {}

    @contextlib.asynccontextmanager
    async def start_proxy() -> AsyncIterator[str]:
        ctx = (
            proxy_subprocess(doc, workdir / "proxy", arm_name, workers=workers, root=root)
            if mode == "subprocess"
            else proxy_inprocess(doc)
        )
        async with ctx as endpoints:
            current["endpoints"] = endpoints
            try:
                yield endpoints.http_url
            finally:
                current.pop("endpoints", None)

    def probe() -> LoadProbe:
        endpoints = current.get("endpoints")
        if endpoints is None:
            return triton_pending_probe(servers, model.name, trace)
        return proxy_probe(servers, model.name, endpoints, trace)

    return ArmSpec.started(
        arm_name,
        start_proxy,
        priority=plan.priority,
        description=f"{plan.description} ({mode})",
        probe=probe,
    )


def with_connection_limit(arm: ArmSpec, limit: int) -> ArmSpec:
    """The same arm; the generator opens at most ``limit`` connections to it.

    Requests beyond the limit wait in the generator's pool, first come first served, and that
    wait is charged to them. An arm that holds many requests (a proxy queueing them by class)
    can reach the limit under overload, and then the pool's FIFO, not the arm, decides the
    order: keep the limit above the requests in flight the run can reach.
    """
    if limit < 1:
        raise ValueError(f"connection limit must be >= 1, got {limit}")
    inner = arm.open

    @contextlib.asynccontextmanager
    async def open_() -> AsyncIterator[TargetSpec]:
        async with inner() as spec:
            yield replace(spec, connection_limit=limit)

    return replace(arm, open=open_)
