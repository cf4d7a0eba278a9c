"""The hub's statuses connection (``<hub_id>-statuses``) cut alone, on a real nats-server.

nats-server cuts it (here: its system account's ``KICK``, what a slow consumer's cut does to
it) while the hub's main connection stays up; the status events agents send meanwhile are lost
to it (core NATS keeps none). Once it is back, every step the hub runs reads what its attempts
stored in ``REACH_STATUS`` meanwhile, at once — not when its silence timeout (15 s) has it ask,
by when a workflow's deadline may have run out on an outcome its agent reported long before.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_mesh import Client, MeshSettings, Step, TaskState
from reach_mesh._nats_asking import reconnects_of
from reach_mesh.agent import Task
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import TaskStatusEvent, step_task_id

from .helpers import FAST, WF_FAST, Fleet, eventually, status_events

pytestmark = pytest.mark.timeout(60)

#: An account of its own for the mesh, and the system account that may kick its connections.
_ACCOUNTS = """accounts {
  MESH { jetstream: enabled, users: [ { user: mesh, password: mesh } ] }
  SYS { users: [ { user: sys, password: sys } ] }
}
system_account: SYS
"""


@pytest.fixture(scope="module")
def kickable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A nats-server whose system account can cut any one connection of the mesh."""
    where: Path = tmp_path_factory.mktemp("kickable")
    (where / "accounts.conf").write_text(_ACCOUNTS)
    with EmbeddedNats(where / "nats", auth_config=where / "accounts.conf") as server:
        yield server


def _as(server: EmbeddedNats, user: str) -> str:
    return server.url.replace("nats://", f"nats://{user}:{user}@")


async def kick(server: EmbeddedNats, name: str) -> None:
    """Have nats-server cut the mesh's connection named ``name``."""
    nc = await nats.connect(_as(server, "sys"))
    try:
        msg = await nc.request("$SYS.REQ.ACCOUNT.MESH.CONNZ", b"{}", timeout=2)
        connz: dict[str, Any] = json.loads(msg.data)
        cid = next(c["cid"] for c in connz["data"]["connections"] if c.get("name") == name)
        body = json.dumps({"cid": cid}).encode()
        await nc.request(f"$SYS.REQ.SERVER.{connz['server']['id']}.KICK", body, timeout=2)
    finally:
        await nc.close()


async def test_a_step_that_ended_while_the_statuses_connection_was_cut_is_decided_at_once(
    kickable: EmbeddedNats,
) -> None:
    """A step's attempt ends while the hub's statuses connection is cut: its final status is
    stored, and lost to the hub (``status_filter`` drops what the hub would hear until the
    reconnection, which nats-server's kick makes real). Its silence timeout (20 s) is longer
    than the workflow's deadline (10 s). Back on NATS, the hub reads the outcome from
    ``REACH_STATUS`` at once: the workflow SUCCEEDED seconds before its deadline, the handler
    run once — not TIMEOUT at the deadline, an outcome the agent never reported."""
    s = MeshSettings(
        nats_url=_as(kickable, "mesh"),
        namespace="gap",
        **{**FAST, **WF_FAST, "step_silence_timeout": 20.0, "step_deliver_timeout": 20.0},
    )
    cap = "wf:gap:v1"
    fleet = Fleet(s)
    async with Hub(settings=s) as hub:
        engine = hub.workflows
        assert engine is not None
        statuses = reconnects_of(hub.status_nc)
        assert statuses is not None
        agent = fleet.agent("gap.a1")
        release = asyncio.Event()

        @agent.handler(cap)
        async def run(task: Task[int]) -> int:
            fleet.runs[task.task_id] += 1
            await release.wait()
            return task.payload + 1

        await agent.start()
        cut = False
        lost: list[TaskStatusEvent] = []

        def while_cut(ev: TaskStatusEvent) -> bool:
            if cut:
                lost.append(ev)
            return not cut

        engine.status_filter = while_cut
        try:
            async with Client(settings=s) as mesh:
                step = Step(capability=cap, payload=1, timeout=10.0, retries=0)
                wf_id = await mesh.submit_fanout([step], timeout=10.0)
                task_id = step_task_id(wf_id, 0, step)
                await eventually(lambda: fleet.runs[task_id] == 1)
                cut = True  # from here on what the hub would hear is lost ...
                release.set()

                async def stored() -> bool:
                    events = await status_events(mesh, "gap", task_id)
                    return any(e.state is TaskState.SUCCEEDED for e in events)

                await eventually(stored)  # (the attempt's SUCCEEDED, in REACH_STATUS)
                before = statuses.count
                t0 = time.monotonic()
                await kick(kickable, f"{hub.hub_id}-statuses")
                await eventually(lambda: statuses.count > before, timeout=10)
                cut = False  # ... until the statuses connection is back
                assert any(e.state is TaskState.SUCCEEDED for e in lost), lost
                assert hub.nc.is_connected and reconnects_of(hub.nc).count == 0  # type: ignore[union-attr]
                res = await mesh.workflow(wf_id, timeout=15)
                took = time.monotonic() - t0
                assert res.state is TaskState.SUCCEEDED, res
                assert res.steps[0].result == 2 and res.steps[0].attempts == 1
                assert fleet.runs[task_id] == 1
                assert took < 5, f"decided {took:.1f}s after the cut: not read back at once"
        finally:
            engine.status_filter = None
            release.set()
            await fleet.close()
