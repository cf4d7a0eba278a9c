"""Durable workflows from the caller's side: :class:`WorkflowsMixin` is the base of
:class:`~reach_mesh.client.Client` that submits fanout/chain workflows to
``reach.wf.<ns>.submit``, waits for their results (:class:`~reach_mesh._client_results.ResultWaits`)
and streams their events."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Literal

import nats.js.errors
import pydantic_core
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError
from nats.js.api import ConsumerConfig, DeliverPolicy
from opentelemetry.trace import Span
from pydantic import ValidationError

from reach_mesh import protocol
from reach_mesh._cancels import uncancelled
from reach_mesh._client_fields import _check_timeout, _consumer_name, _end_span, _reply_slack
from reach_mesh._client_results import ResultWaits, _Done, _final_result
from reach_mesh._guard import refuse
from reach_mesh._retry import RetriesExhausted, describe, retrying, storage_full
from reach_mesh.config import MeshSettings
from reach_mesh.errors import (
    MeshTimeoutError,
    MeshUnavailableError,
    PayloadTooLargeError,
    ThrottledError,
    UnknownWorkflowError,
    WorkflowConflictError,
    WorkflowSpecError,
)
from reach_mesh.models import TaskState
from reach_mesh.tracing import (
    SPAN_WORKFLOW,
    SpanKind,
    inject,
    span,
)
from reach_mesh.workflow import (
    SECONDS_MAX,
    CancelResult,
    Step,
    WorkflowEvent,
    WorkflowList,
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
    WorkflowView,
    check_payload_sizes,
    new_workflow_id,
    spec_digest,
    validate_spec,
)

__all__ = ["WorkflowsMixin"]

#: How long a workflow submission rides out JetStream being unavailable (a leader election
#: takes 4-9 s) before it raises ``MeshUnavailableError``; a repeat is deduplicated.
_SUBMIT_RETRY: Final = 15.0
#: One try of a submission: the JetStream client's timeout, or what is left of the budget (at
#: least ``_SUBMIT_TRY_MIN``).
_SUBMIT_TRY: Final = 5.0
_SUBMIT_TRY_MIN: Final = 0.25
#: The longest pause between two tries of a submission (``retrying``'s is 2 s). A "no
#: responders" (no leader of the stream: an election) is answered by the caller's own server,
#: at no cost to the cluster, and the stream takes submissions again as soon as a leader is
#: elected: a 2 s pause kept them waiting up to 2 s past it (chaos seed 202, partition).
_SUBMIT_PAUSE_MAX: Final = 0.5
#: How long a submission answered "no responders" waits for JetStream to say whether the
#: workflow stream exists at all (asked once per submission, and never by a client that had
#: one stored). While the stream's leader is dead and not yet replaced nobody answers that
#: question: asked after every try with the JetStream client's 5 s timeout, it made each try
#: of a submission 5 s long, and three tries in the 15 s budget all fell in elections (chaos
#: seed 202, node_kill: 14 submissions failed, each one stored 5 s after its tries).
_STREAM_CHECK: Final = 1.0

#: How often a cancel asks again while the owner stops the workflow (s).
_CANCEL_POLL: Final = 0.2
#: How long a cancel asks again about a workflow no hub knows (one just submitted).
_CANCEL_UNKNOWN_GRACE: Final = 2.0

#: ``workflow_events`` without a timeout: waits as long as the workflow runs (s).
_FOREVER: Final = 10 * 365 * 86400.0
#: How long ``workflow_events`` reads the events the stream holds once the result is in (s).
_EVENT_DRAIN: Final = 2.0


class WorkflowsMixin(ResultWaits):
    """The workflow methods of ``Client`` (which sets every attribute below)."""

    settings: MeshSettings
    #: A submission was stored: the workflow stream exists, and a "no responders" is an
    #: election (``_submit`` asks no more whether the stream is there).
    _wf_stream_seen: bool

    # ------------------------------------------------------------------ workflows

    async def fanout(
        self,
        steps: Sequence[Step],
        *,
        policy: str = "all",
        timeout: float = 30.0,
        workflow_id: str | None = None,
    ) -> WorkflowResult:
        """Run ``steps`` in parallel, durably, and wait for the aggregated result.

        ``policy``: ``all`` (every branch; the first failure is reported as ``error``), ``any``
        (first success wins, the rest are cancelled) or ``quorum(k)``. Branches still
        unfinished at ``timeout`` end TIMEOUT. Malformed specs raise typed errors
        (``WorkflowSpecError``, ``SelectorError``, ...) before anything is sent; a workflow
        that fails is *returned* (``result.state``), not raised. Waiting ends as
        :meth:`workflow`'s does.
        """
        # Checked before the spec (which takes None, and a string of digits): it is waited.
        timeout = _check_timeout(timeout, SECONDS_MAX, WorkflowSpecError)
        spec = self._workflow_spec("fanout", steps, policy, timeout, workflow_id)
        return await self._run_workflow(spec, timeout, chosen_id=workflow_id is not None)

    async def chain(
        self, steps: Sequence[Step], *, timeout: float = 30.0, workflow_id: str | None = None
    ) -> WorkflowResult:
        """Run ``steps`` in order; each step's input is the previous output merged with its own
        payload (see :func:`reach_mesh.workflow.merge_payload`). ``result.result`` is the last
        step's output."""
        timeout = _check_timeout(timeout, SECONDS_MAX, WorkflowSpecError)
        spec = self._workflow_spec("chain", steps, "all", timeout, workflow_id)
        return await self._run_workflow(spec, timeout, chosen_id=workflow_id is not None)

    async def submit_fanout(
        self,
        steps: Sequence[Step],
        *,
        policy: str = "all",
        timeout: float | None = None,
        workflow_id: str | None = None,
    ) -> str:
        """Submit a fanout without waiting; returns the workflow id (re-submitting the same id
        is a no-op). ``timeout=None``: the steps' TTL (``task_ttl``) bounds it."""
        spec = self._workflow_spec("fanout", steps, policy, timeout, workflow_id)
        with self._workflow_span(spec):
            await self._submit(spec, inject({}), chosen_id=workflow_id is not None)
        return spec.workflow_id

    async def submit_chain(
        self,
        steps: Sequence[Step],
        *,
        timeout: float | None = None,
        workflow_id: str | None = None,
    ) -> str:
        """Submit a chain without waiting; returns the workflow id."""
        spec = self._workflow_spec("chain", steps, "all", timeout, workflow_id)
        with self._workflow_span(spec):
            await self._submit(spec, inject({}), chosen_id=workflow_id is not None)
        return spec.workflow_id

    async def workflow(self, workflow_id: str, *, timeout: float = 30.0) -> WorkflowResult:
        """Wait for (or fetch, if already finished) the result of a submitted workflow.

        ``MeshTimeoutError`` when it has no result within ``timeout`` (it goes on: ask again),
        ``MeshUnavailableError`` when this client is closed meanwhile. A result that came while
        the connection was down is read from its record once the connection is back.

        It knows no spec, so it compares none: where callers may submit different specs
        under one id of their own at about the same time, wait with ``fanout`` / ``chain``,
        which raise ``WorkflowConflictError`` when another spec ran under it (``submit_*``
        compares only with a record that exists when it submits)."""
        protocol.validate_workflow_id(workflow_id)
        timeout = _check_timeout(timeout, SECONDS_MAX)
        loop = asyncio.get_running_loop()
        began = loop.time()
        sub, done = await self._done_subscription(workflow_id)
        try:
            found = await self._stored_result(workflow_id, within=timeout)
            if found is not None:
                return found
            spent = loop.time() - began
            return (await self._await_done(done, workflow_id, timeout, spent=spent))[0]
        finally:
            self._drop_done(done)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def inspect_workflow(
        self, workflow_id: str, *, namespace: str | None = None
    ) -> WorkflowView:
        """A workflow of this client's namespace (or ``namespace``) as it stands, running or
        final: its owner, each step's state, attempt, agent, history and error, and why a
        step waits (``reach-mesh workflow <id>``). ``UnknownWorkflowError`` when no record of
        it exists. It does not wait, and carries no result payloads (``workflow`` does)."""
        protocol.validate_workflow_id(workflow_id)
        ns = self.namespace if namespace is None else protocol.validate_namespace(namespace)
        data = await self._query("workflow", {"workflow_id": workflow_id}, ns=ns)
        return WorkflowView.model_validate_json(data)

    async def list_workflows(
        self,
        *,
        state: TaskState | str | Sequence[TaskState | str] = (),
        limit: int = protocol.WORKFLOW_LIST_LIMIT,
        since: float = protocol.WORKFLOW_LIST_SINCE,
        namespace: str | None = None,
        all_namespaces: bool = False,
    ) -> WorkflowList:
        """The workflows of this client's namespace (or ``namespace``) whose record was
        written in the last ``since`` seconds, newest first, at most ``limit`` (up to 500);
        only those in ``state`` when given — e.g. ``state=["FAILED", "TIMEOUT"]`` for what
        failed in the last hour (``reach-mesh workflows``). A record is written when its
        workflow starts and when it ends; the unfinished ones not in the window (running since
        before it, or PENDING: taken by no hub yet) are listed too, so ``RUNNING`` lists what
        runs now. A busy namespace has more
        records in the window than one list reads: the answer then says ``truncated`` and
        from when it read (``oldest_read_at``). Errors are
        cut to the start of their message (``inspect_workflow`` has the whole). Bad arguments
        raise ``BadRequestError`` (from the hub, which checks them). A list the hub cannot read
        within 2.5 s is asked again, as every hub query is, until 10 s are up: then
        ``MeshUnavailableError``; no answer at all (NATS unreachable, a hub gone mid-question)
        is ``MeshTimeoutError`` after 5 s.

        ``all_namespaces``: every namespace's (each summary says its ``namespace``), an
        operator query (``{"op": "workflows"}`` on ``reach.hub.<ns>.admin``: in secure mode
        only an operator identity may ask it)."""
        ns = self.namespace if namespace is None else protocol.validate_namespace(namespace)
        states = [state] if isinstance(state, str) else list(state)
        body = {
            "state": [s.value if isinstance(s, TaskState) else s for s in states],
            "limit": limit,
            "since_s": since,
        }
        if all_namespaces:
            data = await self._query("admin", {"op": "workflows", **body}, ns=ns)
        else:
            data = await self._query("workflows", body, ns=ns)
        return WorkflowList.model_validate_json(data)

    async def cancel_workflow(
        self,
        workflow_id: str,
        *,
        reason: str | None = None,
        namespace: str | None = None,
        timeout: float = 10.0,
        before_start: bool = False,
    ) -> CancelResult:
        """Stop a running workflow of this client's namespace (or ``namespace``): its steps not
        finished are cancelled (agents running them are told to stop; work still queued is
        dropped unrun) and its one final result is FAILED with ``REACH_WORKFLOW_CANCELLED``;
        steps that finished keep their results (``reach-mesh cancel <id>``).

        Returns once a final result is stored (``final``; ``cancelled`` False when the
        workflow had ended by itself first, ``result`` its outcome), asking again while the
        owner stops it (a cancel is idempotent), or the last answer (``final=False``) at
        ``timeout``. ``UnknownWorkflowError`` when it has no record (asked again for up to
        2 s: one just submitted may not be taken yet) — unless ``before_start``: then a
        workflow no hub has started yet (its submission waits in the stream for a fair
        share, or it was never submitted: the hub cannot tell) is answered at once,
        ``final=False``, ``state=PENDING``, no ``owner``: the cancel is recorded, and the hub
        that takes the submission ends it cancelled without running a step (in a namespace
        no hub knows, ``UnknownWorkflowError`` all the same);
        ``MeshUnavailableError`` when no owner could be reached until ``timeout`` (its message
        says whether the cancel may have been taken). Its asks carry one ``cancel_id``: the
        hub audits them once per distinct answer, not once per ask."""
        protocol.validate_workflow_id(workflow_id)
        ns = self.namespace if namespace is None else protocol.validate_namespace(namespace)
        reason = protocol.validate_reason(reason)
        now = time.monotonic()
        deadline = now + timeout
        # Just submitted, no hub has taken it yet: it has no record to cancel for a moment.
        unknown_until = now + min(timeout, _CANCEL_UNKNOWN_GRACE)
        # Every ask of this cancel carries it: the hub audits them once per distinct answer.
        cancel_id = uuid.uuid4().hex
        last: CancelResult | None = None
        while True:
            # The hub answers within what is left (at most 3 s), less the way back.
            within = round(
                min(protocol.CANCEL_WAIT, max(0.2, deadline - time.monotonic() - 1.0)), 3
            )
            asked: dict[str, Any] = {
                "workflow_id": workflow_id,
                "reason": reason,
                "within_s": within,
                "cancel_id": cancel_id,
            }
            if before_start:
                asked["before_start"] = True
            body = protocol.dumps(asked)
            try:
                data = await self._call_hub(ns, "cancel", body, inject({}), deadline, within + 1.0)
            except UnknownWorkflowError:
                if before_start or time.monotonic() + _CANCEL_POLL >= unknown_until:
                    raise  # (with before_start: a namespace the hub does not know)
                await asyncio.sleep(_CANCEL_POLL)
                continue
            except MeshTimeoutError:
                # No answer at all from the hub asked (slow, or gone since): a cancel is
                # idempotent and its asks share one cancel_id, so ask again while there is
                # time for an answer, then say what an owner said, if one did.
                if time.monotonic() + _CANCEL_POLL + 1.2 >= deadline:
                    if last is None:
                        raise
                    return last
                await asyncio.sleep(_CANCEL_POLL)
                continue
            except (MeshUnavailableError, ThrottledError):
                if last is None:
                    raise
                # An owner said it had the cancel: ask on until the deadline (it may have
                # lost the workflow before recording the cancel), then say what it said.
                if time.monotonic() + _CANCEL_POLL >= deadline:
                    return last
                await asyncio.sleep(_CANCEL_POLL)
                continue
            last = CancelResult.model_validate_json(data)
            if last.final or time.monotonic() + _CANCEL_POLL >= deadline:
                return last
            if last.recorded_before_start:
                return last  # nothing changes until a hub takes its submission
            await asyncio.sleep(_CANCEL_POLL)

    async def workflow_events(
        self, workflow_id: str, *, timeout: float | None = None
    ) -> AsyncIterator[WorkflowEvent]:
        """Every event of a workflow from its start (replayed from JetStream), ending with a
        ``kind="done"`` event that carries the ``WorkflowResult`` (its record once final, or
        its ``.done`` announcement: as :meth:`workflow` waits).

        A workflow that finished within ``workflow_event_hold`` has no event stored (its
        result says every step's outcome): ``done`` alone. Once the result is in, the events
        the stream holds are read (for up to 4 s more: a count, then the reads); on a
        replicated stream an event
        stored after that is not. ``MeshTimeoutError`` when it has no result within
        ``timeout``."""
        protocol.validate_workflow_id(workflow_id)
        js = self.nc.jetstream()
        subject = protocol.wf_event(self.namespace, workflow_id)
        sub_done, done = await self._done_subscription(workflow_id)
        result_wait: asyncio.Future[WorkflowResult] | None = None
        got: asyncio.Future[Msg] | None = None
        sub: Subscription | None = None
        try:
            # The result, beside the events: the record (finished before), then the
            # announcement, with the record read again now and then.
            result_wait = asyncio.ensure_future(
                self._result_of(done, workflow_id, _FOREVER if timeout is None else timeout)
            )
            try:
                sub = await js.subscribe(
                    subject,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.ALL,
                    stream=protocol.STREAM_WF_EVENTS,
                    # Named: the filter then travels in the API subject, where NATS
                    # permissions can hold a caller to its own namespace (docs/security.md).
                    config=ConsumerConfig(name=_consumer_name()),
                )
            except (nats.errors.Error, TimeoutError) as err:
                raise MeshUnavailableError(f"cannot read workflow events: {describe(err)}") from err
            got = asyncio.ensure_future(sub.next_msg(timeout=None))
            seen = 0
            while not result_wait.done():
                await asyncio.wait({got, result_wait}, return_when=asyncio.FIRST_COMPLETED)
                if got.done():
                    msg, got = _event_msg(got), asyncio.ensure_future(sub.next_msg(timeout=None))
                    ours, event = _event_of(msg, subject)
                    seen += ours
                    if event is not None:
                        yield event
            result = result_wait.result()  # MeshTimeoutError at ``timeout``
            # The events stored before the result that are still to read.
            stored = 0
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                async with asyncio.timeout(_EVENT_DRAIN):
                    # (``uncancelled``: the caller's own connection may be nats-py's.)
                    info = await uncancelled(
                        js.stream_info(protocol.STREAM_WF_EVENTS, subjects_filter=subject)
                    )
                stored = (info.state.subjects or {}).get(subject, 0)
            end = asyncio.get_running_loop().time() + _EVENT_DRAIN
            while seen < stored:
                await asyncio.wait({got}, timeout=end - asyncio.get_running_loop().time())
                if not got.done():
                    break
                msg, got = _event_msg(got), asyncio.ensure_future(sub.next_msg(timeout=None))
                ours, event = _event_of(msg, subject)
                seen += ours
                if event is not None:
                    yield event
            yield WorkflowEvent(
                workflow_id=workflow_id, kind="done", state=result.state, result=result
            )
        finally:
            for task in (got, result_wait):
                if task is not None:
                    task.cancel()
                    if task.done() and not task.cancelled():
                        task.exception()  # seen: the iteration ended for its own reason
            self._drop_done(done)
            for s in (sub, sub_done):
                if s is not None:
                    with contextlib.suppress(Exception):
                        await s.unsubscribe()

    async def _result_of(self, done: _Done, workflow_id: str, timeout: float) -> WorkflowResult:
        """The workflow's result: its record if final already, else ``done``'s announcement
        (:meth:`_await_done`)."""
        found = await self._stored_result(workflow_id)
        if found is not None:
            return found
        got = await self._await_done(done, workflow_id, timeout)
        return got[0]

    def _workflow_spec(
        self,
        kind: Literal["fanout", "chain"],
        steps: Sequence[Step],
        policy: str,
        timeout: float | None,
        workflow_id: str | None,
    ) -> WorkflowSpec:
        where: tuple[str | int, ...] = ()
        try:
            specs = []
            for i, step in enumerate(steps):
                where = ("steps", i)
                specs.append(step.spec() if isinstance(step, Step) else _bad_step(step))
            where = ()
            spec = WorkflowSpec(
                workflow_id=workflow_id or new_workflow_id(),
                kind=kind,
                steps=specs,
                policy=policy,
                timeout=timeout,
                namespace=self.namespace,
            )
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            field = ".".join(str(p) for p in (*where, *first["loc"])) or "workflow"
            raise WorkflowSpecError(
                f"invalid workflow: {field}: {first['msg']}", field=field
            ) from err
        validate_spec(spec)  # typed errors here, before anything is sent
        return spec

    def _workflow_span(self, spec: WorkflowSpec) -> AbstractContextManager[Span]:
        """The caller's ``reach.workflow`` span (CLIENT) around a submission (and its wait):
        parent of the owning hub's ``reach.workflow``. With tracing off it records nothing but
        still gives the workflow a trace of its own."""
        return span(
            SPAN_WORKFLOW,
            kind=SpanKind.CLIENT,
            destination=protocol.wf_submit(spec.namespace),
            attributes={
                "reach.namespace": spec.namespace,
                "reach.workflow_id": spec.workflow_id,
                "reach.workflow.kind": spec.kind,
                "reach.workflow.steps": len(spec.steps),
            },
        )

    async def _run_workflow(
        self, spec: WorkflowSpec, timeout: float, *, chosen_id: bool
    ) -> WorkflowResult:
        with self._workflow_span(spec) as sp:
            headers = inject({})
            # Subscribe to the result before submitting: no window in which it could be missed.
            # For one message: the server drops the interest itself once ``.done`` is
            # delivered (``_done_subscription``).
            sub, done = await self._done_subscription(spec.workflow_id)
            delivered = False
            try:
                result = await self._submit(spec, headers, chosen_id=chosen_id)
                if result is None:
                    result, delivered = await self._await_done(
                        done, spec.workflow_id, timeout + _reply_slack(timeout)
                    )
                if chosen_id:
                    _refuse_another_specs(spec, result)
            finally:
                if not delivered:
                    self._drop_done(done)  # a stored result or an error: not waited on now
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            _end_span(sp, result.state, result.error.code if result.error else None)
            return result

    async def _submit(
        self, spec: WorkflowSpec, headers: dict[str, str], *, chosen_id: bool
    ) -> WorkflowResult | None:
        """Publish to ``reach.wf.<ns>.submit``; the workflow's stored result when it has one
        already (this id finished before), as far as this call read it.

        Infrastructure errors (no stream leader during an election, a reconnect) are retried
        for up to ``_SUBMIT_RETRY`` seconds: the ``Nats-Msg-Id`` makes a repeat a no-op (and
        another submission of the same id is stored, and made the same workflow by the hubs). A
        ``chosen_id`` (the caller's, not a fresh random one) taken by another spec raises
        ``WorkflowConflictError``; a random id cannot be another spec's, so it is not read
        back (one round trip fewer per workflow)."""
        try:
            body = protocol.encode(spec)
        except pydantic_core.PydanticSerializationError as err:
            raise WorkflowSpecError(
                f"invalid workflow: a payload cannot be written as JSON: {err}", field="payload"
            ) from err
        # What the hub would refuse (it checks the same), refused before anything is sent.
        server: int = self.nc.max_payload
        check_payload_sizes(
            spec, len(body), protocol.carried_max(self.settings.max_payload, server)
        )
        record_max = server - protocol.MESSAGE_ROOM
        if len(body) > record_max:
            raise PayloadTooLargeError(
                f"workflow of {len(body)} bytes: its record may take {record_max} (the NATS "
                f"server's max_payload less {protocol.MESSAGE_ROOM})",
                size=len(body),
                max_size=record_max,
            )
        # Random per submission, repeated by its retries only (protocol.submit_msg_id); as
        # ``uuid4().hex`` was, at a quarter of its cost.
        headers[protocol.HDR_MSG_ID] = protocol.submit_msg_id(
            spec.namespace, spec.workflow_id, os.urandom(16).hex()
        )
        headers[protocol.HDR_EXPECTED_STREAM] = protocol.STREAM_WF
        jsc = await self._js_client()
        subject = protocol.wf_submit(spec.namespace)
        budget = _SUBMIT_RETRY if spec.timeout is None else min(_SUBMIT_RETRY, spec.timeout)
        loop = self._loop or asyncio.get_running_loop()  # (``self.nc`` checked it)
        deadline = loop.time() + budget
        # Whether the stream is known to be there (or was asked about in this submission).
        checked = self._wf_stream_seen

        async def publish() -> Any:
            nonlocal checked
            # Each try within the budget (one try may wait the JetStream client's 5 s).
            left = min(_SUBMIT_TRY, max(_SUBMIT_TRY_MIN, deadline - loop.time()))
            try:
                return await jsc.publish(subject, body, headers, timeout=left)
            except nats.js.errors.NoStreamResponseError:
                # No stream answered: none exists (no hub ever ran), or it has no leader now.
                if not checked:
                    checked = True
                    js = self.nc.jetstream(timeout=min(_STREAM_CHECK, left))
                    if not await _stream_may_exist(js, protocol.STREAM_WF):
                        raise MeshUnavailableError(
                            "no workflow stream: is a hub (`reach-mesh hub`) running?"
                        ) from None
                raise
            except nats.js.errors.APIError as err:
                if storage_full(err):
                    # No room comes back within a retry budget: an operator makes it.
                    raise MeshUnavailableError(
                        f"JetStream did not take workflow {spec.workflow_id}: {describe(err)}. "
                        "Make room (docs/operations.md, JetStream storage is full); submitting "
                        "the same workflow id again is safe",
                        workflow_id=spec.workflow_id,
                    ) from err
                raise

        try:
            ack = await retrying(
                f"submit {spec.workflow_id}", publish, deadline, max_delay=_SUBMIT_PAUSE_MAX
            )
        except RetriesExhausted as err:
            raise MeshUnavailableError(
                f"JetStream did not take workflow {spec.workflow_id} within {budget:g}s "
                f"({describe(err.__cause__ or err)}): the cluster may be electing a leader or "
                "unreachable; submitting the same workflow id again is safe",
                workflow_id=spec.workflow_id,
            ) from err
        except MaxPayloadError as err:
            raise PayloadTooLargeError(f"workflow exceeds the max payload: {err}") from err
        self._wf_stream_seen = True
        if chosen_id:
            return _final_result(await self._check_conflict(spec))
        if ack.duplicate:  # stored before (a retry): it may have finished meanwhile
            return await self._stored_result(spec.workflow_id)
        return None

    async def _check_conflict(self, spec: WorkflowSpec) -> WorkflowRecord | None:
        """Refuse a workflow id that a submission with another spec took first; the record
        read, if any. (None yet: no hub has taken a submission of the id; a result of another
        spec is then told by ``_refuse_another_specs``.)"""
        record = await self._workflow_record(spec.workflow_id)
        if record is not None and record.spec_digest not in (None, wire_digest(spec)):
            raise WorkflowConflictError(
                f"workflow id {spec.workflow_id!r} was submitted before with another spec; "
                "the first spec stands (submit the same spec again, or use a new id)",
                workflow_id=spec.workflow_id,
            )
        return record


def _event_msg(got: asyncio.Future[Msg]) -> Msg:
    """The message an events subscription's read got; its connection closing is the mesh
    becoming unreachable."""
    try:
        return got.result()
    except nats.errors.Error as err:
        raise MeshUnavailableError(f"workflow events stopped: {describe(err)}") from err


def _event_of(msg: Msg, subject: str) -> tuple[bool, WorkflowEvent | None]:
    """Whether ``msg`` came on the watched workflow's ``subject``, and its event (None when
    malformed). One on another subject is dropped: the events consumer was changed by another
    identity allowed to create consumers on the stream (under this consumer's name)."""
    if msg.subject != subject:
        refuse(msg, f"not an event of the watched workflow ({subject})")
        return False, None
    try:
        return True, WorkflowEvent.model_validate_json(msg.data)
    except ValueError:
        return True, None


def _bad_step(step: object) -> Any:
    raise WorkflowSpecError(f"expected reach_mesh.Step, got {type(step).__name__}")


async def _stream_may_exist(js: Any, stream: str) -> bool:
    """False only when JetStream says ``stream`` does not exist."""
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return False
    except Exception:
        return True  # cannot tell now (no leader, timeout): treat as there
    return True


def wire_digest(spec: WorkflowSpec) -> str:
    """:func:`spec_digest` of ``spec`` as the hubs read it: decoded from what is sent (a
    payload's NaN or infinity is sent as null, and null fields are left out of the digest)."""
    return spec_digest(protocol.decode(protocol.encode(spec), WorkflowSpec))


def _refuse_another_specs(spec: WorkflowSpec, result: WorkflowResult) -> None:
    """Raise ``WorkflowConflictError`` when ``result`` is of another spec submitted under the
    same (chosen) id first: two submissions that raced each other before either had a record
    (or one queued behind a backlog) both passed the check at submission; the hubs ran the
    first and refused the other, whose caller waited on the same id."""
    if result.spec_digest is not None and result.spec_digest != wire_digest(spec):
        raise WorkflowConflictError(
            f"workflow id {spec.workflow_id!r} was submitted with another spec at about the "
            "same time, which ran; this spec did not (submit it under a new id)",
            workflow_id=spec.workflow_id,
        )
