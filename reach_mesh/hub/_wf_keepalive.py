"""The keepalive of the submissions a hub runs, and what a late one finds.

A hub holds each submission it runs in progress (``+WPI``) from one loop for all of them,
every ``workflow_ack_wait / 3`` (:meth:`SubmissionKeepalive._keepalive`); the same loop looks
at the workflows it handed back (:class:`~reach_mesh.hub._wf_handbacks.HandBacks`) and starts
the orphan sweep. A hub whose ticks came late (paused, cut off from NATS) first stops the runs
another hub took over meanwhile (``_stop_lost_runs``). ``_watch_submissions`` keeps the
``reach_workflow_submissions`` gauge from the shared consumer, and watches its leader
(``_stale_leader``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

from nats.js.api import ConsumerInfo

from reach_mesh import protocol
from reach_mesh._retry import describe
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.hub import _wf_orphans
from reach_mesh.hub._stale_leader import HOLD_FLOOR, StaleLeaderWatch, step_down
from reach_mesh.hub._wf_handbacks import HandBacks
from reach_mesh.tracing.metrics import HubMetrics

__all__ = ["SUBMISSIONS_EVERY", "SubmissionKeepalive"]

log = logging.getLogger("reach_mesh.hub.workflows")

#: Seconds between two reads of the shared consumer for ``reach_workflow_submissions``.
SUBMISSIONS_EVERY: Final = 5.0


class SubmissionKeepalive(HandBacks):
    """``+WPI`` for the submissions a hub runs (a base of ``WorkflowEngine``; see the module)."""

    _sweeping: asyncio.Task[None] | None
    #: The watch of ``_watch_submissions`` (None before its first look).
    _stale_watch: StaleLeaderWatch | None = None

    if TYPE_CHECKING:

        async def _owner_now(self, ns: str, workflow_id: str) -> str | None: ...

    async def _keepalive(self) -> None:
        """``+WPI`` for every submission this hub runs, every ``workflow_ack_wait / 3``: one
        loop for all of them.

        A hub that could not send them for an ack wait (paused, cut off from NATS, its loop
        stalled) may have lost workflows to another hub meanwhile, which took them over from
        the redelivered submission. It asks their records, and stops the runs it lost
        (``_stop_lost_runs``): its ``+WPI`` on its own, older delivery would keep the
        submission from coming back to any hub (nats-server takes it for the message's), so
        a new owner that died would leave the workflow unresumed until this run's next write
        failed — after its step, which may run for hours."""
        loop = asyncio.get_running_loop()
        wait = self._settings.workflow_ack_wait
        kept_at = loop.time()
        unchecked = False  # a late tick could not read every record: the next tick asks again
        swept_at = loop.time()
        while True:
            await asyncio.sleep(wait / 3)
            late = loop.time() - kept_at > wait
            unchecked = not await self._keep(check=late or unchecked)
            self._recheck_hand_backs()
            if self._nc.is_connected:
                kept_at = loop.time()
            if loop.time() - swept_at >= _wf_orphans.ORPHAN_SWEEP_EVERY and (
                self._sweeping is None or self._sweeping.done()
            ):
                swept_at = loop.time()
                self._sweeping = asyncio.create_task(self._sweep_quietly())

    async def _watch_submissions(self, metrics: HubMetrics | None) -> None:
        """Every ``SUBMISSIONS_EVERY`` seconds, the shared consumer's info and
        ``REACH_WF``'s: ``reach_workflow_submissions`` (absent while it cannot be read), and
        the watch on a consumer leader sitting on a stale copy of the stream
        (``_stale_leader``: a step-down asked for when it is seen long enough)."""
        loop = asyncio.get_running_loop()
        watch = StaleLeaderWatch(max(HOLD_FLOOR, 2 * self._settings.workflow_ack_wait))
        self._stale_watch = watch
        while True:
            try:
                info = await self._js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS)
            except Exception:
                info = None
                watch.unread()
            if metrics is not None:
                gauge = metrics.workflow_submissions
                if info is not None:
                    gauge.labels("waiting").set(info.num_pending or 0)
                    gauge.labels("taken").set(info.num_ack_pending or 0)
                else:
                    # Unread: no value, rather than an old one that max() over hubs would keep.
                    for stage in ("waiting", "taken"):
                        with contextlib.suppress(KeyError):
                            gauge.remove(stage)
            if info is not None and info.cluster is not None and info.cluster.leader:
                await self._watch_leader(watch, info, loop.time())
            await asyncio.sleep(SUBMISSIONS_EVERY)

    async def _watch_leader(self, watch: StaleLeaderWatch, info: ConsumerInfo, now: float) -> None:
        """One look of ``watch`` (the stream's info read now), and the step-down it asks for."""
        try:
            stream = await self._js.stream_info(protocol.STREAM_WF)
        except Exception:
            watch.unread()
            return
        verdict = watch.observe(stream, info, now)
        if verdict is None:
            return
        try:
            said = await step_down(
                self._nc,
                protocol.STREAM_WF,
                protocol.CONSUMER_HUBS,
                verdict.prefer,
                of=verdict.server,
            )
        except Exception as err:
            said = f"not answered: {describe(err)}"
        log.warning(
            "consumer %s of %s: its leader %s sits on a stale copy of the stream (%s): asked "
            "it to step down, %s (docs/operations.md, A consumer leader on a stale replica)",
            protocol.CONSUMER_HUBS,
            protocol.STREAM_WF,
            verdict.server,
            verdict.why,
            said,
        )

    async def _keep(self, *, check: bool) -> bool:
        """One keepalive pass: with ``check`` (a late tick, or one after a record could not
        be read), first stop the runs lost meanwhile; then ``+WPI`` for each run still here —
        none on a lost run's older delivery, not even once. False when a record could not be
        read (its run is kept)."""
        read = True
        if check:
            try:
                read = await self._stop_lost_runs()
            except Exception:
                read = False
        for task, msg in list(self._running.items()):
            if task.done() or task.cancelling():
                continue  # stopped as lost (above) or ending
            with contextlib.suppress(Exception):
                await msg.in_progress()
        return read

    async def _stop_lost_runs(self) -> bool:
        """Stop each run of a workflow whose record names another hub as its owner now (read
        from the stream's leader; a record that cannot be read keeps its run). False when a
        record could not be read (JetStream still recovering after the pause, ...)."""
        gate = asyncio.Semaphore(32)
        unread = 0

        async def check(ns: str, workflow_id: str, task: asyncio.Task[None]) -> None:
            nonlocal unread
            async with gate:
                try:
                    owner = await self._owner_now(ns, workflow_id)
                except MeshUnavailableError:
                    unread += 1
                    return
            if owner in (None, self.hub_id) or task.done():
                return
            log.warning(
                "workflow %s was taken over by hub %s while this hub could not keep it "
                "(paused, cut off); its run here stops",
                workflow_id,
                owner,
            )
            task.cancel()

        await asyncio.gather(
            *(check(ns, wid, task) for (ns, wid), (_, task) in list(self._owning.items()))
        )
        return unread == 0
