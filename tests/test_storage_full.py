"""JetStream's storage full (a server's ``max_file_store``, an account's limit, a disk): what the
mesh keeps, what it says, and that nothing is lost.

A server with 8 MiB of JetStream storage is filled by a stream of its own while a workflow's
step runs. Routing needs no store and goes on. A submission is refused at once with what to
do, not retried for seconds nor blamed on an election. The hub, whose heartbeat writes are
refused, is blind and says why (``/healthz``, the micro fleet answer, ``reach-mesh doctor``),
so it declares nobody LOST. The step's result, which could not be stored, is not lost and its
handler does not run again: once there is room the workflow ends with both results, and the
refused workflow id submitted again runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from reach_mesh import Client, MeshSettings, Step
from reach_mesh._cli_doctor import diagnose
from reach_mesh._retry import storage_full
from reach_mesh.agent import Agent
from reach_mesh.errors import MeshUnavailableError
from reach_mesh.hub import Hub
from reach_mesh.hub.http import HubHttp
from reach_mesh.models import AgentState, TaskState
from reach_mesh.server import EmbeddedNats

from .helpers import FAST, WF_FAST, eventually, gated_echo

#: Small enough to fill in a second, large enough for the mesh's own records.
STORE = 8 << 20


async def _fill(url: str) -> int:
    """Fill the server's JetStream store with a stream of this test's; the messages stored."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="FILLER", subjects=["filler.>"]))
        stored = 0
        for size in (60_000, 1_000, 10):  # to the last bytes: small messages fit in a remnant
            while True:
                try:
                    await js.publish("filler.x", b"x" * size)
                except Exception as err:
                    assert storage_full(err), err  # what the engine and the client tell apart
                    break
                stored += 1
        return stored
    finally:
        await nc.close()


async def _make_room(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream("FILLER")
    finally:
        await nc.close()


async def test_a_full_store_refuses_new_work_loudly_and_loses_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub.audit")
    async with EmbeddedNats(max_file_store=STORE) as server:
        settings = MeshSettings(nats_url=server.url, namespace="full", **FAST, **WF_FAST)
        agent = Agent("full.echo.a1", settings=settings)
        echo = gated_echo(agent, "test:echo:v1", hold="slow")
        started, gate, runs = echo.started, echo.gate, echo.runs

        async with Hub(settings=settings) as hub, agent, Client(settings=settings) as mesh:
            # The audit stream reserves audit_max_bytes (1 GiB), or a sixteenth of it: no room
            # for either here, and the hub says so instead of running without an audit history
            # in silence (a larger store takes the sixteenth: the test below).
            said = " ".join(r.getMessage() for r in caplog.records)
            assert "no REACH_AUDIT stream" in said and "audit_max_bytes" in said, said

            steps = [Step(capability="test:echo:v1", payload=p) for p in ("slow", "fast")]
            wf_id = await mesh.submit_fanout(steps, timeout=60)
            await asyncio.wait_for(started.wait(), 10)
            assert await _fill(server.url) > 0

            # Routing needs no store.
            routed = await mesh.request(capability="test:echo:v1", payload="routed")
            assert routed.state is TaskState.SUCCEEDED and routed.result == "routed"

            # A submission is refused at once, saying why and what to do.
            refused = [Step(capability="test:echo:v1", payload="later")]
            t0 = time.monotonic()
            with pytest.raises(MeshUnavailableError) as caught:
                await mesh.fanout(refused, workflow_id="full-later", timeout=30)
            assert time.monotonic() - t0 < 3, "a full store is not an election: no retries"
            text = str(caught.value)
            assert "storage is full" in text and "insufficient resources" in text, text
            assert "same workflow id again is safe" in text, text
            assert caught.value.code == "REACH_UNAVAILABLE"

            # The step's handler ends now: its final status finds no room.
            gate.set()
            # The hub's heartbeat writes are refused: blind, and why, wherever it is read.
            await eventually(hub.registry.blind, timeout=5)
            reason = hub.registry.blind_reason()
            assert reason is not None and "storage is full" in reason, reason
            health = json.loads(bytes((await HubHttp(hub).healthz()).body))
            assert health["registry_blind"] is True
            assert "storage is full" in health["registry_blind_reason"], health
            found = {f.check: f for f in await diagnose(settings)}
            assert found["hubs"].status == "fail", found["hubs"]
            assert "storage is full" in found["hubs"].detail, found["hubs"]
            assert "JetStream storage is full)" in found["hubs"].detail  # the runbook's section
            await asyncio.sleep(2.0)  # several leases with no heartbeat stored
            view = hub.registry.agents.get(agent.agent_id)
            assert view is not None and view.state is not AgentState.LOST  # blind: nobody LOST

            await _make_room(server.url)
            result = await mesh.workflow(wf_id, timeout=30)
            assert result.state is TaskState.SUCCEEDED, result
            assert [s.result for s in result.steps] == ["slow", "fast"], result.steps
            assert [s.attempts for s in result.steps] == [1, 1], result.steps
            again = await mesh.fanout(refused, workflow_id="full-later", timeout=30)
            assert again.state is TaskState.SUCCEEDED and again.steps[0].result == "later"
            assert sorted(runs) == ["fast", "later", "routed", "slow"], runs  # each ran once
            await eventually(lambda: not hub.registry.blind(), timeout=5)


async def test_an_audit_stream_too_large_for_the_store_takes_a_sixteenth(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store smaller than audit_max_bytes (a small volume: the default is 1 GiB) but with
    room for a sixteenth of it: the audit stream is created with that, and the hub says so."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub.audit")
    async with EmbeddedNats(max_file_store=STORE) as server:
        settings = MeshSettings(nats_url=server.url, namespace="full", audit_max_bytes=32 << 20)
        async with Hub(settings=settings) as hub:
            audit = await hub.nc.jetstream().stream_info("REACH_AUDIT")
            assert audit.config.max_bytes == 2 << 20, audit.config
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "REACH_AUDIT stream created with max_bytes 2097152" in said, said


async def test_an_account_nearly_full_is_a_doctor_warning(tmp_path: Path) -> None:
    """An account's own JetStream limit (``jetstream: {max_file: …}`` in the server's
    accounts): the doctor reads it and warns past 80 %, and a submission past it is refused
    as the server's limit's is."""
    conf = tmp_path / "accounts.conf"
    conf.write_text(
        "accounts {\n"
        "  APP: {\n"
        f"    jetstream: {{max_file: {STORE}, max_mem: 1048576}}\n"
        '    users: [{user: "app", password: "app"}]\n'
        "  }\n"
        "}\n"
    )
    async with EmbeddedNats(tmp_path / "store", auth_config=conf) as server:
        url = server.url.replace("nats://", "nats://app:app@")
        settings = MeshSettings(nats_url=url, namespace="full", audit_enabled=False, **FAST)
        async with Hub(settings=settings), Client(settings=settings) as mesh:
            found = {f.check: f for f in await diagnose(settings)}
            assert found["jetstream"].status == "ok", found["jetstream"]
            assert await _fill(url) > 0
            found = {f.check: f for f in await diagnose(settings)}
            jetstream = found["jetstream"]
            assert jetstream.status == "warn" and "nearly full" in jetstream.detail, jetstream
            with pytest.raises(MeshUnavailableError, match="storage is full"):
                await mesh.fanout([Step(capability="test:echo:v1", payload=1)], timeout=30)
