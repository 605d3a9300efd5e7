"""The scheduling section: defaults, strict loading, validation, helper formulas."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from proxy.control.concurrency import AdaptiveConcurrencyConfig
from proxy.scheduling.config import (
    ClassConfig,
    SchedulingConfig,
    derive_concurrency,
    derived_lane,
    load_scheduling,
)
from proxy.strict import ConfigError


def test_defaults_are_three_valid_classes() -> None:
    config = load_scheduling(None)
    assert list(config.classes) == ["realtime", "online", "offline"]
    ranks = [c.rank for c in config.classes.values()]
    assert ranks == sorted(ranks)
    assert config.default_class == "online"
    assert config.dispatch == "strict_aging"
    assert config == SchedulingConfig()


def test_full_section_loads() -> None:
    config = load_scheduling(
        {
            "default_class": "batch",
            "dispatch": "weighted_round_robin",
            "aging": {"step_s": 0.25},
            "max_queued_total": 100,
            "concurrency": 8,
            "api_key_header": "x-api-key",
            "api_keys": {"k1": {"class_name": "rt", "allow_class_header": True}},
            "classes": {
                "rt": {"rank": 0, "triton_priority": 1, "min_share": 0.25, "weight": 4},
                "batch": {"rank": 1, "max_share": 0.3, "queue_timeout_s": None},
            },
        },
        source="policy.yaml",
    )
    assert config.classes["batch"].queue_timeout_s is None
    assert config.classes["rt"].weight == 4
    assert config.api_keys["k1"].allow_class_header is True
    assert config.aging.step_s == 0.25


BAD: list[tuple[dict[str, Any], str]] = [
    ({"classes": {"a": {"rank": -1}}, "default_class": "a"}, "rank must be >= 0"),
    ({"classes": {"a": {"rank": 0, "min_share": 1.5}}, "default_class": "a"}, "min_share"),
    ({"classes": {"a": {"rank": 0, "max_share": 0}}, "default_class": "a"}, "max_share"),
    (
        {"classes": {"a": {"rank": 0, "min_share": 0.5, "max_share": 0.4}}, "default_class": "a"},
        "must not exceed max_share",
    ),
    ({"classes": {"a": {"rank": 0, "weight": 0}}, "default_class": "a"}, "weight"),
    ({"classes": {"a": {"rank": 0, "max_queue": 0}}, "default_class": "a"}, "max_queue"),
    ({"classes": {"a": {"rank": 0, "queue_timeout_s": 0}}, "default_class": "a"}, "timeout"),
    ({"classes": {"a": {"rank": 0, "max_concurrency": 0}}, "default_class": "a"}, "max_conc"),
    ({"classes": {"a": {"rank": 0, "triton_priority": -1}}, "default_class": "a"}, "triton_pr"),
    ({"classes": {"a": {"rank": 0}}}, "default_class 'online' is not a class"),
    ({"classes": {}}, "at least one class"),
    ({"classes": {"a b": {"rank": 0}}, "default_class": "a b"}, "class name"),
    (
        {
            "classes": {"a": {"rank": 0, "min_share": 0.6}, "b": {"rank": 1, "min_share": 0.6}},
            "default_class": "a",
        },
        "add up to 1.2",
    ),
    ({"api_keys": {"secret-key-123": {"class_name": "vip"}}}, "class 'vip' is not a class"),
    ({"api_keys": {"sha256:abc": {"class_name": "online"}}}, "64 hex digits"),
    ({"aging": {"step_s": 0}}, "step_s"),
    ({"dispatch": "fifo"}, "must be one of"),
    ({"max_queued_total": 0}, "max_queued_total"),
    ({"concurrency": 0}, "concurrency"),
    ({"class_header": "bad header"}, "class_header"),
    ({"classes": {"online": {"rank": 0, "weigth": 2}}}, "did you mean 'weight'"),
    ({"clases": {}}, "did you mean 'classes'"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_invalid_sections_are_errors_with_a_path(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_scheduling(data, source="policy.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("policy.yaml: scheduling")


def test_api_key_errors_do_not_print_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_scheduling({"api_keys": {"secret-key-123": {"class_name": "vip"}}})
    assert "secret-key-123" not in str(info.value)


@pytest.mark.parametrize(
    ("triton_priority", "levels", "expected"),
    [
        (1, 3, 1),
        (3, 3, 3),
        (5, 3, 3),  # above the model's levels: its lowest level, not Triton's default
        (2, 0, None),  # the model has no priority levels: Triton would ignore it
        # The class sets none: Triton's default level (0), overriding the client's own.
        (0, 3, 0),
    ],
)
def test_triton_priority_for(triton_priority: int, levels: int, expected: int | None) -> None:
    config = SchedulingConfig(
        classes={"a": ClassConfig(rank=0, triton_priority=triton_priority)}, default_class="a"
    )
    assert config.triton_priority_for("a", levels) == expected
    # A class a reload removed counts as the default class.
    assert config.triton_priority_for("nope", levels) == expected


@pytest.mark.parametrize(
    ("max_batch_size", "instances", "expected"), [(0, 1, 2), (1, 1, 2), (8, 1, 16), (8, 2, 32)]
)
def test_derive_concurrency(max_batch_size: int, instances: int, expected: int) -> None:
    assert derive_concurrency(max_batch_size, instances) == expected
    assert SchedulingConfig().instance_concurrency(max_batch_size, instances) == expected
    assert SchedulingConfig(concurrency=5).instance_concurrency(max_batch_size, instances) == 5


def test_slots_are_adaptive_unless_fixed_or_turned_off() -> None:
    assert SchedulingConfig().adaptive()  # the default since session 31
    assert not SchedulingConfig(concurrency=5).adaptive()
    off = AdaptiveConcurrencyConfig(enabled=False)
    assert not SchedulingConfig(adaptive_concurrency=off).adaptive()
    doc = {"classes": {"a": {"rank": 0}}, "default_class": "a"}
    assert load_scheduling(doc).adaptive()
    assert not load_scheduling({**doc, "adaptive_concurrency": {"enabled": False}}).adaptive()


@pytest.mark.parametrize(
    ("capacity", "max_share", "max_concurrency", "min_share", "limit", "reserved"),
    [
        (10, 0.3, None, 0.0, 3, 0),
        (2, 0.3, None, 0.0, 1, 0),  # never rounded down to nothing
        (0, 0.3, None, 0.0, 1, 0),
        (10, 1.0, 2, 0.5, 2, 2),  # the reservation never exceeds the cap
        (10, 0.5, 4, 0.2, 4, 2),
        (10, 1.0, None, 0.3, 10, 3),
        (3, 1.0, None, 0.3, 3, 0),
    ],
)
def test_share_limit_and_reservation(
    capacity: int,
    max_share: float,
    max_concurrency: int | None,
    min_share: float,
    limit: int,
    reserved: int,
) -> None:
    cls = ClassConfig(
        rank=0, max_share=max_share, max_concurrency=max_concurrency, min_share=min_share
    )
    assert cls.share_limit(capacity) == limit
    assert cls.reserved(capacity) == reserved


def test_spare_instances_need_a_per_instance_cap() -> None:
    with pytest.raises(ValueError, match="spare_instances needs max_per_instance"):
        ClassConfig(rank=1, spare_instances=1)
    with pytest.raises(ValueError, match="spare_instances must be >= 0"):
        ClassConfig(rank=1, max_per_instance=2, spare_instances=-1)
    lane = ClassConfig(rank=1, max_per_instance=4, spare_instances=2)
    assert [lane.share_limit(100, n) for n in (1, 2, 3, 5)] == [4, 4, 4, 12]


def test_spare_per_instance_lends_each_kept_spare_that_many_never_past_the_depth() -> None:
    with pytest.raises(ValueError, match="spare_per_instance must be >= 0"):
        ClassConfig(rank=1, max_per_instance=2, spare_instances=1, spare_per_instance=-1)
    lane = ClassConfig(rank=1, max_per_instance=8, spare_instances=2, spare_per_instance=3)

    def behind(instances: int, **kw: Any) -> int:  # the oldest queued has waited 1 s
        return lane.share_limit(100, instances, waited_s=1.0, **kw)

    # 8 on each lane instance, 3 on each spare kept; one instance is the lane (no spare).
    assert [behind(n) for n in (1, 2, 3, 5)] == [8, 8 + 3, 8 + 6, 24 + 6]
    assert behind(5, spare=False) == 40  # lent whole: 8 everywhere
    # Keeping up (nothing queued, or the oldest younger than deepen_after_s): nothing lent.
    assert [lane.share_limit(100, 5, waited_s=w) for w in (None, 0.0, 0.9)] == [24] * 3
    shallow = replace(lane, shallow_per_instance=2, spare_per_instance=9)
    assert shallow.share_limit(100, 5, waited_s=0.5) == 3 * 2  # shallow: keeping up
    assert shallow.share_limit(100, 5, waited_s=1.0) == 3 * 8 + 2 * 8  # never past the depth
    assert ClassConfig(rank=1, spare_per_instance=4).share_limit(100, 5, waited_s=9.0) == 100


def test_the_derived_lane_keeps_the_class_s_spare_per_instance() -> None:
    config = load_scheduling(
        {
            "classes": {
                "rt": {"rank": 0, "slo_p99_ms": 100},
                "off": {"rank": 1, "spare_per_instance": 2},
            },
            "default_class": "off",
        }
    )
    off = config.for_model(16).classes["off"]
    assert (off.max_per_instance, off.spare_instances, off.spare_per_instance) == (8, 1, 2)
    assert off.share_limit(100, 3, waited_s=1.0) == 2 * 8 + 2


def test_slot_sharing_defaults_to_null_and_refuses_unknown_values() -> None:
    assert load_scheduling(None).slot_sharing is None
    assert load_scheduling({"slot_sharing": "by_rank"}).slot_sharing == "by_rank"
    with pytest.raises(ConfigError, match="slot_sharing"):
        load_scheduling({"slot_sharing": "per_class"})


@pytest.mark.parametrize(
    ("max_batch_size", "lane"),
    [(0, None), (1, None), (2, (1, 1)), (4, (2, 1)), (16, (8, 2)), (128, (64, 16))],
)
def test_derived_lane_is_half_a_batch_and_a_quarter_of_that_while_it_moves(
    max_batch_size: int, lane: tuple[int, int] | None
) -> None:
    assert derived_lane(max_batch_size) == lane


def test_the_default_classes_give_offline_a_lane_per_model() -> None:
    config = load_scheduling(None)
    assert config.lane_classes() == ("offline",)
    per_model = config.for_model(16)
    offline = per_model.classes["offline"]
    assert (offline.max_per_instance, offline.shallow_per_instance, offline.spare_instances) == (
        8,
        2,
        1,
    )
    # Everything else as written: the other classes, and offline's own keys.
    assert offline.max_share == config.classes["offline"].max_share == 0.5
    assert {n: c for n, c in per_model.classes.items() if n != "offline"} == {
        n: c for n, c in config.classes.items() if n != "offline"
    }
    assert config.for_model(1).classes is config.classes  # nothing batches, nothing pads
    assert config.for_model(16, packs_long=False).classes is config.classes  # nothing packs


@pytest.mark.parametrize(
    ("written", "packs", "enforced"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True)],
)
def test_deadline_admission_defaults_to_on_where_the_routing_packs(
    written: bool | None, packs: bool, enforced: bool
) -> None:
    extra = {} if written is None else {"shed_late": written}
    config = load_scheduling(extra or None)
    assert config.shed_late is written
    for max_batch_size in (0, 16):  # with a lane or without
        assert config.for_model(max_batch_size, packs_long=packs).shed_late is enforced


@pytest.mark.parametrize(
    ("classes", "extra", "lanes"),
    [
        # no class has an SLO: nothing to protect
        ({"a": {"rank": 0}, "b": {"rank": 1}}, {}, ()),
        # a lane of its own wins
        ({"rt": {"rank": 0, "slo_p99_ms": 50}, "off": {"rank": 1, "max_per_instance": 3}}, {}, ()),
        # a throughput class ranked above every SLO class pads nobody's batches but its own
        ({"bulk": {"rank": 0}, "rt": {"rank": 1, "slo_p99_ms": 50}}, {}, ()),
        # turned off
        ({"rt": {"rank": 0, "slo_p99_ms": 50}, "off": {"rank": 1}}, {"throughput_lane": False}, ()),
        # every throughput class below an SLO class, in file order
        (
            {"b": {"rank": 2}, "rt": {"rank": 0, "slo_p99_ms": 50}, "a": {"rank": 1}},
            {},
            ("b", "a"),
        ),
    ],
)
def test_lane_classes(classes: dict[str, Any], extra: dict[str, Any], lanes: tuple[str]) -> None:
    config = load_scheduling({"default_class": next(iter(classes)), "classes": classes, **extra})
    assert config.lane_classes() == lanes
    if not lanes:
        assert config.for_model(16).classes is config.classes


@pytest.mark.parametrize(
    ("instances", "spares", "lane"),
    [(1, 1, 1), (2, 1, 1), (3, 1, 2), (5, 1, 4), (6, 2, 4), (9, 3, 6)],
)
def test_the_derived_lane_keeps_a_third_of_the_instances_spare(
    instances: int, spares: int, lane: int
) -> None:
    offline = load_scheduling(None).for_model(16).classes["offline"]
    assert offline.spare_fraction == pytest.approx(1 / 3)
    assert offline.spares(instances) == spares
    assert offline.lane(instances) == lane
    assert offline.lane(instances, spare=False) == instances


def test_spare_fraction_needs_a_lane_and_stays_below_one() -> None:
    with pytest.raises(ConfigError, match="spare_fraction needs max_per_instance"):
        load_scheduling(
            {"default_class": "a", "classes": {"a": {"rank": 0, "spare_fraction": 0.5}}}
        )
    with pytest.raises(ConfigError, match="spare_fraction must be within"):
        load_scheduling(
            {
                "default_class": "a",
                "classes": {"a": {"rank": 0, "max_per_instance": 2, "spare_fraction": 1.0}},
            }
        )


SHARINGS = ("shared", "by_rank", "placed_by_rank")


def test_slot_sharing_left_null_places_by_rank_where_routing_packs_and_levels_exist() -> None:
    config = load_scheduling(None)
    assert config.slot_sharing is None
    packed = config.for_model(16, packs_long=True, priority_levels=3)
    assert packed.slot_sharing == "placed_by_rank"
    # Triton serves in arrival order without levels; a policy that does not pack keeps one pool
    assert config.for_model(16, packs_long=True, priority_levels=0).slot_sharing == "shared"
    assert config.for_model(16, packs_long=False, priority_levels=3).slot_sharing == "shared"
    for given in SHARINGS:
        written = load_scheduling({"slot_sharing": given})
        for packs, levels in ((True, 3), (False, 0)):
            assert written.for_model(16, packs, levels).slot_sharing == given


def test_placement_counts_by_rank_under_by_rank_and_placed_by_rank_only() -> None:
    ranks = {s: load_scheduling({"slot_sharing": s}).ranks_placement() for s in SHARINGS}
    assert ranks == {"shared": False, "by_rank": True, "placed_by_rank": True}
    assert not load_scheduling(None).ranks_placement()  # unresolved: as written, no rank
