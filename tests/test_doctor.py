"""``reach-mesh doctor`` against real nats-servers: a healthy mesh, a server with no hub and
no streams yet, and one without JetStream — each check's verdict and the exit code. (Secure
mode: ``test_security_nats.py``; a cluster with a node lost: ``test_cluster.py``.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from reach_mesh import MeshSettings, protocol
from reach_mesh._cli_doctor import STREAMS, Finding, _security, diagnose
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats, find_nats_server

from .helpers import FAST, eventually, free_port, heal, partition, run_cli

pytestmark = pytest.mark.timeout(60)


def _by_check(found: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in found}


async def test_a_healthy_mesh_is_ok(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    """Every check made, none failed; the hub and the agent are named, and the CLI's JSON
    says ``ok`` with exit code 0."""
    agent = Agent(f"{namespace}.doc.a1", settings=settings)

    @agent.handler("doc:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    async with agent:
        found = _by_check(await diagnose(settings))
        assert settings.nats_url is not None
        cli = await run_cli(settings.nats_url, "doctor", "--json")
    for check in (
        "nats",
        "security",
        "jetstream",
        "streams",
        "workflow queue",
        "hubs",
        "workflows",
    ):
        assert found[check].status == "ok", found[check]
    assert found["streams"].detail.startswith(f"{len(STREAMS)} of {len(STREAMS)} ok")
    assert hub.hub_id in found["hubs"].detail
    assert "ONLINE" in found["agents"].detail, found["agents"]
    assert cli.returncode == 0, cli.stderr
    body = json.loads(cli.stdout)
    assert body["ok"] is True
    assert {c["check"] for c in body["checks"]} >= {"nats", "jetstream", "hubs", "agents"}


async def test_no_hub_yet_fails_and_says_what_is_missing() -> None:
    """A JetStream server no hub ever used: the streams are missing (one line), no hub
    answers (FAIL: the agents are then not asked, rather than waited for), exit code 1."""
    async with EmbeddedNats() as server:
        found = await diagnose(MeshSettings(nats_url=server.url))
        cli = await run_cli(server.url, "doctor")
    checks = _by_check(found)
    assert checks["jetstream"].status == "ok"
    assert checks["streams"].status == "warn"
    assert checks["streams"].detail.startswith(f"none of the {len(STREAMS)} exists")
    assert not any(f.check in STREAMS for f in found)  # one line says it for them all
    assert checks["workflow queue"].status == "warn" and "hub" in checks["workflow queue"].detail
    assert checks["hubs"].status == "fail" and "reach-mesh hub" in checks["hubs"].detail
    assert checks["agents"].status == "warn" and "not checked" in checks["agents"].detail
    assert cli.returncode == 1, cli.stderr
    assert "FAIL  hubs" in cli.stdout and "1 failed" in cli.stdout


async def test_an_agent_declared_lost_lately_is_a_warning() -> None:
    """An agent that stopped heartbeating without a goodbye (hung, crashed) is declared LOST and
    leaves every listing but the recently LOST table: the agents check still warns, naming it,
    while it is not back (it said OK, the fleet's remaining agents all ONLINE); once it
    registers again the warning goes."""
    async with EmbeddedNats() as server:
        s = MeshSettings(nats_url=server.url, namespace="doc", **FAST)
        ok, hung = Agent("doc.ok.a1", settings=s), Agent("doc.hung.a1", settings=s)
        for agent in (ok, hung):

            @agent.handler("doc:echo:v1")
            async def echo(task: Task[Any]) -> Any:
                return task.payload

        async with Hub(settings=s) as hub, ok, hung:
            await partition(hung)  # no heartbeat, nothing on its ctl subject: hung
            await eventually(lambda: bool(hub.registry.recently_lost("doc")), timeout=10)
            found = _by_check(await diagnose(s))
            cli = await run_cli(server.url, "doctor")
            await heal(hung)
            await eventually(lambda: not hub.registry.recently_lost("doc"), timeout=10)
            back = _by_check(await diagnose(s))
    agents = found["agents"]
    assert agents.status == "warn", agents
    assert agents.detail.startswith("1 in every namespace: 1 ONLINE; 1 declared LOST"), agents
    assert "doc.hung.a1 (" in agents.detail and "s ago)" in agents.detail, agents
    assert cli.returncode == 0, cli.stderr  # a warning
    assert "WARN  agents" in cli.stdout, cli.stdout
    assert back["agents"].status == "ok", back["agents"]


async def test_the_nats_line_names_the_server_it_is_on() -> None:
    """Of several URLs given (a cluster, one node down), the line names the server the check
    connected to, not the list: `connected to a,b,c` read as if every one answered."""
    dead = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    async with EmbeddedNats(server_name="solo") as server:
        found = _by_check(await diagnose(MeshSettings(nats_url=f"{dead},{server.url}")))
        one = _by_check(await diagnose(MeshSettings(nats_url=server.url)))
    nats_line = found["nats"]
    assert nats_line.status == "ok", nats_line
    assert nats_line.detail.startswith(
        f"connected to {server.url} (server solo), one of 2 URLs given, nats-server "
    ), nats_line
    assert dead not in nats_line.detail, nats_line
    assert one["nats"].detail.startswith(f"connected to {server.url} (server solo), nats-"), one


async def test_a_stream_missing_is_named() -> None:
    """A hub made the streams, then one was deleted (by hand, or never made by an older hub):
    that one is named with what to do; the others are one line."""
    async with EmbeddedNats() as server:
        settings = MeshSettings(nats_url=server.url, audit_enabled=True)
        async with Hub(settings=settings):
            pass
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().delete_stream(protocol.STREAM_AUDIT)
        finally:
            await nc.close()
        found = _by_check(await diagnose(settings))
    n = len(STREAMS)
    assert found["streams"].status == "warn"
    assert found["streams"].detail.startswith(f"{n - 1} of {n} ok (R1)"), found["streams"]
    assert found[protocol.STREAM_AUDIT].status == "warn"
    assert "hubs create them" in found[protocol.STREAM_AUDIT].detail
    assert protocol.STREAM_WF not in found


@pytest.fixture
def no_jetstream() -> Iterator[str]:
    """A nats-server without JetStream (no ``-js``)."""
    port = free_port()
    proc = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


async def test_a_server_without_jetstream_fails(no_jetstream: str) -> None:
    """JetStream not enabled: its check fails and says how to enable it; the streams are not
    asked one by one."""
    for _ in range(50):  # the server is listening within moments
        try:
            found = _by_check(await diagnose(MeshSettings(nats_url=no_jetstream)))
            break
        except Exception:
            await asyncio.sleep(0.1)
    assert found["nats"].status == "ok"
    assert found["jetstream"].status == "fail"
    assert "-js" in found["jetstream"].detail, found["jetstream"]
    assert "streams" not in found and "workflow queue" not in found
    assert found["hubs"].status == "fail"


@pytest.mark.parametrize(
    ("url", "token", "status"),
    [
        ("nats://127.0.0.1:4222,nats://localhost:4223", None, "ok"),
        ("nats://[::1]:4222", None, "ok"),
        ("nats://127.0.0.1:4222,nats://10.0.0.5:4222", None, "warn"),
        ("nats.internal:4222", None, "warn"),
        ("nats://10.0.0.5:4222", "s3cret", "warn"),
        ("nats://u:p@10.0.0.5:4222", None, "warn"),
    ],
)
def test_open_mode_on_a_network_address_is_a_warning(
    url: str, token: str | None, status: str
) -> None:
    """Open mode is fine on loopback only; a shared secret (a token, a password) lets a
    connection in but tells no identity apart (secure mode: ``test_security_nats.py``)."""
    found = _security(MeshSettings(nats_url=url, nats_token=token), url)
    assert found.status == status, found
    if status == "warn":
        assert "reach-mesh auth init" in found.detail
