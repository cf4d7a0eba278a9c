"""Subscriptions whose messages are handled as nats-py reads them, not a pass of the loop later.

nats-py runs a subscription's callback in a task of its own: the reader queues each message,
and the task takes it in a later pass of the event loop, behind whatever else is ready then.
On a workflow's critical path that is one pass per message — the submission a hub pulls, the
work an agent pulls, a step's status, the ack of each write the hub waits on — several tens of
microseconds each on an idle machine, more when the loop has other work queued.

A subscription made with a one-answer future instead (``subscribe(future=...)``, as nats-py's
old-style requests are) is resolved in the reader itself (``Client._process_msg``: the future's
``cancelled()``, then ``set_result(msg)``), with no queue and no task. :class:`Inline` stands
for such a future that is never done: each message goes to its handler at once, in the reader.
A handler there must be quick and must not wait (it runs inside nats-py's read loop, which reads
nothing meanwhile), and it must not raise into the reader (an exception would end the read
loop): :class:`Inline` logs what it raises and goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

__all__ = ["Inline", "subscribe_inline"]

log = logging.getLogger("reach_mesh.nats")


class Inline:
    """A future to nats-py that hands every message to ``take`` as it is read."""

    __slots__ = ("_take",)

    def __init__(self, take: Callable[[Msg], None]) -> None:
        self._take = take

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def set_result(self, msg: Msg) -> None:
        try:
            self._take(msg)
        except Exception:  # (never into nats-py's reader)
            log.exception("handling a message on %s failed", msg.subject)


async def subscribe_inline(nc: NATS, subject: str, take: Callable[[Msg], None]) -> Subscription:
    """Subscribe ``take`` to ``subject``, called in nats-py's reader for each message."""
    return await nc.subscribe(subject, future=cast("asyncio.Future[Any]", Inline(take)))
