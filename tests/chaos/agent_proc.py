"""One chaos agent as its own process: ``python agent_proc.py AGENT_ID LOG``.

Settings come from ``REACH_*`` environment variables. The handler of ``chaos:work:v1`` appends
a ``start`` line before it does anything and an ``end`` line when it ends (``O_APPEND`` writes:
a SIGKILL loses nothing already written) — the history checker reads them.

Payload: ``{"x": int, "mode": "ok" | "fail" | "slow" | "stubborn", "ms": int}``; ``ok``
returns ``{"x": x + 1}`` after ``ms`` milliseconds, ``fail`` raises a non-retryable
``TaskFailed``, ``slow`` sleeps ``ms`` (longer than the step timeout: the agent cancels it),
``stubborn`` too but ignores the cancellation and returns (outcome ``late``: the agent has
abandoned it by then, and drops what it returns).

SIGUSR1 makes the agent deaf (the ``deaf`` fault): its work consumer stops and its task, batch
and ctl subscriptions are unsubscribed — through the same internals as ``_deafen`` in
``tests/test_deaf_agents.py``, a client whose subscription loop died — while its heartbeats go
on, and the handlers it already runs finish (their statuses and keep-alives are publishes). It
appends a ``deaf`` line when nothing reaches it any more. It stays so until it is restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from typing import Any

from reach_mesh import _runner
from reach_mesh.agent import Agent, Task, TaskFailed
from reach_mesh.agent._run import serve
from reach_mesh.config import load_settings
from reach_mesh.logs import configure_logging

CAPABILITY = "chaos:work:v1"


class Log:
    """The agent's JSON lines (``O_APPEND``: a SIGKILL loses nothing already written)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, **ev: Any) -> None:
        os.write(self.fd, (json.dumps({**ev, "t": time.time()}) + "\n").encode())


def build(agent_id: str, log: Log) -> Agent:
    pid = os.getpid()
    agent = Agent(agent_id, settings=load_settings(), max_concurrency=32)

    @agent.handler(CAPABILITY)
    async def work(task: Task[Any]) -> Any:
        run_id = uuid.uuid4().hex
        log(
            ev="start",
            run=run_id,
            wf=task.workflow_id,
            step=task.step,
            task=task.task_id,
            attempt=task.attempt,
            agent=agent_id,
            pid=pid,
            # Task records this process read so far (informational: the table's fence reads).
            fr=agent.work.fence_reads if agent.work is not None else 0,
        )
        outcome = "error"
        try:
            p = task.payload
            if p["mode"] == "stubborn":
                loop = asyncio.get_running_loop()
                until = loop.time() + p["ms"] / 1000
                while (left := until - loop.time()) > 0:
                    try:
                        await asyncio.sleep(left)
                    except asyncio.CancelledError:
                        outcome = "late"  # ignored: its agent abandons it
                if outcome == "late":
                    return {"x": -1}  # dropped by the agent (a wrong result, were it kept)
            await asyncio.sleep(p["ms"] / 1000)
            if p["mode"] == "fail":
                outcome = "failed"
                raise TaskFailed("planned failure", retryable=False)
            if p["mode"] == "flaky" and task.attempt == 1:
                outcome = "flaky"  # a planned retry follows
                raise TaskFailed("planned flake", retryable=True)
            outcome = "ok"
            return {"x": p["x"] + 1}
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            log(ev="end", run=run_id, outcome=outcome)

    return agent


async def deafen(agent: Agent, log: Log) -> None:
    """Nothing reaches ``agent`` any more, while its heartbeats go on (as ``_deafen`` in
    ``tests/test_deaf_agents.py``). A signal before the agent has started waits for it."""
    await agent._registered.wait()  # (its subscriptions and work consumer are made before)
    if agent.work is not None:
        await agent.work.stop()
    for sub in list(agent._subs):
        await sub.unsubscribe()
        agent._subs.remove(sub)
    await agent.nc.flush()  # the server dropped its interest before any hub asks
    log(ev="deaf", agent=agent.agent_id, pid=os.getpid(), running=agent._running)


async def main(agent_id: str, log_path: str) -> None:
    log = Log(log_path)
    agent = build(agent_id, log)
    loop = asyncio.get_running_loop()
    deaf: list[asyncio.Task[None]] = []  # (a reference: the loop keeps only a weak one)
    loop.add_signal_handler(
        signal.SIGUSR1, lambda: deaf.append(loop.create_task(deafen(agent, log)))
    )
    await serve(agent)


if __name__ == "__main__":
    # ``reach_mesh.agent.run`` but for the SIGUSR1 handler (tracing is off in the chaos runs),
    # and its logging: the agent's WARNINGs (a lost server, a subject NATS refused this
    # identity) go to the process's log as a hub's do.
    configure_logging(os.environ.get("REACH_LOG_LEVEL", "WARNING"))
    _runner.run(main(sys.argv[1], sys.argv[2]))
