"""The router: per-model policies plus the rules every policy runs under.

Rules, in order, for each decision:

1. No candidates: :class:`NoCandidatesError` (frontends answer 503 / UNAVAILABLE).
2. Staleness is judged here, from the injected clock and ``RoutingConfig.stale_after_s``; the
   caller's ``Candidate.stale`` is overwritten.
3. ``weight = caller's weight * feedback weight * (stale_weight if stale)``, at least
   ``MIN_WEIGHT``. Stale is a penalty, never an exclusion.
4. When no candidate has a fresh snapshot, every snapshot is removed (and the stale penalty
   with it) so policies compare the proxy's own in-flight counts only.
5. The model's policy picks; the decision is counted and timed in :class:`RoutingStats`.

Two paths make the same decision: :meth:`Router.choose` prepares a whole candidate list and
runs the policy's linear ``choose`` (the definition, and the tests' oracle);
:meth:`Router.place` keeps one :class:`~proxy.routing.view.ModelView` per kind of request,
refreshed from the fleet's change journal, and runs the policy's ``choose_view`` on it
(sub-linear in the number of instances; what each policy keeps is in its docstring).
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from proxy.clock import Clock
from proxy.routing.base import Candidate, Policy, RouteRequest
from proxy.routing.config import RoutingConfig
from proxy.routing.feedback import InstanceFeedback
from proxy.routing.registry import build_policy
from proxy.routing.retry import RetryBudget
from proxy.routing.select import MIN_WEIGHT
from proxy.routing.view import FRESH, NO_SNAPSHOT, STALE, CandidateSource, ModelView, Shape

DecisionObserver = Callable[[str, str, str, float], None]
"""Called after each decision with (model, policy name, chosen instance, seconds taken)."""


class NoCandidatesError(LookupError):
    """No instance can take the request; the message says why."""


@dataclass
class RoutingStats:
    """Plain counters of routing decisions; telemetry reads them, tests assert on them."""

    decisions: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """``(model, policy, instance) -> decisions``."""
    decision_seconds: defaultdict[tuple[str, str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    """``(model, policy, instance) -> total seconds spent deciding``."""
    fallbacks: Counter[tuple[str, str]] = field(default_factory=Counter)
    """``(model, reason) -> count``; reasons: ``all_stale``, ``no_metrics``."""

    def record_decision(self, model: str, policy: str, instance: str, seconds: float) -> None:
        key = (model, policy, instance)
        self.decisions[key] += 1
        self.decision_seconds[key] += seconds

    def record_fallback(self, model: str, reason: str) -> None:
        self.fallbacks[(model, reason)] += 1


class LinearSource(Protocol):
    """Candidates for the linear path (``proxy.placement.FleetPlacement.filtered``)."""

    def filtered(self, request: RouteRequest, exclude: frozenset[str]) -> list[Candidate]: ...


class Router:
    """Chooses an instance for each request with the model's configured policy.

    One policy object per model (built on the model's first request), so stateful policies
    (round robin position, hash ring) keep separate state per model. A config reload builds a
    new Router; pass the same ``stats`` to keep counting.
    """

    def __init__(
        self,
        config: RoutingConfig,
        clock: Clock,
        rng: random.Random,
        stats: RoutingStats | None = None,
        observer: DecisionObserver | None = None,
    ) -> None:
        self.config = config
        self.stats = stats if stats is not None else RoutingStats()
        self.observer = observer
        self._clock = clock
        self._rng = rng
        self.feedback = (
            InstanceFeedback(config.feedback, clock) if config.feedback.enabled else None
        )
        self.retry_budget = RetryBudget(config.retry, clock)
        """Shared by every request routed here; ``record_request()`` / ``try_retry()``."""
        self._policies: dict[str, tuple[str, Policy]] = {}
        self._by_shape: dict[tuple[CandidateSource, Shape], ModelView] = {}
        self._views: dict[tuple[object, ...], ModelView] = {}

    def policy(self, model: str) -> tuple[str, Policy]:
        """``(policy name, policy)`` serving ``model``."""
        entry = self._policies.get(model)
        if entry is None:
            spec = self.config.policy_for(model)
            # Each policy gets its own generator: one model's traffic does not shift another's
            # random choices, and a seeded router stays reproducible.
            rng = random.Random(self._rng.getrandbits(64))
            entry = self._policies[model] = (spec.name, build_policy(spec.name, spec.params, rng))
        return entry

    def keeps_sessions(self, model: str) -> bool:
        """Whether ``model``'s policy places requests by their session key."""
        return self.policy(model)[1].keeps_sessions

    def packs_long(self, model: str) -> bool:
        """Whether ``model``'s policy gathers long work into a lane (``Policy.packs_long``)."""
        return self.policy(model)[1].packs_long

    def prepare_one(
        self, c: Candidate, model: str, now: float, strip: bool, evaluate: bool = True
    ) -> tuple[Candidate, int, float | None, float | None]:
        """One candidate as policies see it (rules 2-4; ``strip``: rule 4 applies), its
        snapshot's status (``NO_SNAPSHOT``, ``FRESH``, ``STALE``), when it turns stale (or
        None), and from when a feedback window may be evaluated on it (or None).
        ``evaluate=False`` reads the feedback weight without evaluating a window: a view
        evaluates only the candidates of a decision, as the linear path does."""
        snapshot = c.snapshot
        status = NO_SNAPSHOT
        stale_at: float | None = None
        limit = self.config.stale_after_s
        if snapshot is not None:
            if now - snapshot.taken_at > limit:
                status = STALE
            else:
                status, stale_at = FRESH, snapshot.taken_at + limit
        weight = c.weight
        feedback = self.feedback
        window_at: float | None = None
        if feedback is not None:
            if evaluate:
                weight *= feedback.weight(c.name, model, snapshot, now)
            else:
                weight *= feedback.current(c.name, model)
            window_at = feedback.due_at(c.name, model, snapshot)
        is_stale = status == STALE
        if strip:
            snapshot, is_stale = None, False
        elif is_stale:
            weight *= self.config.stale_weight
        weight = max(weight, MIN_WEIGHT)
        if snapshot is c.snapshot and is_stale == c.stale and weight == c.weight:
            return c, status, stale_at, window_at  # the common case
        return c.prepared(snapshot, is_stale, weight), status, stale_at, window_at

    def prepare(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Candidates as the policy will see them (rules 2-4 of the module docstring)."""
        now = self._clock.now()
        limit = self.config.stale_after_s
        stale = [c.snapshot is not None and now - c.snapshot.taken_at > limit for c in candidates]
        fresh = any(
            c.snapshot is not None and not s for c, s in zip(candidates, stale, strict=True)
        )
        if not fresh:
            reason = "all_stale" if any(stale) else "no_metrics"
            self.stats.record_fallback(request.model, reason)
        return [self.prepare_one(c, request.model, now, not fresh)[0] for c in candidates]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        """The chosen candidate (as prepared: match it to an instance by ``name``).

        The linear path: every candidate prepared, the policy's ``choose`` over the list. The
        proxy's requests go through :meth:`place`; this stays the definition it must match.
        """
        if not candidates:
            raise NoCandidatesError(f"no ready instance serves model '{request.model}'")
        # The whole decision is timed (engine rules + policy), with the CPU's clock: how long
        # it took is a measurement, not an input to any decision.
        began = time.perf_counter()
        prepared = self.prepare(request, candidates)
        name, policy = self.policy(request.model)
        chosen = policy.choose(prepared, request)
        self._record(request.model, name, chosen.name, time.perf_counter() - began)
        return chosen

    def place(
        self, request: RouteRequest, source: CandidateSource, exclude: frozenset[str] = frozenset()
    ) -> Candidate | None:
        """The decision :meth:`choose` would make on ``source``'s candidates for ``request``
        (after its per-request filters, less ``exclude``), from a view of them kept up to date
        by the fleet's change journal: the cost grows with what changed since the last decision
        and with log(instances), not with the number of instances. None: no candidate.

        The policy's ``keep_off`` instances are taken out first, like ``exclude``; only when
        none is left are they put back (:meth:`place_linear` is the same on the linear path)."""
        began = time.perf_counter()
        now = self._clock.now()
        name, policy = self.policy(request.model)
        keep = policy.keep_off(request)
        if keep:
            chosen = self._place(request, source, exclude | keep, name, policy, now, began)
            if chosen is not None:
                return chosen
        return self._place(request, source, exclude, name, policy, now, began)

    def place_linear(
        self, request: RouteRequest, source: LinearSource, exclude: frozenset[str] = frozenset()
    ) -> Candidate | None:
        """:meth:`place`'s decision by the linear path (:meth:`choose` over
        ``source.filtered``): what it must match. None: no candidate."""
        keep = self.policy(request.model)[1].keep_off(request)
        candidates = source.filtered(request, exclude | keep) if keep else []
        if not candidates:
            candidates = source.filtered(request, exclude)
        return self.choose(request, candidates) if candidates else None

    def _place(
        self,
        request: RouteRequest,
        source: CandidateSource,
        exclude: frozenset[str],
        name: str,
        policy: Policy,
        now: float,
        began: float,
    ) -> Candidate | None:
        key = (source, request.model, request.class_name, request.class_cap, request.level)
        view = self._views.get(key)
        if view is None:
            shape = Shape.of(request, policy.reads_ahead or source.slots_by_level(request.model))
            view = self._by_shape.get((source, shape))
            if view is None:
                view = ModelView(source, shape.request(request), self)
                self._by_shape[(source, shape)] = view
            # Several keys may share one view (a class without a cap, a level the policy
            # does not read): the plain tuple is what each request pays to find it.
            self._views[key] = view
        view.sync(now)
        removed = view.exclude(exclude) if exclude else []
        try:
            if not view.members:
                return None
            reason = view.settle_mode(now)
            if reason is not None:
                self.stats.record_fallback(request.model, reason)
            view.evaluate_feedback(now, exclude)
            chosen = policy.choose_view(view, request)
        finally:
            if removed:
                view.restore(removed, now)
        self._record(request.model, name, chosen.name, time.perf_counter() - began)
        return chosen

    def _record(self, model: str, policy: str, instance: str, seconds: float) -> None:
        self.stats.record_decision(model, policy, instance, seconds)
        if self.observer is not None:
            self.observer(model, policy, instance, seconds)
