"""Push consumers that deliver outside every inbox, deleted by the hubs (docs/security.md).

nats-server checks a consumer's creation against its creator's permissions by the API subject
only, never the ``deliver_subject`` in its body (nats-server issue 8274). Agents, callers and
the operator may create consumers of their own data (an agent on ``REACH_STATUS`` and
``REACH_WORK``, a caller on ``REACH_WF_EVENTS`` under any name, the operator on
``REACH_AUDIT``), so each may have the server push messages to a subject it may not publish
to: another tenant's agent's ``.task`` or ``.ctl``. The subscribers drop them unread
(``_guard``), but read each — a replay of everything an agent stored, at each creation, or a
consumer's idle heartbeats (10 a second) for as long as it exists, after its creator left.

Every consumer reach-mesh makes is pulled, or pushes to an inbox of its maker (nats-py's
``new_inbox``, under ``nats_inbox_prefix``, which starts with ``_INBOX``). A hub deletes, every
``SWEEP_INTERVAL``, the consumers of those four streams that push anywhere else: a flood so
made ends within that, and none outlives its creator. Every hub sweeps (a delete twice is
"not found", ignored); the list is paged (``CONSUMER.LIST``, 256 a page).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from nats.js.api import ConsumerInfo
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from reach_mesh import protocol
from reach_mesh.logs import LineBudget

__all__ = ["SWEEP_INTERVAL", "SWEPT_STREAMS", "foreign_push", "sweep_forever", "sweep_once"]

log = logging.getLogger("reach_mesh.hub")

#: The streams on which identities other than hubs may create consumers (``_auth.py``).
SWEPT_STREAMS: Final = (
    protocol.STREAM_STATUS,
    protocol.STREAM_WORK,
    protocol.STREAM_WF_EVENTS,
    protocol.STREAM_AUDIT,
)
#: Seconds between two sweeps of a hub.
SWEEP_INTERVAL: Final = 5.0
#: What one ``CONSUMER.LIST`` answers at most.
_PAGE: Final = 256

_lines = LineBudget(30.0)


def foreign_push(info: ConsumerInfo) -> bool:
    """Whether the consumer pushes to a subject that is no inbox."""
    deliver = info.config.deliver_subject
    return bool(deliver) and not protocol.is_inbox(deliver or "")


async def sweep_once(js: JetStreamContext) -> int:
    """Delete the consumers of ``SWEPT_STREAMS`` that push outside every inbox; how many."""
    deleted = 0
    for stream in SWEPT_STREAMS:
        offset = 0
        while True:
            try:
                page = await js.consumers_info(stream, offset=offset or None)
            except NotFoundError:
                break  # (not made yet)
            for info in page:
                if not foreign_push(info):
                    continue
                with contextlib.suppress(NotFoundError):  # (another hub's sweep was first)
                    await js.delete_consumer(stream, info.name)
                deleted += 1
                _lines.warn(
                    log,
                    stream,
                    "consumer %s of %s deleted: it pushed to %r, no inbox (docs/security.md)",
                    info.name,
                    stream,
                    info.config.deliver_subject,
                )
            if len(page) < _PAGE:
                break
            offset += len(page)
    return deleted


async def sweep_forever(js: JetStreamContext) -> None:
    """:func:`sweep_once` every ``SWEEP_INTERVAL``, through JetStream's outages."""
    while True:
        await asyncio.sleep(SWEEP_INTERVAL)
        try:
            await sweep_once(js)
        except Exception as err:  # JetStream away or slow: the next sweep asks again
            log.debug("push consumer sweep: %s", type(err).__name__)
