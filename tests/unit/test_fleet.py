import contextlib

from proxy.clock import FakeClock
from proxy.fleet.instances import Fleet, HealthConfig, InstanceSpec, Work


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
    fleet.report_failure(inst, "refused", immediate=True)
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


def test_eject_after_several_consecutive_failures() -> None:
    fleet, _ = make(eject_after_failures=3)
    inst = fleet.get("i0")
    fleet.report_failure(inst, "x")
    fleet.report_failure(inst, "x")
    fleet.report_answer(inst)  # an answer in between: the failures were not consecutive
    fleet.report_failure(inst, "x")
    fleet.report_failure(inst, "x")
    assert inst.healthy
    fleet.report_failure(inst, "x")
    assert not inst.healthy


def test_refused_ejects_at_once() -> None:
    fleet, _ = make(eject_after_failures=3)
    inst = fleet.get("i0")
    fleet.report_failure(inst, "refused", immediate=True)
    assert not inst.healthy


def test_model_out_on_one_instance_only() -> None:
    fleet, clock = make(backoff_initial_s=1, backoff_max_s=4)
    i0, i1 = fleet.get("i0"), fleet.get("i1")
    changes: list[str] = []
    fleet.listeners.append(lambda i: changes.append(i.name))
    fleet.exclude_model(i0, "m", "unloaded")
    fleet.exclude_model(i0, "m", "unloaded")  # once is enough
    assert changes == ["i0"]
    assert fleet.serving("m") == [i1] and fleet.serving("other") == [i0, i1]
    assert i0.healthy and fleet.due_model_probes() == []
    clock.advance(1)
    assert fleet.due_model_probes() == [(i0, "m")]
    fleet.model_probe_failed(i0, "m")
    assert i0.models_out["m"].backoff_s == 2 and fleet.due_model_probes() == []
    fleet.include_model(i0, "m")
    assert fleet.serving("m") == [i0, i1] and changes == ["i0", "i0"]


def test_ahead_of_counts_the_same_or_more_important_levels_and_those_above() -> None:
    fleet, _ = make(1)
    inst = fleet.get("i0")
    with contextlib.ExitStack() as stack:
        for level in (1, 1, 2, 3, 0):
            stack.enter_context(fleet.track(inst, "m", work=Work(level=level)))
        stack.enter_context(fleet.track(inst, "other", work=Work(level=1)))
        assert inst.ahead_of("m", 2) == (3, 2)  # levels 1, 1, 2; above it: 1, 1
        assert inst.ahead_of("m", 1) == (2, 0)
        assert inst.ahead_of("m", 3) == (4, 3)  # the default level (0) is neither
        assert inst.ahead_of("m", None) == (5, 0)  # no level: every request of the model
    assert inst.ahead_of("m", 2) == (0, 0)
