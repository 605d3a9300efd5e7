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


def test_orphaned_sequences_say_why_until_restarted_ended_or_idle() -> None:
    clock = FakeClock()
    a = SequenceAffinity(clock, max_entries=3, idle_timeout_s=10)
    for seq in (1, 2, 3):
        a.bind("m", seq, "i0")
    a.bind("m", 4, "i1")  # 1 is evicted: the table holds 3
    a.forget_instance("i0", "was removed by a policy reload")
    assert a.lookup("m", 3) is None and a.orphaned("m", 3) == "was removed by a policy reload"
    assert a.orphaned("m", 4) is None and a.lookup("m", 4) == "i1"
    a.bind("m", 3, "i1")  # started again elsewhere
    assert a.orphaned("m", 3) is None
    assert a.orphaned("m", 1) is None  # evicted before, so not known at all
    assert a.orphaned("m", 2) is not None
    a.end("m", 2)
    assert a.orphaned("m", 2) is None
    a.bind("m", 5, "i0")
    a.forget_instance("i0", "was ejected (x)")
    clock.advance(11)
    assert a.orphaned("m", 5) is None  # idle past the timeout: forgotten
