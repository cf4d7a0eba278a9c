"""A wary agent's fence read at the records' stream leader, through a hub (verb ``record``).

A wary agent (``Agent.wary``) trusts a direct get of a step's task record only once the
stream's leader says every replica caught up (``WorkConsumer._replicas_checked``): a direct get
is answered by any replica, one behind among them (chaos secure seed 174). While a replica
catches up — a node thawed after a SIGSTOP took some 80 s (seed 184) — that check fails though
the leader has its quorum, and every step would wait. Then the agent asks a hub to read the
record at the leader (``hub/_record_read.py``), which the agent may not itself (its
``STREAM.MSG.GET`` does not name the key: it would read other namespaces' records). An answer
is as good as a direct get after a passed check, for this step only: it says nothing of the
replicas, so the agent stays wary (the next step's direct get may still reach the one behind).
No answer (no hub, a timeout, JetStream unavailable, the hub busy): the step waits, as before.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Final

import nats.errors

from reach_mesh import protocol
from reach_mesh._jspub import JsClient
from reach_mesh._retry import describe
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.logs import LineBudget
from reach_mesh.models import RecordReply, TaskEnvelope
from reach_mesh.workflow import TaskRecord, stored_record

if TYPE_CHECKING:
    from reach_mesh.agent._agent import Agent

__all__ = ["LeaderReads"]

log = logging.getLogger("reach_mesh.agent.work")

#: How long (s) a step waits for a hub's answer before it waits as before (nak'd).
_ASK_TIMEOUT: Final = 1.0
#: After no hub answered (none listens, or a timeout), how long (s) the steps that follow wait
#: without asking: each would wait as long for the same silence.
_SILENT_FOR: Final = 0.25
#: Wary reads failing their check this long (s) — replicas behind, or no leader — are told in
#: a WARNING, at most one per ``_WARN_EVERY`` s.
_WARN_AFTER: Final = 5.0
_WARN_EVERY: Final = 30.0


class LeaderReads:
    """The work consumer's leader reads through hubs, and what it tells of wary reads whose
    replica check fails (``WorkConsumer._record``)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        #: Steps whose records a hub read at the leader, and reads no hub answered (not asked,
        #: no answer, an error): ``reach_agent_leader_reads_total{outcome}``.
        self.answered = 0
        self.unanswered = 0
        #: Since when (monotonic) wary reads' checks have failed, None while they pass.
        self._failing_since: float | None = None
        #: Since the last WARNING: task ids of steps that waited, and steps read through hubs.
        self._waiting: set[str] = set()
        self._through_hubs = 0
        self._hubs_silent_until = -math.inf
        self._lines = LineBudget(_WARN_EVERY)

    def passed(self) -> None:
        """A check of the replicas passed: wary reads read them directly again."""
        self._failing_since = None
        self._waiting.clear()
        self._through_hubs = 0

    async def read(
        self, jsc: JsClient, env: TaskEnvelope, check: BaseException
    ) -> TaskRecord | None:
        """The step's task record (None: none, deleted, or not a ``TaskRecord``) as the stream's
        leader has it, read by a hub, the replica check having failed with ``check``. Raises
        ``MeshUnavailableError`` when no hub gives an answer (the step waits)."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        agent = self._agent
        try:
            if env.namespace != protocol.namespace_of(agent.agent_id):
                # (A hub reads the subject's namespace: the agent's own.)
                raise MeshUnavailableError(f"a step of namespace {env.namespace!r}")
            if now < self._hubs_silent_until:
                raise MeshUnavailableError("no hub answered lately")
            try:
                msg = await jsc.ask(
                    protocol.hub_agent_subject(agent.agent_id, "record"),
                    protocol.dumps({"task_id": env.task_id}),
                    timeout=_ASK_TIMEOUT,
                )
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
                self._hubs_silent_until = time.monotonic() + _SILENT_FOR
                raise
            reply = protocol.parse_reply(msg.data, RecordReply)
            if reply.task_id != env.task_id:
                raise MeshUnavailableError(f"answered for task {reply.task_id!r}")
        except Exception as err:
            self.unanswered += 1
            self._waiting.add(env.task_id)
            self._warn(check)
            raise MeshUnavailableError(
                f"{check}; no hub read the record at the leader: {describe(err)}"
            ) from err
        self.answered += 1
        self._through_hubs += 1
        self._warn(check)
        if reply.record is None:
            return None
        return stored_record(TaskRecord, (protocol.dumps(reply.record), reply.revision))

    def _warn(self, check: BaseException) -> None:
        since = self._failing_since
        if since is None or time.monotonic() - since < _WARN_AFTER:
            return
        held = self._lines.take()
        if held is None:
            return
        log.warning(
            "%d step(s) waiting, %d read at the leader through a hub instead, while wary reads "
            "fail for %.0f s: %s",
            len(self._waiting),
            self._through_hubs,
            time.monotonic() - since,
            check,
        )
        self._waiting.clear()
        self._through_hubs = 0
