"""Who has a resent task, asked before a hub routes it (``HoldersMixin``, a base of
:class:`~reach_mesh.hub.Hub`).

A caller that sends a route request again with the same ``task_id`` — after its own NATS
reconnection, its answer lost; after a hub that held its route stopped — marks it with the
``Reach-Resend: 1`` header (docs/protocol.md): its first send may have reached an agent, which
runs it. The hubs' pins (``hub/_pins.py``) usually send it there. But a hub may hold no pin for
it: its connection came back a moment ago and its pins ask is not answered yet (the secure
chaos run's ``node_kill``: three routes of 500 ran twice in 3 of 11 runs), it started since,
or the hub that routed the first send died before its pins message left. Such a hub does not
choose at once: it asks, at the same moment and for ``HOLDER_WAIT`` at most (half the
route's time left, if less),

- the other hubs, on ``reach.hubs.<ns>.pin_of`` (body: the task id; a hub that has a pin
  answers the agent id, the others stay silent), and
- the agents that could serve the request (``HOLDER_ASK_MOST`` at most), ctl ``task_state``
  with ``route: true`` (a request-reply task of that id, not a workflow's step; no fence:
  asking changes nothing on the agent).

The first hub to name an agent, or agent to hold the task id (any state but ``PENDING``
without an attempt: running, queued, or finished — its idempotency table answers), is where
the route goes, as for a pin (``_Flight.in_hand``). When every agent asked says it does not
hold it, the hub routes at once, without waiting for the hubs: a hub's pin names an agent,
and that agent said no. Otherwise (some agent silent, or more candidates than were asked) it
routes when ``HOLDER_WAIT`` is over, as if the request were new.

An unmarked request costs nothing of this, nor does a marked one whose pin this hub has. The
mark lets a caller do nothing it could not do unmarked: the route is decided among the agents
its request matches, in its own namespace, as any other; and sending the same task id again
unmarked would reach the agent that holds it through the pins anyway. It costs the hub at most
``HOLDER_ASK_MOST + 1`` small requests and ``HOLDER_WAIT``, within the namespace's route rate,
and no more than ``HOLDER_SEEKS_MOST`` seeks at once (beyond, a resend is routed unmarked).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import protocol
from reach_mesh.errors import BadRequestError, ReachError
from reach_mesh.hub._pins import HUB_HEADER, TaskPins
from reach_mesh.models import TaskState

__all__ = [
    "HOLDER_ASK_MOST",
    "HOLDER_SEEKS_MOST",
    "HOLDER_WAIT",
    "RESEND_HEADER",
    "HoldersMixin",
    "resend_marked",
]

log = logging.getLogger("reach_mesh.hub")

#: The header a caller puts on a route request it sends again (value ``1``).
RESEND_HEADER: Final = protocol.HDR_RESEND
#: How long a hub asks, at most, who holds a resent task it has no pin for (seconds).
HOLDER_WAIT: Final = 0.25
#: Agents a hub asks at most whether they hold a resent task.
HOLDER_ASK_MOST: Final = 32
#: Resent tasks a hub seeks the holder of at once, at most; beyond, routed as if unmarked.
HOLDER_SEEKS_MOST: Final = 256


def resend_marked(headers: dict[str, str] | None) -> bool:
    """Whether a route request's headers mark it as sent again (``Reach-Resend: 1``);
    ``BadRequestError`` for any other value of the header."""
    if not headers:
        return False
    value = headers.get(RESEND_HEADER)
    if value is None:
        return False
    if value.strip() != "1":
        raise BadRequestError(
            f"invalid {RESEND_HEADER} header {value[:40]!r}: expected 1 (the request is sent "
            "again with the same task_id), or no header",
            field=RESEND_HEADER,
            value=value[:100],
        )
    return True


def _holds(data: bytes) -> bool:
    """Whether an agent's answer to ctl ``task_state`` says it holds the task id."""
    try:
        body = protocol.loads_object(data)
    except ReachError:
        return False
    if "error" in body:
        return False
    return "attempt" in body or body.get("state") not in (None, TaskState.PENDING.value)


class HoldersMixin:
    """The methods of ``Hub`` that find the holder of a resent task (``Hub`` sets every
    attribute below)."""

    hub_id: str
    _pins: TaskPins
    #: Holder seeks in progress (``HOLDER_SEEKS_MOST``).
    _seeking: int

    if TYPE_CHECKING:

        @property
        def nc(self) -> NATS: ...

    async def _seek_holder(
        self, ns: str, task_id: str, candidates: Collection[str], wait: float = HOLDER_WAIT
    ) -> str | None:
        """The agent the other hubs or the ``candidates`` say holds ``task_id``, or None
        (module docstring). Asked for ``wait`` seconds at most; never raises."""
        nc = self.nc
        wait = max(0.001, min(wait, HOLDER_WAIT))
        asked = list(itertools.islice(candidates, HOLDER_ASK_MOST))
        every = len(asked) == len(candidates)
        body = protocol.dumps({"op": "task_state", "task_id": task_id, "route": True})
        hub_ask: asyncio.Future[Msg] = asyncio.ensure_future(
            nc.request(
                protocol.hub_broadcast(ns, "pin_of"),
                task_id.encode(),
                timeout=wait,
                headers={HUB_HEADER: self.hub_id},
            )
        )
        agent_asks: dict[asyncio.Future[Msg], str] = {
            asyncio.ensure_future(
                nc.request(protocol.agent_ctl(agent_id), body, timeout=wait)
            ): agent_id
            for agent_id in asked
        }
        pending: set[asyncio.Future[Msg]] = {hub_ask, *agent_asks}
        said_no = 0
        self._seeking += 1
        try:
            while pending and not (every and said_no == len(asked)):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for ask in done:
                    if ask.cancelled() or ask.exception() is not None:
                        continue
                    data = ask.result().data
                    if ask is hub_ask:
                        agent_id = data.decode(errors="replace")
                        if protocol.AGENT_ID_RE.fullmatch(agent_id) and agent_id.startswith(
                            ns + "."
                        ):
                            return agent_id
                    elif _holds(data):
                        return agent_asks[ask]
                    else:
                        said_no += 1
            # Every candidate said no (a hub's pin would name one of them), or time is up.
            return None
        finally:
            self._seeking -= 1
            for ask in pending:
                ask.cancel()
            for ask in pending:
                with contextlib.suppress(BaseException):
                    await ask

    async def _on_pin_of(self, msg: Msg) -> None:
        """``reach.hubs.<ns>.pin_of``: another hub asks which agent a resent task went to;
        answered only when this hub has a pin for it."""
        headers = msg.headers
        if not msg.reply or headers is None or headers.get(HUB_HEADER) == self.hub_id:
            return
        task_id = msg.data.decode(errors="replace")
        if not protocol.TASK_ID_RE.fullmatch(task_id):
            return
        agent_id = self._pins.get(msg.subject.split(".", 3)[2], task_id)
        if agent_id is None:
            return
        try:
            await self.nc.publish(msg.reply, agent_id.encode())
        except Exception as err:  # the connection is closing or gone
            log.debug("pin_of not answered: %s", type(err).__name__)
