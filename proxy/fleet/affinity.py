"""Sticky placement of stateful sequences: a sequence stays on the instance that got its start."""

from __future__ import annotations

from collections import OrderedDict

from proxy.clock import Clock


class SequenceAffinity:
    """Bounded table ``(model, sequence_id) -> instance``, forgotten on end or when idle.

    Triton drops a sequence's state after ``max_sequence_idle_microseconds``; entries idle for
    ``idle_timeout_s`` go too. When full, the least recently used entry is evicted (its sequence
    has most likely been abandoned by its client).
    """

    def __init__(self, clock: Clock, *, max_entries: int = 100_000, idle_timeout_s: float = 600.0):
        self._clock = clock
        self._max = max_entries
        self._idle = idle_timeout_s
        self._table: OrderedDict[tuple[str, int | str], tuple[str, float]] = OrderedDict()
        self._orphans: OrderedDict[tuple[str, int | str], tuple[str, float]] = OrderedDict()
        """Sequences whose instance left: ``key -> (why, last seen)``, so their next requests
        get a clear error instead of landing on an instance that never saw their start."""

    def __len__(self) -> int:
        return len(self._table)

    def lookup(self, model: str, sequence_id: int | str) -> str | None:
        key = (model, sequence_id)
        entry = self._table.get(key)
        if entry is None:
            return None
        now = self._clock.now()
        if now - entry[1] > self._idle:
            del self._table[key]
            return None
        self._table[key] = (entry[0], now)
        self._table.move_to_end(key)
        return entry[0]

    def orphaned(self, model: str, sequence_id: int | str) -> str | None:
        """Why the sequence's instance is gone, if it went while the sequence was open."""
        key = (model, sequence_id)
        entry = self._orphans.get(key)
        if entry is None:
            return None
        if self._clock.now() - entry[1] > self._idle:
            del self._orphans[key]
            return None
        return entry[0]

    def bind(self, model: str, sequence_id: int | str, instance: str) -> None:
        key = (model, sequence_id)
        self._orphans.pop(key, None)
        self._table[key] = (instance, self._clock.now())
        self._table.move_to_end(key)
        self._expire()

    def end(self, model: str, sequence_id: int | str) -> None:
        self._table.pop((model, sequence_id), None)
        self._orphans.pop((model, sequence_id), None)

    def forget_instance(self, instance: str, why: str = "") -> None:
        """Drop every sequence placed on ``instance`` (ejected, or removed by a reload);
        with ``why``, their next requests are told why (see :meth:`orphaned`)."""
        for key in [k for k, v in self._table.items() if v[0] == instance]:
            _, seen = self._table.pop(key)
            if why:
                self._orphans[key] = (why, seen)
                self._orphans.move_to_end(key)
        while len(self._orphans) > self._max:
            self._orphans.popitem(last=False)

    def _expire(self) -> None:
        while len(self._table) > self._max:
            self._table.popitem(last=False)
        now = self._clock.now()
        while self._table:
            key, (_, seen) = next(iter(self._table.items()))
            if now - seen <= self._idle:
                break
            del self._table[key]
