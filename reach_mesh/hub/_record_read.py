"""The ``record`` agent verb: a task record read at the records' stream leader, for an agent.

A wary agent (back from a silence its attempts may have been given up in: ``agent/_work.py``)
trusts a direct get of its step's task record only once the stream's leader says every replica
caught up — a direct get is answered by any replica, and one behind the leader answered a
stale record once (chaos secure seed 174). While a replica catches up (a thawed node took
80 s: seed 184) that check fails, and every wary step waited. The agent may not read at the
leader itself: ``$JS.API.STREAM.MSG.GET`` does not name the key in its subject, so it would let
an agent read other namespaces' records. A hub may: it answers ``reach.hub.<ns>.record.<service>
.<instance>`` with the record of ``<ns>.<task_id>`` as the leader has it, once the leader's
``STREAM.INFO`` says it heard from a quorum lately (one cut off from it keeps leading, behind,
for some ten seconds). The namespace is the subject's, which NATS permissions bind to the
agent; a task id has no dots, so the key is one of that namespace's by construction.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from reach_mesh import protocol
from reach_mesh._kv import entry_at_quorate_leader
from reach_mesh.errors import BadRequestError, MeshUnavailableError, ThrottledError
from reach_mesh.models import RecordReply, RecordRequest

if TYPE_CHECKING:
    from reach_mesh.tracing.metrics import HubMetrics

__all__ = ["RECORD_READS_AT_ONCE", "RECORD_READS_PER_NAMESPACE", "RecordReadMixin"]

#: Leader reads one hub makes at once; past it, ``REACH_THROTTLED`` at once (the agent waits
#: and asks again, as when no hub answers): a cluster catching up must not get a request to
#: its leader per waiting step from every hub.
RECORD_READS_AT_ONCE: Final = 64
#: Of those, what one namespace's agents may hold: one compromised agent asking on its own
#: subject (or a tenant's many wary agents) must not take every tenant's reads.
RECORD_READS_PER_NAMESPACE: Final = 16
#: A request carries one task id (at most 64 characters).
RECORD_REQUEST_MAX: Final = 1024
#: The leader's word is taken if it heard from a quorum of its replicas within this long (s),
#: as for an agent's own check (``agent/_work.py``: ``_QUORUM_HEARD``).
_QUORUM_HEARD: Final = 2.0
#: How long (s) a read may take: the agent asking waits about a second.
_READ_TIMEOUT: Final = 1.5


class RecordReadMixin:
    """``Hub._on_record`` (``hub/_hub.py`` subscribes it with the other agent verbs)."""

    metrics: HubMetrics
    _js: JetStreamContext | None
    #: Leader reads in progress (``RECORD_READS_AT_ONCE``), and per namespace
    #: (``RECORD_READS_PER_NAMESPACE``; none kept at 0).
    _record_reads: int
    _record_reads_by_ns: dict[str, int]

    async def _on_record(self, msg: Msg, ns: str) -> bytes:
        """Answer a ``RecordRequest`` with a ``RecordReply``; ``REACH_BAD_REQUEST`` /
        ``REACH_PAYLOAD_TOO_LARGE`` for bad input, ``REACH_THROTTLED`` when this hub is busy
        with ``RECORD_READS_AT_ONCE`` reads, ``REACH_UNAVAILABLE`` when the stream's leader did
        not answer (or did not hear from a quorum lately)."""
        outcome = "refused"
        try:
            sender = protocol.identity_of(msg.subject)
            if sender is None:  # (the subscription's subjects all name one)
                raise BadRequestError(f"{msg.subject} names no agent")
            protocol.validate_agent_id(sender)
            req = protocol.decode(msg.data, RecordRequest, max_size=RECORD_REQUEST_MAX)
            if self._record_reads >= RECORD_READS_AT_ONCE:
                raise ThrottledError("this hub is busy with other record reads", retry_after_ms=100)
            held = self._record_reads_by_ns
            if held.get(ns, 0) >= RECORD_READS_PER_NAMESPACE:
                raise ThrottledError(
                    f"namespace {ns!r} holds its share of this hub's record reads",
                    retry_after_ms=100,
                )
            js = self._js
            if js is None:
                raise MeshUnavailableError("this hub is not connected to JetStream yet")
            # ``ns`` is the subject's (the agent's own): a task id has no dots, so the key is
            # one of its namespace's, whatever the body says.
            key = protocol.task_key(ns, req.task_id)
            self._record_reads += 1
            held[ns] = held.get(ns, 0) + 1
            outcome = "unavailable"
            try:
                async with asyncio.timeout(_READ_TIMEOUT):
                    got = await entry_at_quorate_leader(
                        js, protocol.KV_TASKS, key, heard_within=_QUORUM_HEARD
                    )
            except TimeoutError as err:
                raise MeshUnavailableError(
                    f"the leader of KV_{protocol.KV_TASKS} did not answer within "
                    f"{_READ_TIMEOUT:g} s"
                ) from err
            finally:
                self._record_reads -= 1
                held[ns] -= 1
                if not held[ns]:
                    del held[ns]
            reply = RecordReply(task_id=req.task_id)
            if got is not None:
                value, reply.revision, marker = got
                if not marker:
                    reply.record = _object(value)
            outcome = "absent" if reply.record is None else "found"
            return protocol.encode(reply)
        finally:
            self.metrics.record_reads_total.labels(outcome).inc()


def _object(value: bytes) -> dict[str, object] | None:
    """``value`` parsed, if it is a JSON object (a ``TaskRecord`` is)."""
    try:
        got = protocol.loads(value)
    except BadRequestError:
        return None
    return got if isinstance(got, dict) else None
