"""What a new user writes first: handlers in any reasonable shape, labels as Python values,
requests and workflows in the wrong namespace — each either works or says exactly why."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from reach_mesh import Client, MeshSettings, RetryPolicy, Step, TaskState
from reach_mesh.agent import Agent, Task
from reach_mesh.errors import BadRequestError, NoMatchError
from reach_mesh.hub import Hub

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


class Pair(BaseModel):
    a: int
    b: int


# --------------------------------------------------------------------------- handlers


async def test_handlers_in_every_reasonable_shape(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    # ``LocalTask`` is imported here only: with ``from __future__ import annotations`` the
    # annotations are strings, resolved where the handler is defined.
    from reach_mesh.agent import Task as LocalTask

    agent = Agent(f"{namespace}.shapes.a1", settings=settings)

    @agent.handler("shape:raw:v1")
    async def raw(task):  # type: ignore[no-untyped-def]  # unannotated: one of the shapes
        return {"payload": task.payload, "task_id": bool(task.task_id)}

    @agent.handler("shape:local:v1")
    async def local(task: LocalTask[Pair]) -> int:
        return task.payload.a + task.payload.b

    @agent.handler("shape:bare:v1")
    async def bare(payload: dict[str, Any]) -> list[str]:
        return sorted(payload)

    @agent.handler("shape:model:v1")
    async def model(pair: Pair) -> int:
        return pair.a * pair.b

    for i in range(2):  # the closure-in-a-loop idiom

        @agent.handler(f"shape:loop{i}:v1")
        async def loop(task: LocalTask[int], _i: int = i) -> int:
            return task.payload + _i

    async with agent, Client(settings=settings) as mesh:
        got = await mesh.request(capability="shape:raw:v1", payload=[1, "x"])
        assert got.result == {"payload": [1, "x"], "task_id": True}
        assert (
            await mesh.request(capability="shape:local:v1", payload={"a": 2, "b": 3})
        ).result == 5
        bad = await mesh.request(capability="shape:local:v1", payload={"a": 2})
        assert bad.state is TaskState.FAILED and bad.error is not None
        assert bad.error.code == "REACH_BAD_REQUEST"
        got = await mesh.request(capability="shape:bare:v1", payload={"y": 1, "x": 2})
        assert got.result == ["x", "y"]
        assert (
            await mesh.request(capability="shape:model:v1", payload={"a": 4, "b": 5})
        ).result == 20
        assert (await mesh.request(capability="shape:loop0:v1", payload=10)).result == 10
        assert (await mesh.request(capability="shape:loop1:v1", payload=10)).result == 11


def test_handlers_that_cannot_work_are_refused_with_the_reason(settings: MeshSettings) -> None:
    agent = Agent("refuse.h.a1", settings=settings)
    with pytest.raises(TypeError, match="need defaults"):

        @agent.handler("refuse:two:v1")
        async def two(task: Task[Any], other: Any) -> None:
            return None

    with pytest.raises(TypeError, match="cannot resolve an annotation"):

        @agent.handler("refuse:unknown:v1")
        async def unknown(task: NoSuchType) -> None:  # type: ignore[name-defined]  # noqa: F821
            return None

    with pytest.raises(TypeError, match="async def"):

        @agent.handler("refuse:sync:v1")  # type: ignore[type-var]  # not async: refused
        def sync(task: Task[Any]) -> None:
            return None


# --------------------------------------------------------------------------- labels


async def test_label_numbers_and_booleans_become_selector_strings(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(
        f"{namespace}.labels.a1",
        labels={"mem_gb": 16, "gpu": True, "ratio": 0.5, "tier": "gold"},
        settings=settings,
    )

    @agent.handler("labels:echo:v1")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    assert agent.card().labels == {"mem_gb": "16", "gpu": "true", "ratio": "0.5", "tier": "gold"}
    async with agent, Client(settings=settings) as mesh:
        res = await mesh.request(
            selector="cap=labels:echo:v1 AND gpu=true AND mem_gb=16 AND ratio=0.5", payload=1
        )
        assert res.ok and res.agent_id == agent.agent_id


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"mem": [16]}, "label 'mem' is a list"),
        ({"mem": None}, "label 'mem' is a NoneType"),
        ({"bad key": "x"}, "invalid label key 'bad key'"),
        ({"empty": ""}, "label 'empty' must be 1 to 256 characters"),
    ],
)
def test_bad_labels_are_refused_when_the_agent_is_built(
    labels: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadRequestError, match=message):
        Agent("refuse.labels.a1", labels=labels, settings=MeshSettings())


# --------------------------------------------------------------------------- namespaces


async def test_no_match_names_the_namespace_that_has_the_agents(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(f"{namespace}.elsewhere.a1", settings=settings)
    cap = f"{namespace}x:where:v1"

    @agent.handler(cap)
    async def where(task: Task[Any]) -> Any:
        return "here"

    async with agent, Client(settings=settings, namespace=f"{namespace}other") as mesh:
        with pytest.raises(NoMatchError) as err:
            await mesh.request(capability=cap, payload=None)
        assert f"no agent in namespace '{namespace}other'" in err.value.message
        assert f"1 match in '{namespace}'" in err.value.message
        assert err.value.details["other_namespaces"] == {namespace: 1}
        # A typo gets a "did you mean" in the headline.
        with pytest.raises(NoMatchError, match=rf"did you mean {cap[:-3]}:v1\?"):
            await mesh.request(capability=cap.replace("where", "wher"), payload=None)
        # By id, the id's namespace is used: no trap.
        assert (await mesh.request(agent_id=agent.agent_id, payload=None)).result == "here"


async def test_a_workflow_in_a_namespace_nobody_serves_says_why(
    wf_hub: Hub, wf_settings: MeshSettings, namespace: str
) -> None:
    agent = Agent(f"{namespace}.wfwhere.a1", settings=wf_settings)
    cap = f"{namespace}x:wfwhere:v1"

    @agent.handler(cap)
    async def where(task: Task[Any]) -> Any:
        return "here"

    async with agent, Client(settings=wf_settings, namespace=f"{namespace}other") as mesh:
        out = await mesh.chain(
            [Step(capability=cap, payload=1, retry=RetryPolicy(ttl=0.6))], timeout=10
        )
    assert out.state is TaskState.TIMEOUT
    assert out.steps[0].error is not None
    assert f"no agent in namespace '{namespace}other' matches" in out.steps[0].error.message
    assert f"1 match in '{namespace}'" in out.steps[0].error.message


async def test_show_decision_says_why_not_the_agents_the_selector_removed(
    hub: Hub, settings: MeshSettings, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from reach_mesh.cli import print_decision

    agents = [
        Agent(f"{namespace}.why.{region}", labels={"region": region}, settings=settings)
        for region in ("us-east", "eu-west")
    ]
    for agent in agents:

        @agent.handler("why:echo:v1")
        async def echo(task: Task[Any]) -> Any:
            return task.payload

    async with agents[0], agents[1], Client(settings=settings) as mesh:
        decision = await mesh.route(selector="cap=why:echo:v1 AND region=eu-west")
        assert decision.chosen == f"{namespace}.why.eu-west"
        reasons = {f.agent_id: f.reason for f in decision.filtered}
        assert reasons == {f"{namespace}.why.us-east": "selector: region=eu-west not met"}
        print_decision(decision)
        out = capsys.readouterr().out
        assert f"{namespace}.why.us-east  filtered  selector: region=eu-west not met" in out
        with pytest.raises(NoMatchError) as err:
            await mesh.route(selector="cap=why:echo:v1 AND region=ap-south")
        filtered = err.value.details["decision"]["filtered"]
        assert {f["agent_id"] for f in filtered} == {a.agent_id for a in agents}


# --------------------------------------------------------------------------- the command line

CLI = [sys.executable, "-m", "reach_mesh.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    env.update(extra)
    return env


async def test_agent_command_reads_the_config_file_it_is_given(
    hub: Hub, settings: MeshSettings, namespace: str, tmp_path: Path
) -> None:
    """`reach-mesh agent mod:attr --config FILE`: the agents the module builds at import time
    take their settings from FILE — here the only place that names the NATS server."""
    agent_id = f"{namespace}.conf.a1"
    (tmp_path / "fromconf.py").write_text(
        "from reach_mesh.agent import Agent\n"
        f"agent = Agent({agent_id!r})\n"
        "@agent.handler('conf:echo:v1')\n"
        "async def echo(task):\n"
        "    return task.payload\n"
    )
    conf = tmp_path / "agent.yaml"
    conf.write_text(yaml.safe_dump({"nats_url": settings.nats_url}))
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "agent",
        "fromconf:agent",
        "--config",
        str(conf),
        cwd=tmp_path,
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        seen = b""
        while b"serving" not in seen:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, f"the agent command ended: {seen.decode()}"
            seen += line
        assert f"serving {agent_id}".encode() in seen, seen
        async with Client(settings=settings) as mesh:
            res = await mesh.request(agent_id=agent_id, capability="conf:echo:v1", payload=3)
        assert res.result == 3
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have ended by itself
            proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)


def test_auth_writes_only_a_nats_url_given_on_its_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """$REACH_NATS_URL is where this shell talks to, not where each identity will run: the
    settings files carry a URL only when the auth command is given one."""
    from reach_mesh.cli import main

    def urls(d: Path) -> set[str | None]:
        files = sorted(d.glob("*.yaml"))
        assert files, f"no settings files in {d}"
        return {yaml.safe_load(f.read_text()).get("nats_url") for f in files}

    monkeypatch.setenv("REACH_NATS_URL", "nats://this-shell:4222")
    assert main(["auth", "init", str(tmp_path / "a")]) == 0
    assert main(["auth", "add-agent", "billing.inv.i1", "--dir", str(tmp_path / "a")]) == 0
    assert urls(tmp_path / "a") == {None}
    given = "nats://mesh-1:4222,nats://mesh-2:4222"
    assert main(["auth", "init", str(tmp_path / "b"), "--nats", given]) == 0
    assert urls(tmp_path / "b") == {given}
    assert main(["--nats", "nats://mesh-3:4222", "auth", "init", str(tmp_path / "c")]) == 0
    assert urls(tmp_path / "c") == {"nats://mesh-3:4222"}
    # Adding to a directory `auth init` never made (a forgotten --dir): refused, nothing
    # written — a partial directory would hold no hub and no server config.
    assert main(["auth", "add-operator", "alice", "--dir", str(tmp_path / "d")]) == 2
    assert not (tmp_path / "d").exists()
    assert main(["auth", "add-operator", "alice", "--dir", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "operator.alice.yaml").exists()
    # Again (the documented way to rewrite auth.conf): not "added", its seed kept.
    seed = (tmp_path / "a" / "operator.alice.nk").read_bytes()
    capsys.readouterr()
    assert main(["auth", "add-operator", "alice", "--dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "operator alice was issued already (its seed is unchanged" in out, out
    assert "added to" not in out, out
    assert (tmp_path / "a" / "operator.alice.nk").read_bytes() == seed


def test_reach_strategy_takes_the_names_the_hub_knows(capsys: pytest.CaptureFixture[str]) -> None:
    from reach_mesh.cli import build_parser
    from reach_mesh.hub.strategies import STRATEGIES

    parser = build_parser()
    for name in STRATEGIES:
        assert parser.parse_args(["reach", "--strategy", name]).strategy == name
    for wrong in ("weighted", "p2c"):  # what the help text used to offer
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["reach", "--strategy", wrong])
        assert exited.value.code == 2
        assert f"invalid choice: {wrong!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["reach", "--help"])
    shown = capsys.readouterr().out
    assert all(name in shown for name in STRATEGIES), shown
    assert "p2c" not in shown and "weighted," not in shown
    # The names come from the hub's registry without importing the hub itself.
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, reach_mesh.cli; print(*sorted(m for m in sys.modules "
            "if m.startswith('reach_mesh.hub')))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert run.stdout.split() == ["reach_mesh.hub", "reach_mesh.hub.strategies"]


async def test_reach_waits_the_configured_request_timeout(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """`reach` without --timeout waits ``request_timeout`` (here $REACH_REQUEST_TIMEOUT), not a
    fixed 30 s; no answer in time is exit code 5 (outcome unknown)."""
    agent = Agent(f"{namespace}.slow.a1", settings=settings)
    release = asyncio.Event()

    @agent.handler("slow:wait:v1")
    async def wait(task: Task[Any]) -> None:
        await release.wait()
        return None

    async with agent:
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            "reach",
            "--nats",
            settings.nats_url or "",
            "--agent",
            agent.agent_id,
            "--payload",
            "1",
            env=_env(REACH_REQUEST_TIMEOUT="1"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            release.set()
        took = time.monotonic() - t0
    assert proc.returncode == 5, (out, err)
    assert err.startswith(b"error REACH_TIMEOUT"), err
    assert took < 20, took  # the old fixed default waited 30 s


def test_help_is_plain_text_and_every_argument_says_what_it_takes() -> None:
    """`reach-mesh --help` shows no reST markup (``…``), and no command has a bare positional
    argument (`inspect agent_id` with nothing saying its form)."""
    import argparse

    from reach_mesh.cli import build_parser

    parser = build_parser()
    assert "``" not in parser.format_help()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        for action in command._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"reach-mesh {name}: {action.dest} has no help"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("status", "doctor"),  # a name from other tools
        ("explain", "reach --dry-run"),
        ("agnets", "agents"),  # a typo of a command
        ("stauts", "doctor"),  # a typo of a familiar name
    ],
)
def test_an_unknown_command_says_which_one_was_meant(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from reach_mesh.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--nats", "nats://127.0.0.1:4222", typed])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown command {typed!r}: did you mean `reach-mesh {meant}`?" in err, err


def test_an_unknown_command_like_none_points_at_the_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from reach_mesh.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["xyzzy"])
    err = capsys.readouterr().err
    assert "invalid choice: 'xyzzy'" in err and "reach-mesh --help says what each does" in err


@pytest.mark.skipif(not shutil.which("make"), reason="no make")
@pytest.mark.parametrize("python", ["old", "missing"])
def test_make_demo_with_a_python_too_old_says_which_one_to_name(
    tmp_path: Path, python: str
) -> None:
    """`make demo` on a machine whose python3 is 3.10 (Ubuntu 22.04): one line saying which
    Python it found and how to name another, before a venv is made — not pip's "requires a
    different Python" after a minute of creating one."""
    fake = tmp_path / "python3.10"
    says = '[ "$1" = --version ] && { echo "Python 3.10.12"; exit 0; }'
    fake.write_text(f"#!/bin/sh\n{says}\nexit 1\n")
    fake.chmod(0o755)
    given = str(fake) if python == "old" else str(tmp_path / "nosuchpython")
    venv = tmp_path / "venv"
    run = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "demo", f"PYTHON={given}", f"VENV={venv}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0, run.stdout
    found = "Python 3.10.12" if python == "old" else "not found"
    assert f"reach-mesh needs Python >= 3.11; {given} is {found}: name one" in run.stderr
    assert "make demo PYTHON=python3.12" in run.stderr, run.stderr
    assert not venv.exists()


def test_the_command_alone_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """`reach-mesh` with no command, as a new user first types it: the commands with what each
    does and where to start (exit 2), not argparse's bare "required: COMMAND"."""
    from reach_mesh.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"\bup\s+run the mesh until Ctrl-C", err), err
    assert "doctor" in err and "cordon" in err
    assert err.rstrip().endswith("start with `reach-mesh up --demo`"), err
