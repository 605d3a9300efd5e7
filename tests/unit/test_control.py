"""The control loops' pure parts: batching-window and class-limit controllers, windowed
quantiles, the control section of the policy file, the class queues' share scale."""

from __future__ import annotations

from typing import Any

import pytest

from proxy import config as config_mod
from proxy.control.batching import BatchingController, BatchingSample, ClassP99
from proxy.control.class_limits import ClassLimitController
from proxy.control.config import BatchingConfig, ClassLimitsConfig
from proxy.control.loops import ClassRoles
from proxy.fleet.model_control import batching_window_us, with_batching_window
from proxy.scheduling.config import ClassConfig, SchedulingConfig
from proxy.scheduling.queues import ClassQueues
from proxy.stats.window import WindowedQuantiles
from proxy.strict import ConfigError

# --- batching window ------------------------------------------------------------------------

CFG = BatchingConfig(enabled=True, min_us=100, max_us=20_000, dwell_s=60.0)


def sample(
    window_us: int = 2000,
    rt_p99_ms: float | None = 10.0,
    online_p99_ms: float | None = None,
    backlog: float = 0.0,
    queue_us: float | None = None,
    backlog_now: float | None = None,
) -> BatchingSample:
    classes = {"rt": ClassP99(None if rt_p99_ms is None else rt_p99_ms / 1e3, 0.1)}
    classes["online"] = ClassP99(None if online_p99_ms is None else online_p99_ms / 1e3, 0.5)
    return BatchingSample("m", window_us, "rt", classes, queue_us, backlog, backlog_now)


@pytest.mark.parametrize(
    ("s", "direction", "reason", "new"),
    [
        # top class above its SLO: halve
        (sample(rt_p99_ms=120), "down", "slo_violation", 1000),
        # within 90 % of it: approaching
        (sample(rt_p99_ms=95), "down", "slo_approach", 1000),
        # a small window still moves by min_step_us, down to the floor
        (sample(window_us=600, rt_p99_ms=95), "down", "slo_approach", 100),
        # without a backlog, Triton's queue alone eats half the top SLO
        (sample(rt_p99_ms=50, queue_us=60_000, backlog=0.7), "down", "triton_queue", 1000),
        # a deep queue (the window is still binding) with a backlog: lengthen
        (sample(rt_p99_ms=10, queue_us=60_000, backlog=5), "up", "backlog", 4000),
        # every SLO holds with margin and offline work waits: double
        (sample(rt_p99_ms=50, online_p99_ms=200, backlog=3), "up", "backlog", 4000),
        (sample(rt_p99_ms=50, backlog=3, backlog_now=1.0), "up", "backlog", 4000),
        # a class without enough samples counts as holding
        (sample(rt_p99_ms=None, backlog=3), "up", "backlog", 4000),
        # a small window grows by at least min_step_us
        (sample(window_us=100, rt_p99_ms=10, backlog=3), "up", "backlog", 600),
        # no backlog: a long window only adds waiting
        (sample(window_us=8000, rt_p99_ms=10, backlog=0.2), "down", "idle", 4000),
    ],
)
def test_batching_rules(s: BatchingSample, direction: str, reason: str, new: int) -> None:
    d = BatchingController(CFG).observe(s, now=0.0)
    assert d is not None
    assert (d.direction, d.reason, d.new, d.old) == (direction, reason, new, s.window_us)


@pytest.mark.parametrize(
    "s",
    [
        # between lengthen_ratio (0.6) and shorten_ratio (0.9): hold, even with a backlog
        sample(rt_p99_ms=75, backlog=10),
        # an online class above 60 % of its SLO blocks lengthening
        sample(rt_p99_ms=10, online_p99_ms=400, backlog=10),
        # a small backlog, between backlog_min / 2 and backlog_min: hold
        sample(rt_p99_ms=10, backlog=0.7),
        # a backlog over the window that is gone now (the surge just ended): hold
        sample(rt_p99_ms=10, backlog=5, backlog_now=0.0),
        # batches fill before the window expires (queue well under it): a longer one buys nothing
        sample(window_us=8000, rt_p99_ms=10, queue_us=3000, backlog=10),
        # at the bounds nothing moves
        sample(window_us=20_000, rt_p99_ms=10, backlog=10),
        sample(window_us=100, rt_p99_ms=200),
        sample(window_us=100, rt_p99_ms=10, backlog=0),
    ],
)
def test_batching_holds(s: BatchingSample) -> None:
    assert BatchingController(CFG).observe(s, now=0.0) is None


def test_batching_dwell() -> None:
    ctl = BatchingController(CFG)
    d = ctl.observe(sample(rt_p99_ms=200), now=100.0)
    assert d is not None
    ctl.changed(100.0)
    assert ctl.observe(sample(window_us=1000, rt_p99_ms=200), now=159.9) is None
    d = ctl.observe(sample(window_us=1000, rt_p99_ms=200), now=160.0)
    assert d is not None and d.new == 500


# --- class limits ---------------------------------------------------------------------------

LIM = ClassLimitsConfig(enabled=True, interval_s=10.0)


def test_class_limits_cut_the_least_important_first_and_release_in_reverse() -> None:
    ctl = ClassLimitController("m", LIM)
    lower = ("online", "offline")
    t = 0.0
    steps = []
    # Violation: offline halves down to its floor (0.1), then online.
    for _ in range(6):
        d = ctl.observe("rt", 0.2, 0.1, lower, t)
        assert d is not None
        steps.append((d.target, round(d.new, 4), d.direction, d.reason))
        t += 10.0
    assert steps == [
        ("offline", 0.5, "down", "slo_violation"),
        ("offline", 0.25, "down", "slo_violation"),
        ("offline", 0.125, "down", "slo_violation"),
        ("offline", 0.1, "down", "slo_violation"),
        ("online", 0.5, "down", "slo_violation"),
        ("online", 0.25, "down", "slo_violation"),
    ]
    # In the hysteresis band: hold.
    assert ctl.observe("rt", 0.08, 0.1, lower, t) is None
    t += 10.0
    # Recovered: online first, additively.
    d = ctl.observe("rt", 0.05, 0.1, lower, t)
    assert d is not None and (d.target, round(d.new, 4), d.direction) == ("online", 0.35, "up")


def test_class_limits_wait_for_the_interval_and_for_samples() -> None:
    ctl = ClassLimitController("m", LIM)
    assert ctl.observe("rt", None, 0.1, ("offline",), 0.0) is None
    assert ctl.observe("rt", 0.2, 0.1, ("offline",), 0.0) is not None
    assert ctl.observe("rt", 0.2, 0.1, ("offline",), 9.9) is None
    assert ctl.observe("rt", 0.2, 0.1, ("offline",), 10.0) is not None


def test_class_roles() -> None:
    sched = SchedulingConfig()
    roles = ClassRoles.of(sched)
    assert roles is not None
    assert roles.top == "realtime"
    assert roles.lower == ("online", "offline")
    assert roles.throughput == ("offline",)
    assert ClassRoles.of(None) is None


# --- the gate's share scale -----------------------------------------------------------------


def test_share_scale_limits_a_class_but_not_below_its_min_share() -> None:
    sched = SchedulingConfig(
        classes={
            "rt": ClassConfig(rank=0),
            "off": ClassConfig(rank=1, min_share=0.2, max_share=1.0),
        },
        default_class="rt",
    )
    q: ClassQueues[int] = ClassQueues(sched)
    for i in range(20):
        q.push(i, "off", 0.0)
    q.set_share_scale("off", 0.5)
    taken = 0
    while q.pop(0.0, 10) is not None:
        taken += 1
    assert taken == 5  # floor(1.0 * 0.5 * 10)
    q.set_share_scale("off", 0.1)
    for _ in range(5):
        q.release("off")
    taken = 0
    while q.pop(0.0, 10) is not None:
        taken += 1
    assert taken == 2  # min_share 0.2 of 10 holds whatever the factor
    # The total is never changed: the top class still gets every other slot.
    for i in range(10):
        q.push(i, "rt", 0.0)
    while q.pop(0.0, 10) is not None:
        taken += 1
    assert q.in_flight() == 10
    with pytest.raises(ValueError):
        q.set_share_scale("off", 0.0)


# --- windowed quantiles ---------------------------------------------------------------------


def test_window_forgets_old_values() -> None:
    w = WindowedQuantiles(10.0, slices=10)
    for _ in range(100):
        w.record(0.010, now=0.5)
    w.record(1.0, now=5.0)
    assert w.count(5.0) == 101
    assert w.quantile(0.99, 5.0) == pytest.approx(0.010, rel=0.01)
    assert w.quantile(1.0, 5.0) == pytest.approx(1.0, rel=0.01)
    # The 0.5 s slice leaves the window after 10 s; the 5 s one stays until 15 s.
    assert w.count(10.5) == 1
    assert w.quantile(0.5, 10.5) == pytest.approx(1.0, rel=0.01)
    assert w.count(15.5) == 0
    assert w.quantile(0.99, 15.5) is None
    # A slot reused after a full turn starts empty.
    w.record(0.5, now=20.5)
    assert w.count(20.5) == 1


# --- config ---------------------------------------------------------------------------------

INSTANCES = [{"name": "a", "http": "http://127.0.0.1:1"}]


def parse(control: Any) -> config_mod.ProxyConfig:
    return config_mod.parse({"instances": INSTANCES, "control": control}, "p.yaml")


def test_control_section_defaults_off() -> None:
    c = config_mod.parse({"instances": INSTANCES}).control
    assert not c.any_enabled and not c.dry_run
    assert c.batching.dwell_s == 60.0


def test_control_section_parses() -> None:
    c = parse(
        {
            "dry_run": True,
            "batching": {"enabled": True, "models": ["m"], "max_us": 8000},
            "class_limits": {"enabled": True, "min_factor": 0.2},
        }
    ).control
    assert c.dry_run and c.batching.models == ("m",) and c.batching.max_us == 8000
    assert c.class_limits.min_factor == 0.2


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"batching": {"enable": True}}, "control.batching.enable"),
        ({"batching": {"min_us": 5000, "max_us": 100}}, "min_us <= max_us"),
        ({"batching": {"lengthen_ratio": 0.95}}, "hysteresis"),
        ({"class_limits": {"release_ratio": 0.95}}, "hysteresis"),
        ({"class_limits": {"decrease_factor": 1.5}}, "decrease_factor"),
        ({"tick_s": 0}, "tick_s"),
    ],
)
def test_control_section_is_strict(doc: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(doc)


# --- config override ------------------------------------------------------------------------


def test_with_batching_window_changes_only_the_window() -> None:
    config = {
        "name": "m",
        "max_batch_size": 8,
        "dynamic_batching": {"max_queue_delay_microseconds": "2000", "priority_levels": 3},
        "parameters": {"k": {"string_value": "v"}},
    }
    out = with_batching_window(config, 500)
    assert batching_window_us(config) == 2000
    assert batching_window_us(out) == 500
    out["dynamic_batching"]["max_queue_delay_microseconds"] = "2000"
    assert out == config
    with pytest.raises(ValueError):
        with_batching_window({"name": "m"}, 500)
    assert batching_window_us({"name": "m"}) is None
