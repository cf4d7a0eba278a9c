"""The hub's control plane: :class:`ControlMixin` (a base of :class:`~reach_mesh.hub.Hub`)
answers an agent's own verbs (register, heartbeat, unregister) with their identity checks,
takes failure reports and operator breaker broadcasts, audits agent state changes, and answers
fleet queries and admin ops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import protocol
from reach_mesh._auth import requester_of
from reach_mesh._nats import has_identity
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    BadRequestError,
    IdentityMismatchError,
    InternalError,
    MeshUnavailableError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
    UnknownWorkflowError,
)
from reach_mesh.hub._asked import asked_states, json_object
from reach_mesh.hub._fleet import fleet_answer, fleet_asked
from reach_mesh.hub._wf_view import STEPS_PER_CHARGE, VIEW_DEADLINE
from reach_mesh.hub.audit import AuditLog, Repeats
from reach_mesh.hub.breaker import caller_report
from reach_mesh.hub.registry import AgentView, Registry
from reach_mesh.hub.throttle import Throttle
from reach_mesh.logs import IDENTITY_REJECTED, QUARANTINE, LineBudget, log_event
from reach_mesh.models import (
    AgentState,
    CordonRecord,
    FailureReport,
    Heartbeat,
    HeartbeatReply,
    RegisterReply,
    RegisterRequest,
    TaskState,
    UnregisterRequest,
)
from reach_mesh.tracing.metrics import HubMetrics
from reach_mesh.workflow import CancelResult, WorkflowView

if TYPE_CHECKING:
    from reach_mesh.hub.workflows import WorkflowEngine

__all__ = [
    "ADMIN_OPS",
    "QUARANTINE_CODE",
    "RELEASE_CODE",
    "VIEWS_AT_ONCE",
    "VIEWS_KEPT_FREE",
    "VIEWS_PER_NAMESPACE",
    "VIEW_RATE",
    "ControlMixin",
    "ViewSlots",
]

log = logging.getLogger("reach_mesh.hub")

ADMIN_OPS: Final = (
    "cordon",
    "uncordon",
    "quarantine",
    "release",
    "remove",
    "agents",
    "workflows",
)
#: Report codes for operator quarantine / release, broadcast so every hub's breaker follows.
QUARANTINE_CODE: Final = "REACH_OPERATOR_QUARANTINE"
#: Capabilities a register audit event lists (with their count).
_AUDIT_CAPABILITIES: Final = 16
RELEASE_CODE: Final = "REACH_OPERATOR_RELEASE"
#: What a hub asks an agent's ctl subject to check a caller's word that nobody is there.
_PING: Final = b'{"op":"ping"}'
_PING_TIMEOUT: Final = 1.0
#: Workflow views a hub answers per second and namespace (burst: twice that), a view of more
#: than 16 steps counting one more per 16 steps. Each reads up to two JetStream messages per
#: step: a loop of them must not become a load on the server.
VIEW_RATE: Final = 20.0
#: Workflow views one hub reads at once (each for at most ``_wf_view.VIEW_DEADLINE``); more
#: are refused ``REACH_THROTTLED`` at once instead of holding the hub's request slots.
VIEWS_AT_ONCE: Final = 8
#: Of those, what one namespace's questions may hold (and as many of the cancels, and of the
#: slots for other hubs' questions): one tenant listing in a loop (a list lasts up to 2.5 s,
#: and its budget lets it start two a second) once held five of the eight and refused the
#: others' views whenever it took them all.
VIEWS_PER_NAMESPACE: Final = 2
#: A namespace may hold more than its share while this many slots stay free for the others
#: (one tenant's burst of views, a script cancelling many workflows, is not cut to two at a
#: time on an idle hub): at most ``VIEWS_AT_ONCE - VIEWS_KEPT_FREE`` then.
VIEWS_KEPT_FREE: Final = 4
#: Views of a namespace's budget one list of its workflows costs (it reads up to
#: ``_wf_list.SCAN_MAX`` records, in one of the ``VIEWS_AT_ONCE`` slots).
LIST_CHARGE: Final = 10


#: ``HeartbeatReply`` bodies by (state, lease, cordoned): a beat's answer is one of a few.
_HB_REPLIES: dict[tuple[AgentState, float, bool], bytes] = {}
_HB_REPLIES_MAX: Final = 1024


class ViewSlots:
    """Workflow views (or cancels) one hub works on now: ``VIEWS_AT_ONCE`` at most, of which
    ``VIEWS_PER_NAMESPACE`` for one namespace (only namespaces holding any have an entry)."""

    __slots__ = ("busy", "by_ns")

    def __init__(self) -> None:
        self.busy = 0
        self.by_ns: dict[str, int] = {}


def _heartbeat_reply(state: AgentState, lease_timeout: float, cordoned: bool) -> bytes:
    key = (state, lease_timeout, cordoned)
    body = _HB_REPLIES.get(key)
    if body is None:
        if len(_HB_REPLIES) >= _HB_REPLIES_MAX:  # leases are the agents' to choose
            _HB_REPLIES.clear()
        body = _HB_REPLIES[key] = protocol.encode(
            HeartbeatReply(state=state, lease_timeout=lease_timeout, cordoned=cordoned)
        )
    return body


class ControlMixin:
    """The registry-verb, report and admin methods of ``Hub`` (which sets every attribute
    below in its ``__init__`` and ``start``)."""

    hub_id: str
    settings: MeshSettings
    registry: Registry
    audit: AuditLog
    metrics: HubMetrics
    _nc: NATS | None
    _register_throttle: Throttle
    #: Registrations per agent id: a few in a row, then one a second.
    _agent_register_throttle: Throttle
    #: Workflow views per namespace (``VIEW_RATE``), and those being read now: asked here
    #: (``False``), and asked by other hubs of a workflow this one owns (``True``).
    _workflow_view_throttle: Throttle
    _views_running: dict[bool, ViewSlots]
    #: Cancels being worked on now (``_on_cancel``: asked here; ``_on_peer_cancel``: by
    #: another hub), ``VIEWS_AT_ONCE`` of each.
    _cancels_running: dict[bool, ViewSlots]
    #: The cancel audit events let through per (namespace, requester, ``cancel_id``): the
    #: asks of one cancel are audited once per distinct answer.
    _cancel_repeats: Repeats
    #: The unregister audit events let through per (agent id, session): a repeat of one
    #: (the agent asks until answered, b99cd53) is answered ``removed`` again, audited once.
    _unregister_repeats: Repeats
    #: Lines about owners that did not answer a workflow view, one per owner per minute.
    _owner_lines: LineBudget
    #: ``REACH-IDENTITY-REJECTED`` lines, one per verb per 30 s.
    _rejected_lines: LineBudget
    #: Agents whose ctl subject this hub is asking now (``_nobody_on``): one ask at a time.
    _pinging: set[str]

    workflows: WorkflowEngine | None

    if TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

        def known_namespace(self, ns: str) -> bool: ...

    # ------------------------------------------------------------------ registry verbs

    async def _on_register(self, msg: Msg, ns: str) -> bytes:
        # The sender's own budget first, by the identity its subject names (what NATS binds to
        # it): an agent registering in a loop — or flooding its subject with garbage — spends
        # its own few tokens, not its namespace's, so its neighbours still register.
        sender = protocol.identity_of(msg.subject) or ""
        again = self._agent_register_throttle.check(sender)
        if again > 0:
            raise ThrottledError(
                f"agent {sender!r} is registering too often",
                retry_after_ms=int(again * 1000) + 1,
            )
        retry = self._register_throttle.check(ns)
        if retry > 0:
            if self.known_namespace(ns):
                self.metrics.throttled_total.labels(ns).inc()
            raise ThrottledError(
                f"namespace {ns!r} is registering too fast", retry_after_ms=int(retry * 1000) + 1
            )
        req = protocol.decode(msg.data, RegisterRequest, max_size=256 * 1024)
        self._check_identity(msg.subject, "register", req.card.agent_id)
        view = await self.registry.register(req, protocol.agent_task(req.card.agent_id))
        await self.audit.record(
            ns,
            "register",
            agent_id=view.agent_id,
            session=req.session,
            # Bounded: an agent re-registering with long lists must not flush the shared
            # audit stream (its card is in the registry anyway).
            capabilities=req.card.capabilities[:_AUDIT_CAPABILITIES],
            capability_count=len(req.card.capabilities),
            state=view.state.value,
        )
        return protocol.encode(
            RegisterReply(
                agent_id=view.agent_id,
                session=view.record.session,
                state=view.state,
                heartbeat_interval=view.record.heartbeat_interval,
                lease_timeout=view.record.lease_timeout,
                hub_id=self.hub_id,
                max_payload=self.settings.max_payload,
                suspect_timeout=self.settings.suspect_timeout,
                cordoned=self.registry.cordoned(view.agent_id, view.record),
            )
        )

    async def _on_heartbeat(self, msg: Msg, ns: str) -> bytes:
        hb = protocol.decode(msg.data, Heartbeat, max_size=64 * 1024)
        self._check_identity(msg.subject, "heartbeat", hb.agent_id)
        view = await self.registry.heartbeat(hb)
        self.metrics.heartbeat_total.inc()
        # The agent's word on its cordon (it refuses new task ids while cordoned: a caller
        # may send it tasks past the hubs' routing, docs/security.md).
        return _heartbeat_reply(
            view.state,
            view.record.lease_timeout,
            self.registry.cordoned(view.agent_id, view.record),
        )

    async def _on_unregister(self, msg: Msg, ns: str) -> bytes:
        req = protocol.decode(msg.data, UnregisterRequest, max_size=64 * 1024)
        self._check_identity(msg.subject, "unregister", req.agent_id)
        removed = await self.registry.unregister(req.agent_id, req.session)
        # (A repeat of a session's unregister is answered removed as the first was: the
        # agent asks again until answered. Audited once here; a repeat another hub answers —
        # one this hub's answer was lost for, or slower than 0.5 s — is audited there.)
        if removed and (
            req.session is None
            or self._unregister_repeats.first((req.agent_id, req.session), {"removed": True})
        ):
            await self.audit.record(ns, "unregister", agent_id=req.agent_id, reason="graceful")
        return protocol.dumps({"agent_id": req.agent_id, "removed": removed})

    def _check_identity(self, subject: str, verb: str, claimed: str) -> None:
        """Refuse a message whose body speaks for another agent than its subject names: the
        subject is what NATS permissions bind to the sender (docs/security.md)."""
        sender = protocol.identity_of(subject)
        if sender == claimed:
            return
        self._rejected(verb, sender, claimed)
        raise IdentityMismatchError(
            f"{verb} on {subject} speaks for {claimed!r}: an agent may only {verb} itself "
            f"({sender!r})",
            subject_agent=sender,
            body_agent=claimed,
        )

    def _rejected(self, verb: str, sender: str | None, claimed: str, **fields: Any) -> None:
        """Count a message refused for speaking for another identity; log it at most once per
        30 s per verb (anyone may send them: a flood must not fill the log)."""
        self.metrics.identity_rejected_total.labels(verb).inc()
        held = self._rejected_lines.take(verb)
        if held is None:
            return
        log_event(
            log,
            IDENTITY_REJECTED,
            f"{verb} refused: sender and claimed identity differ",
            verb=verb,
            sender=sender,
            claimed=claimed,
            suppressed=held,
            **fields,
        )

    # ------------------------------------------------------------------ reports & breaker

    async def _on_report(self, msg: Msg) -> None:
        """A caller's (or another component's) word on an agent: feeds this hub's breaker,
        bounded per reporter; a caller's own errors are not the agent's fault."""
        try:
            report = protocol.decode(msg.data, FailureReport, max_size=64 * 1024)
        except ReachError:
            return  # publish-only subject: nobody to answer; never crash on it
        if report.code in (QUARANTINE_CODE, RELEASE_CODE):
            # Operator actions reach the breakers through hubs only (``_on_breaker``).
            self._rejected("report", None, report.agent_id, code=report.code)
            return
        ns = msg.subject.split(".", 3)[2]
        if protocol.namespace_of(report.agent_id) != ns:
            # Callers may report only on their own namespace's subject (NATS permissions):
            # a report there about another tenant's agent must not touch its breaker.
            self._rejected("report", ns, report.agent_id)
            return
        view = self.registry.agents.get(report.agent_id)
        if view is None:
            return
        if not caller_report(view.breaker, view.health, report):
            return  # the reporter's budget is spent: nothing changed
        if not report.success and report.code == UnknownAgentError.code:
            # The caller found nobody on its subject (direct mode). Its word alone does not
            # set the agent aside (callers name their reporter themselves: one could keep a
            # live agent out of rotation): the hub looks for itself, as a route of ours would.
            if (
                not await self._nobody_on(view)
                or self.registry.agents.get(view.agent_id) is not view
            ):
                return
            view.unreached_at = self.registry.now
        self.registry.regrade(view)

    async def _nobody_on(self, view: AgentView) -> bool:
        """Whether NATS answers *no responders* for ``view``'s ctl subject (every process of
        an agent id subscribes it, on the connection of its task subject). ``False`` when it
        answers, when asking fails or times out, and while another ask about it is out.

        Asked with a random reply subject (``Registry.asks``): agents may publish on this
        hub's reply subjects, and one that could guess the next of nats-py's could answer for
        a deaf agent and keep work going to it."""
        agent_id = view.agent_id
        if agent_id in self._pinging:
            return False
        self._pinging.add(agent_id)
        try:
            await self.registry.ask_agent(agent_id, _PING, timeout=_PING_TIMEOUT)
        except nats.errors.NoRespondersError:
            return True
        except Exception:
            return False
        finally:
            self._pinging.discard(agent_id)
        return False

    async def _on_breaker(self, msg: Msg) -> None:
        """An operator's quarantine / release, broadcast by the hub that took the request."""
        try:
            report = protocol.decode(msg.data, FailureReport, max_size=64 * 1024)
        except ReachError:
            return
        view = self.registry.agents.get(report.agent_id)
        if view is None:
            return
        if report.code == QUARANTINE_CODE:
            view.breaker.trip()
        elif report.code == RELEASE_CODE:
            view.breaker.reset()
        else:
            return
        self.registry.regrade(view)

    def _on_state_change(self, view: AgentView, old: AgentState, new: AgentState) -> None:
        ns = view.record.card.namespace
        if new is AgentState.SUSPECT and old is AgentState.ONLINE:
            self.metrics.lease_expired_total.labels(ns).inc()
        elif new is AgentState.ONLINE:
            # The series exists from 0 while the namespace has agents: a counter born at its
            # first increment hides that increment from increase() (the first expiries of a
            # namespace would not be seen by ReachLeaseExpiries).
            self.metrics.lease_expired_total.labels(ns)
        if new is AgentState.QUARANTINED and view.quarantines != view.breaker.openings:
            # Counted (and logged) once per opening of the breaker, not per return to the
            # state: a quarantined agent whose beats run late goes SUSPECT and back.
            view.quarantines = view.breaker.openings
            self.metrics.quarantine_total.inc()
            log_event(
                log,
                QUARANTINE,
                f"circuit breaker open: agent quarantined ({view.breaker.why or 'breaker open'})",
                agent_id=view.agent_id,
                reason=view.breaker.why,
                open_for_s=view.breaker.open_timeout,
            )
        if old is AgentState.LOST or not self.registry.loaded or view.left:
            # An agent appearing (registered here or through another hub) is told by its
            # ``register`` event; a LOST -> ONLINE state event would say it was lost before.
            # And a hub starting up catches up with states (SUSPECT until the heartbeats are
            # loaded, then ONLINE) that no agent went through. An agent that left without
            # being lost (a goodbye: its ``unregister`` event tells it) is no ``LOST`` event.
            return
        if self._nc is not None and not self._nc.is_closed:
            # Soon, not now: the change is a consequence of the action being handled (e.g. a
            # registration), whose own event should come first in the story.
            asyncio.get_running_loop().call_soon(
                self.audit.add,
                ns,
                "state",
                {"agent_id": view.agent_id, "old": old.value, "new": new.value},
            )

    # ------------------------------------------------------------------ queries & admin

    async def _on_agents(self, msg: Msg, ns: str) -> bytes:
        body = json_object(msg.data)
        agent_id = body.get("agent_id")
        if agent_id is not None:
            agent_id = protocol.validate_agent_id(str(agent_id))
            if protocol.namespace_of(agent_id) != ns:
                raise BadRequestError(
                    f"agent {agent_id!r} is not in namespace {ns!r}: ask on "
                    f"{protocol.hub_subject(protocol.namespace_of(agent_id), 'agents')}",
                    field="agent_id",
                )
            view = self.registry.require(agent_id)
            return protocol.encode(view.info(self.registry.now))
        if body.get("all_namespaces"):
            raise BadRequestError(
                "the fleet of every namespace is an operator query: send "
                '{"op": "agents"} on reach.hub.<ns>.admin',
                field="all_namespaces",
            )
        return self._fleet(ns, body)

    async def _on_workflow(self, msg: Msg, ns: str) -> bytes:
        """One workflow of ``ns`` as it stands (``hub/_wf_view.py``)."""
        engine, _, workflow_id = self._view_asked(msg.data)
        with self._view_slot(ns, peer=False):
            self._charge_view(ns, 1)
            view = await engine.view(
                ns,
                workflow_id,
                charge=lambda steps: self._charge_view(ns, (steps - 1) // STEPS_PER_CHARGE),
                ask_owner=lambda owner, end: self._ask_owner(ns, workflow_id, owner, end),
            )
        return protocol.encode(view)

    async def _on_workflows(self, msg: Msg, ns: str) -> bytes:
        """The recent workflows of ``ns`` (``hub/_wf_list.py``). One list reads up to
        ``SCAN_MAX`` records: it costs ``LIST_CHARGE`` views of the namespace's budget."""
        return await self._list_workflows(ns, json_object(msg.data), every=False)

    async def _list_workflows(self, ns: str, body: dict[str, Any], *, every: bool) -> bytes:
        """The recent workflows of ``ns`` — of every namespace with ``every`` (an operator's
        ``workflows`` admin op, asked on ``ns``'s subject) — as ``body`` asks. One list reads
        up to ``SCAN_MAX`` records: it costs ``LIST_CHARGE`` views of ``ns``'s budget; an
        operator's list of every namespace is no tenant's to pay for, and is bounded by the
        view slot it takes and its deadline alone."""
        states, limit, since_s = _list_asked(body)
        if self.workflows is None:
            raise MeshUnavailableError("this hub runs no workflow engine")
        with self._view_slot(None if every else ns, peer=False):
            if not every:
                self._charge_view(ns, LIST_CHARGE)
            listed = await self.workflows.list(
                None if every else ns, states=states, limit=limit, since_s=since_s
            )
        return protocol.encode(listed)

    async def _on_peer_workflow(self, msg: Msg, ns: str) -> bytes:
        """Another hub asks for the view of a workflow this hub owns (``hub_peer``): its live
        view, never asked on again, within the time the asking hub still waits (``within_s``);
        the asking hub charged the namespace already. Peer views have slots of their own, so
        other hubs cannot crowd out this hub's own questions."""
        engine, body, workflow_id = self._view_asked(msg.data)
        within = _within_s(body, VIEW_DEADLINE)
        with self._view_slot(ns, peer=True):
            return protocol.encode(await engine.view(ns, workflow_id, within=within))

    async def _on_cancel(self, msg: Msg, ns: str) -> bytes:
        return await self.cancel_workflow(ns, msg.data, self._requester(msg))

    async def cancel_workflow(self, ns: str, data: bytes, requester: str | None) -> bytes:
        """Cancel a workflow of ``ns`` (``WorkflowEngine.cancel``) as ``data`` asks (the body
        of ``reach.hub.<ns>.cancel``): its owner stops it, answered within ``within_s`` (at
        most ``protocol.CANCEL_WAIT``); with ``before_start`` one no hub has started yet is
        cancelled before it starts. Counted against the namespace's workflow-view budget;
        every cancel asked is audited (``cancel``), with ``requester``: who asked, as this hub
        can tell (``_requester``; ``"http"``: its own HTTP API), never as a body says — the
        asks of one cancel (the same ``cancel_id``) once per distinct answer."""
        engine, body, workflow_id = self._view_asked(data)
        reason = protocol.validate_reason(body.get("reason"))
        within = _within_s(body, protocol.CANCEL_WAIT, default=protocol.CANCEL_WAIT)
        before_start = body.get("before_start", False)
        if not isinstance(before_start, bool):
            raise BadRequestError("before_start must be true or false", field="before_start")
        cancel_id = body.get("cancel_id")
        if cancel_id is not None and (
            not isinstance(cancel_id, str) or not protocol.TASK_ID_RE.fullmatch(cancel_id)
        ):
            raise BadRequestError(
                "cancel_id must be 1-64 characters of [A-Za-z0-9_-]", field="cancel_id"
            )
        # Recorded before it starts when asked, and only where the namespace exists: in any
        # other nothing is left behind (REACH_UNKNOWN_WORKFLOW).
        unknown_ns = before_start and not self.known_namespace(ns)
        answer: CancelResult | None = None
        code: str | None = None
        with self._view_slot(ns, peer=False, running=self._cancels_running):
            self._charge_view(ns, 1)  # refused ones are not audited: the budget bounds these
            try:
                try:
                    answer = await engine.cancel(
                        ns,
                        workflow_id,
                        reason,
                        within=within,
                        ask_owner=lambda owner, end: self._ask_owner_cancel(
                            ns, workflow_id, reason, owner, end
                        ),
                        before_start=before_start and not unknown_ns,
                    )
                except UnknownWorkflowError as err:
                    if not unknown_ns:
                        raise
                    raise UnknownWorkflowError(
                        f"no workflow {workflow_id!r} in namespace {ns!r}, and this hub does "
                        "not know that namespace (no agent registered there, not configured): "
                        "nothing was recorded",
                        workflow_id=workflow_id,
                    ) from err
            except ReachError as err:
                code = err.code
                raise
            except Exception:
                code = InternalError.code  # the dispatcher answers REACH_INTERNAL
                raise
            finally:
                event: dict[str, Any] = {
                    "workflow_id": workflow_id,
                    "requester": requester,
                    "reason": reason,
                    "before_start": before_start or None,
                    "final": None if answer is None else answer.final,
                    "cancelled": None if answer is None else answer.cancelled,
                    "state": None if answer is None else answer.state.value,
                    "owner": None if answer is None else answer.owner,
                    "error": code,
                    "cancel_id": cancel_id,
                }
                # Asked again with the same cancel_id (the client asks until the answer is
                # final, and for 2 s about an unknown id): audited when the answer changed.
                key = (ns, requester, cancel_id)
                if cancel_id is None or self._cancel_repeats.first(key, event):
                    self.audit.add(ns, "cancel", event)
        return protocol.encode(answer)

    async def _on_peer_cancel(self, msg: Msg, ns: str) -> bytes:
        """Another hub passes on a cancel of a workflow this hub owns (``hub_peer``), to be
        answered within ``within_s``; the asking hub charged and audits it."""
        engine, body, workflow_id = self._view_asked(msg.data)
        reason = protocol.validate_reason(body.get("reason"))
        within = _within_s(body, protocol.CANCEL_WAIT)
        with self._view_slot(ns, peer=True, running=self._cancels_running):
            return protocol.encode(
                await engine.cancel(ns, workflow_id, reason, within=within, before_start=False)
            )

    async def _ask_owner_cancel(
        self, ns: str, workflow_id: str, reason: str | None, owner: str, end: float
    ) -> CancelResult:
        """The owner hub's answer to a cancel, by loop time ``end``. Raises what the owner
        answered, or ``MeshUnavailableError`` saying whether the cancel may have been taken:
        nothing was when no owner listens; when it does not answer in time, it may have."""
        left = end - asyncio.get_running_loop().time()
        if left <= 0.2 or self.workflows is None:
            raise MeshUnavailableError(
                f"no time left to ask hub {owner!r}, which runs workflow {workflow_id!r}: "
                "nothing was cancelled; ask again"
            )
        # The owner answers within what is left, less the way back.
        body = protocol.dumps(
            {"workflow_id": workflow_id, "reason": reason, "within_s": round(left - 0.15, 3)}
        )
        try:
            data = await self.workflows.ask(
                protocol.hub_peer(ns, "cancel", owner), body, timeout=left
            )
        except nats.errors.NoRespondersError as err:
            raise MeshUnavailableError(
                f"hub {owner!r}, which runs workflow {workflow_id!r}, is not reachable: nothing "
                "was cancelled; ask again (if it is gone, another hub takes the workflow over "
                "within workflow_ack_wait)",
                owner=owner,
            ) from err
        except Exception as err:
            held = self._owner_lines.take(owner)
            if held is not None:
                log.info(
                    "workflow cancel: hub %s (an owner) did not answer (%s; %d more held back)",
                    owner,
                    type(err).__name__,
                    held,
                )
            raise MeshUnavailableError(
                f"hub {owner!r}, which runs workflow {workflow_id!r}, did not answer in time: "
                "it may have taken the cancel; ask again (a cancel is idempotent)",
                owner=owner,
            ) from err
        protocol.raise_for_error(data)  # the owner's own answer (UNKNOWN, UNAVAILABLE, ...)
        return CancelResult.model_validate_json(data)

    def _view_asked(self, data: bytes) -> tuple[WorkflowEngine, dict[str, Any], str]:
        """The engine, the body and the workflow id of a question about a workflow."""
        body = json_object(data)
        raw = body.get("workflow_id")
        if not isinstance(raw, str):
            raise BadRequestError("workflow_id (a string) is required", field="workflow_id")
        workflow_id = protocol.validate_workflow_id(raw)
        if self.workflows is None:
            raise MeshUnavailableError("this hub runs no workflow engine")
        return self.workflows, body, workflow_id

    @contextlib.contextmanager
    def _view_slot(
        self, ns: str | None, *, peer: bool, running: dict[bool, ViewSlots] | None = None
    ) -> Iterator[None]:
        """One of the ``VIEWS_AT_ONCE`` views (or, with ``running=self._cancels_running``,
        cancels) this hub works on at once (asked here, or by another hub: each its own
        slots), at most ``VIEWS_PER_NAMESPACE`` of them for ``ns`` (the subject's; None: an
        operator's list of every namespace, no tenant's), or ``REACH_THROTTLED`` at once."""
        slots = (self._views_running if running is None else running)[peer]
        if slots.busy >= VIEWS_AT_ONCE:
            raise ThrottledError(
                "this hub is busy with other workflow views or cancels", retry_after_ms=100
            )
        held = slots.by_ns
        if ns is not None:
            if held.get(ns, 0) >= VIEWS_PER_NAMESPACE and (
                VIEWS_AT_ONCE - slots.busy - 1 < VIEWS_KEPT_FREE
            ):
                raise ThrottledError(
                    f"namespace {ns!r} holds its share of this hub's workflow views or cancels",
                    retry_after_ms=100,
                )
            held[ns] = held.get(ns, 0) + 1
        slots.busy += 1
        try:
            yield
        finally:
            slots.busy -= 1
            if ns is not None:
                held[ns] -= 1
                if not held[ns]:
                    del held[ns]

    async def _ask_owner(
        self, ns: str, workflow_id: str, owner: str, end: float
    ) -> WorkflowView | None:
        """The owner hub's view of a workflow (by loop time ``end``), or None: it is gone, did
        not answer in time, or answered with an error (logged, at most once a minute per
        owner: the views then come from the records, without why steps wait)."""
        left = end - asyncio.get_running_loop().time()
        if left <= 0.05:
            return None
        body = protocol.dumps({"workflow_id": workflow_id, "within_s": round(left - 0.05, 3)})
        try:
            if self.workflows is None:
                return None
            data = await self.workflows.ask(
                protocol.hub_peer(ns, "workflow", owner), body, timeout=left
            )
            protocol.raise_for_error(data)
            return WorkflowView.model_validate_json(data)
        except Exception as err:  # the local view stands in: its records are as durable
            held = self._owner_lines.take(owner)
            if held is not None:
                log.info(
                    "workflow views: hub %s (an owner) did not answer (%s; %d more held back): "
                    "views come from the records",
                    owner,
                    type(err).__name__,
                    held,
                )
            return None

    def _charge_view(self, ns: str, n: int) -> None:
        """Take ``n`` tokens of ``ns``'s workflow-view budget, or refuse (``VIEW_RATE``)."""
        n = min(n, int(self._workflow_view_throttle.burst) - 1)  # a record says how many steps
        retry = self._workflow_view_throttle.check(ns, n) if n > 0 else 0.0
        if retry > 0:
            raise ThrottledError(
                f"namespace {ns!r} asks for workflow views too fast",
                retry_after_ms=int(retry * 1000) + 1,
            )

    def _fleet(self, namespace: str | None, body: dict[str, Any]) -> bytes:
        """The agents ``body`` asks for (``hub/_fleet.py``): as many as one NATS message of
        this hub's connection carries, with the counts of all of them."""
        ask = fleet_asked(body)
        return fleet_answer(self.registry, self.hub_id, namespace, ask, self.nc.max_payload)

    def _requester(self, msg: Msg) -> str | None:
        """Who asked, as far as NATS lets this hub tell: in secure mode (this hub has an
        identity) the identity whose private inbox the reply subject is under
        (``_auth.requester_of``), e.g. ``operator.admin``; None in open mode, where anyone may
        name any inbox. Never a body's word: the body is the sender's to write."""
        return requester_of(msg.reply) if has_identity(self.settings) else None

    async def _on_admin(self, msg: Msg, ns: str) -> bytes:
        return await self.admin_op(ns, msg.data, self._requester(msg))

    async def admin_op(self, ns: str, data: bytes, requester: str | None) -> bytes:
        """The operator action ``data`` asks (the body of ``reach.hub.<ns>.admin``), audited
        (``admin``) with the operator's ``reason`` and ``requester``: who asked, as this hub
        can tell (``_requester``; ``"http"``: its own HTTP API), never as a body says."""
        body = json_object(data)
        op = body.get("op")
        if op == "agents":
            return self._fleet(None, body)
        if op == "workflows":
            return await self._list_workflows(ns, body, every=True)
        agent_id = protocol.validate_agent_id(str(body.get("agent_id", "")))
        reason = protocol.validate_reason(body.get("reason"))  # before anything is done
        if op in ("cordon", "uncordon"):
            cordon = (
                CordonRecord(reason=reason, requester=requester, cordoned_at=time.time())
                if op == "cordon"
                else None
            )
            view = await self.registry.set_cordon(agent_id, cordon)
            state = AgentState.LOST if view is None else view.state  # (not registered)
        elif op in ("quarantine", "release"):
            view = self.registry.require(agent_id)
            code = QUARANTINE_CODE if op == "quarantine" else RELEASE_CODE
            report = FailureReport(agent_id=agent_id, code=code)
            await self.nc.publish(protocol.hub_broadcast(ns, "breaker"), protocol.encode(report))
            await self.nc.flush()
            (view.breaker.trip if op == "quarantine" else view.breaker.reset)()
            self.registry.regrade(view)
            state = view.state
        elif op == "remove":
            self.registry.require(agent_id)
            await self.registry.unregister(agent_id, None)
            state = AgentState.LOST
        else:
            raise BadRequestError(
                f"unknown admin op {op!r}: expected one of {', '.join(ADMIN_OPS)}", field="op"
            )
        await self.audit.record(
            ns, "admin", agent_id=agent_id, op=op, requester=requester, reason=reason
        )
        return protocol.dumps({"agent_id": agent_id, "op": op, "state": state})


def _list_asked(body: dict[str, Any]) -> tuple[frozenset[TaskState], int, float]:
    """``state`` (a state name or a list of them), ``limit`` and ``since_s`` of a list of
    workflows (``reach.hub.<ns>.workflows``), checked."""
    states = asked_states(body, TaskState)
    limit = body.get("limit", protocol.WORKFLOW_LIST_LIMIT)
    most = protocol.WORKFLOW_LIST_MAX
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise BadRequestError(f"limit must be an integer in [1, {most}]", field="limit")
    since = body.get("since_s", protocol.WORKFLOW_LIST_SINCE)
    longest = protocol.WORKFLOW_LIST_SINCE_MAX
    if isinstance(since, bool) or not isinstance(since, int | float) or not 0 < since <= longest:
        raise BadRequestError(f"since_s must be in (0, {longest:g}]", field="since_s")
    return states, limit, float(since)


def _within_s(body: dict[str, Any], limit: float, default: float | None = None) -> float:
    """``within_s`` of a question about a workflow: the seconds in (0, ``limit``] its asker
    still waits (required from another hub; from a caller, ``default`` when absent)."""
    within = body.get("within_s")
    if within is None and default is not None:
        return default
    if isinstance(within, bool) or not isinstance(within, int | float) or not 0 < within <= limit:
        raise BadRequestError(f"within_s must be in (0, {limit:g}]", field="within_s")
    return float(within)
