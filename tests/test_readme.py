"""The README as a new user runs it: every command of "Running a mesh" and the workflow script,
pasted in order, as subprocesses, against the mesh of a real `reach-mesh up --demo`."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach_mesh import Client

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end > 0 else len(text)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments kept (bash ignores them)."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def _argv(command: str) -> list[str]:
    """``command`` as argv, the trailing ``&`` and comments dropped; the README's `.venv/bin/`
    is this interpreter's bin directory."""
    argv = shlex.split(command, comments=True)
    if argv and argv[-1] == "&":
        argv.pop()
    return [a.replace(".venv/bin/", f"{BIN}/") for a in argv]


def _read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 30.0) -> str:
    """Lines of ``proc``'s stdout until one matches ``pattern`` (read in a thread: a
    buffered pipe and select() do not mix)."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stream = proc.stdout

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:
            break
        seen += line
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"no {pattern!r} from {proc.args!r} in {timeout:g}s; got:\n{seen}")


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args!r} did not stop on Ctrl-C") from None
    return proc.returncode


@pytest.fixture
def user_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    env["REACH_STATE_DIR"] = str(tmp_path / "state")  # not the user's ~/.local/state
    env["PYTHONUNBUFFERED"] = "1"
    yield env


#: What each command of "Running a mesh" must print (a regex on stdout).
EXPECT = {
    "doctor": (
        r"(?m)^OK\s+hubs\s+1 answering(?s:.*)"
        r"^(OK|WARN)\s+agents\s+3 in every namespace(?s:.*)^0 failed,"
    ),
    "agents": r"NS\s+AGENT\s+STATE.*\n(?s:.*)demo\s+demo\.calc\.c1\s+ONLINE",
    "inspect": r'"agent_id": "demo\.calc\.c1"',
    "--show-decision": r'"state": "SUCCEEDED"(?s:.*)"text": "bonjour"(?s:.*)"decision": \{',
    "--dry-run": r"demo\.translator\.t1\s+CHOSEN",
    "reach --agent": r'"state": "SUCCEEDED"(?s:.*)"sum": 12',
    "audit": r"demo\.calc\.c1",
    "uncordon": r'"state": "ONLINE"',
    "cordon": r'"state": "CORDONED"',
    "snapshot": r"wrote \d+ agents to registry\.json",
    "tools": (
        r"TOOL\s+DESCRIPTION\s+AGENTS\n(?s:.*)translate\s+Translate text\s+demo\.translator\.t1"
    ),
    "shop:price:v1": r'"state": "SUCCEEDED"(?s:.*)"price": 9\.5',
    "workflows": r"(?m)^\d+ workflow\(s\) of namespace demo since ",
}


def _expected(command: str) -> str:
    words = " ".join(_argv(command)[1:])  # the command, not the interpreter's path
    return next(v for k, v in EXPECT.items() if k in words)


def _start(command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _argv(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run_as_documented(command: str, cwd: Path, env: dict[str, str]) -> None:
    """Run ``command``: exit code 0 and the output :data:`EXPECT` wants."""
    run = subprocess.run(
        _argv(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
    assert re.search(_expected(command), run.stdout), f"{command}\n{run.stdout}"


def test_readme_running_a_mesh_works_as_written(tmp_path: Path, user_env: dict[str, str]) -> None:
    section = _section("## Running a mesh")
    up_block, cli_block, agent_block = _blocks(section, "bash")
    (myagents,) = _blocks(section, "python")
    (up_cmd,) = _commands(up_block)
    assert up_cmd.startswith(".venv/bin/reach-mesh up --demo")
    up = _start(up_cmd, tmp_path, user_env)
    background: list[subprocess.Popen[str]] = []
    try:
        out = _read_until(up, r"^export REACH_NATS_URL=")
        assert "agents demo.translator.t1, demo.summarizer.s1, demo.calc.c1" in out
        url = re.search(r"export REACH_NATS_URL=(\S+)", out)
        assert url is not None
        commands = _commands(cli_block)
        export, commands = commands[0], commands[1:]
        assert export.startswith("export REACH_NATS_URL=nats://127.0.0.1:4222")
        env = {**user_env, "REACH_NATS_URL": url.group(1)}  # "as printed by `up`"
        for command in commands:
            _run_as_documented(command, tmp_path, env)
        assert (tmp_path / "registry.json").exists()

        # Your own agents and one more hub.
        (tmp_path / "myagents.py").write_text(myagents)
        for command in _commands(agent_block):
            if command.split("#")[0].strip().endswith("&"):
                proc = _start(command, tmp_path, env)
                background.append(proc)
                _read_until(proc, r"^serving shop\.pricer\.p1$|^hub \S+ serving")
                continue
            _run_as_documented(command, tmp_path, env)

        # The workflow script of the README, against the same mesh.
        (script,) = _blocks(_section("### Workflows"), "python")
        (tmp_path / "workflows.py").write_text(script)
        run = subprocess.run(
            [sys.executable, "workflows.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert run.returncode == 0, run.stderr
        fanned = r"^fanout SUCCEEDED \[\('demo\.\S+', 'SUCCEEDED'\)"  # states as words
        assert re.search(fanned, run.stdout, re.M), run.stdout
        assert re.search(r"^chain SUCCEEDED \{'summary'", run.stdout, re.M), run.stdout
        assert re.search(r"^event done SUCCEEDED", run.stdout, re.M), run.stdout
        assert re.search(r"^submitted SUCCEEDED", run.stdout, re.M), run.stdout
    finally:
        for proc in background:
            assert _stop(proc) == 0
        code = _stop(up)
    assert code == 0


async def test_the_demo_agents_run_with_the_agent_command(
    hub: object, nats_url: str, user_env: dict[str, str]
) -> None:
    """`reach-mesh agent reach_mesh.demo:demo_agents`, as the README names it."""
    command = f".venv/bin/reach-mesh agent reach_mesh.demo:demo_agents --nats {nats_url}"
    proc = _start(command, ROOT, user_env)
    try:
        out = await asyncio.to_thread(_read_until, proc, r"^serving ")
        assert "serving demo.translator.t1, demo.summarizer.s1, demo.calc.c1" in out
        async with Client(nats_url, namespace="demo") as mesh:
            res = await mesh.request(agent_id="demo.calc.c1", payload={"values": [1, 2]})
        assert res.ok and res.result["sum"] == 3
    finally:
        assert await asyncio.to_thread(_stop, proc) == 0


def test_readme_sdk_example_runs(tmp_path: Path, user_env: dict[str, str]) -> None:
    """The SDK example at the top of the README, as a script (it starts its own server)."""
    script = _blocks(_section("## The SDK"), "python")[0]
    (tmp_path / "sdk.py").write_text(script)
    run = subprocess.run(
        [sys.executable, "sdk.py"],
        cwd=tmp_path,
        env=user_env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert run.returncode == 0, run.stderr
    assert re.match(r"SUCCEEDED 5 calc\.adder\.a1 [0-9a-f]{32}$", run.stdout.strip()), run.stdout
