"""``reach-mesh cancel <id>`` of a workflow no hub knows, run as a user runs it (a process of
its own) against a real nats-server and hub: it says the workflow is unknown, exits 4 (nothing
of that name), and names ``--before-start`` — the way to cancel a workflow whose submission
still waits for a hub, so that it never starts. Without ``--namespace`` it also says how to
cancel in another namespace.

(What ``--before-start`` then does from the CLI — recorded, exit 0 — is pinned by
``test_workflow_cancel.py::test_the_cli_and_the_rest_api_cancel``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from reach_mesh import MeshSettings, protocol
from reach_mesh.cli import EXIT_NOT_FOUND
from reach_mesh.hub import Hub

from .helpers import task_record

pytestmark = pytest.mark.timeout(60)

CLI = [sys.executable, "-m", "reach_mesh.cli"]
UNKNOWN = "REACH_UNKNOWN_WORKFLOW"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    env.update(extra)
    return env


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    """``reach-mesh ARGS`` in a process of its own: exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        env=_env() if env is None else env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line for the user, no traceback
    return lines[0]


async def _not_recorded(nats_url: str, ns: str, workflow_id: str) -> None:
    """A plain cancel of an unknown workflow leaves nothing behind: no workflow record."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(protocol.KV_WORKFLOWS)
        with pytest.raises(KeyNotFoundError):
            await kv.get(protocol.workflow_key(ns, workflow_id))
        assert await task_record(nc, ns, f"{workflow_id}-0") is None
    finally:
        await nc.close()


async def test_cancel_of_an_unknown_workflow_names_before_start(
    wf_hub: Hub, wf_settings: MeshSettings, nats_url: str
) -> None:
    ns, url = wf_settings.namespace, nats_url
    code, out, err = await _cli("--nats", url, "cancel", "never-sent", "--namespace", ns)
    assert code == EXIT_NOT_FOUND == 4, (code, out, err)
    assert out == ""
    line = _one_error_line(err)
    assert line.startswith(f"error {UNKNOWN}: "), line
    assert "'never-sent'" in line and f"namespace '{ns}'" in line, line
    assert "reach-mesh cancel --before-start" in line, line
    # The namespace was given: no hint to look in another.
    assert "pass --namespace" not in line, line
    await _not_recorded(url, ns, "never-sent")

    # For a script: the same error as JSON on stdout, the same exit code.
    code, out, err = await _cli("--nats", url, "cancel", "never-sent", "--namespace", ns, "--json")
    assert code == 4, (code, out, err)
    wire = json.loads(out)["error"]
    assert wire["code"] == UNKNOWN and "--before-start" in wire["message"], wire
    assert wire["details"]["workflow_id"] == "never-sent", wire
    assert "--before-start" in _one_error_line(err)


async def test_cancel_of_an_unknown_workflow_without_namespace_names_both_ways(
    wf_hub: Hub, wf_settings: MeshSettings, nats_url: str
) -> None:
    """The namespace from the environment (``REACH_NAMESPACE``), not ``--namespace``: the
    workflow may live in another namespace, or not be taken by a hub yet — the message says
    how to cancel in each case."""
    ns, url = wf_settings.namespace, nats_url
    env = _env(REACH_NAMESPACE=ns)
    code, out, err = await _cli("--nats", url, "cancel", "not-yet-submitted", env=env)
    assert code == 4, (code, out, err)
    assert out == ""
    line = _one_error_line(err)
    assert line.startswith(f"error {UNKNOWN}: "), line
    assert "'not-yet-submitted'" in line and f"namespace '{ns}'" in line, line
    assert "reach-mesh cancel --before-start" in line, line
    assert line.endswith("(pass --namespace to cancel in another)"), line
    await _not_recorded(url, ns, "not-yet-submitted")
