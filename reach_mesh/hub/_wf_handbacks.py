"""Workflows this hub handed back that no hub took again: adopted from their records.

A hub whose run of a workflow outlives its retries on an infrastructure error hands the
submission back (a ``nak``, ``WorkflowEngine._own``) for the hubs' consumer to deliver again,
to any hub, which resumes the workflow from its records. Across a JetStream election the new
leader of ``REACH_WF`` may instead delete it, unacked (nats-server 2.15.1, chaos: its drifted
copy of the consumer's state): never delivered again and no longer stored for the orphan
sweep (``OrphanSweep``), its workflow would stay RUNNING with no hub running it.

So the hub remembers each workflow it hands back (``_remember_hand_back``) and, from its
keepalive loop, looks at those handed back more than ``1 + 2 * workflow_ack_wait`` seconds
ago (:meth:`HandBacks._check_hand_backs`). One running here again (delivered again, or adopted)
is forgotten; so is one whose record, read from its stream's leader, is gone, final, at
another revision than this hub's last write or naming another owner (resumed elsewhere, or
ended). One still as this hub left it is **adopted** as the sweep adopts a forgotten
submission: from the stored message if ``REACH_WF`` still has it, else from one rebuilt from
the run's spec under the record's ``submission_seq`` (another sequence would be taken for a
re-submission), its trace context and its submission time (the deadline still runs from
it). A record that cannot be read is asked again at the next tick. Kept an hour at most.

The memory is the hub's own: if this hub dies too, such a workflow stays RUNNING.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import TYPE_CHECKING, Any, Final

from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from reach_mesh import protocol
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.hub._step_state import Workflow
from reach_mesh.hub._wf_orphans import OrphanSweep
from reach_mesh.workflow import WorkflowRecord, stored_record

__all__ = ["HANDED_BACK_KEPT", "HandBacks"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: Seconds a hand-back (and a workflow adopted from one, for its warning) is remembered.
HANDED_BACK_KEPT: Final = 3600.0


class HandBacks(OrphanSweep):
    """Hand-backs not delivered again (a base of ``WorkflowEngine``; see the module)."""

    #: Workflows this hub handed back, by (namespace, id): the run's ``Workflow`` (its
    #: submission's sequence, its last record revision) and when, by the event loop's clock.
    _handed: dict[tuple[str, str], tuple[Workflow, float]]
    #: Workflows adopted from a hand-back (warned once each), and when.
    _readopted: dict[tuple[str, str], float]
    #: Runs of submissions delivered to this hub, by stream sequence (``WorkflowEngine``).
    _runs_by_seq: dict[int, asyncio.Task[None]]
    _rechecking: asyncio.Future[None] | None

    if TYPE_CHECKING:

        async def _record_now(
            self, ns: str, workflow_id: str, end: float | None = None
        ) -> tuple[bytes, int] | None: ...

        def _background(self, aw: Any) -> None: ...

    def _init_hand_backs(self) -> None:
        self._handed = {}
        self._readopted = {}
        self._rechecking = None

    def _remember_hand_back(self, wf: Workflow) -> None:
        """``wf``'s run hands its submission back (``_own``): remember it, when its record
        and submission are known (a run that wrote no record has nothing to resume)."""
        if wf.seq is None or wf.rev == 0:
            return
        self._handed[(wf.ns, wf.id)] = (wf, asyncio.get_running_loop().time())

    def _recheck_hand_backs(self) -> None:
        """From the keepalive loop: look at the hand-backs, one pass at a time."""
        if self._handed and (self._rechecking is None or self._rechecking.done()):
            self._rechecking = asyncio.ensure_future(self._check_quietly())
            self._background(self._rechecking)

    async def _check_quietly(self) -> None:
        try:
            await self._check_hand_backs()
        except Exception as err:  # (JetStream errors) the next tick looks again
            log.debug("handed-back workflows: %r", err)

    def _running_here(self, wf: Workflow) -> bool:
        """Whether a run of ``wf`` is on this hub: one that owns it, one adopting it, or one
        its submission was delivered to again (before that run's compare-and-set puts it in
        ``_owning``; adopted then, the two runs would take it from each other)."""
        seq = wf.seq or 0
        return (wf.ns, wf.id) in self._owning or seq in self._adopting or seq in self._runs_by_seq

    async def _check_hand_backs(self) -> None:
        """One pass (see the module): forget or adopt each hand-back old enough."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for key, at in list(self._readopted.items()):
            if now - at > HANDED_BACK_KEPT:
                del self._readopted[key]
        after = 1.0 + 2 * self._settings.workflow_ack_wait
        for key, (wf, at) in list(self._handed.items()):
            if now - at > HANDED_BACK_KEPT:
                del self._handed[key]
                continue
            if now - at < after:
                continue
            if self._running_here(wf):
                del self._handed[key]
                continue
            try:
                got = await self._record_now(wf.ns, wf.id, loop.time() + 2.0)
            except MeshUnavailableError:
                continue  # asked again at the next tick
            record = stored_record(WorkflowRecord, got)
            if (
                got is None
                or record is None
                or record.result is not None
                or record.state.final
                or got[1] != wf.rev
                or record.owner != self.hub_id
            ):
                del self._handed[key]  # resumed elsewhere, or ended
                continue
            seq = record.submission_seq if record.submission_seq is not None else wf.seq
            assert seq is not None
            try:
                raw = await self._js.get_msg(protocol.STREAM_WF, seq=seq)
            except NotFoundError:
                raw = _rebuilt(wf, record, seq)
            except Exception as err:  # (JetStream errors) at the next tick
                log.debug("handed-back workflow %s: %r", wf.id, err)
                continue
            if self._handed.get(key, (None, 0.0))[0] is not wf or self._running_here(wf):
                continue  # handed back again meanwhile, or running here again
            if not self._shares.admits(wf.ns):
                continue  # this hub runs its share: at a later tick
            del self._handed[key]
            waited = now - at
            if key in self._readopted:
                log.info(
                    "workflow %s handed back %.0f s ago and not delivered again since: "
                    "adopted again",
                    wf.id,
                    waited,
                )
            else:
                log.warning(
                    "workflow %s handed back %.0f s ago and not delivered again since: "
                    "adopted, resuming from its records",
                    wf.id,
                    waited,
                )
                self.orphans_adopted += 1
                if self._metrics is not None:
                    self._metrics.workflow_orphans_total.labels("adopted").inc()
            self._readopted[key] = loop.time()
            raw.seq = seq
            self._start_adopted(raw, wf.ns)


def _rebuilt(wf: Workflow, record: WorkflowRecord, seq: int) -> RawStreamMsg:
    """The submission of ``wf`` as the stream had it: its spec, its trace context, its
    sequence and its submission time (the record's, else the run's)."""
    submitted = record.submitted_at if record.submitted_at is not None else wf.submitted_at
    return RawStreamMsg(
        subject=protocol.wf_submit(wf.ns),
        seq=seq,
        data=protocol.encode(wf.spec),
        headers=dict(wf.headers),
        stream=protocol.STREAM_WF,
        time=datetime.datetime.fromtimestamp(submitted, tz=datetime.UTC),
    )
