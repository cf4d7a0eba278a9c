"""Ordinary mistakes, as a user makes them on the command line: each ends in one line on stderr
that names the fix, an exit code that says what kind of mistake it is (2 bad input, 3 nothing to
talk to, 4 nothing of that name, 5 no answer in time), no traceback — and quickly."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach_mesh import BadRequestError, Client, MeshSettings
from reach_mesh.cli import exit_code
from reach_mesh.errors import MeshUnavailableError, NotPermittedError
from reach_mesh.hub import Hub
from reach_mesh.server import EmbeddedNats

from .helpers import fetch

CLI = [sys.executable, "-m", "reach_mesh.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    env.update(extra)
    return env


def _refused_port() -> int:
    """A loopback port nothing listens on (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _fails_in_one_line(
    argv: list[str], env: dict[str, str], *expected: str, cwd: Path | None = None, code: int = 2
) -> str:
    run = subprocess.run(
        [*CLI, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == code, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return run.stdout


def test_short_http_token(nats_url: str) -> None:
    _fails_in_one_line(
        ["agents", "--nats", nats_url],
        _env(REACH_HTTP_TOKEN="short"),
        "REACH_HTTP_TOKEN is too short",
        "at least 16 characters",
    )


def test_misspelled_yaml_key(nats_url: str, tmp_path: Path) -> None:
    conf = tmp_path / "mesh.yaml"
    conf.write_text("heartbeat_intervl: 1.0\n")
    _fails_in_one_line(
        ["--config", str(conf), "agents", "--nats", nats_url],
        _env(),
        f"unknown setting 'heartbeat_intervl' in {conf}",
        "did you mean 'heartbeat_interval'?",
    )


def test_bad_setting_value_names_the_variable(nats_url: str) -> None:
    _fails_in_one_line(
        ["agents"],
        _env(REACH_NATS_URL=nats_url, REACH_REQUEST_TIMEOUT="soon"),
        "REACH_REQUEST_TIMEOUT",
    )


@pytest.mark.parametrize(
    ("given", "value"), [("REACH_REQUEST_TIMEOUT", "5s"), ("yaml max_payload", "1MiB")]
)
def test_a_setting_with_a_unit_says_settings_take_plain_numbers(
    nats_url: str, tmp_path: Path, given: str, value: str
) -> None:
    """`request_timeout: 5s`, `max_payload: 1MiB`: the fix (seconds, bytes) is in the line."""
    conf = tmp_path / "mesh.yaml"
    conf.write_text(f"max_payload: {value}\n")
    env = _env(REACH_NATS_URL=nats_url)
    if given.startswith("REACH_"):
        env[given] = value
        conf.write_text("{}\n")
    _fails_in_one_line(
        ["--config", str(conf), "agents"],
        env,
        given.removeprefix("yaml "),
        f"({value!r}: a plain number, times in seconds and sizes in bytes)",
    )


def test_a_misspelled_variable_is_warned_of_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`REACH_REQUEST_TIMOUT=5` is not a setting: it was ignored in silence, and the user ran
    on the default 30 s. Now a warning names the variable meant (once per process); variables
    that are no settings and spell none (REACH_CONFIG, REACH_LOG_LEVEL, ...) are left alone."""
    from reach_mesh import config

    for var in [v for v in os.environ if v.startswith("REACH_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(config, "_warned_env", set())
    monkeypatch.setenv("REACH_REQUEST_TIMOUT", "5")
    monkeypatch.setenv("REACH_LOG_LEVEL", "INFO")
    monkeypatch.setenv("REACH_STATE_DIR", "/tmp")
    monkeypatch.setenv("REACH_AUTH_DIR", "/tmp")
    with caplog.at_level(logging.WARNING, logger="reach_mesh.config"):
        assert config.load_settings().request_timeout == 30.0
        config.load_settings()
    warned = [r.getMessage() for r in caplog.records if r.name == "reach_mesh.config"]
    assert warned == [
        "REACH_REQUEST_TIMOUT is not a setting and is ignored: did you mean REACH_REQUEST_TIMEOUT?"
    ]


def test_busy_http_port(nats_url: str, busy_port: int) -> None:
    _fails_in_one_line(
        ["hub", "--nats", nats_url, "--http-port", str(busy_port)],
        _env(),
        f"HTTP port {busy_port} is already in use",
        "--http-port",
    )


@pytest.mark.parametrize(
    ("url", "cause"),
    [
        ("nats://127.0.0.1:{refused}", "connection refused: nothing listens on 127.0.0.1:"),
        ("nats://no-such-host.invalid:4222", "unknown host 'no-such-host.invalid'"),
    ],
)
def test_unreachable_nats_says_why(url: str, cause: str) -> None:
    url = url.format(refused=_refused_port())
    _fails_in_one_line(["agents", "--nats", url], _env(), "REACH_UNAVAILABLE", cause, code=3)


def test_nothing_listening_says_what_to_do() -> None:
    """The first-hour mistake: no server started yet. The line says how to start one."""
    url = f"nats://127.0.0.1:{_refused_port()}"
    _fails_in_one_line(
        ["doctor", "--nats", url],
        _env(),
        "connection refused",
        "is nats-server running? `reach-mesh up` starts one",
        "$REACH_NATS_URL",
        code=3,
    )


async def test_a_client_without_a_url_says_how_to_give_one_in_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's workflow script run without ``REACH_NATS_URL`` exported: the error names
    the Python ways to give the URL, not only the CLI's ``--nats``."""
    monkeypatch.delenv("REACH_NATS_URL", raising=False)
    monkeypatch.delenv("REACH_CONFIG", raising=False)
    with pytest.raises(BadRequestError, match=r"no NATS URL: .*Client\(url\).*REACH_NATS_URL"):
        async with Client(namespace="demo"):
            pass


def test_a_port_that_is_not_a_nats_servers_says_so(busy_port: int) -> None:
    """The dashboard's port given as the NATS one (it takes the connection and says nothing,
    as the hub's HTTP server does): not a bare "no connection within 2s"."""
    _fails_in_one_line(
        ["agents", "--nats", f"nats://127.0.0.1:{busy_port}"],
        _env(),
        "REACH_UNAVAILABLE",
        f"127.0.0.1:{busy_port} takes connections but is not a NATS server",
        "it sent nothing in 1s",
        "is it the hub's HTTP port?",
        code=3,
    )


@pytest.mark.parametrize(
    ("url", "cause"),
    [
        ("http://127.0.0.1:4222", "is not a NATS URL: use nats://host:4222"),
        ("nats://127.0.0.1:99999", "its port is not a number in 0-65535"),
    ],
)
def test_a_url_that_is_not_a_nats_one_is_bad_input_not_unavailable(url: str, cause: str) -> None:
    """Exit 2 (fix the command), not 3 (try again later): retrying cannot help."""
    _fails_in_one_line(["agents", "--nats", url], _env(), "REACH_BAD_REQUEST", cause, code=2)


@pytest.mark.parametrize(
    "argv",
    [
        ["hub", "--http-port", "99999"],
        ["hub", "--http-port", "-1"],
        ["up", "--http-port", "-5"],
        ["up", "--nats-port", "70000"],
        ["agent", "x:y", "--metrics-port", "65536"],
        ["auth", "init", "d", "--port", "99999"],
    ],
)
def test_a_port_out_of_range_is_refused_not_wrapped(argv: list[str]) -> None:
    """Ports were taken modulo 65536: ``--http-port 99999`` served on 34463, another
    program's port perhaps (``hub --http-port -1`` on 65535: off is leaving it out)."""
    run = subprocess.run([*CLI, *argv], env=_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "65535]" in run.stderr and "Traceback" not in run.stderr


def test_an_http_port_setting_out_of_range_names_the_variable(nats_url: str) -> None:
    _fails_in_one_line(
        ["hub", "--nats", nats_url], _env(REACH_HTTP_PORT="70000"), "REACH_HTTP_PORT"
    )


async def test_a_snapshot_that_cannot_be_written_is_bad_input(
    hub: Hub, nats_url: str, tmp_path: Path
) -> None:
    code, _, err = await _cli("--nats", nats_url, "snapshot", "-o", str(tmp_path / "no" / "x.json"))
    assert code == 2, err
    assert err.decode().strip().splitlines() == [
        f"error REACH_BAD_REQUEST: cannot write {tmp_path / 'no' / 'x.json'}: "
        "No such file or directory"
    ]


@pytest.mark.parametrize("url", ["nats://127.0.0.1:{refused}", "nats://no-such-host.invalid:4222"])
async def test_connect_fails_within_two_seconds(url: str) -> None:
    url = url.format(refused=_refused_port())
    t0 = time.monotonic()
    with pytest.raises(MeshUnavailableError):
        await Client(settings=MeshSettings(nats_url=url)).connect()
    assert time.monotonic() - t0 < 3.0  # 2 s connect_timeout, then the diagnosis


def test_agent_does_not_claim_to_serve_before_it_is_connected(tmp_path: Path) -> None:
    (tmp_path / "lonely.py").write_text(
        "from reach_mesh.agent import Agent, Task\n"
        "agent = Agent('lonely.echo.a1')\n"
        "@agent.handler('lonely:echo:v1')\n"
        "async def echo(task: Task[int]) -> int:\n"
        "    return task.payload\n"
    )
    url = f"nats://127.0.0.1:{_refused_port()}"
    out = _fails_in_one_line(
        ["agent", "lonely:agent", "--nats", url],
        _env(),
        "connection refused",
        cwd=tmp_path,
        code=3,
    )
    assert "serving" not in out


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ("labels={f'k{i}': 'v' for i in range(129)}", "labels"),
        ("max_concurrency=100001", "max_concurrency"),
        ("weight=0", "weight"),
    ],
)
def test_an_agent_over_a_card_limit_is_told_in_one_line(
    tmp_path: Path, kwargs: str, field: str
) -> None:
    """A card over a documented limit: one ``REACH_BAD_REQUEST`` line naming the field, exit
    2, before anything connects (it was pydantic's ValidationError, several lines, exit 1,
    after the agent had connected and subscribed)."""
    (tmp_path / "over.py").write_text(
        "from reach_mesh.agent import Agent, Task\n"
        f"agent = Agent('over.echo.a1', {kwargs})\n"
        "@agent.handler('over:echo:v1')\n"
        "async def echo(task: Task[int]) -> int:\n"
        "    return task.payload\n"
    )
    url = f"nats://127.0.0.1:{_refused_port()}"  # (nothing connects: refused first)
    _fails_in_one_line(
        ["agent", "over:agent", "--nats", url], _env(), "REACH_BAD_REQUEST", field, cwd=tmp_path
    )


def test_a_factory_that_fails_is_not_said_to_need_arguments(tmp_path: Path) -> None:
    """A ``TypeError`` raised inside a factory of no arguments is its own error (its
    traceback shows where), not "a function that cannot be called without arguments"."""
    (tmp_path / "factory.py").write_text("def agents():\n    return len(3)\n")
    run = subprocess.run(
        [*CLI, "agent", "factory:agents", "--nats", "nats://127.0.0.1:1"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "cannot be called without arguments" not in run.stderr
    assert "object of type 'int' has no len()" in run.stderr, run.stderr


def test_agent_target_that_needs_arguments(tmp_path: Path) -> None:
    (tmp_path / "factory.py").write_text("def agents(settings):\n    return []\n")
    _fails_in_one_line(
        ["agent", "factory:agents", "--nats", "nats://127.0.0.1:1"],
        _env(),
        "cannot be called without arguments",
        cwd=tmp_path,
    )


async def test_output_into_a_closed_pipe_is_quiet(hub: Hub, nats_url: str) -> None:
    """`reach-mesh ... | head` (the reader leaves early): no BrokenPipeError, exit 0."""
    cli = " ".join(CLI)
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        f"{cli} snapshot --nats {nats_url} | true; exit ${{PIPESTATUS[0]}}",
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert err == b"", err
    assert proc.returncode == 0


async def _cli(*args: str) -> tuple[int | None, bytes, bytes]:
    """``reach-mesh ARGS`` in a process of its own: exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        *CLI, *args, env=_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out, err


async def test_global_options_before_the_command(hub: Hub, nats_url: str) -> None:
    code, out, err = await _cli("--nats", nats_url, "agents", "--namespace", "nobody")
    assert code == 0, err
    assert b"no agents in namespace 'nobody'" in out
    code, out, _ = await _cli("--nats", nats_url, "tools", "--json")
    assert code == 0 and isinstance(json.loads(out), list)


def test_exit_code_of_each_kind_of_error() -> None:
    """The table of README.md ("Running a mesh") and ``reach-mesh --help``, by wire code: what
    a script branches on (retry on 3, look elsewhere on 4, check the outcome on 5)."""
    from reach_mesh.cli import EXIT_CODES, exit_code
    from reach_mesh.errors import error_from_wire

    expected = {
        "REACH_BAD_REQUEST": 2,
        "REACH_BAD_SELECTOR": 2,
        "REACH_PAYLOAD_TOO_LARGE": 2,
        "REACH_UNAVAILABLE": 3,
        "REACH_THROTTLED": 3,
        "REACH_AGENT_BUSY": 3,
        "REACH_NO_MATCH": 4,
        "REACH_UNKNOWN_NAMESPACE": 4,
        "REACH_UNKNOWN_AGENT": 4,
        "REACH_UNKNOWN_WORKFLOW": 4,
        "REACH_NO_HANDLER": 4,
        "REACH_TIMEOUT": 5,
        "REACH_INTERNAL": 1,
        "REACH_FROM_A_NEWER_HUB": 1,
    }
    for code, want in expected.items():
        assert exit_code(error_from_wire({"code": code, "message": "m"})) == want, code
        if want > 2:
            assert code in EXIT_CODES, code  # the table of --help names it
    assert "REACH_BAD_*" in EXIT_CODES
    assert exit_code(RuntimeError("a bug")) == 1
    run = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "exit codes:" in run.stdout and "REACH_TIMEOUT" in run.stdout


async def test_exit_codes_end_to_end(hub: Hub, settings: MeshSettings, namespace: str) -> None:
    nats = ("--nats", settings.nats_url or "")
    code, _, err = await _cli("reach", *nats, "--agent", f"{namespace}.nobody.x1", "--payload", "1")
    assert code == 4 and b"error REACH_" in err, err
    code, _, err = await _cli(
        "reach", *nats, "--namespace", namespace, "--capability", "nobody:here:v1"
    )
    assert code == 4 and b"REACH_NO_MATCH" in err, err
    code, _, err = await _cli("workflow", *nats, "--namespace", namespace, "no-such-workflow")
    assert code == 4 and b"REACH_UNKNOWN_WORKFLOW" in err, err
    code, _, err = await _cli("reach", *nats, "--selector", "cap=x:y:v1 AND", "--payload", "1")
    assert code == 2 and b"REACH_BAD_SELECTOR" in err, err
    code, _, err = await _cli("reach", *nats, "--agent", "a.b.c1", "--strategy", "p2c")
    assert code == 2 and b"invalid choice: 'p2c'" in err, err


async def test_a_payload_read_from_a_file_or_stdin(
    hub: Hub, settings: MeshSettings, namespace: str, tmp_path: Path
) -> None:
    """`reach --payload @FILE` / `--payload -`: a payload past the shell's argument limit
    (~128 KiB) can be sent; one over max_payload is refused in one line naming the setting."""
    from reach_mesh.agent import Agent, Task

    agent = Agent(f"{namespace}.echo.e1", settings=settings)

    @agent.handler("echo:len:v1")
    async def length(task: Task[dict[str, str]]) -> int:
        return len(task.payload["blob"])

    nats = ("--nats", settings.nats_url or "")
    to_echo = ("reach", *nats, "--agent", agent.agent_id, "--payload")
    blob = tmp_path / "blob.json"
    blob.write_text(json.dumps({"blob": "x" * 300_000}))  # past one argument's 128 KiB
    async with agent:
        code, out, err = await _cli(*to_echo, f"@{blob}")
        assert code == 0, err
        assert json.loads(out)["result"] == 300_000
        proc = await asyncio.create_subprocess_exec(
            *CLI, *to_echo, "-",
            env=_env(), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(b'{"blob": "abc"}'), 60)
        assert proc.returncode == 0, err
        assert json.loads(out)["result"] == 3
    blob.write_text(json.dumps({"blob": "x" * (2 << 20)}))
    code, _, err = await _cli(*to_echo, f"@{blob}")
    assert code == 2, err
    assert err.startswith(b"error REACH_PAYLOAD_TOO_LARGE: request of "), err
    assert b"(max_payload, set alike on every hub and agent" in err, err
    code, _, err = await _cli(*to_echo, "@nowhere")
    assert code == 2, err
    assert err.startswith(b"error REACH_BAD_REQUEST: cannot read --payload file "), err
    blob.write_text("sku: a1\n")
    code, _, err = await _cli(*to_echo, f"@{blob}")
    assert code == 2, err
    not_json = f"error REACH_BAD_REQUEST: --payload file {blob} is not valid JSON"
    assert err.startswith(not_json.encode()), err


async def test_hubs_with_no_hub_answering_exits_3() -> None:
    """`reach-mesh hubs` is how a script asks "is a hub up?": none answering is an error."""
    async with EmbeddedNats() as server:
        for extra in ((), ("--json",)):
            code, out, err = await _cli("hubs", "--nats", server.url, *extra)
            assert code == 3, (out, err)
            assert err.decode().startswith("error REACH_UNAVAILABLE: no hub answered"), err
            assert server.url.encode() in err
            # (--json: the same error as JSON on stdout, for the script reading it)
            assert (
                out == b"" if not extra else json.loads(out)["error"]["code"] == "REACH_UNAVAILABLE"
            )
        code, _, err = await _cli("agents", "--via-micro", "--nats", server.url)
        assert code == 3 and b"no hub answered" in err, err


def test_version() -> None:
    run = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("reach-mesh ")


def test_every_option_has_help() -> None:
    from reach_mesh.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    assert isinstance(subparsers.choices, dict)
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"


def test_ctrl_c_of_up_then_restart_lets_an_agent_reconnect(tmp_path: Path) -> None:
    """Agents connected to `up` say NATS is gone when it stops, and come back when it runs
    again on the same port (JetStream kept in the state dir)."""
    port = _refused_port()
    env = _env(REACH_STATE_DIR=str(tmp_path / "state"), PYTHONUNBUFFERED="1")
    url = f"nats://127.0.0.1:{port}"
    (tmp_path / "one.py").write_text(
        "from reach_mesh.agent import Agent\n"
        "agent = Agent('back.echo.a1')\n"
        "@agent.handler('back:echo:v1')\n"
        "async def echo(task):\n"
        "    return task.payload\n"
    )

    def up() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*CLI, "up", "--nats-port", str(port), "--http-port", "-1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("export REACH_NATS_URL="):
                assert line.strip().endswith(f":{port}")
                return proc
        raise AssertionError("up did not start")

    def stop(proc: subprocess.Popen[str]) -> str:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is not None
        return proc.stdout.read()

    log = (tmp_path / "agent.log").open("w+")
    first = up()
    agent = subprocess.Popen(
        [*CLI, "agent", "one:agent", "--nats", url],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(tmp_path / "agent.log", "serving back.echo.a1")
        # Its last line says where the work is, and that it goes on at the next run.
        said = stop(first).strip().splitlines()[-1]
        kept = tmp_path / "state" / f"nats-{port}"
        assert said == (
            f"reach-mesh up: stopped; JetStream kept in {kept}: when up runs again on port "
            f"{port}, unfinished workflows go on and agents still running reconnect"
        ), said
        _wait_for(tmp_path / "agent.log", "lost NATS at")
        second = up()
        try:
            _wait_for(tmp_path / "agent.log", "reconnected to NATS")
            deadline = time.monotonic() + 30
            while True:
                run = subprocess.run(
                    [*CLI, "reach", "--nats", url, "--agent", "back.echo.a1", "--payload", "7"],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                if run.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert run.returncode == 0, run.stderr
            assert '"result": 7' in run.stdout
        finally:
            stop(second)
    finally:
        agent.send_signal(signal.SIGINT)
        agent.wait(timeout=30)
        log.close()
    text = (tmp_path / "agent.log").read_text()
    # Once per outage (two: the restart, then the end of the test), not every heartbeat.
    assert text.count("lost NATS at") == 2, text
    assert text.count("reconnected to NATS") == 1, text
    # No heartbeat noise while NATS is gone. Right after the reconnect the new `up` may not
    # have its hub subscribed yet: at most one beat finds no hub (and says so).
    failed = [ln for ln in text.splitlines() if "heartbeat of back.echo.a1" in ln]
    assert len(failed) <= 1 and all("no hub answered" in ln for ln in failed), text


async def test_agent_command_serves_each_agents_metrics(hub: Hub, nats_url: str) -> None:
    """``reach-mesh agent --metrics-port 0``: each agent's /metrics on a port of its own, told
    on start (what the ReachAgentFailures alert needs scraped)."""
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "agent",
        "reach_mesh.demo:demo_agents",
        "--nats",
        nats_url,
        "--metrics-port",
        "0",
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        urls: dict[str, str] = {}
        while len(urls) < 3:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            assert line, "the agent command ended"
            if line.startswith("metrics of "):
                agent_id, url = line.removeprefix("metrics of ").strip().split(": ")
                urls[agent_id] = url
        assert len(set(urls.values())) == 3
        for url in urls.values():
            status, body = await fetch(url)
            assert status == 200 and b"reach_agent_inflight" in body
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)


def _wait_for(path: Path, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path}:\n{path.read_text()}")


async def test_a_refused_credential_fails_at_once(tmp_path: Path) -> None:
    async with EmbeddedNats(tmp_path, auth_token="s3cret-token") as server:
        t0 = time.monotonic()
        with pytest.raises(NotPermittedError, match="Authorization Violation") as err:
            await Client(settings=MeshSettings(nats_url=server.url, nats_token="wrong")).connect()
        assert time.monotonic() - t0 < 1.0  # retrying a wrong credential cannot help
        # Not "unavailable, try again" (exit 3): where its identity's settings come from.
        assert "REACH_CONFIG=" in err.value.message and exit_code(err.value) == 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tables_fit_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from reach_mesh._cli_fleet import print_table

    rows = [("AGENT", "CAPABILITIES"), ("a.b.c1", ",".join(f"cap:n{i}:v1" for i in range(40)))]
    monkeypatch.setenv("COLUMNS", "60")
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    print_table(rows)
    lines = screen.getvalue().splitlines()
    assert all(len(line) <= 60 for line in lines) and lines[1].endswith("…")
    piped = io.StringIO()  # not a terminal: nothing is cut
    monkeypatch.setattr(sys, "stdout", piped)
    print_table(rows)
    assert rows[1][1] in piped.getvalue()


async def test_a_workflow_with_no_hub_ever_started_says_to_start_one() -> None:
    """A fanout on a NATS where no hub ever ran: no workflow stream exists, so the submission
    fails at once with the fix in the message, not after the submit retry budget."""
    from reach_mesh import Step

    async with EmbeddedNats() as server:
        settings = MeshSettings(nats_url=server.url, namespace="nohub")
        async with Client(settings=settings) as mesh:
            t0 = time.monotonic()
            with pytest.raises(MeshUnavailableError, match=r"no workflow stream: is a hub"):
                await mesh.fanout([Step(capability="demo:echo:v1", payload={})], timeout=30)
            assert time.monotonic() - t0 < 5.0


async def test_an_agent_with_no_hub_says_so_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """An agent started before any hub: its first unanswered registration is a WARNING that
    names the likely cause, not 30 silent seconds."""
    from reach_mesh.agent import Agent, Task

    caplog.set_level(logging.WARNING, logger="reach_mesh")
    async with EmbeddedNats() as server:
        agent = Agent("nohub.echo.a1", settings=MeshSettings(nats_url=server.url))

        @agent.handler("demo:echo:v1")
        async def echo(task: Task[int]) -> int:
            return task.payload

        starting = asyncio.ensure_future(agent.start())
        try:
            for _ in range(100):
                if any(
                    "no hub answered the registration" in r.getMessage() for r in caplog.records
                ):
                    break
                await asyncio.sleep(0.05)
            (line,) = [
                r.getMessage()
                for r in caplog.records
                if "no hub answered the registration" in r.getMessage()
            ]
            assert "nohub.echo.a1" in line and "reach-mesh hub" in line and server.url in line
            assert not starting.done()  # still trying
        finally:
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            await agent.close()


async def test_an_agent_whose_hub_stopped_says_no_hub_answers(
    settings: MeshSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub stopped (Ctrl-C of `reach-mesh hub`), NATS still up: each heartbeat of the
    agent found no responder. It said `heartbeat of … failed: NoRespondersError()`; it now
    says what that means and how to look."""
    from reach_mesh.agent import Agent, Task

    caplog.set_level(logging.WARNING, logger="reach_mesh")
    agent = Agent(f"{settings.namespace}.echo.a1", settings=settings)

    @agent.handler("demo:echo:v1")
    async def echo(task: Task[int]) -> int:
        return task.payload

    async with Hub(settings=settings):
        await agent.start()
    try:
        for _ in range(100):
            if any("heartbeat of" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        lines = [r.getMessage() for r in caplog.records if "heartbeat of" in r.getMessage()]
        assert lines, [r.getMessage() for r in caplog.records]
        assert lines[0] == (
            f"heartbeat of {agent.agent_id}: no hub answered (none runs on this NATS, or each "
            "is starting: `reach-mesh hubs`); the next beats ask again"
        )
    finally:
        await agent.close()


async def test_dry_run_explains_a_no_match(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """`reach --dry-run --show-decision` with a selector nobody meets prints the decision —
    which term removed each candidate — before the error line."""
    from reach_mesh.agent import Agent, Task

    agent = Agent(f"{namespace}.gpu.g1", settings=settings, labels={"gpu": "true"})

    @agent.handler("sum:add:v1")
    async def add(task: Task[dict[str, int]]) -> int:
        return 0

    async with agent:
        code, out, err = await _cli(
            "--nats",
            settings.nats_url or "",
            "reach",
            "--namespace",
            namespace,
            "--selector",
            "cap=sum:add:v1 AND gpu=false",
            "--dry-run",
            "--show-decision",
        )
    assert code != 0
    assert f"{namespace}.gpu.g1" in out.decode() and "gpu=false not met" in out.decode(), out
    assert b"REACH_NO_MATCH" in err, err


async def test_json_answers_stay_json_on_errors_and_with_the_decision(
    hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    """A script piping ``reach`` (or any ``--json``) into ``jq`` reads one JSON document on
    stdout: an error is ``{"error": ...}`` there too (the line for people stays on stderr),
    and ``--show-decision`` puts the decision in the answer, its table on stderr."""
    from reach_mesh.agent import Agent, Task

    agent = Agent(f"{namespace}.calc.c1", settings=settings)

    @agent.handler("sum:add:v1")
    async def add(task: Task[dict[str, int]]) -> int:
        return task.payload["a"] + task.payload["b"]

    nats = ("--nats", settings.nats_url or "")
    async with agent:
        code, out, err = await _cli(
            *nats, "reach", "--namespace", namespace, "--capability", "sum:nope:v1"
        )
        assert code == 4, err
        assert json.loads(out)["error"]["code"] == "REACH_NO_MATCH"
        assert b"error REACH_NO_MATCH" in err
        code, out, err = await _cli(
            *nats,
            "reach",
            "--namespace",
            namespace,
            "--capability",
            "sum:add:v1",
            "--payload",
            '{"a": 2, "b": 3}',
            "--show-decision",
        )
        assert code == 0, err
        answer = json.loads(out)
        assert answer["result"] == 5 and answer["decision"]["chosen"] == agent.agent_id
        assert b"CHOSEN" in err
    code, out, _ = await _cli("--nats", "nats://127.0.0.1:1", "agents", "--json")
    assert code == 3
    assert json.loads(out)["error"]["code"] == "REACH_UNAVAILABLE"


async def test_a_workflow_step_with_a_capability_typo_says_did_you_mean(
    wf_settings: MeshSettings, namespace: str
) -> None:
    """A step waits for an agent to appear (durable work may be submitted before its agents
    start), so a typo ends TIMEOUT — and the TIMEOUT says why, as a plain request would."""
    from reach_mesh import Step, TaskState
    from reach_mesh.agent import Agent, Task

    agent = Agent(f"{namespace}.tr.t1", settings=wf_settings)

    @agent.handler("text:translate:v1")
    async def translate(task: Task[dict[str, str]]) -> dict[str, str]:
        return task.payload

    async with Hub(settings=wf_settings), agent, Client(settings=wf_settings) as mesh:
        out = await mesh.fanout([Step(capability="text:transalte:v1", payload={})], timeout=1.5)
    assert out.state is TaskState.TIMEOUT
    error = out.steps[0].error
    assert error is not None and "did you mean text:translate:v1" in error.message, error


async def test_a_client_with_no_hub_says_so_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """A request on a NATS where no hub answers keeps retrying until its deadline (a hub may be
    restarting), but says so at once — the CLI shows the line on stderr — and only once."""
    caplog.set_level(logging.WARNING, logger="reach_mesh")
    async with EmbeddedNats() as server, Client(settings=MeshSettings(nats_url=server.url)) as c:
        asking = asyncio.ensure_future(c.agents())
        try:

            def said() -> list[str]:
                return [
                    r.getMessage()
                    for r in caplog.records
                    if r.getMessage().startswith("no hub answered on")
                ]

            for _ in range(40):
                if said():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # more retries meanwhile: still one line
            (line,) = said()
            assert "reach-mesh hub" in line and server.url in line
            assert not asking.done()
        finally:
            asking.cancel()
            with contextlib.suppress(BaseException):
                await asking


async def test_audit_where_no_hub_ever_ran_says_so() -> None:
    """No audit stream is not "no matching events": the error says why there is none."""
    async with EmbeddedNats() as server, Client(settings=MeshSettings(nats_url=server.url)) as c:
        with pytest.raises(MeshUnavailableError, match=r"no audit stream .*no hub has run here"):
            await c.audit()


def test_agent_spec_given_as_a_file_name_says_how_to_name_the_module(tmp_path: Path) -> None:
    """`reach-mesh agent myagents.py:agent` — a file name where a module name goes."""
    from reach_mesh._cli_serve import load_agents
    from reach_mesh.errors import BadRequestError

    with pytest.raises(BadRequestError, match=r"a module name, not a file: myagents:agent"):
        load_agents("myagents.py:agent")
    # a path, as a shell completes it: the dotted name that imports, not a TypeError
    for spec, named in [
        ("./myagents.py:agent", "myagents:agent"),
        ("agents/shop.py:agent", "agents.shop:agent"),
        ("./agents/shop:agent", "agents.shop:agent"),
    ]:
        with pytest.raises(BadRequestError, match=rf"a module name, not a file: {named}\)$"):
            load_agents(spec)


def test_agent_spec_without_its_attribute_names_the_agents_the_module_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reach-mesh agent myagents` (or `myagents.py`, or `myagents:agnt`): the module imports,
    and the error names the `module:attribute` to give, not only the grammar."""
    from reach_mesh._cli_serve import load_agents

    (tmp_path / "first_hour_one.py").write_text(
        "from reach_mesh.agent import Agent\n"
        "helper = 3\n"
        "agent = Agent('shop.pricer.p1', capabilities=['shop:price:v1'])\n"
    )
    (tmp_path / "first_hour_two.py").write_text(
        "from reach_mesh.agent import Agent\n"
        "pricer = Agent('shop.pricer.p1', capabilities=['shop:price:v1'])\n"
        "fleet = [Agent('shop.taxer.t1', capabilities=['shop:tax:v1'])]\n"
    )
    (tmp_path / "first_hour_none.py").write_text("def build(n):\n    return n\n")
    monkeypatch.chdir(tmp_path)
    for spec in ("first_hour_one", "first_hour_one.py", "./first_hour_one.py"):
        with pytest.raises(
            BadRequestError, match=r"module:attribute.*did you mean first_hour_one:agent\?$"
        ):
            load_agents(spec)
    with pytest.raises(
        BadRequestError,
        match=r"'first_hour_one' has no attribute 'agnt'; did you mean first_hour_one:agent\?$",
    ):
        load_agents("first_hour_one:agnt")
    with pytest.raises(
        BadRequestError, match=r"its Agents: first_hour_two:fleet, first_hour_two:pricer$"
    ):
        load_agents("first_hour_two")
    with pytest.raises(BadRequestError, match=r"has no attribute 'agent' \(nor any Agent"):
        load_agents("first_hour_none:agent")
    assert [a.agent_id for a in load_agents("first_hour_one:agent")] == ["shop.pricer.p1"]


async def test_a_zero_timeout_is_refused_not_taken_for_the_default(
    hub: Hub, settings: MeshSettings
) -> None:
    """``timeout=0`` (``reach --timeout 0``) is out of range like -1, not silently the
    settings' ``request_timeout``."""
    async with Client(settings=settings) as c:
        with pytest.raises(BadRequestError, match=r"invalid timeout 0"):
            await c.request(capability="a:b:v1", timeout=0)


def test_an_unquoted_reason_is_told_by_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``cordon ID --reason host maintenance``: the command's own usage and the likely cause,
    not the top-level usage."""
    from reach_mesh.cli import main

    with pytest.raises(SystemExit) as out:
        main(["cordon", "demo.calc.c1", "--reason", "host", "maintenance"])
    assert out.value.code == 2
    err = capsys.readouterr().err
    assert "usage: reach-mesh cordon" in err
    assert "unrecognized arguments: maintenance" in err and "goes in quotes" in err
    with pytest.raises(SystemExit):
        main(["auth", "add-agent", "a.b.c1", "extra"])
    assert "usage: reach-mesh auth add-agent" in capsys.readouterr().err


def test_a_bad_log_level_or_audit_bound_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A log level nobody knows (flag or environment) is bad input, in one line with what
    would do (exit 2, no traceback); ``audit --since`` of no time, or ``--limit 0``, are
    refused, not answered with an empty list."""
    from reach_mesh.cli import main

    assert main(["agents", "--log-level", "FOO"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error REACH_BAD_REQUEST: unknown log level 'FOO' (--log-level)")
    assert "use DEBUG, INFO, WARNING or ERROR" in err and "Traceback" not in err
    _fails_in_one_line(["agents"], _env(REACH_LOG_LEVEL="verbose"), "$REACH_LOG_LEVEL")
    for bad in (["--since", "-5"], ["--since", "0"], ["--limit", "0"]):
        with pytest.raises(SystemExit) as out:
            main(["audit", *bad])
        assert out.value.code == 2
        assert f"argument {bad[0]}: {bad[1]} is not in" in capsys.readouterr().err


async def test_an_agent_script_says_when_it_serves(
    hub: Hub, nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """`python myagent.py` with ``reach_mesh.agent.run(agent)``: at WARNING, a script that
    connected and registered printed nothing at all. It prints what `reach-mesh agent`
    prints once registered."""
    script = tmp_path / "serving_script.py"
    script.write_text(
        "import os\n"
        "from reach_mesh import MeshSettings\n"
        "from reach_mesh.agent import Agent, Task, run\n"
        "settings = MeshSettings(nats_url=os.environ['URL'])\n"
        "agent = Agent(os.environ['ID'], settings=settings)\n"
        "@agent.handler('demo:echo:v1')\n"
        "async def echo(task: Task[int]) -> int:\n"
        "    return task.payload\n"
        "run(agent)\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        env=_env(URL=nats_url, ID=f"{namespace}.echo.a1"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line == f"serving {namespace}.echo.a1\n".encode()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0


@pytest.mark.parametrize("own_logging", [False, True])
def test_an_agent_script_logs_without_being_told_to(tmp_path: Path, own_logging: bool) -> None:
    """A script that starts its agent with ``reach_mesh.agent.run`` and sets up no logging: its
    warnings reach stderr as the CLI's do (an SRE audit's agents said nothing — no hub, a
    drain cut short — unless the script configured logging). A script that set logging up
    keeps its own."""
    script = tmp_path / "agent_script.py"
    setup = "logging.basicConfig(format='OWN %(levelname)s %(message)s')\n" if own_logging else ""
    script.write_text(
        "import logging, os\n"
        "from reach_mesh import MeshSettings\n"
        "from reach_mesh.agent import Agent, Task, run\n"
        f"{setup}"
        "agent = Agent('nohub.echo.a1', settings=MeshSettings(nats_url=os.environ['URL']))\n"
        "@agent.handler('demo:echo:v1')\n"
        "async def echo(task: Task[int]) -> int:\n"
        "    return task.payload\n"
        "run(agent)\n"
    )
    with EmbeddedNats() as server:  # no hub: the agent warns that none answers
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            env=_env(URL=server.url),
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 20
            line = ""
            while time.monotonic() < deadline and "no hub answered" not in line:
                line = proc.stderr.readline()
            assert "no hub answered the registration" in line, line
            if own_logging:
                assert line.startswith("OWN WARNING"), line
            else:
                assert json.loads(line)["level"] == "WARNING"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
