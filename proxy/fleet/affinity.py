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

    def bind(self, model: str, sequence_id: int | str, instance: str) -> None:
        key = (model, sequence_id)
        self._table[key] = (instance, self._clock.now())
        self._table.move_to_end(key)
        self._expire()

    def end(self, model: str, sequence_id: int | str) -> None:
        self._table.pop((model, sequence_id), None)

    def forget_instance(self, instance: str) -> None:
        """Drop every sequence placed on ``instance`` (it died: its state is gone)."""
        for key in [k for k, v in self._table.items() if v[0] == instance]:
            del self._table[key]

    def _expire(self) -> None:
        while len(self._table) > self._max:
            self._table.popitem(last=False)
        now = self._clock.now()
        while self._table:
            key, (_, seen) = next(iter(self._table.items()))
            if now - seen <= self._idle:
                break
            del self._table[key]
