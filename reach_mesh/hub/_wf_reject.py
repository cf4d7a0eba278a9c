"""The submissions a hub does not run: those it refuses (stored as a FAILED result, then
termed), those that lost the start of their workflow to another message of the same id, and
those it gives back for later (their namespace holds its fair share of the hub).
Split from :mod:`reach_mesh.hub.workflows` (which runs the workflows this hub owns)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final, Literal

from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError

from reach_mesh import protocol
from reach_mesh._consume import PullConsumer, stream_seq
from reach_mesh.errors import MeshUnavailableError, ReachError
from reach_mesh.hub import _durable
from reach_mesh.hub._steps import Workflow
from reach_mesh.hub._wf_queries import WorkflowQueries
from reach_mesh.hub.shares import Shares, defer_delay
from reach_mesh.logs import NAMESPACE_SHARE, LineBudget, log_event
from reach_mesh.models import ErrorBody, TaskState
from reach_mesh.tracing import trace_id_from_headers
from reach_mesh.workflow import (
    WorkflowRecord,
    WorkflowResult,
    WorkflowSpec,
    spec_digest,
    stored_record,
)

__all__ = ["WorkflowRefusals", "refused_id"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: How long a submission this hub refuses waits before it comes back, while a workflow of its
#: id runs from a record that does not say which message it runs from.
_REFUSED_RUNNING_DELAY: Final = 30.0


class WorkflowRefusals(WorkflowQueries):
    """Refused and superseded submissions (the base of ``WorkflowEngine``, which sets every
    attribute below)."""

    #: Submissions refused because their id is another spec's workflow.
    conflict_total: int
    #: Submissions given back for later: their namespace held its fair share (``_defer``).
    deferred_total: int
    _defer_lines: LineBudget
    #: What each namespace holds of this hub: workflows, and the bytes of their submissions.
    _shares: Shares
    _held_bytes: Shares
    _pull: PullConsumer | None

    if TYPE_CHECKING:

        async def _publish_done(
            self,
            ns: str,
            result: WorkflowResult,
            headers: dict[str, str],
            encoded: bytes | None = None,
        ) -> None: ...

        def _count_done(self, ns: str, kind: str, result: WorkflowResult) -> None: ...

    def _defer(self, msg: Msg, ns: str) -> None:
        """Fairness: this hub runs ``workflow_concurrency`` workflows (or ``HELD_BYTES`` of
        submissions) and ``ns`` its fair share of them (:class:`~reach_mesh.hub.shares.Shares`).
        The submission goes back to the stream for later — a nak whose delay grows with its
        deliveries (:func:`~reach_mesh.hub.shares.defer_delay`) — and the pull moves on to the
        submissions behind it, other namespaces' among them. Nothing is read or written for
        it: whoever takes it later starts or resumes it from the records as usual."""
        self.deferred_total += 1
        if self._metrics is not None:
            self._metrics.workflow_deferred_total.inc()
        try:
            deliveries = msg.metadata.num_delivered or 1
        except Exception:
            deliveries = 1
        if self._defer_lines.take() is not None:
            log_event(
                log,
                NAMESPACE_SHARE,
                f"this hub runs {self._shares.total} workflows ({self._held_bytes.total:,} "
                f"bytes of submissions) and namespace {ns!r} its fair share of them "
                f"({self._shares.held(ns)} of {self._shares.share(ns)}, "
                f"{self._held_bytes.held(ns):,} of {self._held_bytes.share(ns):,} bytes): its "
                "further submissions wait in the stream",
                level=logging.WARNING,
                namespace=ns,
                deferred=self.deferred_total,
            )
        self._background(self._hand_back(msg, defer_delay(deliveries)))

    async def _hand_back(self, msg: Msg, delay: float) -> None:
        try:
            await msg.nak(delay=delay)
        finally:
            if self._pull is not None:
                self._pull.release()

    async def _refuse_taken(self, msg: Msg, wf: Workflow, result: WorkflowResult | None) -> None:
        """Refuse a submission whose id is another spec's workflow: counted, never run. When
        that workflow has finished, its result is announced again, as for a repeat of the
        same spec: a caller waiting on ``.done`` (one that skipped the record check before
        submitting) reads the other spec's ``spec_digest`` there and knows at once. One still
        running announces its result when it ends."""
        self.conflict_total += 1
        log.warning("workflow %s: submission refused, the id is taken by another spec", wf.id)
        if result is not None:
            with contextlib.suppress(Exception):
                await self._publish_done(wf.ns, result, wf.headers)
        with contextlib.suppress(Exception):
            await msg.term()

    async def _lost_start(self, msg: Msg, wf: Workflow) -> bool:
        """End a submission whose run lost its workflow's start to another message of the same
        id (submitted again: each submission is stored), as the record tells; False when the
        record tells no such thing (another hub took this very message over)."""
        won = await self._won_by_another(wf)
        if won is None:
            return False
        if won.spec_digest not in (None, wf.digest):
            await self._refuse_taken(msg, wf, won.result)
        elif won.result is not None:
            # Finished already: back in a moment, it finds the result stored and announces
            # it again (as for any later re-submission).
            with contextlib.suppress(Exception):
                await msg.nak(delay=0.1)
        else:  # its winner runs it, and announces its result
            log.info("workflow %s: submitted again while another hub runs it; dropped", wf.id)
            self._jsc.ack_later(msg)
        return True

    async def _won_by_another(self, wf: Workflow) -> WorkflowRecord | None:
        """The record of a workflow this hub never owned (it lost its first write) that
        another submission message than ``wf``'s won: it runs from that one
        (``WorkflowRecord.submission_seq``), or has ended already — a race of two messages
        of one id, both over a record no hub ran (a cancel made before either started). Read
        from the stream's leader; None when it is not that, or cannot be read."""
        if wf.rev != 0 or wf.seq is None:
            return None
        end = asyncio.get_running_loop().time() + 2.0
        try:
            got = await self._record_now(wf.ns, wf.id, end)
        except MeshUnavailableError:
            return None
        record = stored_record(WorkflowRecord, got)
        if record is None:
            return None
        if record.result is not None:
            return record
        other = record.submission_seq is not None and record.submission_seq != wf.seq
        return record if other else None

    async def _reject(self, msg: Msg, headers: dict[str, str], err: ReachError) -> None:
        """A submission this hub refuses: store and publish its failed result, then term it
        (never redelivered) — in that order: stored first, a rejection that meets a JetStream
        outage comes back (nak) rather than leaving its caller without an answer.

        An id that is a workflow's already keeps that workflow's record and result, with two
        exceptions: a record holding only a cancel made before any hub took the submission
        (the rejection is its end), and a running workflow whose own submission this is
        (``WorkflowRecord.submission_seq``) — redelivered to a hub that cannot run it (hubs of
        different versions, or ``max_payload``s, in a rolling change): it ends FAILED with
        this error, over the record (its old owner's final write then fails and reads this
        result), rather than the term leaving it RUNNING with no message to resume it from."""
        log.info("rejecting workflow submission on %s: %s", msg.subject, err.message)
        ns = protocol.submit_namespace(msg.subject)
        wf_id, kind = refused_id(msg.headers, msg.data)
        try:
            protocol.validate_workflow_id(wf_id)
            protocol.validate_namespace(ns)
        except ReachError:
            with contextlib.suppress(Exception):
                await msg.term()
            return  # nobody can be waiting for a result without a valid id
        digest = _digest_of(msg.data, self._settings.max_payload * 8)
        trace_id = trace_id_from_headers(headers)  # the caller's, as a run's result carries
        result = WorkflowResult(
            workflow_id=wf_id,
            kind=kind,
            state=TaskState.FAILED,
            error=ErrorBody(code=err.code, message=err.message, details=err.details),
            hub_id=self.hub_id,
            finished_at=self._server_clock.now(),
            spec_digest=digest,
            trace_id=trace_id,
        )
        assert self._wf_kv is not None
        kv = self._wf_kv
        key = protocol.workflow_key(ns, wf_id)
        record = WorkflowRecord(
            state=result.state,
            owner=self.hub_id,
            result=result,
            spec_digest=digest,
            trace_id=trace_id,
        )
        seq = stream_seq(msg)
        try:
            try:
                await _durable.create(
                    kv,
                    key,
                    protocol.encode(record),
                    self._io_deadline(),
                    on_retry=self._infra_retry,
                )
            except KeyWrongLastSequenceError:
                got = await self._io(f"read {key}", lambda: _durable.get(kv, key), None)
                held = stored_record(WorkflowRecord, got)
                if got is None or held is None or held.result is not None:
                    raise
                own = held.submission_seq is not None and held.submission_seq == seq
                if not (held.cancelled_before_start or own):
                    if held.submission_seq is None and held.owner is not None:
                        # A running workflow of a hub that did not say which message it runs
                        # from: this may be that message. Not termed: it comes back (to a
                        # hub that can run it, or once the workflow has ended).
                        log.warning(
                            "workflow %s runs while this hub refuses a submission of it (%s): "
                            "handed back for later",
                            wf_id,
                            err.code,
                        )
                        with contextlib.suppress(Exception):
                            await msg.nak(delay=_REFUSED_RUNNING_DELAY)
                        return
                    raise
                if own:
                    log.warning(
                        "workflow %s came back to a hub that refuses it (%s: %s): it ends FAILED",
                        wf_id,
                        err.code,
                        err.message,
                    )
                await _durable.cas(
                    kv,
                    key,
                    protocol.encode(record),
                    got[1],
                    self._io_deadline(),
                    on_retry=self._infra_retry,
                )
            await self._publish_done(ns, result, headers)
        except KeyWrongLastSequenceError:
            # The id is a workflow's already: its own record and result stand.
            self.conflict_total += 1
            with contextlib.suppress(Exception):
                await msg.term()
            return
        except Exception as e:
            # Not stored (JetStream unavailable past the retries): the rejection is made
            # again when the submission comes back.
            log.warning("cannot store the rejection of workflow %s: %r", wf_id, e)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        with contextlib.suppress(Exception):
            await msg.term()
        self._count_done(ns, kind, result)


def refused_id(
    headers: dict[str, str] | None, data: bytes
) -> tuple[str, Literal["fanout", "chain"]]:
    """The workflow id a refused submission is answered under, and its kind: the id its
    ``Nats-Msg-Id`` names, else (a client that skips the header, or names no valid id there)
    the one its body names, so that its caller, waiting on that id, gets the answer. "" when
    it names none (not validated here)."""
    wf_id = protocol.named_workflow_id(headers)
    kind: Literal["fanout", "chain"] = "fanout"
    with contextlib.suppress(Exception):
        body = protocol.loads(data)
        if body.get("kind") == "chain":
            kind = "chain"
        if not wf_id and isinstance(body.get("workflow_id"), str):
            wf_id = body["workflow_id"]
    return wf_id, kind


def _digest_of(data: bytes, max_size: int) -> str | None:
    """:func:`spec_digest` of a refused submission that still reads as a spec (refused for
    what it asks, not its shape): the refusal is then this spec's, and another spec submitted
    under the same id is told a conflict rather than handed the refusal. None when it does not
    read as one."""
    try:
        return spec_digest(protocol.decode(data, WorkflowSpec, max_size=max_size))
    except Exception:
        return None
