from proxy.clock import FakeClock
from proxy.fleet.affinity import SequenceAffinity


def test_bind_lookup_end() -> None:
    a = SequenceAffinity(FakeClock())
    a.bind("m", 1, "i0")
    a.bind("m", "s", "i1")
    assert a.lookup("m", 1) == "i0"
    assert a.lookup("m", "s") == "i1"
    assert a.lookup("other", 1) is None
    a.end("m", 1)
    assert a.lookup("m", 1) is None


def test_idle_entries_expire_and_table_is_bounded() -> None:
    clock = FakeClock()
    a = SequenceAffinity(clock, max_entries=3, idle_timeout_s=10)
    for i in range(5):
        a.bind("m", i, "i0")
    assert len(a) == 3
    assert a.lookup("m", 0) is None and a.lookup("m", 4) == "i0"
    clock.advance(11)
    a.bind("m", 99, "i1")
    assert len(a) == 1


def test_lookup_refreshes_and_forget_instance() -> None:
    clock = FakeClock()
    a = SequenceAffinity(clock, idle_timeout_s=10)
    a.bind("m", 1, "i0")
    a.bind("m", 2, "i1")
    clock.advance(8)
    assert a.lookup("m", 1) == "i0"
    clock.advance(8)
    assert a.lookup("m", 1) == "i0"
    assert a.lookup("m", 2) is None
    a.forget_instance("i0")
    assert a.lookup("m", 1) is None
