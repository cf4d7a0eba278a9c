"""What the workflow engine answers about a workflow it may not own: its view
(``reach.hub.<ns>.workflow``) and its cancel (``reach.hub.<ns>.cancel``) — asked of any hub,
which answers from the records or passes the question to the owner. Split from
:mod:`reach_mesh.hub.workflows` (which runs the workflows this hub owns)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh.errors import (
    MeshUnavailableError,
    ThrottledError,
    UnknownWorkflowError,
    WorkflowCancelledError,
)
from reach_mesh.hub import _durable
from reach_mesh.hub._shapes import WorkflowShapes, final_result
from reach_mesh.hub._steps import Workflow
from reach_mesh.hub._wf_list import list_workflows
from reach_mesh.hub._wf_view import VIEW_DEADLINE, workflow_view
from reach_mesh.hub.registry import Registry
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.workflow import (
    CancelResult,
    WorkflowList,
    WorkflowRecord,
    WorkflowView,
    stored_record,
)

__all__ = ["WorkflowQueries"]

log = logging.getLogger("reach_mesh.hub.workflows")


class WorkflowQueries(WorkflowShapes):
    """Views and cancels of workflows (the base of ``WorkflowEngine``, which sets every
    attribute below)."""

    _js: JetStreamContext
    _registry: Registry
    #: The workflows this hub runs, by (namespace, id), from when their record names it.
    _owning: dict[tuple[str, str], tuple[Workflow, asyncio.Task[Any]]]

    async def view(
        self,
        ns: str,
        workflow_id: str,
        *,
        charge: Callable[[int], None] | None = None,
        ask_owner: Callable[[str, float], Awaitable[WorkflowView | None]] | None = None,
        within: float = VIEW_DEADLINE,
    ) -> WorkflowView:
        """One workflow as it stands, within ``within`` seconds (``reach.hub.<ns>.workflow``;
        ``hub/_wf_view.py``)."""
        if self._wf_kv is None or self._tasks_kv is None:
            raise MeshUnavailableError("this hub's workflow engine has not started")
        return await workflow_view(
            ns,
            workflow_id,
            hub_id=self.hub_id,
            records=self._wf_kv,
            tasks=self._tasks_kv,
            tracker=self._tracker,
            running_here=(ns, workflow_id) in self._owning,
            waiting=lambda index: self._waiting_steps.get((ns, workflow_id, index)),
            silent_agent=self._silent_agent,
            charge=charge,
            ask_owner=ask_owner,
            within=within,
        )

    def _silent_agent(self, agent_id: str) -> str | None:
        """Why a running step's agent may hold it up, as this hub's registry has it: its
        heartbeats stopped past its lease (SUSPECT — hung, paused or cut off). The step's
        attempt is asked about: a question that times out keeps it on the agent (it may be
        running it), until the agent answers (back, with the step or without it) or is
        declared LOST (lease_timeout + suspect_timeout after its last heartbeat), or the
        workflow's deadline comes first. None while it beats."""
        agent = self._registry.agents.get(agent_id)
        if agent is None:
            return None
        silent = self._registry.now - agent.last_seen
        lease = agent.record.lease_timeout
        if silent <= lease:
            return None
        lost_in = lease + self._settings.suspect_timeout - silent
        when = f"in about {lost_in:.0f} s" if lost_in >= 1 else "any moment now"
        return (
            f"its agent {agent_id} has sent no heartbeat for {silent:.0f} s (lease "
            f"{lease:g} s: hung, paused or cut off); the step stays on it until it answers "
            f"again, or goes to another agent when it is declared LOST, {when} (reach-mesh "
            f"inspect {agent_id})"
        )

    async def list(
        self,
        ns: str | None,
        *,
        states: frozenset[TaskState],
        limit: int,
        since_s: float,
    ) -> WorkflowList:
        """The recent workflows of ``ns`` (None: of every namespace), newest first
        (``reach.hub.<ns>.workflows``, the operators' ``workflows`` admin op;
        ``hub/_wf_list.py``)."""
        return await list_workflows(
            self._js, ns, hub_id=self.hub_id, states=states, limit=limit, since_s=since_s
        )

    async def cancel(
        self,
        ns: str,
        workflow_id: str,
        reason: str | None,
        *,
        within: float,
        ask_owner: Callable[[str, float], Awaitable[CancelResult]] | None = None,
        before_start: bool = False,
    ) -> CancelResult:
        """Stop a running workflow of ``ns`` (``reach.hub.<ns>.cancel``); what it did, within
        ``within`` seconds.

        The owner (this hub, or the hub the record names, asked through ``ask_owner(hub_id,
        end)``, which raises when it cannot tell) stops the workflow as a policy stops
        unneeded branches: the cancel is written into the workflow record, then the steps not
        finished are fenced (records marked cancelled, markers behind work still queued, a
        cancel to the agents running them), and the workflow's one final result is FAILED
        with ``REACH_WORKFLOW_CANCELLED``; steps that finished keep their results. The answer
        is ``final`` once a result is stored.

        No record (no hub has taken its submission yet, or it was never submitted): with
        ``before_start`` the cancel is recorded first (``_cancel_unstarted``), so the hub that
        takes the submission ends it cancelled without starting a step; otherwise
        ``UnknownWorkflowError``. ``MeshUnavailableError`` when that cannot be told."""
        if self._wf_kv is None:
            raise MeshUnavailableError("this hub's workflow engine has not started")
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        got = await self._record_now(ns, workflow_id, end)
        record = stored_record(WorkflowRecord, got)
        running = self._owning.get((ns, workflow_id))
        if running is not None and (record is None or record.result is None):
            wf, task = running
            # Ours: the record names this hub, or there is none though the run here wrote it
            # (``rev``: its bucket was deleted; the run's next write creates it again,
            # ``_owner_write``). A run that has not written it yet is between owners (below):
            # a cancel held only in its memory would be lost if it handed the workflow back.
            if (record is None and wf.rev > 0) or (
                record is not None and record.owner == self.hub_id
            ):
                if wf.cancel(_cancel_error(reason)):
                    log.info("workflow %s of %r: cancel requested (%s)", workflow_id, ns, reason)
                # What is left of the time after the second read below.
                await asyncio.wait({task}, timeout=max(0.0, end - loop.time() - 0.3))
                got = await self._record_now(ns, workflow_id, end)
                record = stored_record(WorkflowRecord, got)
                if not task.done() and (record is None or record.result is None):
                    return self._not_final(ns, workflow_id, self.hub_id)  # fencing, storing
            elif record is not None:
                running = None  # a run here that lost the workflow: its owner decides
        stored = final_result(got)
        if stored is not None:
            return CancelResult(
                workflow_id=workflow_id,
                namespace=ns,
                final=True,
                # The final record keeps ``cancel`` only when the result is the cancel's.
                cancelled=record is not None and record.cancel is not None,
                state=stored.state,
                owner=stored.hub_id,
                result=stored,
            )
        taken = "it may have been taken" if running is not None else "nothing was cancelled"
        between = MeshUnavailableError(
            f"workflow {workflow_id!r} is between owners: {taken}; ask again (a hub takes it "
            f"over within {self._settings.workflow_ack_wait:g}s)",
        )
        if record is None:
            if running is not None:
                raise between  # handed back before its record was made
            if before_start:
                return await self._cancel_unstarted(ns, workflow_id, reason, end, ask_owner)
            raise UnknownWorkflowError(
                f"no workflow {workflow_id!r} in namespace {ns!r}: never submitted, not taken "
                "by a hub yet, or finished longer ago than workflow_retention (to cancel one "
                "whose submission still waits for a hub, so that it never starts: ask again "
                "with before_start, `reach-mesh cancel --before-start`)",
                workflow_id=workflow_id,
            )
        owner = record.owner
        if (
            ask_owner is not None
            and owner is not None
            and owner != self.hub_id
            and protocol.HUB_ID_RE.fullmatch(owner)
        ):
            try:
                return await ask_owner(owner, end)
            except (MeshUnavailableError, ThrottledError):
                if record.cancel is None:
                    raise
        if record.cancel is not None:
            return self._not_final(ns, workflow_id, owner)  # whoever runs it finishes it
        raise between

    async def _cancel_unstarted(
        self,
        ns: str,
        workflow_id: str,
        reason: str | None,
        end: float,
        ask_owner: Callable[[str, float], Awaitable[CancelResult]] | None,
    ) -> CancelResult:
        """A cancel of a workflow without a record: its submission waits in the stream (no
        hub has taken it: fair shares, a backlog), or it was never submitted. The cancel is
        recorded first — a workflow record holding only ``cancel``, created as a hub creates
        one when it starts a workflow, so of the two one wins — and the hub that takes the
        submission finds it and ends the workflow cancelled without starting a step (as it
        finishes a cancel it takes over). Answered not final, ``PENDING``, no owner. A hub
        that created the record first wins: then it is the cancel of a running workflow."""
        assert self._wf_kv is not None
        record = WorkflowRecord(state=TaskState.PENDING, cancel=_cancel_error(reason))
        try:
            # Within the cancel's own time: a caller is not kept past it.
            await _durable.create(
                self._wf_kv,
                protocol.workflow_key(ns, workflow_id),
                protocol.encode(record),
                end,
                on_retry=self._infra_retry,
            )
        except KeyWrongLastSequenceError:
            within = max(0.0, end - asyncio.get_running_loop().time())
            return await self.cancel(
                ns, workflow_id, reason, within=within, ask_owner=ask_owner, before_start=False
            )
        except Exception as err:
            # A write whose answer was lost may have landed: the caller asks again.
            raise MeshUnavailableError(
                f"the cancel of workflow {workflow_id!r} was not confirmed "
                f"({type(err).__name__}): it may have been recorded; ask again (a cancel is "
                "idempotent)"
            ) from err
        log.info("workflow %s of %r: cancelled before it started (%s)", workflow_id, ns, reason)
        return self._not_final(ns, workflow_id, None)

    @staticmethod
    def _not_final(ns: str, workflow_id: str, owner: str | None) -> CancelResult:
        """A cancel's answer while not final: ``owner`` has it (or it is in the record of a
        workflow between owners, which the hub that takes it over finishes). No owner: the
        cancel is recorded before any hub started the workflow (``PENDING``)."""
        state = TaskState.RUNNING if owner is not None else TaskState.PENDING
        return CancelResult(
            workflow_id=workflow_id, namespace=ns, final=False, state=state, owner=owner
        )


def _cancel_error(reason: str | None) -> ErrorBody:
    """The error of a workflow cancelled on request (its result's, and its record's ``cancel``)."""
    return ErrorBody(
        code=WorkflowCancelledError.code,
        message="cancelled on request" + (f": {reason}" if reason else ""),
    )
