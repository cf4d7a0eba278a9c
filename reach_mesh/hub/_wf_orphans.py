"""Submissions the hubs' consumer has forgotten: adopted, so that no workflow is lost to it.

A submission stays in ``REACH_WF`` (a work queue) until a hub acks it, after its result is
stored. nats-server keeps, per consumer, an ack floor: every message at or below it counts as
acked. Across leader elections that state can drift from the stream's (chaos seed 84,
``node_kill``: a workflow handed back with a nak 46 ms before its consumer's leader moved was
never delivered again; the new leader's ack floor had passed it, and five acked submissions
were still in the stream): a message at or below the floor that is still stored is one the
consumer will never deliver again. If its workflow has no result, nothing would ever run it.

Each hub sweeps for them (:meth:`OrphanSweep._sweep_orphans`, from the keepalive loop, every
``ORPHAN_SWEEP_EVERY`` seconds, only messages submitted more than two ack waits ago): a
forgotten submission whose workflow is final is deleted; one whose workflow is unfinished is
**adopted** — run from the stored message as if delivered, and deleted once its result is
stored — by the hub its record names as owner (when that hub does not run it), by any hub
when the record names none (never started; of two hubs adopting it at once, the second takes
it over by CAS and fences the first), or when nobody listens for its owner (no responders:
gone). Taking a workflow over is the usual fenced takeover (the record's CAS): steps in
flight are adopted, none runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
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
from reach_mesh.workflow import WorkflowRecord, WorkflowSpec, stored_record

__all__ = ["ORPHAN_SWEEP_EVERY", "OrphanSweep"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: Seconds between two sweeps of a hub (at least; the keepalive loop runs them).
ORPHAN_SWEEP_EVERY: Final = 30.0
#: Forgotten submissions one sweep looks at, at most.
_SWEEP_MAX: Final = 256


class _Adopted(Msg):
    """A stored submission run as if delivered: there is no delivery to ack, nak or renew
    (the consumer forgot it); it is deleted from the stream once its result is stored."""

    async def ack(self) -> None:
        return None

    async def ack_sync(self, timeout: float = 1.0) -> Msg:
        return self

    async def nak(self, delay: int | float | None = None) -> None:
        return None

    async def in_progress(self) -> None:
        return None

    async def term(self) -> None:
        return None


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
    hub_id: str
    _owning: dict[tuple[str, str], Any]
    #: Workflows this hub adopted and runs now (by ``(ns, id)``).
    _adopting: dict[tuple[str, str], asyncio.Task[None]]
    orphans_adopted: int
    orphans_deleted: int

    if TYPE_CHECKING:

        async def _own(self, msg: Msg) -> None: ...

        async def ask(self, subject: str, body: bytes, *, timeout: float) -> bytes: ...

        async def _workflow_at_leader(
            self, ns: str, workflow_id: str
        ) -> tuple[bytes, int] | None: ...

    async def _sweep_orphans(self) -> None:
        """One sweep (see the module): adopt or delete what the consumer forgot."""
        info = await self._js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
        floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
        if not floor:
            return
        oldest = time.time() - 2 * self._settings.workflow_ack_wait
        seq = 1
        for _ in range(_SWEEP_MAX):
            try:
                raw = await self._js.get_msg(
                    protocol.STREAM_WF, seq=seq, subject=protocol.wf_submit("*"), next=True
                )
            except NotFoundError:
                return
            if raw.seq is None or raw.seq > floor:
                return  # the consumer has it (pending, or not delivered yet)
            seq = raw.seq + 1
            if raw.time is None or raw.time.timestamp() > oldest:
                continue  # submitted lately: left to the next sweep
            await self._forgotten(raw)

    async def _forgotten(self, raw: RawStreamMsg) -> None:
        """Delete ``raw`` (a submission at or below the ack floor) when its workflow is final;
        adopt its workflow when it is unfinished and this hub should (see the module)."""
        try:
            spec = WorkflowSpec.model_validate_json(raw.data or b"")
        except ValueError:
            await self._delete(raw)  # never a workflow (no FAILED record is stored for it)
            return
        key = (spec.namespace, spec.workflow_id)
        if key in self._owning or key in self._adopting:
            return  # running here: its result's store ends it
        got = await self._workflow_at_leader(*key)
        record = stored_record(WorkflowRecord, got)
        if record is not None and (record.result is not None or record.state.final):
            await self._delete(raw)
            self.orphans_deleted += 1
            return
        owner = None if record is None else record.owner
        if owner not in (None, self.hub_id) and await self._answers(spec.namespace, owner):
            return  # a live owner: its own sweep adopts it
        log.warning(
            "workflow %s: its submission was forgotten by the hubs' consumer (a JetStream "
            "election); adopted, resuming from its records",
            spec.workflow_id,
        )
        self.orphans_adopted += 1
        task = asyncio.create_task(self._adopt(raw, key), name="reach-workflow-adopted")
        self._adopting[key] = task

    async def _adopt(self, raw: RawStreamMsg, key: tuple[str, str]) -> None:
        try:
            await self._own(_adopted(self._nc, raw))
            got = await self._workflow_at_leader(*key)
            record = stored_record(WorkflowRecord, got)
            if record is not None and (record.result is not None or record.state.final):
                await self._delete(raw)
        except Exception as err:  # the next sweep tries again
            log.warning("workflow %s: adopting it failed: %r", key[1], err)
        finally:
            self._adopting.pop(key, None)

    async def _answers(self, ns: str, owner: str | None) -> bool:
        """Whether hub ``owner`` answers (a view request to it, as other hubs ask it, with the
        engine's random reply tokens): False only when nobody listens for it — it is gone."""
        if owner is None:
            return False
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
