"""Placing a workflow step: which agent takes an attempt, and why none does.

:class:`StepPlacing` is the base of :class:`~reach_mesh.hub._steps.StepRunner`: it chooses the
agents of the attempts a workflow sends at its start and of every later attempt (through the
hub's router, with agents that have no durable work consumer left out, the load counted at
once), and words why a step waits or timed out unplaced.
"""

from __future__ import annotations

from reach_mesh.errors import BadRequestError, NoMatchError, ReachError
from reach_mesh.hub._step_state import Unroutable, Workflow, step_route
from reach_mesh.hub._wf_events import WorkflowEvents
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.router import Router
from reach_mesh.models import ErrorBody, RouteRequest, TaskState
from reach_mesh.selector import Selector
from reach_mesh.workflow import StepSpec, TaskRecord

__all__ = ["StepPlacing"]


class StepPlacing(WorkflowEvents):
    """Chooses agents for steps (a base of ``StepRunner``; ``WorkflowEngine`` sets every
    attribute below)."""

    _registry: Registry
    _router: Router
    #: Agents registered with ``durable_work=False`` (no work consumer): never offered a
    #: step. Kept from state changes so choosing a step does not scan the registry.
    _no_work: set[str]

    async def _first_choices(self, wf: Workflow) -> None:
        """Choose the agents of the attempts sent when the workflow starts (every fanout step,
        a chain's step 0), before the workflow record names them (``first_agents``)."""
        starting = wf.spec.steps if wf.spec.kind == "fanout" else wf.spec.steps[:1]
        first: list[tuple[AgentView, str | None] | None] = []
        # Agents chosen ahead for the next steps of the same route (``_ahead``), their
        # capability, and where that run of steps ends (the steps of a run not chosen ahead
        # are chosen one by one).
        ahead: list[AgentView] = []
        called: str | None = None
        run_end = 0
        for i, step in enumerate(starting):
            if step.task_id is not None:
                # A caller-chosen task id may be another workflow's: its step is sent only
                # after its record is created (the claim, ``_begin``), never at the start.
                first.append(None)
                continue
            route = step_route(step)
            if i >= run_end:
                ahead, called, run_end = self._ahead(wf.ns, starting, i)
            if ahead:
                first.append((ahead.pop(0), called))
                continue
            try:
                view, capability = await self._choose(route, wf.ns, set())
            except Unroutable:
                view = None  # refused when the step starts (``_step``)
            first.append(None if view is None else (view, capability))
        wf.first = first

    def _ahead(
        self, ns: str, steps: list[StepSpec], start: int
    ) -> tuple[list[AgentView], str | None, int]:
        """The agents of ``steps[start]`` and the steps right after it that share its route
        (and a hub-chosen task id), chosen in one router call (``Router.decide_many``: what
        one ``_choose`` per step would choose, each load counted before the next), the
        capability they are called with, and the index past that run of steps. Fewer agents
        than steps (none when the run is one step, or the call does not apply): the rest of
        the run is chosen one by one, without asking again (a fanout of 256 steps would ask
        256 times, each over the steps left)."""
        route = step_route(steps[start])
        end = start + 1
        while end < len(steps) and steps[end].task_id is None and step_route(steps[end]) is route:
            end += 1
        if end - start < 2:
            return [], None, end
        views, capability = self._router.decide_many(
            route, ns, end - start, exclude=frozenset(self._no_work)
        )
        return views, capability, end

    def _release_first(self, wf: Workflow) -> None:
        """Give back the load counted on first choices that will not be sent by this hub."""
        for choice in wf.first:
            if choice is not None:
                choice[0].outstanding = max(0, choice[0].outstanding - 1)
        wf.first = []

    def _unplaced(
        self, rec: TaskRecord, route: RouteRequest, ns: str, no_work: str | None
    ) -> str | None:
        """For a step's TIMEOUT: why no agent holds it, if none does — ``no_work``, else the
        router's no-match sentence (with its "did you mean", for a capability typo)."""
        if no_work is not None or rec.agent_id is not None:
            return no_work
        # A dry run: were an agent routable now, it must not take a half-open breaker's probe.
        dry = route.model_copy(update={"dry_run": True})
        try:
            self._router.decide(dry, ns, "wf", exclude=frozenset(self._no_work))
        except NoMatchError as err:
            return err.message
        except ReachError:
            return None
        return None

    def _waiting_reason(self, route: RouteRequest, ns: str, no_work: str | None) -> str:
        target = route.agent_id or route.capability or route.selector
        return no_work or f"no routable agent for {target} in namespace {ns!r}"

    def _waiting_event(self, wf: Workflow, index: int, rec: TaskRecord, reason: str) -> None:
        """A PENDING step event that says why the step cannot be placed (it keeps waiting)."""
        err = NoMatchError(reason, task_id=rec.task_id)
        self._step_event(
            wf,
            index,
            rec,
            TaskState.PENDING,
            attempt=rec.attempt or None,
            agent_id=None,
            error=ErrorBody(code=err.code, message=err.message, details=err.details),
        )

    async def _choose(
        self, route: RouteRequest, ns: str, exclude: set[str]
    ) -> tuple[AgentView | None, str | None]:
        """An agent for the step (its load counted), else ``(None, None)`` while none matches;
        ``Unroutable`` when the router refuses the route itself (the caller's mistake)."""
        if route.agent_id is not None and route.agent_id not in self._registry.agents:
            await self._registry.fetch(route.agent_id)
        for tried in (exclude, set()):
            skip = frozenset(tried | self._no_work)
            while True:
                try:
                    choice = self._router.decide(route, ns, "wf", exclude=skip)
                except NoMatchError:
                    break  # retry without ``tried``: better an agent that failed before
                except BadRequestError as err:
                    raise Unroutable(err) from err
                view = choice.view
                if not view.record.card.durable_work:
                    # Not known yet (registered before this engine listened): skip it.
                    self._no_work.add(view.agent_id)
                    skip = skip | {view.agent_id}
                    continue
                # Count it now, before any await: concurrent branches see the load at once.
                view.outstanding += 1
                return view, choice.capability
            if not tried:
                break
        return None, None

    def _no_work_reason(self, route: RouteRequest, ns: str) -> str | None:
        """Which agents matching ``route`` were passed over for having no durable work
        consumer — or, when only agents of other namespaces match, that — as a sentence for
        the step's error; None when neither is why."""
        if not self._no_work:
            return self._router.namespace_hint(route, ns)
        if route.agent_id is not None:
            ids: set[str] | frozenset[str] = {route.agent_id}
        elif route.capability is not None:
            ids = self._registry.index.by_capability(route.capability)
        elif route.selector is not None:
            try:
                ids = self._registry.index.candidates(Selector.parse(route.selector))
            except ReachError:
                return None
        else:
            return None
        skipped = sorted(
            a
            for a in ids & self._no_work
            if (v := self._registry.agents.get(a)) is not None and v.record.card.namespace == ns
        )
        if not skipped:
            return self._router.namespace_hint(route, ns)
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        return f"not offered to {', '.join(skipped[:5])}{more}: registered with durable_work=false"
