"""A model's routing candidates kept up to date between requests, and indexes over them.

The linear path (``Router.choose``) builds every candidate, prepares every one and lets the
policy scan the list: its cost grows with the number of instances. A :class:`ModelView` keeps
the prepared candidates of one kind of request (:class:`Shape`) instead, and refreshes only
the instances the fleet's change journal names (a request started or finished there, a new
snapshot, health, drain...) plus those a timer says changed (a snapshot turned stale, a
feedback window fell due). Policies read it through indexes that the view updates with each
refreshed candidate:

- :class:`Ordering`: candidates sorted by ``(filter level, policy key, fleet position)``; the
  minimum and its ties in O(log n) (``least_*``, ``weighted_score``, ``expected_start``), or
  the candidates in fleet order (``p2c`` samples them by index);
- :class:`WeightTree`: prefix sums of weights in fleet order (``random``);
- policy-owned state (``round_robin``'s rotation, ``consistent_hash``'s loads).

Per-request filters of placement (a free slot, the class's per-instance cap) become a
candidate's *filter level*, ``2 * (no free slot) + (class at its cap)``: the candidates the
linear path keeps are exactly those at the lowest level present ("free or all", then "under
the cap or all"), so every index answers for that level. Instances a retry excludes are taken
out for one decision and put back.

Cost of a decision: O((k + 1) log n) where k is the number of instances named by the journal
or a timer since the view's previous decision (a request's start and finish, new snapshots at
instances / scrape interval). Sorted lists shift pointers with ``list.insert`` / ``del`` (C
``memmove``, n pointers, a few hundred ns at n = 1,000); everything else is logarithmic.

Decisions are the linear path's (``tests/unit/test_routing_view.py`` runs both side by side).
What that rests on is said where it applies: exact float sums for ``random`` and
``round_robin`` (power-of-two weights), policy state per shape rather than per model
(``round_robin``, ``consistent_hash``), connections held by aiohttp read at the instance's next
change (``least_connections``), and every input reaching the journal.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, overload

from proxy.fleet.instances import ChangeJournal
from proxy.routing.base import Candidate, RouteRequest
from proxy.routing.select import weight_of

NO_SNAPSHOT, FRESH, STALE = 0, 1, 2
"""Status of a candidate's scraped snapshot (before the engine's rule 4 strips it)."""
LEVELS = 4
"""Filter levels: ``2 * (no free slot) + (class at its per-instance cap)``."""
GONE = LEVELS
"""Where policy state keeps an instance that left the view since the last decision: the
linear form only notices absence at a decision, so one that left and came back in between
keeps its state."""


@dataclass(frozen=True)
class Shape:
    """What, in a request, changes the candidates placement builds for it: the model; the
    class and its per-instance cap when it has one (the filter reads the class's count); the
    priority level when the policy or the slot filter reads ``ahead``. One view per shape."""

    model: str
    class_name: str | None
    class_cap: int | None
    level: int | None

    @staticmethod
    def of(request: RouteRequest, reads_ahead: bool) -> Shape:
        capped = request.class_cap is not None
        return Shape(
            request.model,
            request.class_name if capped else None,
            request.class_cap,
            request.level if reads_ahead else None,
        )

    def request(self, request: RouteRequest) -> RouteRequest:
        """``request`` with only what the shape keeps (what the view builds candidates for)."""
        return dataclasses.replace(request, class_name=self.class_name, level=self.level)


class CandidateSource(Protocol):
    """The fleet's live state, as placement turns it into candidates."""

    @property
    def journal(self) -> ChangeJournal:
        """The fleet's change journal: one object for the source's life (views keep it)."""
        ...

    @property
    def positions(self) -> Mapping[str, int]:
        """Every instance's place in policy order."""
        ...

    def slots_by_level(self, model: str) -> bool:
        """The filter counts slots of ``model`` by priority level (the candidates depend on
        the level)."""
        ...

    def builder(self, request: RouteRequest) -> Callable[[str], tuple[Candidate, int] | None]:
        """A function of an instance's name: its candidate for requests shaped like
        ``request`` and its filter level, or None when it takes none (unhealthy, model out or
        draining there, unknown)."""
        ...


class Preparer(Protocol):
    """The engine's per-candidate rules (``Router.prepare_one``)."""

    def prepare_one(
        self, c: Candidate, model: str, now: float, strip: bool, evaluate: bool = True
    ) -> tuple[Candidate, int, float | None, float | None]: ...


class Member:
    """One instance in a view: its candidate as built, as prepared, and where it stands."""

    __slots__ = ("cand", "due", "level", "name", "pos", "raw", "status", "stripped")

    def __init__(self, name: str, pos: int) -> None:
        self.name = name
        self.pos = pos
        self.raw: Candidate
        self.cand: Candidate
        self.level = 0
        self.status = NO_SNAPSHOT
        self.due: float | None = None
        self.stripped = False
        """Prepared under rule 4 (see ``ModelView.strip``)."""


class ViewIndex(Protocol):
    """Derived state a view keeps up to date: told of every member added, removed, changed."""

    def add(self, m: Member) -> None: ...

    def remove(self, m: Member) -> None: ...

    def change(self, m: Member, old_level: int, old: Candidate) -> None: ...


IndexT = TypeVar("IndexT", bound=ViewIndex)


class ModelView:
    """Prepared candidates of one :class:`Shape` (for one router and one candidate source)."""

    def __init__(self, source: CandidateSource, request: RouteRequest, preparer: Preparer) -> None:
        self.source = source
        self._journal = source.journal
        self.request = request
        """The request that created the view, reduced to its shape (:meth:`Shape.request`)."""
        self._build = source.builder(request)
        self.model = request.model
        self._prep = preparer
        self.members: dict[str, Member] = {}
        self.by_pos: dict[int, Member] = {}
        self.count = [0] * LEVELS
        self.fresh = [0] * LEVELS
        self.stale = [0] * LEVELS
        self.strip = False
        """Rule 4 in force: no candidate of the lowest level has a fresh snapshot."""
        self.indexes: dict[Hashable, ViewIndex] = {}
        self._timers: list[tuple[float, str]] = []
        self._windows: list[set[str]] = [set() for _ in range(LEVELS)]
        """Per filter level, members on which a feedback window may be evaluated: the
        linear path evaluates at the first decision that has them among its candidates."""
        self._epoch = -1
        self._offset = 0
        self.rebuilds = 0
        """Full refreshes (first use, reload of the instance list, a reader far behind)."""

    # --- keeping up -----------------------------------------------------------------------
    def sync(self, now: float) -> None:
        """Refresh what changed since the last call: journal entries and due timers."""
        journal = self._journal
        timers = self._timers
        names = journal.since(self._epoch, self._offset)
        if names is None:
            self._epoch, self._offset = journal.epoch, journal.end
            self.rebuilds += 1
            todo = dict.fromkeys(self.source.positions)
            for gone in [n for n in self.members if n not in todo]:
                self._drop(self.members[gone])
        elif names:
            self._offset += len(names)
            todo = dict.fromkeys(names, False)
        elif timers and timers[0][0] <= now:
            todo = {}
        else:
            return  # nothing changed: the common case between two decisions in one burst
        while timers and timers[0][0] <= now:
            due, name = heapq.heappop(timers)
            m = self.members.get(name)
            if m is not None and m.due == due:
                m.due = None
                todo[name] = True
        for name, timed in todo.items():
            self._refresh(name, now, timed is not False)

    def _refresh(self, name: str, now: float, timed: bool) -> None:
        """Rebuild ``name``'s candidate; ``timed``: a timer fired for it (or a rebuild), so
        the engine's rules must run again even on the same snapshot."""
        built = self._build(name)
        m = self.members.get(name)
        if built is None:
            if m is not None:
                self._drop(m)
            return
        raw, level = built
        if m is None:
            m = Member(name, self.source.positions[name])
            m.raw = raw
            m.level = level
            self._prepare(m, now)
            self._add(m)
        else:
            self._set(m, raw, level, now, timed)

    def _prepare(self, m: Member, now: float, evaluate: bool = False) -> None:
        m.cand, m.status, due, window_at = self._prep.prepare_one(
            m.raw, self.model, now, self.strip, evaluate
        )
        m.stripped = self.strip
        if window_at is not None and window_at <= now:
            # Due, or due within float rounding of the feedback's own test: tried again at
            # each decision until it evaluates, as the linear path tries at each decision.
            self._windows[m.level].add(m.name)
        else:
            self._windows[m.level].discard(m.name)
            if window_at is not None and (due is None or window_at < due):
                due = window_at
        if due is not None and due != m.due:
            heapq.heappush(self._timers, (due, m.name))
        m.due = due

    def evaluate_feedback(self, now: float, excluded: frozenset[str]) -> None:
        """Evaluate due feedback windows of this decision's candidates (``excluded`` ones
        wait for a decision that has them)."""
        level = self.min_level()
        waiting = self._windows[level]
        if not waiting:
            return
        # In fleet order, as the linear path prepares them: a window's verdict reads the
        # latest windows of the model's other instances (FeedbackParams.peer_ratio).
        positions = self.source.positions
        for name in sorted(waiting, key=lambda n: positions.get(n, -1)):
            m = self.members.get(name)
            if m is None or m.level != level:
                if m is not None or name not in excluded:
                    # Left the view (re-checked if it comes back) or came back elsewhere.
                    waiting.discard(name)
                continue
            old, old_status = m.cand, m.status
            self._prepare(m, now, evaluate=True)
            if old_status != m.status:  # cannot move at the same instant; kept exact anyway
                self._count(m.level, old_status, -1)
                self._count(m.level, m.status, 1)
            for index in self.indexes.values():
                index.change(m, m.level, old)

    def _set(self, m: Member, raw: Candidate, level: int, now: float, again: bool = True) -> None:
        old_level, old, old_status = m.level, m.cand, m.status
        old_raw = m.raw
        m.raw, m.level = raw, level
        if level != old_level and m.name in self._windows[old_level]:
            self._windows[old_level].discard(m.name)
            self._windows[level].add(m.name)
        if again or raw.snapshot is not old_raw.snapshot or m.stripped != self.strip:
            self._prepare(m, now)
        elif old is old_raw:
            m.cand = raw
        else:
            # Same snapshot, no timer due: the engine's rules would give the same snapshot,
            # staleness and weight (only counts moved). Measured: 0.9 µs saved per refresh.
            m.cand = raw.prepared(old.snapshot, old.stale, old.weight)
        if old_level != level or old_status != m.status:
            self._count(old_level, old_status, -1)
            self._count(level, m.status, 1)
        # Each index returns early when what it reads did not move (most touches move one
        # count, or bring a snapshot that changes no key).
        for index in self.indexes.values():
            index.change(m, old_level, old)

    def _count(self, level: int, status: int, step: int) -> None:
        self.count[level] += step
        if status == FRESH:
            self.fresh[level] += step
        elif status == STALE:
            self.stale[level] += step

    def _add(self, m: Member) -> None:
        self.members[m.name] = m
        self.by_pos[m.pos] = m
        self._count(m.level, m.status, 1)
        for index in self.indexes.values():
            index.add(m)

    def _drop(self, m: Member) -> None:
        del self.members[m.name]
        del self.by_pos[m.pos]
        self._count(m.level, m.status, -1)
        for index in self.indexes.values():
            index.remove(m)

    def exclude(self, names: frozenset[str]) -> list[Member]:
        """Take ``names`` out for one decision; :meth:`restore` puts them back."""
        out = [self.members[n] for n in names if n in self.members]
        for m in out:
            self._drop(m)
        return out

    def restore(self, members: list[Member], now: float) -> None:
        for m in members:
            self._add(m)
            if m.stripped != self.strip:  # rule 4 changed while it was out
                self._set(m, m.raw, m.level, now)

    def settle_mode(self, now: float) -> str | None:
        """Apply rule 4 for this decision; the fallback reason when it is in force."""
        level = self.min_level()
        strip = self.fresh[level] == 0
        if strip != self.strip:
            self.strip = strip
            if any(self.fresh) or any(self.stale):
                for m in list(self.members.values()):
                    self._set(m, m.raw, m.level, now)
        if not strip:
            return None
        return "all_stale" if self.stale[level] else "no_metrics"

    # --- reading ---------------------------------------------------------------------------
    def min_level(self) -> int:
        """The filter level of the candidates this decision chooses among."""
        count = self.count
        for level in range(LEVELS):
            if count[level]:
                return level
        return 0

    def index(self, tag: Hashable, factory: Callable[[], IndexT]) -> IndexT:
        """The index ``tag``, built by ``factory`` and filled on first use."""
        found = self.indexes.get(tag)
        if found is None:
            made = factory()
            for m in sorted(self.members.values(), key=lambda m: m.pos):
                made.add(m)
            self.indexes[tag] = made
            return made
        return found  # type: ignore[return-value]

    def ordering(self, tag: Hashable, key: Callable[[Candidate], tuple[float, ...]]) -> Ordering:
        """Candidates sorted by ``key`` (one ordering per ``tag``, which names the key)."""
        found = self.indexes.get(tag)
        if isinstance(found, Ordering):
            return found
        return self.index(tag, lambda: Ordering(key))

    def in_order(self) -> LevelSequence:
        """The candidates of this decision, in fleet order, indexable."""
        ordering = self.ordering("position", _no_key)
        return LevelSequence(ordering.items, self.count[self.min_level()])

    def candidates(self) -> list[Candidate]:
        """The candidates of this decision as a list (what the linear path would pass)."""
        return list(self.in_order())


def _no_key(c: Candidate) -> tuple[float, ...]:
    return ()


Entry = tuple[object, ...]
"""``(level, *key(candidate), position, member)``: flat, so comparing two costs less."""


class Ordering:
    """Members sorted by ``(level, key(candidate), position)``."""

    def __init__(self, key: Callable[[Candidate], tuple[float, ...]]) -> None:
        self.key = key
        self.items: list[Entry] = []
        self._entries: dict[str, Entry] = {}

    def add(self, m: Member) -> None:
        entry = (m.level, *self.key(m.cand), m.pos, m)
        self._entries[m.name] = entry
        bisect.insort(self.items, entry)

    def remove(self, m: Member) -> None:
        entry = self._entries.pop(m.name)
        del self.items[bisect.bisect_left(self.items, entry)]

    def change(self, m: Member, old_level: int, old: Candidate) -> None:
        entry = (m.level, *self.key(m.cand), m.pos, m)
        entries = self._entries
        was = entries[m.name]
        if entry == was:
            return  # e.g. a new snapshot a key does not read
        entries[m.name] = entry
        items = self.items
        del items[bisect.bisect_left(items, was)]
        bisect.insort(items, entry)

    def pick_min(self, rng: random.Random) -> Candidate:
        """The lowest key of the lowest level; ties uniformly at random, drawn exactly as
        :func:`~proxy.routing.select.pick_min` draws them over the same candidates."""
        items = self.items
        if not items:
            raise ValueError("no candidates")
        first = items[0]
        ties = bisect.bisect_right(items, (*first[:-2], math.inf))
        # rng.choice(best) is best[rng._randbelow(len(best))], as is rng.randrange(len(best)).
        entry = first if ties == 1 else items[rng.randrange(ties)]
        return entry[-1].cand  # type: ignore[attr-defined, no-any-return]


class LevelSequence(Sequence[Candidate]):
    """The first ``size`` entries of an ordering, as candidates (``random.sample`` indexes it)."""

    def __init__(self, items: list[Entry], size: int) -> None:
        self._items = items
        self._size = size

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | Sequence[Candidate]:
        if isinstance(i, slice):
            return [_cand(e) for e in self._items[: self._size][i]]
        if not -self._size <= i < self._size:
            raise IndexError(i)
        return _cand(self._items[i % self._size])

    def __iter__(self) -> Iterator[Candidate]:
        return (_cand(e) for e in self._items[: self._size])


def _cand(entry: Entry) -> Candidate:
    member = entry[-1]
    assert isinstance(member, Member)
    return member.cand


class WeightTree:
    """Per filter level, a sum tree of ``weight_of(candidate)`` over fleet positions."""

    def __init__(self, view: ModelView) -> None:
        self._view = view
        size = 1
        while size < max(1, len(view.source.positions)):
            size *= 2
        self._size = size
        self._trees: dict[int, list[float]] = {}

    def _set(self, level: int, pos: int, weight: float) -> None:
        tree = self._trees.get(level)
        if tree is None:
            tree = self._trees[level] = [0.0] * (2 * self._size)
        i = pos + self._size
        tree[i] = weight
        i //= 2
        while i:
            tree[i] = tree[2 * i] + tree[2 * i + 1]
            i //= 2

    def add(self, m: Member) -> None:
        self._set(m.level, m.pos, weight_of(m.cand))

    def remove(self, m: Member) -> None:
        self._set(m.level, m.pos, 0.0)

    def change(self, m: Member, old_level: int, old: Candidate) -> None:
        if old_level != m.level:
            self._set(old_level, m.pos, 0.0)
        elif old.weight == m.cand.weight:
            return
        self._set(m.level, m.pos, weight_of(m.cand))

    def pick(self, rng: random.Random) -> Candidate:
        """What ``rng.choices(candidates, weights)[0]`` picks: one ``rng.random()``, scaled by
        the total, located among the cumulative weights. Identical when the sums are exact
        (weights that are powers of two times small integers, as 1, 0.5, 0.25 are); with other
        weights the tree adds in another order than ``accumulate`` and a draw within rounding
        of a boundary can land on the neighbour."""
        view = self._view
        level = view.min_level()
        tree = self._trees[level]
        x = rng.random() * tree[1]
        i, acc, size = 1, 0.0, self._size
        while i < size:
            left = tree[2 * i]
            if x < acc + left:
                i = 2 * i
            else:
                acc += left
                i = 2 * i + 1
        m = view.by_pos.get(i - size)
        if m is None or m.level != level:
            # x rounded up to the total: like bisect's ``hi``, the last candidate.
            seq = view.in_order()
            return seq[len(seq) - 1]
        return m.cand


class Rotation:
    """Smooth weighted round robin without touching every candidate per pick.

    The linear form keeps ``current_i`` and adds ``w_i`` to each one per pick. Here
    ``current_i = b_i + w_i * t`` after ``t`` picks, so a pick only moves the chosen ``b``
    (``b -= Σ w``), and the largest ``current`` among candidates of one weight is the largest
    ``b``: one heap per distinct weight (a few: 1, the feedback steps, the stale penalty).
    State of a candidate absent from a decision (another filter level, excluded, out of the
    view) is dropped at that decision, and a newcomer draws its rank in fleet order, as in
    the linear form. Identical picks while
    the arithmetic is exact (power-of-two weights); with others ``b + w * t`` and repeated
    addition may round apart.
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.picks = 0
        self._state: dict[str, list[float]] = {}
        """name -> [b, weight, rank]"""
        self._heaps: dict[float, list[tuple[float, float, str]]] = {}
        self._weights: dict[float, int] = {}
        self._kept: list[set[str]] = [set() for _ in range(LEVELS + 1)]
        self._new: list[set[str]] = [set() for _ in range(LEVELS)]

    def add(self, m: Member) -> None:
        if m.name in self._kept[GONE]:
            self._kept[GONE].discard(m.name)
            self._kept[m.level].add(m.name)
            self._reweigh(m)
        else:
            self._new[m.level].add(m.name)

    def remove(self, m: Member) -> None:
        self._new[m.level].discard(m.name)
        if m.name in self._state:
            self._kept[m.level].discard(m.name)
            self._kept[GONE].add(m.name)

    def change(self, m: Member, old_level: int, old: Candidate) -> None:
        if m.name not in self._state:
            self._new[old_level].discard(m.name)
            self._new[m.level].add(m.name)
            return
        if old_level != m.level:
            self._kept[old_level].discard(m.name)
            self._kept[m.level].add(m.name)
        self._reweigh(m)

    def _reweigh(self, m: Member) -> None:
        st = self._state[m.name]
        weight = weight_of(m.cand)
        if weight != st[1]:
            t = self.picks
            b = st[0] + st[1] * t - weight * t
            self._forget(m.name)
            self._keep(m.name, b, weight, st[2])

    def _keep(self, name: str, b: float, weight: float, rank: float) -> None:
        self._state[name] = [b, weight, rank]
        self._weights[weight] = self._weights.get(weight, 0) + 1
        heapq.heappush(self._heaps.setdefault(weight, []), (-b, -rank, name))

    def _forget(self, name: str) -> None:
        weight = self._state.pop(name)[1]
        left = self._weights[weight] - 1
        if left:
            self._weights[weight] = left
        else:
            del self._weights[weight]
            del self._heaps[weight]

    def choose(self, view: ModelView) -> Candidate:
        level = view.min_level()
        for other in range(LEVELS + 1):
            if other != level and self._kept[other]:
                for name in self._kept[other]:
                    self._forget(name)
                    if other != GONE:
                        self._new[other].add(name)
                self._kept[other].clear()
        t = self.picks
        if self._new[level]:
            members = view.members
            for name in sorted(self._new[level], key=lambda n: members[n].pos):
                weight = weight_of(members[name].cand)
                self._keep(name, -weight * t, weight, self._rng.random())
                self._kept[level].add(name)
            self._new[level].clear()
        total = sum(w * n for w, n in self._weights.items())
        best: tuple[float, float] | None = None
        best_name = ""
        for weight, heap in self._heaps.items():
            while True:
                neg_b, neg_rank, name = heap[0]
                st = self._state.get(name)
                if st is not None and st[1] == weight and st[0] == -neg_b and st[2] == -neg_rank:
                    break
                heapq.heappop(heap)
            key = (-neg_b + weight * (t + 1), -neg_rank)
            if best is None or key > best:
                best, best_name = key, name
            if len(heap) > 2 * self._weights[weight] + 16:
                self._heaps[weight] = [
                    (-s[0], -s[2], n) for n, s in self._state.items() if s[1] == weight
                ]
                heapq.heapify(self._heaps[weight])
        if best is None:
            raise ValueError("no candidates")
        st = self._state[best_name]
        st[0] -= total
        heapq.heappush(self._heaps[st[1]], (-st[0], -st[2], best_name))
        self.picks = t + 1
        return view.members[best_name].cand
