"""Process entry point for agents: installs SIGTERM/SIGINT handlers (the library itself never
does) and drains the agents gracefully on either."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from reach_mesh import _runner
from reach_mesh.agent._agent import Agent
from reach_mesh.logs import configure_logging
from reach_mesh.tracing import configure_tracing

__all__ = ["run", "serve"]

log = logging.getLogger("reach_mesh.agent")


async def serve(*agents: Agent, started: Callable[[], None] | None = None) -> None:
    """Start ``agents`` and serve until SIGTERM/SIGINT, then close them gracefully.

    ``started`` is called once every agent is connected and registered. An agent that stops
    on its own (:attr:`Agent.fault`: NATS took away one of its subscriptions) ends the
    serving too: the others are closed, and its error is raised (a process supervisor then
    restarts it)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        # A signal ends the starting too: an agent may wait long to start (its id still in
        # use by a process being replaced, no hub answering yet), and a supervisor's SIGTERM
        # must not have to become a SIGKILL.
        starting = asyncio.ensure_future(_start_all(agents))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
        if starting.cancelled():
            log.info("stopped by a signal while starting")
            return
        starting.result()  # (a start's error is raised)
        if started is not None:
            started()
        _runner.settle()
        waits = [asyncio.ensure_future(stop.wait())]
        waits += [asyncio.ensure_future(a._faulted.wait()) for a in agents]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await asyncio.gather(*(a.close() for a in agents), return_exceptions=True)
    fault = next((a.fault for a in agents if a.fault is not None), None)
    if fault is not None:
        raise fault


async def _start_all(agents: tuple[Agent, ...]) -> None:
    for agent in agents:
        await agent.start()


def run(*agents: Agent) -> None:
    """Blocking: ``reach_mesh.agent.run(agent)`` in a script's ``__main__``; on uvloop when it
    is installed (a process entry point may choose the loop; the library does not).

    Tracing follows the standard OpenTelemetry environment (``OTEL_TRACES_EXPORTER`` …; off
    when unset), with the first agent's service (``<namespace>.<service>.<instance>``) as the
    default service name. Logging, when the script set up none, goes to stderr as the CLI's
    does (``REACH_LOG_LEVEL``, default ``WARNING``): an agent with no hub, a lost NATS server,
    handlers cancelled at the end of a drain are said, not silent. Once every agent is
    registered it prints ``serving <agent ids>`` on stdout, as ``reach-mesh agent`` does."""
    if not logging.getLogger().handlers:
        level = os.environ.get("REACH_LOG_LEVEL", "WARNING")
        try:
            configure_logging(level)
        except ValueError:
            configure_logging("WARNING")
            log.warning("unknown REACH_LOG_LEVEL %r: logging at WARNING", level)
    provider = configure_tracing(agents[0].agent_id.split(".")[1] if agents else "reach-mesh-agent")

    def started() -> None:
        # As `reach-mesh agent` says it: a script that runs quietly at WARNING otherwise
        # gives no sign that it is connected and registered.
        print("serving " + ", ".join(a.agent_id for a in agents), flush=True)

    try:
        _runner.run(serve(*agents, started=started))
    finally:
        if provider is not None:
            provider.shutdown()
