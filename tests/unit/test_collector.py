"""The collector's settings for a measured stretch of work: set inside, restored after."""

from __future__ import annotations

import gc

import pytest

from proxy import collector


def test_quiet_while_freezes_and_raises_thresholds_then_restores_them() -> None:
    before = gc.get_threshold()
    assert before != collector.THRESHOLDS
    gc.unfreeze()
    kept = [object()]  # alive across the stretch: frozen inside, thawed after
    with collector.quiet_while():
        assert gc.get_threshold() == collector.THRESHOLDS
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert kept


def test_quiet_while_restores_after_an_error() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), collector.quiet_while():
        raise RuntimeError("the run failed")
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
