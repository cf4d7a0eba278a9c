"""Work batches: several steps for one agent in one message of its work subject — the wire.

A hub that decides several attempts for one agent in one pass of its event loop (many workflows
started together) may store them as one message on ``reach.work.<ns>.<agent_id>`` instead of
one each, if the agent's card says ``work_batch: true``
(docs/protocol-workflows.md, "Work batches"). The message carries the header
``Reach-Work-Batch: <n>`` and ``n`` lines separated by ``\\n``, each
``<traceparent> <TaskEnvelope JSON>``; the agent runs each line as if it had come alone and
acks the message once every one of them is settled.

Pure: no I/O. ``split`` is fed by the wire: what it refuses is a :class:`BadRequestError`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from reach_mesh.errors import BadRequestError

__all__ = [
    "BATCH_BYTES",
    "BATCH_STEPS",
    "batch_msg_id",
    "join",
    "line",
    "split",
]

#: The most steps one work batch holds (a hub sends at most this many, and at most the agent's
#: ``max_concurrency``: a batch is held whole, so it must not queue more than a slot each).
BATCH_STEPS: Final = 64
#: The most bytes of lines one work batch holds (a step past it starts the next one; less where
#: the NATS server's ``max_payload`` is: ``WorkOut.send``).
BATCH_BYTES: Final = 256 * 1024
#: A W3C ``traceparent``: version, trace id, parent id, flags (lower-case hex).
_TRACEPARENT_RE: Final = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def line(traceparent: str, envelope: bytes) -> bytes:
    """One step of a batch: ``<traceparent> <TaskEnvelope JSON>`` (compact JSON has no raw
    newline: a newline in a string is escaped)."""
    return traceparent.encode() + b" " + envelope


def join(lines: list[bytes]) -> bytes:
    """The body of a batch of ``lines`` (:func:`line`)."""
    return b"\n".join(lines)


def batch_msg_id(namespace: str, steps: list[tuple[str, int]]) -> str:
    """``<ns>.<task_id>#<n>+<count>.<digest>`` — the ``Nats-Msg-Id`` of a batch of ``steps``
    (``(task_id, attempt)`` in order) whose first is attempt ``n`` of ``task_id``: a repeat of
    the batch (sent again after a lost ack) is stored once. ``<digest>``: 16 hex digits of
    BLAKE2b over every step's ``<task_id>#<attempt>``, one per line — another batch that starts
    with the same attempt and holds as many steps (should an attempt ever go out in two
    batches: a hub sends one again only in the same batch, today) is another message, never
    dropped as a repeat of this one. Never an attempt's own id
    (``<ns>.<task_id>#<n>``)."""
    task_id, attempt = steps[0]
    digest = hashlib.blake2b(
        "\n".join(f"{t}#{a}" for t, a in steps).encode(), digest_size=8
    ).hexdigest()
    return f"{namespace}.{task_id}#{attempt}+{len(steps)}.{digest}"


def split(data: bytes, count: str | None) -> list[tuple[str, bytes] | BadRequestError]:
    """The steps of a batch message, in order: ``(traceparent, envelope bytes)`` per line, or
    the :class:`BadRequestError` that refuses the line (no traceparent before the first space).
    The envelope itself is checked where a single step's is.

    Raises :class:`BadRequestError` when the message is no batch at all: ``count`` (its
    ``Reach-Work-Batch`` header) not a whole number from 1 to :data:`BATCH_STEPS`, or not the
    number of lines."""
    if count is None or not count.isdigit() or not 1 <= int(count) <= BATCH_STEPS:
        raise BadRequestError(
            f"work batch: Reach-Work-Batch must be a number of steps from 1 to {BATCH_STEPS}",
            field="Reach-Work-Batch",
            value=count,
        )
    lines = data.split(b"\n")
    if len(lines) != int(count):
        raise BadRequestError(
            f"work batch: {len(lines)} line(s), Reach-Work-Batch says {count}",
            field="Reach-Work-Batch",
            lines=len(lines),
        )
    out: list[tuple[str, bytes] | BadRequestError] = []
    for i, raw in enumerate(lines):
        traceparent, sep, envelope = raw.partition(b" ")
        if not sep or not _TRACEPARENT_RE.fullmatch(traceparent) or not envelope:
            out.append(
                BadRequestError(
                    f"work batch line {i}: not '<traceparent> <TaskEnvelope JSON>'", line=i
                )
            )
            continue
        out.append((traceparent.decode(), envelope))
    return out
