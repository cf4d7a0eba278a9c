"""An agent's goodbye: its session's registration ended, asked until a hub says it is."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_mesh import protocol
from reach_mesh._nats_asking import hedged_request
from reach_mesh._retry import describe
from reach_mesh.errors import MeshUnavailableError, ThrottledError
from reach_mesh.models import UnregisterRequest

__all__ = ["unregister"]

log = logging.getLogger("reach_mesh.agent")

#: An unregister not answered within this long is sent again, to whichever hub the queue group
#: picks (the earlier try still awaited), and one refused "later" is sent again after it.
UNREGISTER_HEDGE: Final = 0.5
#: For this long at most (s).
UNREGISTER_PATIENCE: Final = 5.0


async def unregister(
    nc: NATS, agent_id: str, session: str, *, final: Callable[[Msg], bool]
) -> None:
    """End ``session``'s registration of ``agent_id``, asked until a hub says it did (or knows
    none of it): a try unanswered (its hub paused, wedged) is asked of another after
    ``UNREGISTER_HEDGE``, one refused "later" (``final`` says which: JetStream unavailable,
    the record not read or not deleted, throttled — after its ``retry_after``) again, for
    ``UNREGISTER_PATIENCE`` at most; not when no hub listens. A hub answers an unregister
    once the registration is gone, and a repeat of one that ended it alike. Not ended, the
    agent stays registered — and routed to — until its lease runs out: logged."""
    subject = protocol.hub_agent_subject(agent_id, "unregister")
    body = protocol.encode(UnregisterRequest(agent_id=agent_id, session=session))
    deadline = time.monotonic() + UNREGISTER_PATIENCE
    while True:
        try:
            msg = await hedged_request(
                nc,
                subject,
                body,
                timeout=max(deadline - time.monotonic(), 0.1),
                every=UNREGISTER_HEDGE,
                final=final,
            )
            protocol.raise_for_error(msg.data)
            return
        except NoRespondersError:
            # No hub at all (the mesh down, or restarting): none routes to the agent, and
            # those that start load its record, LOST once its lease and grace are over. Not
            # waited on: every agent stopped while the hubs are away would wait.
            log.info("agent %s could not unregister: no hub answers", agent_id)
            return
        except (NatsTimeoutError, TimeoutError, MeshUnavailableError, ThrottledError) as err:
            # (Throttled: "later", as ``final`` takes it; no hub of this version throttles an
            # unregister, but one that did ended the goodbye after a single try, silently.)
            pause = max(UNREGISTER_HEDGE, err.retry_after if isinstance(err, ThrottledError) else 0)
            if time.monotonic() + pause >= deadline:
                log.warning(
                    "agent %s could not unregister (%s): registered until its lease runs out",
                    agent_id,
                    describe(err),
                )
                return
            await asyncio.sleep(pause)
