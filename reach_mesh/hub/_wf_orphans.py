"""Submissions the hubs' consumer has forgotten: adopted, so that no workflow is lost to it.

A submission stays in ``REACH_WF`` (a work queue) until a hub acks it, after its result is
stored. nats-server keeps, per consumer, an ack floor: every message at or below it counts as
acked. Across leader elections that state can drift from the stream's (chaos seed 84,
``node_kill``: a workflow handed back with a nak 46 ms before its consumer's leader moved was
never delivered again; the new leader's ack floor had passed it, and five acked submissions
were still in the stream): a message at or below the floor that is still stored is one the
consumer will never deliver again. If its workflow has no result, nothing would ever run it.

Each hub sweeps for them (:meth:`OrphanSweep._sweep_orphans`, from the keepalive loop, every
``ORPHAN_SWEEP_EVERY`` seconds, at most ``_SWEEP_MAX`` messages each, the next sweep going on
from where the last one stopped; only messages submitted more than two ack waits ago): a
forgotten submission whose workflow is final is deleted; any other is **adopted** — run from
the stored message as if delivered, within the hub's ``workflow_concurrency`` and its fair
shares — and deleted once the engine is done with it (its result or its refusal stored, or
another message found running its workflow); one the engine hands back stays, adopted again
once the hand-back's delay has passed. A submission is adopted by the hub the record of its
workflow id names as owner (when that hub does not run it), by any hub when there is no record
or it names no owner (never started; of two hubs adopting it at once, the second takes it over
by CAS and fences the first), or when nobody has listened for its owner at every probe for an
ack wait (gone; see :meth:`OrphanSweep._gone`). A submission that is no workflow of its
subject's namespace goes by the id its refusal would be stored under, and by the same rule:
adopted, it is refused as a delivered one is (a FAILED result for that id); one that names no
valid id is adopted by any hub and refused with nothing stored. Taking a workflow over is the
usual fenced takeover (the record's CAS): steps in flight are adopted, none runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any, Final

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import Error as JetStreamError
from nats.js.errors import NotFoundError

from reach_mesh import protocol
from reach_mesh.config import MeshSettings
from reach_mesh.errors import ReachError
from reach_mesh.hub._server_clock import ServerClock
from reach_mesh.hub._wf_reject import refused_id
from reach_mesh.hub.shares import Shares
from reach_mesh.tracing.metrics import HubMetrics
from reach_mesh.workflow import WorkflowRecord, WorkflowSpec, stored_record

__all__ = ["ORPHAN_SWEEP_EVERY", "OrphanSweep"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: Seconds between two sweeps of a hub (at least; the keepalive loop runs them).
ORPHAN_SWEEP_EVERY: Final = 30.0
#: Forgotten submissions one sweep looks at, at most.
_SWEEP_MAX: Final = 256
#: Seconds a silent owner is asked again at each sweep after a forgotten submission last
#: named it.
_SILENCE_KEPT: Final = 600.0


class _Adopted(Msg):
    """A stored submission run as if delivered. There is no delivery to ack, nak or renew (the
    consumer forgot it): what the engine does with it is only noted — an ack or a term (the
    engine is done with it: its result or refusal is stored, or another message runs its
    workflow) makes the sweep delete it from the stream; a nak (handed back) leaves it stored,
    adopted again once the nak's delay has passed, as the consumer would redeliver it."""

    async def ack(self) -> None:
        self._ackd = True

    async def ack_sync(self, timeout: float = 1.0) -> Msg:
        self._ackd = True
        return self

    #: The delay of the engine's hand-back (``nak``), if it handed it back.
    handed_back: float | None = None

    async def nak(self, delay: int | float | None = None) -> None:
        self.handed_back = float(delay or 0)

    async def in_progress(self) -> None:
        return None

    async def term(self) -> None:
        self._ackd = True


def _adopted(nc: Any, raw: RawStreamMsg) -> _Adopted:
    seq = raw.seq or 0
    msg = _Adopted(_client=nc, subject=raw.subject or "", reply="", data=raw.data or b"")
    msg.headers = dict(raw.headers or {})
    msg._metadata = Msg.Metadata(
        sequence=Msg.Metadata.SequencePair(consumer=0, stream=seq),
        num_pending=0,
        num_delivered=0,
        timestamp=raw.time,  # type: ignore[arg-type]  # (the server's, as a delivery's)
        stream=protocol.STREAM_WF,
        consumer=protocol.CONSUMER_HUBS,
    )
    return msg


class OrphanSweep:
    """Forgotten submissions (a base of ``WorkflowEngine``, which sets every attribute below)."""

    _nc: Any
    _js: JetStreamContext
    _settings: MeshSettings
    _server_clock: ServerClock
    hub_id: str
    _owning: dict[tuple[str, str], Any]
    _running: dict[asyncio.Task[None], Msg]
    _shares: Shares
    #: Submissions this hub adopted and runs now, by stream sequence.
    _adopting: dict[int, asyncio.Task[None]]
    #: Submissions this hub adopted and handed back (by stream sequence): when they may be
    #: adopted again (the hand-back's delay, as the consumer would wait it, by the event
    #: loop's clock); adopted again, they are not counted nor logged as forgotten again.
    _handed_back: dict[int, float]
    #: Where the next sweep starts (a stream sequence): one sweep looks at ``_SWEEP_MAX``
    #: messages at most, the next one at those behind them.
    _sweep_from: int
    #: Owners (hub ids) silent at every probe since the first: (that probe's time, when a
    #: forgotten submission last named the owner, its namespace), by the event loop's clock.
    _silent: dict[str, tuple[float, float, str]]
    _metrics: HubMetrics | None
    orphans_adopted: int
    orphans_deleted: int

    if TYPE_CHECKING:

        async def _own(self, msg: Msg) -> None: ...

        async def ask(self, subject: str, body: bytes, *, timeout: float) -> bytes: ...

        async def _workflow_at_leader(
            self, ns: str, workflow_id: str
        ) -> tuple[bytes, int] | None: ...

    async def _sweep_quietly(self) -> None:
        """A sweep (from the keepalive loop); JetStream errors wait for the next one."""
        try:
            await self._sweep_orphans()
        except Exception as err:
            log.debug("sweep for forgotten submissions: %r", err)

    async def _sweep_orphans(self) -> None:
        """One sweep (see the module): adopt or delete what the consumer forgot, from where
        the last sweep stopped (where it failed, too); back to the stream's start once past
        the ack floor."""
        info = await self._js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
        floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
        probed = await self._probe_silent()
        now = asyncio.get_running_loop().time()
        for seq, at in list(self._handed_back.items()):
            if at < now - 3600:  # (ended by another hub meanwhile, most likely)
                del self._handed_back[seq]
        if not floor:
            return
        oldest = self._server_clock.now() - 2 * self._settings.workflow_ack_wait
        seq = self._sweep_from
        try:
            for _ in range(_SWEEP_MAX):
                try:
                    raw = await self._js.get_msg(
                        protocol.STREAM_WF, seq=seq, subject=protocol.wf_submit("*"), next=True
                    )
                except NotFoundError:
                    seq = 1
                    return
                if raw.seq is None or raw.seq > floor:
                    seq = 1
                    return  # the consumer has it (pending, or not delivered yet)
                seq = raw.seq + 1
                if raw.time is None or raw.time.timestamp() > oldest:
                    continue  # submitted lately: left to the next sweep
                try:
                    await self._forgotten(raw, probed)
                except Exception as err:  # (JetStream errors) asked again at the next pass
                    log.debug("forgotten submission %d: %r", raw.seq, err)
        finally:
            self._sweep_from = seq

    async def _probe_silent(self) -> dict[str, tuple[bool, float]]:
        """Ask again each owner that was silent (``_silent``), so that a silence is one from
        probe to probe, however long a pass over the stream takes; forget those no forgotten
        submission has named for ``_SILENCE_KEPT`` seconds. Returns the answers (see
        :meth:`_gone`)."""
        probed: dict[str, tuple[bool, float]] = {}
        loop = asyncio.get_running_loop()
        for owner, (_, needed, ns) in list(self._silent.items()):
            if loop.time() - needed > _SILENCE_KEPT:
                del self._silent[owner]
                continue
            probed[owner] = (await self._answers(ns, owner), loop.time())
            if probed[owner][0]:
                del self._silent[owner]
        return probed

    async def _forgotten(self, raw: RawStreamMsg, probed: dict[str, tuple[bool, float]]) -> None:
        """Delete ``raw`` (a submission at or below the ack floor) when its workflow is final;
        adopt it when its workflow is unfinished and this hub should (see the module). A
        submission that is no workflow of its subject's namespace is looked up under the id
        its refusal would be stored under, and adopted by the same rule (to be refused), or
        by any hub when it names no valid id (refused with nothing stored, then deleted)."""
        if raw.seq is None or raw.seq in self._adopting:
            return
        again = self._handed_back.get(raw.seq)
        if again is not None and again > asyncio.get_running_loop().time():
            return  # handed back for later
        ns = protocol.submit_namespace(raw.subject or "")
        try:
            spec: WorkflowSpec | None = WorkflowSpec.model_validate_json(raw.data or b"")
        except ValueError:
            spec = None
        if spec is not None and spec.namespace == ns:
            wf_id = spec.workflow_id
        else:
            wf_id = refused_id(raw.headers, raw.data or b"")[0]
        try:
            protocol.validate_namespace(ns)
            protocol.validate_workflow_id(wf_id)
        except ReachError:
            wf_id = ""  # nothing stored can name it
        if wf_id:
            if (ns, wf_id) in self._owning:
                return  # running here: its result's store ends it
            got = await self._workflow_at_leader(ns, wf_id)
            record = stored_record(WorkflowRecord, got)
            if record is not None and (record.result is not None or record.state.final):
                await self._delete(raw)
                self._handed_back.pop(raw.seq, None)
                self.orphans_deleted += 1
                if self._metrics is not None:
                    self._metrics.workflow_orphans_total.labels("deleted").inc()
                return
            owner = None if record is None else record.owner
            if owner not in (None, self.hub_id) and not await self._gone(ns, owner, probed):
                return  # a live owner (or one silent only lately): its own sweep adopts it
        if not self._shares.admits(ns):
            return  # this hub runs its share: left to a later pass (or another hub's)
        if again is None:
            log.warning(
                "workflow submission %s (stream sequence %d) was forgotten by the hubs' "
                "consumer (a JetStream election); adopted, resuming from its records",
                wf_id or "?",
                raw.seq,
            )
            self.orphans_adopted += 1
            if self._metrics is not None:
                self._metrics.workflow_orphans_total.labels("adopted").inc()
        else:
            log.info(
                "workflow submission %s (stream sequence %d): adopted again", wf_id or "?", raw.seq
            )
        self._start_adopted(raw, ns)

    def _start_adopted(self, raw: RawStreamMsg, ns: str) -> None:
        """Run ``raw`` (a submission of namespace ``ns``, with its stream sequence) as if
        delivered, within the namespace's share (the caller checked that it admits it)."""
        seq = raw.seq or 0
        msg = _adopted(self._nc, raw)
        self._shares.take(ns)
        task = asyncio.create_task(self._adopt(raw, msg), name="reach-workflow-adopted")
        self._adopting[seq] = task
        self._running[task] = msg

        def done(task: asyncio.Task[None]) -> None:
            self._running.pop(task, None)
            self._shares.give(ns)
            if self._adopting.get(seq) is task:
                del self._adopting[seq]

        task.add_done_callback(done)

    async def _adopt(self, raw: RawStreamMsg, msg: _Adopted) -> None:
        """Run an adopted submission as a delivered one; delete it once the engine is done
        with it (acked or termed), not when it hands it back."""
        try:
            await self._own(msg)
            if msg.is_acked:
                self._handed_back.pop(raw.seq or 0, None)
                await self._delete(raw)
            elif msg.handed_back is not None:
                loop = asyncio.get_running_loop()
                self._handed_back[raw.seq or 0] = loop.time() + msg.handed_back
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the next sweep tries again
            log.warning("adopted workflow submission %s: %r", raw.seq, err)

    async def _gone(self, ns: str, owner: str, probed: dict[str, tuple[bool, float]]) -> bool:
        """Whether hub ``owner`` is gone: nobody listened for it at a probe, nor at every probe
        since one at least an ack wait before (one silence may be a reconnect). ``probed``
        holds this sweep's answers, with when each was asked (one probe per owner and
        sweep)."""
        loop = asyncio.get_running_loop()
        if owner not in probed:
            probed[owner] = (await self._answers(ns, owner), loop.time())
        answered, at = probed[owner]
        if answered:
            self._silent.pop(owner, None)
            return False
        first = self._silent.get(owner, (at, at, ns))[0]
        self._silent[owner] = (first, loop.time(), ns)
        return at - first >= self._settings.workflow_ack_wait

    async def _answers(self, ns: str, owner: str) -> bool:
        """Whether hub ``owner`` answers (a view request to it, as other hubs ask it, with the
        engine's random reply tokens): False only when nobody listens for it."""
        body = json.dumps({"workflow_id": "-", "within_s": 0.5}).encode()
        try:
            await self.ask(protocol.hub_peer(ns, "workflow", owner), body, timeout=1.0)
        except nats.errors.NoRespondersError:
            return False
        except (nats.errors.Error, ReachError, OSError):
            return True  # slow or busy: taken for alive
        return True

    async def _delete(self, raw: RawStreamMsg) -> None:
        if raw.seq is None:
            return
        with contextlib.suppress(NotFoundError, JetStreamError):
            await self._js.delete_msg(protocol.STREAM_WF, raw.seq)
