"""Work messages leave in batches: the attempts one hub decides for one agent in one pass of
its event loop are stored as one message on the agent's work subject, when the agent's card
says ``work_batch: true`` (``reach_mesh/_work_batch.py``, docs/protocol-workflows.md, "Work
batches").

Nothing waits for a batch to fill: a step's work is queued in the pass that decided it and
sent when that pass ends, so under low load every batch is one attempt, sent as a work message
of its own exactly as without batches. Under load (many workflows started by one read from the
socket) a fanout(3)'s three work messages become a share of three batches, one per agent, and
the agents ack one message per batch.

A batch is sent, and sent again after an infrastructure error, as a whole with one
``Nats-Msg-Id`` (its first attempt, its size and a digest of all its attempts): JetStream
stores it once however often it is repeated, as it does a single attempt, and never takes
another batch for a repeat of it. Every step in it waits for that one publish; its error
(past the latest of their deadlines) is each step's, as a publish of its own would have been.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from reach_mesh import _work_batch, protocol
from reach_mesh._jspub import Ack
from reach_mesh.tracing.metrics import HubMetrics

__all__ = ["WorkOut"]

#: Retries ``op`` (named ``what``) through infrastructure errors until the loop time given.
Retrying = Callable[[str, Callable[[], Awaitable[Ack]], float], Awaitable[Ack]]


@dataclass(slots=True, eq=False)
class _Box:
    """The attempts for one work subject decided in this pass."""

    subject: str
    namespace: str
    #: At most this many lines (the agent's ``max_concurrency``, at most ``BATCH_STEPS``).
    limit: int
    #: At most this many bytes of lines (``BATCH_BYTES``, and what the NATS server
    #: carries: ``WorkOut.send``'s ``max_bytes``).
    max_bytes: int
    #: The first attempt as a message of its own (sent so when it stays alone).
    first: tuple[bytes, dict[str, str]]
    lines: list[bytes] = field(default_factory=list)
    #: ``(task_id, attempt)`` of each line (the batch's ``Nats-Msg-Id`` names them all).
    steps: list[tuple[str, int]] = field(default_factory=list)
    size: int = 0
    #: Until when (loop time) the publish is retried: the latest of its steps' deadlines.
    until: float = 0.0
    done: asyncio.Future[None] | None = None


class WorkOut:
    """The work messages of one hub's steps, batched per agent and per pass of the loop."""

    def __init__(
        self,
        publish: Callable[[str, bytes, dict[str, str]], Awaitable[Ack]],
        retrying: Retrying,
        background: Callable[[Awaitable[Any]], None],
        metrics: HubMetrics | None = None,
    ) -> None:
        self._publish = publish
        self._metrics = metrics
        #: ``reach_work_messages_total``'s series by kind, each looked up once, when first
        #: counted: ``labels()`` takes a lock and builds a tuple, per work message.
        self._counted: dict[str, Any] = {}
        self._retrying = retrying
        self._background = background
        self._boxes: dict[str, _Box] = {}
        self._flush_due = False
        #: Work messages sent, and how many of them were batches of several steps.
        self.sent_total = 0
        self.batches_total = 0

    async def send(
        self,
        namespace: str,
        agent_id: str,
        task_id: str,
        attempt: int,
        envelope: bytes,
        headers: dict[str, str],
        *,
        limit: int,
        until: float,
        max_bytes: int = _work_batch.BATCH_BYTES,
    ) -> None:
        """Store the work message of attempt ``attempt`` of ``task_id`` for ``agent_id``: with
        the others this pass decides for that agent, in a batch of at most ``limit`` (1: on its
        own). ``headers``: its own (trace context, ``Nats-Msg-Id``, expected stream), used
        when it goes alone; in a batch its ``traceparent`` goes on its line, and a step whose
        trace context has more than a ``traceparent`` is never put in one (the caller sends
        it with ``limit`` 1). ``max_bytes``: the most bytes of lines a batch may hold (the NATS
        server's ``max_payload``, less room for the headers, may be under ``BATCH_BYTES``: a
        batch it refused would fail every step in it, each of which fits alone). Returns once
        it is stored; raises what the publish raised, past ``until`` (loop time) and the other
        steps' deadlines."""
        subject = protocol.work_subject(namespace, agent_id)
        loop = asyncio.get_running_loop()
        line = _work_batch.line(headers.get("traceparent", ""), envelope)
        box = self._boxes.get(subject)
        if box is not None and (
            len(box.lines) >= box.limit
            or box.size + len(line) + 1 > min(box.max_bytes, max_bytes)
            or limit <= 1
        ):
            self._send_box(self._boxes.pop(subject))
            box = None
        if box is None:
            box = _Box(
                subject,
                namespace,
                max(1, min(limit, _work_batch.BATCH_STEPS)),
                min(max_bytes, _work_batch.BATCH_BYTES),
                (envelope, headers),
                done=loop.create_future(),
            )
            self._boxes[subject] = box
            if not self._flush_due:
                self._flush_due = True
                loop.call_soon(self._flush)
        box.lines.append(line)
        box.steps.append((task_id, attempt))
        box.size += len(line) + 1  # (and its newline)
        box.until = max(box.until, until)
        done = box.done
        assert done is not None
        if len(box.lines) >= box.limit:
            self._send_box(self._boxes.pop(subject))
        await asyncio.shield(done)

    def _flush(self) -> None:
        """The pass that queued work has ended: send every box."""
        self._flush_due = False
        boxes, self._boxes = self._boxes, {}
        for box in boxes.values():
            self._send_box(box)

    def _send_box(self, box: _Box) -> None:
        self._background(self._send(box))

    async def _send(self, box: _Box) -> None:
        done = box.done
        assert done is not None
        if len(box.lines) == 1:
            body, headers = box.first
        else:
            body = _work_batch.join(box.lines)
            headers = {
                protocol.HDR_MSG_ID: _work_batch.batch_msg_id(box.namespace, box.steps),
                protocol.HDR_EXPECTED_STREAM: protocol.STREAM_WORK,
                protocol.HDR_WORK_BATCH: str(len(box.lines)),
            }
            self.batches_total += 1
        self.sent_total += 1
        subject = box.subject
        try:
            await self._retrying(
                f"publish {subject}", lambda: self._publish(subject, body, headers), box.until
            )
        except asyncio.CancelledError:
            done.cancel()  # the hub stops: its steps' tasks end with it
            raise
        except Exception as err:
            if not done.done():
                done.set_exception(err)
                done.exception()  # (each step that waits raises it; none may be left)
            return
        if self._metrics is not None:
            kind = "single" if len(box.lines) == 1 else "batch"
            counter = self._counted.get(kind)
            if counter is None:
                counter = self._counted[kind] = self._metrics.work_messages_total.labels(kind)
            counter.inc()
            if kind == "batch":
                self._metrics.work_batched_steps_total.inc(len(box.lines))
        if not done.done():
            done.set_result(None)
