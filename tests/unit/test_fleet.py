from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec


def make(n: int = 2, **health: float) -> tuple[Fleet, FakeClock]:
    clock = FakeClock()
    specs = tuple(InstanceSpec(f"i{k}", f"http://127.0.0.1:{9000 + k}") for k in range(n))
    return Fleet(specs, HealthConfig(**health), clock), clock  # type: ignore[arg-type]


def test_track_releases_exactly_once_on_error() -> None:
    fleet, _ = make()
    inst = fleet.get("i0")
    try:
        with fleet.track(inst, "m", stream=True):
            assert (inst.in_flight, inst.model_in_flight["m"], inst.streams) == (1, 1, 1)
            raise RuntimeError
    except RuntimeError:
        pass
    assert (inst.in_flight, inst.streams, dict(inst.model_in_flight)) == (0, 0, {})


def test_ejection_backoff_and_recovery() -> None:
    fleet, clock = make(backoff_initial_s=1, backoff_max_s=4)
    inst = fleet.get("i0")
    fleet.report_failure(inst, "refused")
    assert not inst.healthy and [i.name for i in fleet.healthy()] == ["i1"]
    assert inst.next_probe_at == 1
    for expected in (2, 4, 4):
        fleet.report_failure(inst, "refused")
        assert inst.backoff_s == expected
    assert fleet.due_for_probe() == [fleet.get("i1")]
    clock.advance(5)
    assert inst in fleet.due_for_probe()
    fleet.report_success(inst)
    assert inst.healthy and inst.ejected_reason == ""


def test_eject_after_several_failures() -> None:
    fleet, _ = make(eject_after_failures=3)
    inst = fleet.get("i0")
    fleet.report_failure(inst, "x")
    fleet.report_failure(inst, "x")
    assert inst.healthy
    fleet.report_failure(inst, "x")
    assert not inst.healthy
