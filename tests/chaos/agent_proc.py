"""One chaos agent as its own process: ``python agent_proc.py AGENT_ID LOG``.

Settings come from ``REACH_*`` environment variables. The handler of ``chaos:work:v1`` appends
a ``start`` line before it does anything and an ``end`` line when it ends (``O_APPEND`` writes:
a SIGKILL loses nothing already written) — the history checker reads them.

Payload: ``{"x": int, "mode": "ok" | "fail" | "slow" | "stubborn", "ms": int}``; ``ok``
returns ``{"x": x + 1}`` after ``ms`` milliseconds, ``fail`` raises a non-retryable
``TaskFailed``, ``slow`` sleeps ``ms`` (longer than the step timeout: the agent cancels it),
``stubborn`` too but ignores the cancellation and returns (outcome ``late``: the agent has
abandoned it by then, and drops what it returns).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

from reach_mesh.agent import Agent, Task, TaskFailed, run
from reach_mesh.config import load_settings

CAPABILITY = "chaos:work:v1"


def build(agent_id: str, log_path: str) -> Agent:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.getpid()

    def log(**ev: Any) -> None:
        os.write(fd, (json.dumps({**ev, "t": time.time()}) + "\n").encode())

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


if __name__ == "__main__":
    run(build(sys.argv[1], sys.argv[2]))
