"""The fleet's occupancy per model (proxy.routing.occupancy): pure logic, no servers."""

from __future__ import annotations

import math

import pytest

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, Instance, InstanceSpec, ModelOut
from proxy.routing.occupancy import FillRule, LongLoad, Occupancy, busy_shares, long_free


def _inst(name: str, **in_flight: int) -> Instance:
    inst = Instance(InstanceSpec(name=name, http=f"http://{name}:8000"))
    inst.model_in_flight.update(in_flight)
    return inst


def test_busy_share_counts_the_instances_serving_the_model_that_hold_some_of_it() -> None:
    a, b, c, d = _inst("a", m=3, n=1), _inst("b", m=1), _inst("c"), _inst("d", m=2)
    d.healthy = False  # out of rotation: neither busy nor serving
    assert busy_shares([a, b, c, d]) == {"m": 2 / 3, "n": 1 / 3}
    c.models_out["m"] = ModelOut("not ready", 0.0, 1.0)  # c does not serve m now
    assert busy_shares([a, b, c, d])["m"] == 1.0
    assert busy_shares([_inst("x"), _inst("y")]) == {}


def test_busy_share_at_a_depth_is_the_mean_in_flight_over_it() -> None:
    a, b, c = _inst("a", m=4, n=1), _inst("b", m=6, n=2), _inst("c", m=1)
    depths = {"m": 4, "n": 0}  # n's depth is at least 1 whatever the function says
    assert busy_shares([a, b, c], depths.__getitem__) == {"m": 11 / 3 / 4, "n": 1.0}
    c.healthy = False  # out of rotation: neither busy nor serving
    assert busy_shares([a, b, c], depths.__getitem__)["m"] == 1.0  # 10 / 2 over 4: at most 1
    assert busy_shares([_inst("x", m=1)], lambda _m: 4) == {"m": 0.25}


def test_long_free_names_the_instances_serving_the_model_without_its_long_work() -> None:
    a, b, c, d = _inst("a", m=3, n=1), _inst("b", m=1), _inst("c"), _inst("d", m=2)
    a.long_in_flight.update(m=2)
    d.long_in_flight.update(m=1)
    d.healthy = False  # out of rotation: not counted either way
    assert long_free([a, b, c, d]) == {"m": {"b", "c"}}  # n has no long work anywhere
    b.long_in_flight.update(m=1, n=1)
    assert long_free([a, b, c, d]) == {"m": {"c"}, "n": {"a", "c"}}
    c.models_out["m"] = ModelOut("not ready", 0.0, 1.0)
    assert long_free([a, b, c, d])["m"] == frozenset()


def test_occupancy_follows_a_step_with_its_time_constant_and_forgets_idle_models() -> None:
    occ = Occupancy(tau_s=2.0)
    occ.sample({}, 0.0)
    assert occ.get("m") == 0.0
    for i in range(1, 21):  # every instance busy from t = 0, sampled each 0.1 s for 2 s
        occ.sample({"m": 1.0}, i * 0.1)
    assert occ.get("m") == pytest.approx(1 - math.exp(-1))
    for i in range(21, 400):  # idle again: decays, then leaves the table
        occ.sample({}, i * 0.1)
    assert occ.values == {}


def test_occupancy_starts_a_new_model_from_zero_and_checks_its_time_constant() -> None:
    occ = Occupancy(tau_s=1.0)
    occ.sample({"m": 1.0}, 5.0)  # the first sample has no interval: nothing is known yet
    assert occ.get("m") == 0.0
    occ.sample({"m": 1.0}, 6.0)
    assert occ.get("m") == pytest.approx(1 - math.exp(-1))
    with pytest.raises(ValueError, match="tau_s"):
        Occupancy(tau_s=0.0)


def test_a_saturated_model_is_fully_occupied_at_once_and_decays_from_there() -> None:
    # Requests of an uncapped class wait at the gate: the fleet is at its limit now, whatever
    # the average has seen so far (a surge from light load).
    occ = Occupancy(tau_s=2.0)
    occ.sample({"m": 0.3}, 0.0)
    occ.sample({"m": 0.3}, 0.1, saturated={"m"})
    assert occ.get("m") == 1.0
    occ.sample({"m": 1 / 3}, 2.1)  # the wait is gone: back towards the busy share
    assert occ.get("m") == pytest.approx(1 / 3 + (1 - 1 / 3) * math.exp(-1))
    occ.sample({}, 2.2, saturated={"n"})  # waiting with nothing in flight yet
    assert occ.get("n") == 1.0


def test_long_load_is_the_smoothed_rate_of_the_device_time_added_scaled_by_the_workers() -> None:
    load = LongLoad(tau_s=1.0)
    load.add("m", 5.0)
    load.sample(10.0)  # the first sample only starts the clock: what came before is dropped
    assert load.get("m") == 0.0 and load.pending == {}
    load.sample(10.5)  # the average's own first sample: no interval yet either
    for i in range(1, 11):  # 0.05 s of device time every 0.1 s: half an instance, 1 s long
        load.add("m", 0.02)
        load.add("m", 0.03)
        load.sample(10.5 + i * 0.1)
    assert load.get("m") == pytest.approx(0.5 * (1 - math.exp(-1)))
    load.add("m", 0.05)
    load.sample(11.6, scale=2)  # each of two workers sees half the fleet's requests
    assert load.get("m") == pytest.approx(
        0.5 * (1 - math.exp(-1)) + (1.0 - 0.5 * (1 - math.exp(-1))) * (1 - math.exp(-0.1))
    )
    load.sample(11.6)  # no time passed: nothing to divide by, nothing changes
    assert load.get("m") > 0.5 * (1 - math.exp(-1))


def test_the_fill_decides_an_uncapped_class_only_from_its_long_load_on() -> None:
    fleet = Fleet((), HealthConfig(), FakeClock())
    fleet.occupancy.values["m"] = 0.95
    always, from_half = FillRule(depth=0.25), FillRule(depth=0.25, from_load=0.5)
    assert fleet.occupancy_for("m", capped=False) == 0.95  # no rule: the busy share
    assert fleet.occupancy_for("m", capped=False, rule=always) == 0.95  # not sampled yet
    fleet.fills[0.25] = Occupancy()
    fleet.fills[0.25].values["m"] = 0.3
    assert fleet.occupancy_for("m", capped=False, rule=always) == 0.3  # no load: always
    assert fleet.occupancy_for("m", capped=True, rule=always) == 0.95  # capped: busy share
    assert fleet.occupancy_for("m", capped=False) == 0.95  # an arm without a fill
    assert fleet.occupancy_for("m", capped=False, rule=FillRule(depth=0.5)) == 0.95  # no table
    assert fleet.occupancy_for("m", capped=False, rule=from_half) == 0.95  # load not measured
    fleet.long_load = LongLoad()
    fleet.long_load.rates.values["m"] = 0.49
    assert fleet.occupancy_for("m", capped=False, rule=from_half) == 0.95  # light long work
    assert fleet.occupancy_for("m", capped=False, rule=always) == 0.3
    fleet.long_load.rates.values["m"] = 0.5
    assert fleet.occupancy_for("m", capped=False, rule=from_half) == 0.3
    assert fleet.occupancy_for("m", capped=True, rule=from_half) == 0.95
