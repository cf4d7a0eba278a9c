"""One process per agent id: a starting agent waits while another live process serves its id.

Two processes of one agent id (a deploy that starts the new process before the old one stops,
the same command run twice) would share everything NATS keys by the id: its task subjects (a
queue group), its work consumer, its ctl subject. A step the old process holds while its event
loop is blocked past ``work_ack_wait`` is then redelivered to the new one, which has no record
of it and runs it a second time, and request-reply retries of one task id reach either
process's idempotency cache. So before it subscribes to anything, a starting agent asks its
own ctl subject (``{"op": "ping"}``):

- **no responders**: nobody serves the id (the usual start, a restart after a crash or a
  clean stop): it starts;
- **an answer** (another process, live, with its session): it waits, asking again every
  second, until that process has stopped — a deploy's old process drains and closes — and
  says so (``REACH-AGENT-ID-IN-USE``, WARNING, at most once per ``_SAY_EVERY``);
- **no answer** (a process subscribed but not answering: paused, its loop blocked, or cut off
  before NATS noticed): it asks again until the hubs would have declared that process lost
  (``lease_timeout + suspect_timeout`` of silence), then starts, as the hubs then hand its
  work to others;
- **refused** (an ``auth.conf`` written before agents could ask their own ctl subject): it
  starts without the check, and says so once.

The other way round, a process that was silent to the hubs that long (paused, or cut off) may
have been replaced meanwhile, and both would then take every task sent to the id. Before it
serves again — takes a task, beats, or tries its registration again — it asks the same question
(:func:`other_process`), and stops if another process answers (``Agent.confirm_identity``; also
when a hub no longer knows its registration: two live processes of the id keep the one with the
smaller session). One that cannot ask (cut off from NATS) serves nothing held back meanwhile
and registers nothing until it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import protocol
from reach_mesh._nats import refused_first
from reach_mesh.config import MeshSettings
from reach_mesh.errors import MeshUnavailableError, NotPermittedError, ReachError
from reach_mesh.logs import AGENT_ID_IN_USE, get_logger, log_event

__all__ = ["other_process", "wait_for_other_process"]

log = get_logger(__name__)

#: How long a live process has to answer the ping (it answers from its event loop at once).
_ASK_TIMEOUT: Final = 1.0
#: Between two pings while another process serves the id.
_ASK_EVERY: Final = 1.0
#: Between two ``REACH-AGENT-ID-IN-USE`` lines while waiting.
_SAY_EVERY: Final = 30.0
_PING: Final = b'{"op":"ping"}'


async def wait_for_other_process(nc: NATS, agent_id: str, settings: MeshSettings) -> None:
    """Return once no other live process serves ``agent_id`` (see the module's docstring).
    Call it connected and before subscribing to the agent's subjects."""
    subject = protocol.agent_ctl(agent_id)
    silent_for = settings.lease_timeout + settings.suspect_timeout
    silent_since: float | None = None
    said_at = -_SAY_EVERY
    while True:
        try:
            msg = await refused_first(nc, subject, nc.request(subject, _PING, timeout=_ASK_TIMEOUT))
        except NoRespondersError:
            return
        except NotPermittedError:
            log.warning(
                "cannot ask whether another process serves agent id %s: NATS refuses this "
                "identity the id's ctl subject — an identity not issued for this agent id (run "
                "it as REACH_CONFIG=<auth dir>/agent.%s.yaml), or an auth.conf from before this "
                "version (rewrite it with `reach-mesh auth add-agent %s`); starting without the "
                "check",
                agent_id,
                agent_id,
                agent_id,
            )
            return
        except (NatsTimeoutError, TimeoutError):
            if silent_since is None:
                silent_since = time.monotonic()
            elif time.monotonic() - silent_since >= silent_for:
                return  # as long as the hubs wait before they declare an agent lost
            other = "a process that does not answer (paused, or its event loop blocked)"
        else:
            silent_since = None
            try:
                seen = protocol.loads_object(msg.data)
            except ReachError:
                seen = {}  # (an answer all the same: someone serves the id)
            session = str(seen.get("session"))[:12]
            other = f"a live process (session {session}…, {seen.get('status')})"
        now = time.monotonic()
        if now - said_at >= _SAY_EVERY:
            said_at = now
            log_event(
                log,
                AGENT_ID_IN_USE,
                f"agent id {agent_id} is served by {other}: waiting for it to stop before "
                "starting (one process per agent id; stop the old process first, or give each "
                "process its own instance name)",
                agent_id=agent_id,
            )
        await asyncio.sleep(_ASK_EVERY)


#: How long a process that may have been replaced waits for other processes' answers.
_OTHERS_WAIT: Final = 0.5


async def other_process(nc: NATS, agent_id: str, session: str) -> str | None:
    """The session of another live process that serves ``agent_id`` (one that answers its ctl
    ping within ``_OTHERS_WAIT``, with a session other than ``session``), or None. The asking
    process, subscribed to the same subject, answers too: its own answer is left out.

    Raises :class:`MeshUnavailableError` when it cannot tell: not connected when it would ask,
    the connection dropped while it waited, or NATS did not answer a PING sent after the wait
    (what the server sends does not reach this process). nats-py buffers a publish while it
    reconnects, and the ping, or the answers to it, are then lost: no answer is no proof of
    nobody."""
    if not nc.is_connected:
        raise MeshUnavailableError(f"cannot ask who serves agent id {agent_id}: not connected")
    reconnects = nc.stats["reconnects"]
    others: list[str] = []

    async def on_answer(msg: Msg) -> None:
        with contextlib.suppress(ReachError):
            seen = str(protocol.loads_object(msg.data).get("session"))
            if seen != session:
                others.append(seen)

    async def ask() -> None:
        await nc.publish(subject, _PING, reply=inbox)
        await asyncio.sleep(_OTHERS_WAIT)
        if others:
            return
        # No answer proves nobody only over a connection that carries what the server sends:
        # a PONG behind the answers. A link that delivers nothing (held, cut one way, dead
        # without nats-py noticing yet) is no reconnect, and still "connected".
        try:
            await nc.flush(timeout=_ASK_TIMEOUT)  # type: ignore[arg-type]
        except Exception as err:
            raise MeshUnavailableError(
                f"cannot ask who serves agent id {agent_id}: no answer from NATS ({err!r})"
            ) from err

    subject = protocol.agent_ctl(agent_id)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_answer)
    try:
        # Refused (an auth.conf from before agents could ask their own ctl subject, as at
        # start): nobody can be asked, and this is no lost subscription of the agent's.
        await refused_first(nc, subject, ask(), expected=True)
    except NotPermittedError:
        return None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if others:
        return others[0]
    if not nc.is_connected or nc.stats["reconnects"] != reconnects:
        raise MeshUnavailableError(f"cannot ask who serves agent id {agent_id}: cut off meanwhile")
    return None
