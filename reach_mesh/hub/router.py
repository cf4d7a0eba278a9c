"""Pick a live agent for one request and say why.

Stages (each recorded in the :class:`RouteDecision` when ``explain`` is asked for):
candidates (by id, or capability/selector through the inverted index) → filters (state, lease,
breaker, capability health, health score, tried already) → fallback tiers (saturated, then
SUSPECT) → region/zone preference → sticky session → strategy.

``decide`` runs on the event loop for every request, so the common path allocates little: the
pydantic :class:`RouteDecision` is built only when it is returned (``explain``/``dry_run``) or on
a miss, a lone remaining candidate is taken without scoring, and load-based strategies look at a
bounded random sample of a very large candidate set (see :data:`SAMPLE_SIZE`).
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from reach_mesh._nats import has_identity
from reach_mesh.config import MeshSettings
from reach_mesh.errors import NoMatchError, ReachError, UnknownNamespaceError
from reach_mesh.hub.breaker import DEAF, BreakerState
from reach_mesh.hub.index import Matches
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.strategies import (
    Candidate,
    LeastLoaded,
    LoadWeights,
    Strategy,
    get_strategy,
    least_of,
    load_score,
    prefer_region,
    raw_load_score,
)
from reach_mesh.models import AgentState, FilteredAgent, RouteDecision, RouteRequest
from reach_mesh.selector import Selector

__all__ = ["EXPLAIN_CANDIDATES", "SAMPLE_SIZE", "Choice", "Router"]

_HEALTH_MIN: Final = 60.0
#: Agents an explanation looks at beyond the matched ones (rare paths, bounded cost).
_SCAN_LIMIT: Final = 10_000
#: How a filter reason for an agent of another namespace starts.
_OTHER_NS: Final = "namespace "
#: Candidates a load-based strategy (least_loaded, power_of_two, weighted_random) looks at when
#: a target matches more agents than this: a random sample of this size, taken before filtering
#: (the full set is scanned only when the sample leaves nobody routable). Picking the least
#: loaded of 64 random agents spreads load about as well as of all of them, at a constant cost.
#: round_robin and consistent_hash need the whole set (a rotation / the key's owner), and a
#: region/zone preference may hinge on a few agents, so those always scan everything.
SAMPLE_SIZE: Final = 64
_SAMPLED_STRATEGIES: Final = frozenset({"least_loaded", "power_of_two", "weighted_random"})
#: Candidate ids listed in an explained decision; ``candidate_count`` gives the full number.
EXPLAIN_CANDIDATES: Final = 100
#: Filter verdicts that are not exclusions but fallback tiers.
_SUSPECT: Final = "suspect"
_SATURATED: Final = "saturated"
_UNHEALTHY: Final = "unhealthy"
#: Not heard from since a task found nobody subscribed to its subject: with the SUSPECT ones.
_UNREACHED: Final = "unreached"
#: Why a draining agent takes nothing new, for a caller that named it (``agent_id``).
_DRAINING: Final = (
    "state DRAINING (stopping, or restarting: no new work; a restart registers it again, ask "
    "again with the same task_id then, or route by capability)"
)


@dataclass(slots=True)
class Choice:
    """The router's answer: the agent, the capability to call, and (explain only) the decision.

    ``alternates`` are the next-best routable agents in preference order, filled only when
    asked for (direct mode: the caller may spread over them and fail over without a hub trip).
    """

    view: AgentView
    capability: str | None
    elapsed_us: float
    decision: RouteDecision | None = None
    alternates: list[AgentView] = field(default_factory=list)


#: States that keep new work from an agent but not a retry of a task it may hold (``_filter``).
_HOLDER_STATES: Final = frozenset(
    {AgentState.QUARANTINED, AgentState.DRAINING, AgentState.CORDONED}
)


class Router:
    def __init__(
        self,
        registry: Registry,
        settings: MeshSettings,
        hub_id: str,
        *,
        weights: LoadWeights | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._hub_id = hub_id
        self._weights = weights or LoadWeights(
            inflight=settings.load_weight_inflight,
            queue=settings.load_weight_queue,
            pressure=settings.load_weight_pressure,
            saturation=settings.load_saturation,
        )
        self._rng = rng or random.Random()
        # One instance per name: round_robin keeps its position across requests.
        self._strategies: dict[str, Strategy] = {}
        #: Whether answers may speak of other namespaces ("2 match in 'demo'", their agents
        #: and capabilities in explanations): without a NATS identity, where that helps a
        #: newcomer; never in secure mode, where namespaces are tenants kept apart.
        self.across_namespaces = not has_identity(settings)

    def decide(
        self,
        req: RouteRequest,
        namespace: str,
        request_id: str,
        *,
        exclude: frozenset[str] = frozenset(),
        sticky_agent: str | None = None,
        alternates: int = 0,
        only: str | None = None,
    ) -> Choice:
        """Choose an agent for ``req`` or raise ``NoMatchError`` carrying the decision.

        ``alternates``: also return up to that many other routable agents, best first.
        ``only``: that agent or none — among those ``req`` matches, admitted as any other
        (a task that may be in its hands already must not go to another, ``RoutingMixin``)
        except for its breaker, its drain and an operator's cordon: open (``QUARANTINED``) or
        half-open with its probe out, ``DRAINING`` or ``CORDONED``, it is still admitted, and
        given no probe (unless the breaker opened because it was found deaf: nobody listens
        on its subjects). The breaker keeps new work from an agent that
        fails it; a retry of a task it holds is none — its idempotency table answers from
        the run in hand or its result, no handler runs — and another agent would run the
        task a second time. (Breakers are each hub's own: the secure chaos run's
        ``node_kill``, seed 158 — a caller's resend reached the one hub whose breaker had
        quarantined the holder, and ran on another agent.) So is the agent a request names
        (``agent_id``) with ``after_attempt``: the retry of a task that timed out there (the
        ``Client``'s pin after ``REACH_TIMEOUT``) — its breaker, opened by those very
        timeouts, or a cordon does not turn it away (a drain still does: the caller is told).
        """
        t0 = time.perf_counter()
        reg = self._registry
        forced = req.agent_id is not None
        ids, selector, capability = self._targets(req, namespace)
        if only is not None:
            ids = (only,) if only in ids else ()
        strategy_name = req.strategy or self._settings.default_strategy
        strategy = self._strategy(strategy_name)
        explain = req.explain or req.dry_run

        pool: Collection[str] = ids
        sampled = False
        if (
            len(ids) > SAMPLE_SIZE
            and strategy_name in _SAMPLED_STRATEGIES
            and req.region is None
            and req.zone is None
        ):
            if isinstance(ids, Matches):
                pool = ids.sample(self._rng, SAMPLE_SIZE)
            else:
                pool = self._rng.sample(tuple(ids), SAMPLE_SIZE)
            if sticky_agent is not None and sticky_agent in ids and sticky_agent not in pool:
                pool.append(sticky_agent)  # a sticky session must not lose to the dice
            sampled = True
        # ``only``, or the retry of a task that timed out on the agent the caller names
        # (``after_attempt``, the ``Client``'s pin after a ``REACH_TIMEOUT``): that agent may
        # hold it. Turned away for its breaker, the caller routed it as new and it ran on
        # another agent too (secure chaos run ``partition``, seed 168).
        held = only is not None or (forced and bool(req.after_attempt) and req.task_id is not None)
        live, tier, filtered = self._admit(
            pool, namespace, capability, forced, exclude, explain, held
        )
        if not live and sampled:
            # The sample was unlucky (or most of the set is unroutable): look at everything.
            sampled = False
            live, tier, filtered = self._admit(
                ids, namespace, capability, forced, exclude, explain, held
            )
        if not live:
            elapsed = (time.perf_counter() - t0) * 1e6
            decision = self._decision(request_id, req, selector, strategy_name, ids, sampled)
            decision.elapsed_us = elapsed
            if filtered is None:  # explain was off: redo the pass that says why
                filtered = self._admit(ids, namespace, capability, forced, exclude, True, held)[2]
            raise self._no_match(req, namespace, decision, filtered or [], selector, ids)

        chosen: AgentView | None = None
        sticky: Literal["hit", "miss", "none"] = "none"
        if sticky_agent is not None:
            chosen = next((v for v in live if v.agent_id == sticky_agent), None)
            sticky = "hit" if chosen is not None else "miss"
        scores: dict[str, float] | None = None
        cands: list[Candidate] | None = None
        if chosen is None:
            if len(live) == 1 and not explain:
                chosen = live[0]  # nothing to compare: skip building and scoring candidates
            elif not explain and type(strategy) is LeastLoaded and not (req.region or req.zone):
                chosen = self._least_loaded(live)  # the same choice, no Candidate per agent
            else:
                now = reg.now
                cands = [self._candidate(v, now) for v in live]
                narrowed = cands
                if req.region or req.zone:
                    narrowed = list(prefer_region(cands, req.region, req.zone))
                pick, scores = strategy.choose(
                    narrowed, req.hash_key or req.session_id, self._weights, self._rng
                )
                chosen = reg.agents[pick.agent_id]
        if not req.dry_run and not held and chosen.breaker.state is BreakerState.HALF_OPEN:
            # Hand out the single probe; a dry run (``route``, ``--dry-run``) sends nothing,
            # so it must not take it from the next real request, nor a task's holder, whose
            # answer from its idempotency table says nothing of its health.
            chosen.breaker.allow()
        others: list[AgentView] = []
        if alternates > 0 and len(live) > 1:
            others = self._alternates(live, chosen, cands, alternates)
        elapsed = (time.perf_counter() - t0) * 1e6
        choice = Choice(view=chosen, capability=capability, elapsed_us=elapsed, alternates=others)
        if explain:
            decision = self._decision(request_id, req, selector, strategy_name, ids, sampled)
            decision.filtered = (filtered or []) + self._unselected(selector, ids, namespace)
            decision.fallback = tier
            decision.sticky = sticky
            if scores is not None:
                decision.scores = {k: round(v, 4) for k, v in scores.items()}
            decision.chosen = chosen.agent_id
            decision.elapsed_us = elapsed
            choice.decision = decision
        return choice

    def decide_many(
        self,
        req: RouteRequest,
        namespace: str,
        count: int,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[list[AgentView], str | None]:
        """Up to ``count`` agents for ``count`` tasks of ``req``, each counted at once
        (``outstanding``, as ``StepPlacing._choose`` counts a step's), and the capability to
        call: the agents ``count`` calls of :meth:`decide` would choose, one after another
        with each choice counted before the next — the same filters, scores, ties and draws
        from the router's rng — with the candidates looked up, admitted and scored once, and
        only the chosen agent scored (and admitted) again after each choice.

        For ``least_loaded`` without an explanation, region or zone, over a target that is
        not sampled (at most :data:`SAMPLE_SIZE` matches) and whose routable agents all take
        durable work (``card.durable_work``): otherwise, or when an agent the route names is
        asked for, no agents and nothing counted — the caller decides one at a time. Fewer
        than ``count`` when the routable tier runs out (the rest fall back to saturated or
        SUSPECT agents, :meth:`decide`'s fallback tiers). Never raises for a route
        :meth:`decide` refuses: no agents, and :meth:`decide` says why."""
        if (
            count < 1
            or req.agent_id is not None
            or req.explain
            or req.dry_run
            or req.region
            or req.zone
            or type(self._strategy(req.strategy or self._settings.default_strategy))
            is not LeastLoaded
        ):
            return [], None
        try:
            ids, _, capability = self._targets(req, namespace)
        except ReachError:
            return [], None
        if len(ids) > SAMPLE_SIZE:
            return [], None
        live, tier, _ = self._admit(ids, namespace, capability, False, exclude, False)
        if tier is not None or not live or not all(v.record.card.durable_work for v in live):
            return [], None
        now = self._registry.now
        scores = self._scores(live, now)
        chosen: list[AgentView] = []
        while len(chosen) < count:
            view = live[0] if len(live) == 1 else least_of(live, scores, self._rng)
            if view.breaker.state is BreakerState.HALF_OPEN:
                view.breaker.allow()  # its single probe, as ``decide`` hands it out
            view.outstanding += 1
            chosen.append(view)
            i = live.index(view)
            if self._filter(view, namespace, capability, False, exclude) is None:
                scores[i] = self._scores([view], now)[0]
                continue
            # Saturated by its new task, or its probe taken: no longer in the routable tier.
            del live[i], scores[i]
            if not live:
                break
        return chosen, capability

    def _targets(
        self, req: RouteRequest, namespace: str
    ) -> tuple[Collection[str], Selector | None, str | None]:
        """The agent ids ``req`` names or matches in ``namespace``, its parsed selector, and
        the capability to call."""
        reg = self._registry
        if req.agent_id is not None:
            return ((req.agent_id,) if req.agent_id in reg.agents else ()), None, req.capability
        if req.capability is not None:
            # Bitmaps of the namespace's agents only: a request never scans (nor samples)
            # another tenant's fleet. Counted and sampled below without a set of every match.
            return reg.index.capable(req.capability, namespace), None, req.capability
        assert req.selector is not None
        selector = Selector.parse(req.selector)  # parse results are cached (lru)
        return reg.index.select(selector, namespace), selector, selector.task_capability

    def _strategy(self, name: str) -> Strategy:
        """The strategy instance of ``name`` (one per name: round_robin keeps its position)."""
        strategy = self._strategies.get(name)
        if strategy is None:
            strategy = self._strategies[name] = get_strategy(name)
        return strategy

    def _admit(
        self,
        ids: Collection[str],
        namespace: str,
        capability: str | None,
        forced: bool,
        exclude: frozenset[str],
        explain: bool,
        held: bool = False,
    ) -> tuple[list[AgentView], str | None, list[FilteredAgent] | None]:
        """Filter ``ids`` into the routable tier: (routable agents, fallback tier, filtered).

        Tiers, best first: unsaturated ONLINE agents; else the *saturated* ones (at
        ``max_concurrency`` by this hub's count: they queue up to their ``max_queue`` and answer
        ``REACH_AGENT_BUSY`` when really full, which the hub retries elsewhere — better than
        ``REACH_NO_MATCH``, which a caller must not retry); else the *unhealthy* ones (health
        below 60: a burst of BUSY refusals costs 20 points each, and an agent that is never
        routed never earns them back); else SUSPECT ones (lease lapsed, maybe gone) and
        unreachable ones (a task found nobody on their subject since they were last heard:
        gone, or reconnecting). The
        fallback tiers yield one agent each, the least loaded / healthiest. ``filtered``
        (reasons) is built only when ``explain``.
        """
        agents = self._registry.agents
        live: list[AgentView] = []
        saturated: list[AgentView] = []
        unhealthy: list[AgentView] = []
        suspects: list[AgentView] = []
        filtered: list[FilteredAgent] | None = [] if explain else None
        for agent_id in ids:
            view = agents.get(agent_id)
            if view is None:
                continue
            reason = self._filter(view, namespace, capability, forced, exclude, held)
            if reason is None:
                live.append(view)
                continue
            if reason == _SATURATED:
                saturated.append(view)
                if filtered is not None:
                    card = view.record.card
                    filtered.append(
                        FilteredAgent(
                            agent_id=agent_id,
                            reason=f"at capacity ({view.busy}/{card.max_concurrency})",
                        )
                    )
            elif reason == _UNHEALTHY:
                unhealthy.append(view)
                if filtered is not None:
                    score = view.health.value
                    filtered.append(
                        FilteredAgent(
                            agent_id=agent_id, reason=f"health {score:g} < {_HEALTH_MIN:g}"
                        )
                    )
            elif reason in (_SUSPECT, _UNREACHED):
                suspects.append(view)
                if filtered is not None:
                    why = (
                        "SUSPECT (lease lapsed)"
                        if reason == _SUSPECT
                        else "unreachable (nobody on its task subject since it was last heard)"
                    )
                    filtered.append(FilteredAgent(agent_id=agent_id, reason=why))
            elif filtered is not None:
                if view.state is AgentState.QUARANTINED and view.breaker.reason:
                    # Why its breaker opened, as `agents`/`inspect` say it: the explanation
                    # is where an operator asks why an agent gets no work.
                    reason = f"{reason} (breaker open: {view.breaker.reason})"
                filtered.append(FilteredAgent(agent_id=agent_id, reason=reason))
        if live:
            return live, None, filtered
        if saturated:
            # Least loaded first, as one candidate: the strategy has nothing useful to weigh.
            best = min(saturated, key=lambda v: v.busy / v.record.card.max_concurrency)
            return [best], _SATURATED, filtered
        if unhealthy:
            return [max(unhealthy, key=lambda v: v.health.value)], _UNHEALTHY, filtered
        if suspects:
            return suspects, _SUSPECT, filtered
        return [], None, filtered

    def _filter(
        self,
        view: AgentView,
        namespace: str,
        capability: str | None,
        forced: bool,
        exclude: frozenset[str],
        held: bool = False,
    ) -> str | None:
        """Why ``view`` cannot take this request, or None. ``"saturated"``, ``"unhealthy"``,
        ``"suspect"`` and ``"unreached"`` mean fallback only. ``held``: ``view`` may hold the
        task (``decide``'s ``only``): its breaker (``QUARANTINED``, half-open with its probe
        out), a drain or an operator's cordon does not keep it out (each keeps new work from
        it; the agent answers a task it holds from its idempotency table before it looks at
        its drain), unless its breaker opened because it was found deaf."""
        if view.agent_id in exclude:
            return "already tried for this request"
        card = view.record.card
        # agent ids are <namespace>.<service>.<instance>: a prefix test, no split per agent.
        if not view.agent_id.startswith(namespace) or view.agent_id[len(namespace)] != ".":
            return f"{_OTHER_NS}{card.namespace} != {namespace}"
        state = view.state
        if state is AgentState.SUSPECT:
            return _SUSPECT
        if state is AgentState.DRAINING and forced:
            return _DRAINING  # named by the caller: say what to do about it
        # A holder found deaf stays out: nobody listens on its subjects, it cannot answer.
        # (Asked on its ctl subject before the route is decided, ``_ask_deaf_holder``: one
        # that answers is not deaf, its breaker closed, ``Registry.answered_on_ctl``.)
        held = held and view.breaker.why != DEAF
        if state is not AgentState.ONLINE and not (held and state in _HOLDER_STATES):
            return f"state {state.value}"
        if (
            not held
            and view.breaker.state is BreakerState.HALF_OPEN
            and not view.breaker.probe_available
        ):
            return "breaker half-open, probe in flight"
        if capability is not None and capability in view.unavailable:
            return f"reports {capability} unavailable"
        if view.unreached_at > view.spoke_at:
            return _UNREACHED  # (after the exclusions: a fallback tier must not undo them)
        if forced:
            return None  # the caller chose this agent: capacity and health are its call
        if view.health.value < _HEALTH_MIN:
            return _UNHEALTHY
        if view.busy >= card.max_concurrency:
            return _SATURATED
        return None

    def _least_loaded(self, live: list[AgentView]) -> AgentView:
        """:class:`LeastLoaded`'s choice among ``live`` (as ``strategy.choose`` over their
        ``_candidate`` s: the same scores, ties, and draw from the router's rng), without a
        :class:`Candidate` or a scores dict per agent — the engine's per-step path."""
        return least_of(live, self._scores(live, self._registry.now), self._rng)

    def _scores(self, views: list[AgentView], now: float) -> list[float]:
        """The least-loaded score of each of ``views`` at ``now`` (``load_score`` of its
        ``_candidate``)."""
        w = self._weights
        return [
            raw_load_score(
                round(v.estimated_inflight(now)),
                v.record.card.max_concurrency,
                v.queue_depth,
                v.pressure,
                w,
            )
            for v in views
        ]

    def _alternates(
        self,
        live: list[AgentView],
        chosen: AgentView,
        cands: list[Candidate] | None,
        n: int,
    ) -> list[AgentView]:
        """Up to ``n`` routable agents other than ``chosen``, least loaded first."""
        if cands is None:
            now = self._registry.now
            cands = [self._candidate(v, now) for v in live]
        w = self._weights
        ranked = sorted(
            (c for c in cands if c.agent_id != chosen.agent_id),
            key=lambda c: load_score(c, w),
        )
        agents = self._registry.agents
        return [agents[c.agent_id] for c in ranked[:n]]

    def _decision(
        self,
        request_id: str,
        req: RouteRequest,
        selector: Selector | None,
        strategy: str,
        ids: Collection[str],
        sampled: bool,
    ) -> RouteDecision:
        if req.agent_id is not None:
            target = f"agent_id={req.agent_id}"
        elif req.capability is not None:
            target = f"cap={req.capability}"
        else:
            target = str(selector)
        listed = sorted(ids)[:EXPLAIN_CANDIDATES] if len(ids) > EXPLAIN_CANDIDATES else sorted(ids)
        return RouteDecision(
            request_id=request_id,
            hub_id=self._hub_id,
            target=target,
            strategy=strategy,
            candidates=listed,
            candidate_count=len(ids),
            sampled=SAMPLE_SIZE if sampled else None,
        )

    @staticmethod
    def _candidate(view: AgentView, now: float) -> Candidate:
        card = view.record.card
        return Candidate(
            agent_id=view.agent_id,
            inflight=round(view.estimated_inflight(now)),
            max_concurrency=card.max_concurrency,
            queue_depth=view.queue_depth,
            pressure=view.pressure,
            weight=card.weight,
            region=card.region,
            zone=card.zone,
        )

    def _no_match(
        self,
        req: RouteRequest,
        namespace: str,
        decision: RouteDecision,
        filtered: list[FilteredAgent],
        selector: Selector | None,
        ids: Collection[str],
    ) -> NoMatchError:
        reg = self._registry
        nearest: dict[str, object] = {}
        partial: list[tuple[str, str]] = []
        if selector is None and req.capability is not None:
            selector = Selector.parse(f"cap={req.capability}")
        if selector is not None:
            near = reg.index.nearest(
                selector, namespace=None if self.across_namespaces else namespace
            )
            partial = near.partial
            nearest = {
                "partial": [{"agent_id": a, "failed": t} for a, t in partial],
                "similar_capabilities": near.similar_capabilities,
                "similar_values": near.similar_values,
            }
            if near.similar_keys:
                nearest["similar_keys"] = near.similar_keys
        decision.filtered = filtered + self._unselected(selector, ids, namespace)
        decision.nearest = nearest or None
        here = [f for f in filtered if not f.reason.startswith(_OTHER_NS)]
        if req.agent_id is not None and not filtered:
            msg = self._registry.not_registered(req.agent_id).message
        elif here:
            msg = f"no routable agent for {decision.target}: " + "; ".join(
                f"{f.agent_id}: {f.reason}" for f in here[:5]
            )
        else:
            msg = f"no agent in namespace {namespace!r} matches {decision.target}"
        elsewhere = self.elsewhere(req, namespace) if not here else {}
        if elsewhere:
            msg += "; " + _elsewhere_sentence(namespace, elsewhere).split("; ", 1)[1]
            nearest["other_namespaces"] = elsewhere
        similar = nearest.get("similar_capabilities")
        if isinstance(similar, list) and similar:
            msg += f"; did you mean {' or '.join(similar[:3])}?"
        values = nearest.get("similar_values")
        if isinstance(values, dict) and values:
            # A misspelled label value ("region=eu-wset"): the values agents do have.
            close = [f"{k}={v}" for k, vs in values.items() for v in vs[:3]]
            msg += f"; did you mean {' or '.join(close[:3])}?"
        keys = nearest.get("similar_keys")
        if isinstance(keys, dict) and keys and selector is not None:
            # A misspelled label key ("regin=eu-west"): no agent has it at all.
            msg += "; " + _key_hint(selector, keys)
        if msg.endswith(decision.target) and selector is not None:
            # No hint yet ("tier=silver", values nothing like the agents'): the agents of this
            # namespace that fail one term only, and which (``partial`` may be of every one).
            if self.across_namespaces:
                partial = reg.index.nearest(selector, limit=3, namespace=namespace).partial
            if partial:
                msg += "; nearest: " + ", ".join(f"{a} fails only {t}" for a, t in partial[:3])
        if req.selector is not None and _COMMA_TERMS.search(req.selector):
            # Kubernetes' "region=eu-west,gpu=true": one value with a comma in it, here.
            joined = _COMMA_TERMS.sub(" AND ", req.selector)
            msg += f"; terms are joined with AND, not a comma: {joined}"
        return NoMatchError(msg, decision=decision.model_dump(exclude_none=True), **nearest)

    def _unselected(
        self, selector: Selector | None, ids: Collection[str], namespace: str
    ) -> list[FilteredAgent]:
        """For an explanation: agents of ``namespace`` that serve the selector's capability
        but that its other terms removed, each with the first term it fails ("why not that
        one?"). At most ``EXPLAIN_CANDIDATES``; explain and no-match paths only."""
        caps = selector.capabilities if selector is not None else ()
        if selector is None or not caps:
            return []
        reg = self._registry
        out: list[FilteredAgent] = []
        for n, agent_id in enumerate(reg.index.capable(caps[0], namespace)):
            if len(out) >= EXPLAIN_CANDIDATES or n >= _SCAN_LIMIT:
                break
            if agent_id in ids:
                continue
            view = reg.agents.get(agent_id)
            if view is None:
                continue
            card = view.record.card
            labels = card.all_labels()
            failed = next(
                (t for t in selector.terms if not t.matches(card.capabilities, labels)), None
            )
            if failed is not None:
                out.append(FilteredAgent(agent_id=agent_id, reason=f"selector: {failed} not met"))
        return out

    def namespace_hint(self, req: RouteRequest, namespace: str) -> str | None:
        """A sentence when agents of other namespaces (only) match ``req``, else None."""
        counts = self.elsewhere(req, namespace)
        if not counts:
            return None
        return _elsewhere_sentence(namespace, counts)

    def unknown_namespace(self, req: RouteRequest, namespace: str) -> UnknownNamespaceError:
        """The error for a request to a namespace with no agent that no setting names: where
        matching agents are instead, and similar capabilities (bounded work; nothing kept)."""
        details: dict[str, object] = {"namespace": namespace}
        msg = f"namespace {namespace!r} has no registered agent and is not configured on this hub"
        counts = self.elsewhere(req, namespace)
        if counts:
            msg = _elsewhere_sentence(namespace, counts)
            details["other_namespaces"] = counts
        selector = Selector.parse(req.selector) if req.selector is not None else None
        if selector is None and req.capability is not None:
            selector = Selector.parse(f"cap={req.capability}")
        if selector is not None and self.across_namespaces:
            similar = self._registry.index.nearest(selector).similar_capabilities
            if similar:
                msg += f"; did you mean {' or '.join(similar[:3])}?"
                details["similar_capabilities"] = similar
        return UnknownNamespaceError(msg, **details)

    def matching(self, req: RouteRequest, namespace: str) -> Collection[str]:
        """Ids of ``namespace``'s agents that ``req`` targets by capability or selector,
        routable or not (none for a bad selector: its route fails when it decides)."""
        index = self._registry.index
        try:
            if req.capability is not None:
                return index.capable(req.capability, namespace)
            if req.selector is not None:
                return index.select(Selector.parse(req.selector), namespace)
        except ReachError:
            pass
        return ()

    def matching_lost(self, req: RouteRequest, namespace: str, most: int) -> list[str]:
        """Ids of ``namespace``'s agents declared LOST lately and not registered again whose
        registration ``req`` targeted by capability or selector (as :meth:`matching` for the
        registered: the capability declared, or the selector's reference semantics the index
        implements), newest first, ``most`` at most; none for a bad selector."""
        match: Callable[[Collection[str], Mapping[str, str]], bool]
        if req.capability is not None:
            capability = req.capability

            def match(capabilities: Collection[str], _: Mapping[str, str]) -> bool:
                return capability in capabilities

        elif req.selector is not None:
            try:
                match = Selector.parse(req.selector).matches
            except ReachError:
                return []
        else:
            return []
        return self._registry.lost_matching(namespace, match, most)

    def _ids(self, req: RouteRequest) -> Collection[str]:
        """Agent ids (of any namespace) that could serve ``req`` by its target."""
        reg = self._registry
        if req.agent_id is not None:
            return (req.agent_id,)
        if req.capability is not None:
            return reg.index.by_capability(req.capability)
        if req.selector is not None:
            return reg.index.select(Selector.parse(req.selector))
        return ()

    def elsewhere(
        self, req: RouteRequest, namespace: str, limit: int = _SCAN_LIMIT
    ) -> dict[str, int]:
        """Online agents that could serve ``req`` in namespaces other than ``namespace``,
        counted per namespace, most first: why a request found nothing in its own namespace.
        Empty, and nothing looked at, in secure mode (``across_namespaces``)."""
        counts: dict[str, int] = {}
        if not self.across_namespaces:
            return counts
        agents = self._registry.agents
        for n, agent_id in enumerate(self._ids(req)):
            if n >= limit:
                break
            view = agents.get(agent_id)
            if view is None or view.state is not AgentState.ONLINE:
                continue
            ns = view.record.card.namespace
            if ns != namespace:
                counts[ns] = counts.get(ns, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _elsewhere_sentence(namespace: str, counts: dict[str, int]) -> str:
    """``no agent in namespace 'a' matches; 1 match in 'b' (ask namespace 'b': …)``."""
    where = ", ".join(f"{n} match in {ns!r}" for ns, n in counts.items())
    top = next(iter(counts))
    return (
        f"no agent in namespace {namespace!r} matches; {where} "
        f"(ask namespace {top!r}: --namespace {top} / Client(namespace={top!r}))"
    )


#: A comma followed by what reads as another term (``,gpu=true``, ``, mem_gte=8``,
#: ``,gpu exists``): a bare value may hold commas, so the selector parsed, as one value.
_COMMA_TERMS: Final = re.compile(
    r"\s*,\s*(?=[a-z0-9][a-z0-9_.-]*(?:\s*!?=|\s+!?exists\b))", re.ASCII | re.IGNORECASE
)


def _key_hint(selector: Selector, keys: dict[str, list[str]]) -> str:
    """``no agent has a label 'regin' (did you mean region=eu-west?)`` for each key of
    ``keys`` (a misspelled key → the close keys agents have), the term rewritten with them."""
    out: list[str] = []
    seen: set[str] = set()
    for term in selector.terms:
        close = keys.get(term.key)
        if not close or term.key in seen:
            continue
        seen.add(term.key)
        tries = " or ".join(str(dataclasses.replace(term, key=k)) for k in close[:3])
        out.append(f"no agent has a label {term.key!r} (did you mean {tries}?)")
    return "; ".join(out)
