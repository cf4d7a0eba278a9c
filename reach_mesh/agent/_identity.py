"""An agent process's standing with the hubs: whether it may have been replaced by another
process of its id after a silence (paused, its loop blocked, cut off), the ask that settles it
(:meth:`IdentityMixin.confirm_identity`, over :func:`~reach_mesh.agent._one_process.other_process`),
and whether the hubs surely hold its lease (:meth:`IdentityMixin.in_touch`). Split from
``_agent.py``, whose lifecycle (registration, heartbeats, drain) reads and sets the state here
(``_heard_at``, ``_answered_at``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
from typing import Final

from nats.aio.client import Client as NATS

from reach_mesh import protocol
from reach_mesh.agent._one_process import other_process
from reach_mesh.agent._serving import AgentStatus
from reach_mesh.config import MeshSettings
from reach_mesh.errors import AgentReplacedError, ReachError
from reach_mesh.logs import AGENT_ID_IN_USE, log_event

__all__ = ["IdentityMixin"]

log = logging.getLogger("reach_mesh.agent")

#: How long an agent stays wary at most (``_be_wary``), in silences.
_WARY_SPANS: Final = 10


class IdentityMixin:
    """The replacement check and the lease's standing of :class:`~reach_mesh.agent.Agent`."""

    agent_id: str
    session: str
    settings: MeshSettings
    status: AgentStatus
    fault: ReachError | None
    _nc: NATS | None
    #: When a hub last answered a registration or heartbeat of ours (its send time).
    _answered_at: float
    #: When this process last knew it alone serves the id (``may_be_replaced``).
    _heard_at: float
    #: Until when fences are read only once the replicas caught up (``wary``), and since when.
    _wary_until: float
    _wary_since: float
    _replaced_after: float
    _confirming: asyncio.Task[bool] | None
    _touching: asyncio.Future[bool] | None
    _faulted: asyncio.Event
    _stopping: asyncio.Task[None] | None

    if typing.TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

        async def close(self) -> None: ...

        async def _beat(self, subject: str, timeout: float) -> None: ...

    def may_be_replaced(self) -> bool:
        """Silent to the hubs — no registration or heartbeat of ours answered, nor another
        process of the id ruled out, since — for as long as a new process of this id waits
        before it starts (``lease_timeout + suspect_timeout``, ``_one_process``): paused, its
        event loop blocked or cut off, this process may have been replaced, and then both would
        take every task sent to the id. It serves nothing until it knows
        (:meth:`confirm_identity`)."""
        # (Read for every task. -inf until started: not "replaced".)
        heard = self._heard_at
        return heard != -math.inf and time.monotonic() - heard >= self._replaced_after

    def confirm_soon(self) -> None:
        """:meth:`confirm_identity` in the background, once at a time."""
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.create_task(
                self.confirm_identity(), name="reach-agent-confirm"
            )

    async def confirm_identity(self, *, live: bool = False) -> bool:
        """Ask whether another process serves this agent id (its ctl ping); if one does, stop
        (:class:`AgentReplacedError`, ``serve()`` ends with it) rather than share the id.
        ``live``: asked because a hub no longer knows our registration, not after a silence —
        both processes may be live (started at once, each before the other subscribed), and
        each re-registering would replace the other's for good: the one with the smaller
        session keeps the id, the other stops.

        True when this process keeps the id (nobody else answered, or ours is kept); False
        when it stops, or when it could not ask (cut off from NATS: the next heartbeat, task
        or registration try asks again) — then it knows no more than before, and what waited
        for the answer (a task, a registration) waits on."""
        silent = time.monotonic() - self._heard_at
        asked = time.monotonic()
        try:
            other = await other_process(self.nc, self.agent_id, self.session)
        except Exception:
            return False  # (cannot ask now: the next heartbeat, or the next task, asks again)
        if other is None:
            self._heard_at = max(self._heard_at, asked)
            return True
        if self.fault is not None or self.status is not AgentStatus.RUNNING:
            return False
        if live and other > self.session:
            return True  # (ours is kept: the other one stops when it asks)
        why = (
            "which registered it too (two processes started at once): the one with the "
            "smaller session keeps the id"
            if live
            else f"started while this one was silent to the hubs for {silent:.0f} s (paused, "
            "its event loop blocked, or cut off)"
        )
        self.fault = AgentReplacedError(
            f"agent id {self.agent_id} is served by another process (session {other[:12]}…), "
            f"{why}: this one stops, not to take the id's tasks too",
            agent_id=self.agent_id,
        )
        log_event(log, AGENT_ID_IN_USE, self.fault.message, agent_id=self.agent_id)
        self._faulted.set()
        self._stopping = asyncio.create_task(self.close(), name="reach-agent-stop")
        return False

    def in_touch(self) -> bool:
        """True while the hubs surely hold our lease: connected, and a hub answered a
        registration or heartbeat we sent within the last two heartbeat intervals. A lease is
        at least three, so no hub can have declared us SUSPECT or LOST — and given our
        attempts up without asking us — meanwhile. False after a pause of the process
        (SIGSTOP, a stalled VM) or a partition, until the next answer (which may come from a
        hub whose view lags: :meth:`wary` for a while after a silence this long)."""
        if self._nc is None or not self._nc.is_connected:
            return False
        return time.monotonic() - self._answered_at < 2 * self.settings.heartbeat_interval

    def _answered(self, sent: float) -> None:
        """A hub answered the registration or heartbeat we sent at ``sent``: in touch again
        (:meth:`in_touch`) — and wary (:meth:`wary`) if the last answer before it is a lease
        or more older: the hubs may have declared us LOST and given our attempts up."""
        silent = sent - self._answered_at
        if silent >= self.settings.lease_timeout and self._answered_at != -math.inf:
            self._be_wary(silent)
        self._answered_at = sent

    def _be_wary(self, silent: float) -> None:
        """Back from ``silent`` seconds without an answer, or told we are no longer known:
        :meth:`wary` until a fence read finds the task records' replicas caught up with their
        leader (:meth:`caught_up`) — or, a replica never catching up, for ``_WARY_SPANS`` times
        the silence (at least lease + grace, what the hubs wait before they declare an agent
        LOST): such a replica is a fault for an operator (``reach-mesh doctor``), and every
        workflow step of the agent would wait for it meanwhile."""
        s = self.settings
        span = max(silent if math.isfinite(silent) else 0.0, s.lease_timeout + s.suspect_timeout)
        now = self._wary_since = time.monotonic()
        self._wary_until = max(self._wary_until, now + _WARY_SPANS * span)

    def wary(self) -> bool:
        """Whether every step reads its fence for now (``Fences.fresh``), and only once the
        task records' stream leader says each replica has caught up with it
        (``WorkConsumer._record``): back from a silence of a lease or more (paused, cut off),
        the hubs may have declared us LOST and given our attempts up meanwhile, and the replica
        next to us may not have their writes yet — while a hub on our side, whose view lags as
        well, answers our heartbeats as if nothing happened: ``in_touch`` then proves nothing
        (chaos secure seed 174, ``partition``: ``chaos-174-00474-n0`` attempt 1 ran 2.4 s after
        attempt 2, its record read at the replica of the node cut off with it, the records'
        stream without a leader)."""
        return time.monotonic() < self._wary_until

    def wary_since(self) -> float:
        """When (monotonic) the last silence that made us :meth:`wary` ended: what a check of
        the replicas asked before it says nothing about."""
        return self._wary_since

    def caught_up(self, asked_at: float) -> None:
        """The task records' leader, asked at ``asked_at``, said every replica had caught up
        with it: whatever the hubs wrote while we were silent is on each of them, and a direct
        get may answer a fence again. (A silence since then keeps us wary.)"""
        if asked_at >= self._wary_since:
            self._wary_until = -math.inf

    async def back_in_touch(self) -> bool:
        """Before a step delivered while out of touch (:meth:`in_touch` False: paused, cut
        off) reads its fence: one heartbeat now, answered, so the hubs hold our lease again.
        Right after a partition heals, the replica of the task records on our side is behind
        the fences the hubs wrote meanwhile: read at once, it let the attempts given up during
        the cut run again (chaos seed 153, ``partition``: 14 steps ran again 0.26 s after the
        heal, their attempt 2 done elsewhere). False when no hub answered, or a hub no longer
        knows us (declared LOST: the heartbeat loop fences our attempts and registers again):
        the step waits. One heartbeat at a time for every step waiting."""
        if self.in_touch():
            return True
        touching = self._touching
        if touching is None or touching.done():
            touching = self._touching = asyncio.ensure_future(self._touch())
        return await asyncio.shield(touching)

    async def _touch(self) -> bool:
        timeout = max(min(self.settings.heartbeat_interval, 1.0), 0.05)
        try:
            await self._beat(protocol.hub_agent_subject(self.agent_id, "heartbeat"), timeout)
        except Exception:  # (no hub, not known, a reconnect: the step waits for the next)
            return False
        return self.in_touch()
