"""Secure mode: the forgeries of issue 11, tried from the wrong identity against a real nats-server
started with the config ``reach-mesh auth`` generates. Each is refused by the server (permissions
violation, or no connection at all without credentials) or rejected by the hub, and leaves the
registry, the task records and the results as they were; the right identity still works.

docs/security.md maps each line of the threat model to the test here that proves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import stat
import string
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from reach_mesh import (
    Client,
    IdentityMismatchError,
    MeshSettings,
    MeshUnavailableError,
    NotPermittedError,
    Step,
    TaskState,
    UnknownAgentError,
    WorkflowSpecError,
    _work_batch,
    protocol,
)
from reach_mesh._auth import AuthDir
from reach_mesh._nats import flushed
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.hub import _pins as pins_module
from reach_mesh.logs import AGENT_ID_IN_USE, LineBudget
from reach_mesh.models import (
    AgentState,
    FailureReport,
    Heartbeat,
    TaskEnvelope,
    UnregisterRequest,
)
from reach_mesh.server import EmbeddedNats
from reach_mesh.workflow import TaskStatusEvent

from .helpers import eventually

NS = "sec"
VICTIM = f"{NS}.victim.a1"
ROGUE = f"{NS}.rogue.a1"
CAP = "sec:work:v1"
#: A tenant with an agent of its own that routes a lot (its pins: test_one_tenants_routes_...).
FLOOD = "flood"
FLOODER = f"{FLOOD}.f.a1"
FAST = {
    "heartbeat_interval": 0.5,
    "lease_timeout": 3.0,
    "workflow_ack_wait": 1.0,
    "work_ack_wait": 2.0,
    "step_deliver_timeout": 2.0,
    "step_running_interval": 0.3,
    "retry_base": 0.05,
    "retry_cap": 0.2,
    "request_timeout": 5.0,
}


@dataclass
class Mesh:
    auth: AuthDir
    server: EmbeddedNats
    hub: Hub
    victim: Agent
    #: The victim's handler waits on this for payloads that ask it to (a running step).
    release: asyncio.Event = field(default_factory=asyncio.Event)
    #: Every payload the victim's handler ran with.
    ran: list[Any] = field(default_factory=list)

    def settings(self, role: str, name: str) -> MeshSettings:
        return self.auth.settings(role, name, nats_url=self.server.url, **FAST)


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    auth = AuthDir(tmp_path_factory.mktemp("auth"))
    auth.init(namespace=NS)
    auth.add("agent", VICTIM)
    auth.add("agent", ROGUE)
    auth.add("caller", "other")
    auth.add("caller", FLOOD)
    auth.add("agent", FLOODER)
    return auth


@pytest.fixture(scope="module")
def secure_server(auth_dir: AuthDir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with EmbeddedNats(tmp_path_factory.mktemp("store"), auth_config=auth_dir.auth_conf) as s:
        yield s


@pytest.fixture(scope="module")
async def mesh(auth_dir: AuthDir, secure_server: EmbeddedNats) -> AsyncIterator[Mesh]:
    url = secure_server.url
    hub = Hub(settings=auth_dir.settings("hub", "main", nats_url=url, **FAST))
    await hub.start()
    victim = Agent(VICTIM, settings=auth_dir.settings("agent", VICTIM, nats_url=url, **FAST))
    m = Mesh(auth_dir, secure_server, hub, victim)

    @victim.handler(CAP)
    async def work(task: Task[Any]) -> Any:
        m.ran.append(task.payload)
        if task.payload == "hold":
            await m.release.wait()
        return {"by": task.agent_id, "in": task.payload}

    await victim.start()
    try:
        yield m
    finally:
        await victim.close()
        await hub.close()


class Conn:
    """A raw nats-py connection as one identity, recording the server's permission errors."""

    def __init__(self, nc: NATS, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def denied(self, what: str, subject: str) -> None:
        """Wait for the server's permissions violation for ``what`` (publish/subscription)."""
        needle = f'permissions violation for {what} to "{subject.lower()}"'
        await eventually(lambda: any(needle in e for e in self.errors), timeout=3.0)

    async def publish_denied(
        self, subject: str, body: bytes = b"{}", headers: dict[str, str] | None = None
    ) -> None:
        await self.nc.publish(subject, body, headers=headers)
        await self.nc.flush()
        await self.denied("publish", subject)

    async def subscribe_denied(self, subject: str, queue: str = "") -> None:
        await self.nc.subscribe(subject, queue=queue)
        await self.nc.flush()
        await self.denied("subscription", subject)


@pytest.fixture
async def as_identity(mesh: Mesh) -> AsyncIterator[Any]:
    conns: list[NATS] = []

    async def connect(role: str, name: str) -> Conn:
        s = mesh.settings(role, name)
        errors: list[str] = []

        async def on_error(err: Exception) -> None:
            errors.append(str(err).lower())

        nc = await nats.connect(
            mesh.server.url,
            nkeys_seed=s.nats_nkey_seed,
            inbox_prefix=s.nats_inbox_prefix or "_INBOX",
            error_cb=on_error,
            max_reconnect_attempts=0,
        )
        conns.append(nc)
        return Conn(nc, errors)

    yield connect
    for nc in conns:
        await nc.close()


def wrong_identities() -> list[tuple[str, str]]:
    """Who must not be able to act for the victim agent or for a hub."""
    return [("agent", ROGUE), ("caller", NS), ("caller", "other")]


async def agent_snapshot(mesh: Mesh) -> tuple[str, bool, AgentState, int]:
    """What a forgery must not change: the victim's session, cordon, state, KV revision."""
    view = mesh.hub.registry.agents[VICTIM]
    kv = await mesh.hub.nc.jetstream().key_value(protocol.KV_AGENTS)
    entry = await kv.get(VICTIM)
    return view.record.session, view.record.cordoned, view.state, int(entry.revision or 0)


async def ask(conn: Conn, subject: str, body: bytes) -> dict[str, Any]:
    msg = await conn.nc.request(subject, body, timeout=5)
    out: dict[str, Any] = json.loads(msg.data)
    return out


async def audited(mesh: Mesh, kind: str, since: float, count: int) -> list[dict[str, Any]]:
    """The audit events of ``kind`` in NS since ``since`` (hub clock), once ``count`` are
    stored (as the operator reads them: only it may)."""
    await mesh.hub.audit.flush()
    found: list[dict[str, Any]] = []
    async with Client(settings=mesh.settings("operator", "admin")) as op:

        async def stored() -> bool:
            nonlocal found
            events = await op.audit(namespace=NS, since=60)
            found = [e for e in events if e["kind"] == kind and e["ts"] >= since]
            return len(found) >= count

        await eventually(stored, timeout=3.0)
    return found


# --------------------------------------------------------------------------- no credentials


async def test_no_credentials_no_connection(mesh: Mesh) -> None:
    with pytest.raises((nats.errors.Error, OSError, TimeoutError)) as err:
        await asyncio.wait_for(
            nats.connect(mesh.server.url, max_reconnect_attempts=0, allow_reconnect=False), 5
        )
    assert "authorization" in str(err.value).lower() or isinstance(err.value, TimeoutError)


async def test_unknown_nkey_no_connection(mesh: Mesh, tmp_path: Path) -> None:
    from reach_mesh._auth import new_seed

    seed, _ = new_seed()  # a well-formed key the server was never told about
    (tmp_path / "stranger.nk").write_bytes(seed)
    with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
        await asyncio.wait_for(
            nats.connect(
                mesh.server.url,
                nkeys_seed=str(tmp_path / "stranger.nk"),
                max_reconnect_attempts=0,
                allow_reconnect=False,
            ),
            5,
        )


# --------------------------------------------------------------------------- 3, 4, 5, 6: registry


@pytest.mark.parametrize("verb", protocol.AGENT_VERBS)
async def test_agent_verbs_for_another_id_refused_by_server(
    mesh: Mesh, as_identity: Any, verb: str
) -> None:
    """Forgeries 3, 5, 6: register / heartbeat (draining) / unregister on the victim's subject."""
    before = await agent_snapshot(mesh)
    subject = protocol.hub_agent_subject(VICTIM, verb)
    body = protocol.encode(Heartbeat(agent_id=VICTIM, session="forged", draining=True))
    if verb == "unregister":
        body = protocol.encode(UnregisterRequest(agent_id=VICTIM, session=before[0]))
    for role, name in wrong_identities():
        conn = await as_identity(role, name)
        await conn.publish_denied(subject, body)
    assert await agent_snapshot(mesh) == before
    assert mesh.hub.registry.agents[VICTIM].state is AgentState.ONLINE


async def test_register_over_another_id_rejected_by_hub(
    mesh: Mesh, as_identity: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Forgery 3 from a real agent identity on its own subject: the body speaks for the victim."""
    caplog.set_level(logging.WARNING, logger="reach_mesh.hub")
    mesh.hub._rejected_lines = LineBudget(30.0)  # lines of earlier tests held none back
    before = await agent_snapshot(mesh)
    rogue = await as_identity("agent", ROGUE)
    card = mesh.victim.card().model_dump(mode="json", exclude_none=True)
    body = json.dumps({"card": card, "session": "forged-session"}).encode()
    out = await ask(rogue, protocol.hub_agent_subject(ROGUE, "register"), body)
    assert out["error"]["code"] == "REACH_IDENTITY_MISMATCH", out
    hb = protocol.encode(Heartbeat(agent_id=VICTIM, session=before[0], draining=True))
    out = await ask(rogue, protocol.hub_agent_subject(ROGUE, "heartbeat"), hb)
    assert out["error"]["code"] == "REACH_IDENTITY_MISMATCH", out
    bye = protocol.encode(UnregisterRequest(agent_id=VICTIM, session=before[0]))
    out = await ask(rogue, protocol.hub_agent_subject(ROGUE, "unregister"), bye)
    assert out["error"]["code"] == "REACH_IDENTITY_MISMATCH", out
    assert await agent_snapshot(mesh) == before
    rejected = mesh.hub.metrics.identity_rejected_total
    assert rejected.labels("register")._value.get() >= 1
    assert rejected.labels("heartbeat")._value.get() >= 1
    assert rejected.labels("unregister")._value.get() >= 1
    lines = [r for r in caplog.records if getattr(r, "event", None) == "REACH-IDENTITY-REJECTED"]
    assert {(r.verb, r.sender, r.claimed) for r in lines} >= {  # type: ignore[attr-defined]
        ("register", ROGUE, VICTIM),
        ("heartbeat", ROGUE, VICTIM),
        ("unregister", ROGUE, VICTIM),
    }


async def test_impostor_cannot_register_nor_take_the_victims_tasks(
    mesh: Mesh, as_identity: Any
) -> None:
    """Forgery 4: a caller cannot register an agent, nobody but the victim can subscribe to its
    task subjects; the legitimate rogue agent registers itself and only itself."""
    caller = await as_identity("caller", NS)
    await caller.publish_denied(protocol.hub_agent_subject(f"{NS}.impostor.a1", "register"))
    for role, name in wrong_identities():
        conn = await as_identity(role, name)
        await conn.subscribe_denied(protocol.agent_task(VICTIM), queue="reach-agent")
        await conn.subscribe_denied(protocol.agent_batch(VICTIM), queue="reach-agent")
        await conn.subscribe_denied("_INBOX.>")
    # Every request still reaches the victim and only it.
    async with Client(settings=mesh.settings("caller", NS)) as c:
        for i in range(10):
            mode: Literal["proxy", "direct"] = "direct" if i % 2 else "proxy"
            res = await c.request(capability=CAP, payload=i, mode=mode)
            assert res.result == {"by": VICTIM, "in": i}
    # The rogue's own identity works, for its own id.
    rogue = Agent(ROGUE, settings=mesh.settings("agent", ROGUE))

    @rogue.handler("rogue:own:v1")
    async def own(task: Task[Any]) -> Any:
        return "mine"

    async with rogue:
        assert ROGUE in mesh.hub.registry.agents
    await eventually(lambda: ROGUE not in mesh.hub.registry.agents)


# --------------------------------------------------------------------------- 7, 8: operator


async def test_operator_actions_only_by_operator(mesh: Mesh, as_identity: Any) -> None:
    """Forgery 7: admin verbs from an agent or a caller are refused by the server."""
    before = await agent_snapshot(mesh)
    body = json.dumps({"op": "remove", "agent_id": VICTIM}).encode()
    for role, name in wrong_identities():
        conn = await as_identity(role, name)
        await conn.publish_denied(protocol.hub_subject(NS, "admin"), body)
        await conn.publish_denied(protocol.hub_subject("other", "admin"), body)
    assert await agent_snapshot(mesh) == before
    async with Client(settings=mesh.settings("operator", "admin")) as op:
        assert (await op.admin("cordon", VICTIM))["state"] == AgentState.CORDONED
        assert (await op.admin("uncordon", VICTIM))["state"] == AgentState.ONLINE
        assert VICTIM in {a.agent_id for a in await op.agents(all_namespaces=True)}
        assert (await op.list_workflows(all_namespaces=True)).namespace is None
    async with Client(settings=mesh.settings("caller", NS)) as caller:
        # Every namespace's workflows are an operator query too (the admin subject).
        with pytest.raises(NotPermittedError):
            await caller.list_workflows(all_namespaces=True)
        assert (await caller.list_workflows()).namespace == NS
    # A caller's view stays in its namespace: the fleet-wide list is an operator query.
    other = await as_identity("caller", "other")
    out = await ask(
        other, protocol.hub_subject("other", "agents"), b'{"agent_id": "sec.victim.a1"}'
    )
    assert out["error"]["code"] == "REACH_BAD_REQUEST"
    out = await ask(other, protocol.hub_subject("other", "agents"), b'{"all_namespaces": true}')
    assert out["error"]["code"] == "REACH_BAD_REQUEST"
    await other.publish_denied(protocol.hub_subject(NS, "agents"))


async def test_operator_actions_are_audited_with_who_asked_and_why(
    mesh: Mesh, as_identity: Any
) -> None:
    """An operator's cordon is audited with its reason and the operator's identity, which the
    hub takes from the request's reply subject (under the operator's private inbox, which only
    it may read), never from the body: a body naming another requester changes nothing. A
    reason too long is refused before anything is done."""
    since = time.time()
    async with Client(settings=mesh.settings("operator", "admin")) as op:
        out = await op.admin("cordon", VICTIM, reason="disk swap on its host")
        assert out["state"] == AgentState.CORDONED
    operator = await as_identity("operator", "admin")
    subject = protocol.hub_subject(NS, "admin")
    claims = {"op": "uncordon", "agent_id": VICTIM, "reason": "swapped", "requester": "hub.main"}
    out = await ask(operator, subject, json.dumps(claims).encode())
    assert out["state"] == AgentState.ONLINE, out
    too_long = {"op": "cordon", "agent_id": VICTIM, "reason": "x" * (protocol.REASON_MAX + 1)}
    out = await ask(operator, subject, json.dumps(too_long).encode())
    assert out["error"]["code"] == "REACH_BAD_REQUEST", out
    assert "reason must be printable text of at most 200 characters" in out["error"]["message"]
    assert (await agent_snapshot(mesh))[1:3] == (False, AgentState.ONLINE)
    events = await audited(mesh, "admin", since, 2)
    assert [(e["op"], e.get("requester"), e.get("reason")) for e in events] == [
        ("cordon", "operator.admin", "disk swap on its host"),
        ("uncordon", "operator.admin", "swapped"),
    ]


async def test_a_refused_identity_is_told_at_once_not_timed_out(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator command run with a caller identity: the server refuses the publish (an
    ``-ERR`` to the error callback only), and the request used to end as REACH_TIMEOUT five
    seconds later, which reads as "the hub is down". It fails at once, naming the subject and
    the identity it needs; the CLI exits 2 for it. The refusal is logged once per subject per
    30 s, not once per publish."""
    from reach_mesh.cli import EXIT_USAGE, exit_code

    caplog.set_level(logging.WARNING, logger="reach_mesh")
    async with Client(settings=mesh.settings("caller", NS)) as caller:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(NotPermittedError, match="operator identity") as err:
            await caller.admin("cordon", VICTIM)
        assert loop.time() - t0 < 2.0
        assert err.value.details["subject"] == protocol.hub_subject(NS, "admin")
        assert exit_code(err.value) == EXIT_USAGE
        # A caller's own reads need only its namespace named: the line says how.
        assert "reach-mesh agents --namespace <ns>" in err.value.message
        for _ in range(3):
            with pytest.raises(NotPermittedError):
                await caller.admin("cordon", VICTIM)
        admin = protocol.hub_subject(NS, "admin").lower()
        said = [r for r in caplog.records if r.getMessage().startswith("NATS refused")]
        assert len([r for r in said if admin in r.getMessage().lower()]) == 1
    # A route into a namespace that is not its own: batched like every route, and refused
    # at once all the same (it waited out its whole timeout).
    async with Client(settings=mesh.settings("caller", NS)) as caller:
        t0 = loop.time()
        with pytest.raises(NotPermittedError, match=r"reach\.hub\.elsewhere\.route") as err:
            await caller.request(agent_id="elsewhere.work.a1", payload=1, timeout=10)
        assert loop.time() - t0 < 2.0
        # The identity it needs is that namespace's caller, not the operator's.
        assert "REACH_CONFIG=<auth dir>/caller.elsewhere.yaml" in err.value.message
        assert "operator" not in err.value.message
        with pytest.raises(NotPermittedError, match=r"(?i)\$JS\.API\.STREAM\.INFO"):
            await caller.audit(since=60)
        # Its own namespace's queries still work on the same connection.
        assert VICTIM in {a.agent_id for a in await caller.agents()}
    assert (await agent_snapshot(mesh))[2] is AgentState.ONLINE


async def test_a_caller_cannot_report_on_another_namespaces_agents(
    mesh: Mesh, as_identity: Any
) -> None:
    """A caller of namespace "other" reports the victim (of NS) failing, on the one report
    subject it may publish to: the hubs drop the reports unread, so another tenant can neither
    quarantine the victim nor sink its health score."""
    view = mesh.hub.registry.agents[VICTIM]
    health, counts = view.health.value, view.breaker.counts()
    rejected = mesh.hub.metrics.identity_rejected_total.labels("report")
    count = rejected._value.get()
    other = await as_identity("caller", "other")
    for i in range(20):
        report = FailureReport(agent_id=VICTIM, code="REACH_AGENT_BUSY", reporter=f"r{i}")
        await other.nc.publish(protocol.hub_subject("other", "report"), protocol.encode(report))
    await other.nc.flush()
    await eventually(lambda: rejected._value.get() >= count + 20)
    assert view.health.value == health and view.breaker.counts() == counts
    assert view.state is AgentState.ONLINE


async def test_one_tenants_routes_push_out_its_own_pins_only(
    mesh: Mesh, as_identity: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub remembers which agent each task id it routed went to (its pins), so that a
    retry of the id by capability goes there — where the agent's idempotency table answers it
    — rather than run again on another agent. It keeps ``PINS_KEPT`` of them (100,000; 2,000
    here). One pool for every namespace let a tenant with one agent of its own push every
    other tenant's pins out with routes of its own: direct-mode decisions (no agent asked),
    64 a message, at the route rate the hub reads — measured 110,000 in 8-13 s on 2 cores —
    and a retry of the victim's task id by another caller process went to whichever agent,
    ``sticky: none``: it ran twice. Past the bound the namespace holding the most pins drops
    its oldest now: the flood pushes out its own."""
    monkeypatch.setattr(pins_module, "PINS_KEPT", 2_000)
    flooder = Agent(FLOODER, settings=mesh.settings("agent", FLOODER))

    @flooder.handler("flood:work:v1")
    async def work(task: Task[Any]) -> Any:
        return None

    async with Client(settings=mesh.settings("caller", NS)) as c:
        first = await c.request(capability=CAP, payload="pin me", task_id="pinned-order-1")
    assert first.agent_id == VICTIM
    assert mesh.hub._pins.get(NS, "pinned-order-1") == VICTIM
    await flooder.start()
    try:
        conn = await as_identity("caller", FLOOD)
        inbox = f"{mesh.settings('caller', FLOOD).nats_inbox_prefix}.flood"
        answered = 0

        async def on_answers(msg: Any) -> None:
            nonlocal answered
            answered += msg.data.count(b"\n") + 1

        await conn.nc.subscribe(f"{inbox}.>", cb=on_answers)
        traceparent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        sent = 0
        while sent < 3 * pins_module.PINS_KEPT:
            lines = []
            for _ in range(64):
                sent += 1
                body = {"capability": "flood:work:v1", "mode": "direct", "task_id": f"f{sent}"}
                lines.append(f"{inbox}.{sent} {traceparent} {json.dumps(body)}")
            subject = protocol.hub_subject(FLOOD, "route_batch")
            await conn.nc.publish(subject, "\n".join(lines).encode(), reply=f"{inbox}.batch")
        await eventually(lambda: answered >= sent, timeout=20)
        assert conn.errors == []
        # The flood's own pins went (its oldest), and no other tenant's.
        assert mesh.hub._pins.get(FLOOD, "f1") is None
        assert mesh.hub._pins.get(FLOOD, f"f{sent}") == FLOODER
        assert mesh.hub._pins.get(NS, "pinned-order-1") == VICTIM
        # The victim's retry, from another process (unmarked: it never asked the id), goes to
        # the agent that holds the task, and is answered from its idempotency table.
        async with Client(settings=mesh.settings("caller", NS)) as again:
            retry = await again.request(
                capability=CAP, payload="pin me", task_id="pinned-order-1", explain=True
            )
        assert retry.decision is not None and retry.decision.sticky == "hit"
        assert retry.agent_id == VICTIM and retry.cached
    finally:
        await flooder.close()


async def test_answers_to_a_tenant_never_speak_of_another(mesh: Mesh, as_identity: Any) -> None:
    """In secure mode a no-match in namespace "other" for the victim's capability (served in
    NS only) names neither NS nor its agents, nor suggests NS's capabilities; the same
    request in NS is answered as usual."""
    assert mesh.hub.router.across_namespaces is False
    other = await as_identity("caller", "other")
    for body in (
        {"capability": CAP, "dry_run": True},
        {"selector": f"cap={CAP}", "dry_run": True, "explain": True},
        {"capability": "sec:wrok:v1", "dry_run": True},  # a typo of NS's capability
    ):
        out = await ask(other, protocol.hub_subject("other", "route"), json.dumps(body).encode())
        error = out["error"]
        assert error["code"] in ("REACH_NO_MATCH", "REACH_UNKNOWN_NAMESPACE"), out
        assert VICTIM not in json.dumps(out) and f"'{NS}'" not in error["message"], out
        details = error.get("details", {})
        assert not details.get("other_namespaces") and not details.get("similar_capabilities")
        assert "did you mean" not in error["message"], out
    async with Client(settings=mesh.settings("caller", NS)) as c:
        assert (await c.route(capability=CAP)).chosen == VICTIM


async def test_quarantine_report_from_a_caller_ignored(mesh: Mesh, as_identity: Any) -> None:
    """Forgery 8: a caller may report outcomes, not operator quarantines; the hubs' breaker
    broadcast is for hubs only."""
    before = await agent_snapshot(mesh)
    rejected = mesh.hub.metrics.identity_rejected_total.labels("report")
    count = rejected._value.get()
    caller = await as_identity("caller", NS)
    report = protocol.encode(FailureReport(agent_id=VICTIM, code="REACH_OPERATOR_QUARANTINE"))
    await caller.nc.publish(protocol.hub_subject(NS, "report"), report)
    await caller.nc.flush()
    await eventually(lambda: rejected._value.get() > count)
    for role, name in wrong_identities():
        conn = await as_identity(role, name)
        await conn.publish_denied(protocol.hub_broadcast(NS, "breaker"), report)
    await asyncio.sleep(0.2)
    assert mesh.hub.registry.agents[VICTIM].state is AgentState.ONLINE
    assert await agent_snapshot(mesh) == before
    async with Client(settings=mesh.settings("operator", "admin")) as op:
        await op.admin("quarantine", VICTIM)
        await eventually(lambda: mesh.hub.registry.agents[VICTIM].state is AgentState.QUARANTINED)
        await op.admin("release", VICTIM)
        await eventually(lambda: mesh.hub.registry.agents[VICTIM].state is AgentState.ONLINE)


async def test_pins_are_told_by_hubs_only(mesh: Mesh, as_identity: Any) -> None:
    """The pins a hub tells the others (which agent a task id went to) steer retries: no
    caller, agent or operator may publish them, so none can send another caller's retry to an
    agent of its choosing."""
    forged = b'[["order-77", "' + VICTIM.encode() + b'"]]'
    for role, name in [*wrong_identities(), ("operator", "admin")]:
        conn = await as_identity(role, name)
        await conn.publish_denied(
            protocol.hub_broadcast(NS, "pins"), forged, headers={"Reach-Hub": "hub-forged"}
        )
    await asyncio.sleep(0.2)
    assert mesh.hub._pins.get(NS, "order-77") is None


# --------------------------------------------------------------------------- 1, 2, 9: workflows


async def test_step_forgeries_refused(mesh: Mesh, as_identity: Any) -> None:
    """Forgeries 1, 2, 9 on a running step: a forged SUCCEEDED status (on the victim's subject,
    or on the rogue's own subject speaking for the victim), a forged ``.done``, a ctl cancel.
    The workflow ends with the victim's real result, run once."""
    mesh.release.clear()
    caller_settings = mesh.settings("caller", NS)
    async with Client(settings=caller_settings) as c:
        wf_id = await c.submit_fanout([Step(capability=CAP, payload="hold")], timeout=30)
        engine = mesh.hub.workflows
        assert engine is not None
        task_id = f"{wf_id}-0"
        wf_kv = await mesh.hub.nc.jetstream().key_value(protocol.KV_WORKFLOWS)

        async def record() -> dict[str, Any]:
            """The workflow record: it names the attempt sent at the start (``first_agents``;
            the step has no task record of its own until its fence changes)."""
            entry = await wf_kv.get(protocol.workflow_key(NS, wf_id))
            assert entry.value is not None
            out: dict[str, Any] = json.loads(entry.value)
            return out

        for _ in range(100):  # the step is running on the victim
            if mesh.victim.inflight:
                break
            await asyncio.sleep(0.05)
        assert mesh.victim.inflight == 1
        rec = await record()
        assert rec["first_agents"] == [VICTIM] and rec["state"] == "RUNNING"
        forged = TaskStatusEvent(
            task_id=task_id,
            attempt=1,
            agent_id=VICTIM,
            state=TaskState.SUCCEEDED,
            workflow_id=wf_id,
            step=0,
            result={"by": "attacker"},
        )
        done = json.dumps({"workflow_id": wf_id, "state": "SUCCEEDED", "steps": []}).encode()
        cancel = json.dumps({"op": "cancel", "task_id": task_id, "attempt": 1})
        for role, name in wrong_identities():
            conn = await as_identity(role, name)
            await conn.publish_denied(
                protocol.task_status(VICTIM, task_id), protocol.encode(forged)
            )
            await conn.publish_denied(protocol.wf_done(NS, wf_id), done)
            await conn.publish_denied(protocol.wf_event(NS, wf_id), done)
            await conn.publish_denied(protocol.agent_ctl(VICTIM), cancel.encode())
        # The rogue agent on its own status subject, speaking for the victim: the hub refuses.
        rogue = await as_identity("agent", ROGUE)
        forged_before = engine.forged_total
        await rogue.nc.publish(protocol.task_status(ROGUE, task_id), protocol.encode(forged))
        await rogue.nc.flush()
        await eventually(lambda: engine.forged_total > forged_before)
        assert (await record())["state"] == rec["state"]
        assert mesh.victim.inflight == 1  # not cancelled
        mesh.release.set()
        result = await c.workflow(wf_id, timeout=15)
    assert result.state is TaskState.SUCCEEDED
    assert result.steps[0].result == {"by": VICTIM, "in": "hold"}
    assert result.steps[0].agent_id == VICTIM


# --------------------------------------------------------------------------- 10, 11: audit, KV


async def test_audit_forgery_refused(mesh: Mesh, as_identity: Any) -> None:
    """Forgery 10: only hubs publish audit events."""
    event = json.dumps({"ts": 1.0, "kind": "admin", "hub_id": "hub-forged"}).encode()
    for role, name in [*wrong_identities(), ("operator", "admin")]:
        conn = await as_identity(role, name)
        await conn.publish_denied(protocol.audit_subject(NS, "admin"), event)
    await asyncio.sleep(0.3)
    async with Client(settings=mesh.settings("operator", "admin")) as op:
        events = await op.audit(namespace=NS)
    assert events  # the real ones are there
    assert all(e.get("hub_id") != "hub-forged" for e in events)


async def test_only_the_operator_reads_the_audit(mesh: Mesh, as_identity: Any) -> None:
    """The audit stream (every namespace's registrations, routes, operator actions and
    cancels, with who asked and why) is the operator's to read: an agent or a caller of any
    namespace may neither subscribe to its subjects nor reach it through the JetStream API
    (a consumer by name or not, its info, a direct or stored-message get), and the ``Client``
    says so at once; the operator reads it."""
    since = time.time()
    async with Client(settings=mesh.settings("caller", NS)) as c:
        assert (await c.request(capability=CAP, payload="audited")).ok
    audit = protocol.STREAM_AUDIT
    api = "$JS.API"
    for role, name in wrong_identities():
        conn = await as_identity(role, name)
        await conn.subscribe_denied("reach.audit.>")
        await conn.subscribe_denied(protocol.audit_subject(NS, "admin"))
        for subject in (
            f"{api}.CONSUMER.CREATE.{audit}",
            f"{api}.CONSUMER.CREATE.{audit}.peek.reach.audit.{NS}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{audit}.peek",
            f"{api}.STREAM.INFO.{audit}",
            f"{api}.DIRECT.GET.{audit}",
            f"{api}.DIRECT.GET.{audit}.{protocol.audit_subject(NS, 'admin')}",
            f"{api}.STREAM.MSG.GET.{audit}",
        ):
            await conn.publish_denied(subject)
        with pytest.raises(NotPermittedError):
            async with Client(settings=mesh.settings(role, name)) as c:
                await c.audit(namespace=NS, since=3600)
    assert await audited(mesh, "route", since, 1)


@pytest.mark.parametrize(
    ("bucket", "key"),
    [
        (protocol.KV_AGENTS, VICTIM),
        (protocol.KV_HEARTBEATS, VICTIM),
        (protocol.KV_TASKS, f"{NS}.sometask"),
        (protocol.KV_WORKFLOWS, f"{NS}.somewf"),
    ],
)
async def test_kv_writes_refused(mesh: Mesh, as_identity: Any, bucket: str, key: str) -> None:
    """Forgery 11: only hubs write the registry, task and workflow buckets."""
    before = await agent_snapshot(mesh)
    body = json.dumps({"task_subject": f"reach.agent.{ROGUE}.task"}).encode()
    for role, name in [*wrong_identities(), ("operator", "admin")]:
        conn = await as_identity(role, name)
        await conn.publish_denied(f"$KV.{bucket}.{key}", body)
        # Nor through the JetStream API: no purge, delete or stream edits.
        await conn.publish_denied(f"$JS.API.STREAM.PURGE.KV_{bucket}", b"{}")
    assert await agent_snapshot(mesh) == before


async def test_tenants_are_isolated(mesh: Mesh, as_identity: Any) -> None:
    """A caller of another namespace can neither route nor send tasks nor read workflows in
    ``sec``; it works in its own namespace."""
    other = await as_identity("caller", "other")
    await other.publish_denied(protocol.hub_subject(NS, "route"))
    await other.publish_denied(protocol.hub_subject(NS, "route_batch"))
    await other.publish_denied(protocol.agent_task(VICTIM))
    await other.publish_denied(protocol.wf_submit(NS))
    await other.subscribe_denied(protocol.wf_done(NS, "*"))
    await other.publish_denied(
        f"$JS.API.DIRECT.GET.KV_{protocol.KV_WORKFLOWS}.$KV.reach_workflows.{NS}.x"
    )
    # Nor another namespace's workflow events or records by a consumer or a wider read: a
    # consumer's filter is in the subject, its own namespace's only (nats-server holds the
    # body to it: test_a_jetstream_request_body_never_widens_what_its_subject_allows).
    events = f"$JS.API.CONSUMER.CREATE.{protocol.STREAM_WF_EVENTS}"
    kv = f"KV_{protocol.KV_WORKFLOWS}"
    for subject in (
        f"{events}.peek.reach.wf.{NS}.>",
        f"{events}.peek.reach.wf.>",
        f"{events}.peek.reach.wf.*.x.event",
        events,  # the filter in the body
        f"$JS.API.CONSUMER.DURABLE.CREATE.{protocol.STREAM_WF_EVENTS}.peek",
        f"$JS.API.CONSUMER.CREATE.{kv}.peek.$KV.{protocol.KV_WORKFLOWS}.{NS}.>",
        f"$JS.API.DIRECT.GET.{kv}.$KV.{protocol.KV_WORKFLOWS}.>",
        f"$JS.API.DIRECT.GET.{kv}",  # by sequence or a batch, in the body
        f"$JS.API.STREAM.MSG.GET.{kv}",
        f"$JS.API.STREAM.MSG.GET.{protocol.STREAM_WF}",
    ):
        await other.publish_denied(subject)
    async with Client(settings=mesh.settings("caller", "other")) as c:
        assert await c.agents() == []


# --------------------------------------------------------------------------- CLI and config


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_cli_config_starts_nats_server_and_reloads(tmp_path: Path) -> None:
    """``reach-mesh auth init`` writes a config nats-server accepts (as docker/ uses it);
    ``add-caller`` on a running server takes effect with a config reload."""
    import functools
    import subprocess

    from reach_mesh.cli import main
    from reach_mesh.server import find_nats_server

    port = free_port()
    d = tmp_path / "auth"
    init = ["auth", "init", str(d), "--host", "127.0.0.1", "--port", str(port)]
    assert await asyncio.to_thread(main, init) == 0
    assert await asyncio.to_thread(main, ["auth", "add-agent", VICTIM, "--dir", str(d)]) == 0
    assert (d / "hub.main.nk").stat().st_mode & 0o077 == 0  # seeds are private
    binary = find_nats_server()
    run = functools.partial(subprocess.run, capture_output=True, check=False)
    check = await asyncio.to_thread(run, [binary, "-t", "-c", str(d / "nats.conf")])
    assert check.returncode == 0, check.stderr
    log = (tmp_path / "nats.log").open("wb")
    start = functools.partial(subprocess.Popen, stdout=log, stderr=log)
    proc = await asyncio.to_thread(start, [binary, "-c", str(d / "nats.conf")])
    try:
        url = f"nats://127.0.0.1:{port}"
        auth = AuthDir(d)
        hub_settings = auth.settings("hub", "main", nats_url=url, **FAST)
        for _ in range(100):
            try:
                hub = Hub(settings=hub_settings)
                await hub.start()
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the hub could not connect to nats-server")
        try:
            add = ["auth", "add-caller", "late", "--dir", str(d)]
            assert await asyncio.to_thread(main, add) == 0
            caller = auth.settings("caller", "late", nats_url=url, connect_timeout=1.0)
            # Not before the reload, and the error says so (it told the user to give the
            # REACH_CONFIG=... that was given).
            reload_it = r"issued after it last loaded auth\.conf \(reload it: kill -HUP"
            with pytest.raises(NotPermittedError, match=reload_it):
                async with Client(settings=caller) as c:
                    pass
            reload = await asyncio.to_thread(run, [binary, "--signal", f"reload={proc.pid}"])
            assert reload.returncode == 0, reload.stderr
            for _ in range(50):
                try:
                    async with Client(settings=caller) as c:
                        assert await c.agents() == []
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("the caller added after start could not connect")
            # An operator of its own (a person): its actions are audited under its name.
            assert (
                await asyncio.to_thread(main, ["auth", "add-operator", "alice", "--dir", str(d)])
                == 0
            )
            reload = await asyncio.to_thread(run, [binary, "--signal", f"reload={proc.pid}"])
            assert reload.returncode == 0, reload.stderr
            alice = auth.settings("operator", "alice", nats_url=url, connect_timeout=1.0)
            for _ in range(50):
                try:
                    async with Client(settings=alice) as c:
                        with pytest.raises(UnknownAgentError):
                            await c.admin("cordon", "late.nobody.a1", reason="check")
                    break
                except (MeshUnavailableError, NotPermittedError):  # (the reload takes a moment)
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("the operator added after start could not connect")
        finally:
            await hub.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_docker_config_is_valid_with_the_generated_auth(tmp_path: Path) -> None:
    """docker/nats.conf includes the auth.conf of ``reach-mesh auth init docker/auth``."""
    import subprocess

    from reach_mesh.server import find_nats_server

    docker = Path(__file__).resolve().parent.parent / "docker" / "nats.conf"
    conf = tmp_path / "nats.conf"
    conf.write_text(docker.read_text().replace("/data", str(tmp_path / "data")))
    AuthDir(tmp_path / "auth").init()
    check = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True)
    assert check.returncode == 0, check.stderr
    assert 'include "auth/auth.conf"' in docker.read_text()


async def test_a_workflow_is_inspected_by_its_namespace_and_operators_only(
    mesh: Mesh, as_identity: Any
) -> None:
    """``reach.hub.<ns>.workflow`` (and ``.workflows``, the list): a caller of the namespace
    and an operator may look at a workflow; another namespace's caller and agents may not ask
    (the server refuses), and asking in its own namespace finds nothing (records are keyed by
    namespace)."""
    worker = Agent(ROGUE, settings=mesh.settings("agent", ROGUE))

    @worker.handler("rogue:own:v1")
    async def own(task: Task[Any]) -> Any:
        return task.payload

    async with worker, Client(settings=mesh.settings("caller", NS)) as c:
        res = await c.fanout([Step(agent_id=ROGUE, payload=1)], timeout=15)
        assert res.ok
        view = await c.inspect_workflow(res.workflow_id)
    assert view.state is TaskState.SUCCEEDED and view.steps[0].agent_id == ROGUE
    async with Client(settings=mesh.settings("operator", "admin")) as op:
        seen = await op.inspect_workflow(res.workflow_id, namespace=NS)
    assert seen.steps == view.steps
    body = json.dumps({"workflow_id": res.workflow_id}).encode()
    other = await as_identity("caller", "other")
    await other.publish_denied(protocol.hub_subject(NS, "workflow"), body)
    out = await ask(other, protocol.hub_subject("other", "workflow"), body)
    assert out["error"]["code"] == "REACH_UNKNOWN_WORKFLOW"
    rogue = await as_identity("agent", ROGUE)
    await rogue.publish_denied(protocol.hub_subject(NS, "workflow"), body)
    # The list of a namespace's workflows: the same parties, the same bounds.
    async with Client(settings=mesh.settings("caller", NS)) as c:
        assert res.workflow_id in [w.workflow_id for w in (await c.list_workflows()).workflows]
    async with Client(settings=mesh.settings("operator", "admin")) as op:
        listed = await op.list_workflows(namespace=NS)
    assert res.workflow_id in [w.workflow_id for w in listed.workflows]
    await other.publish_denied(protocol.hub_subject(NS, "workflows"), b"{}")
    assert (await ask(other, protocol.hub_subject("other", "workflows"), b"{}"))["workflows"] == []
    await rogue.publish_denied(protocol.hub_subject(NS, "workflows"), b"{}")
    # The question one hub asks another (it skips the view budget) is for hubs only.
    for role, name in [("caller", NS), ("agent", ROGUE), ("operator", "admin")]:
        conn = await as_identity(role, name)
        await conn.publish_denied(protocol.hub_peer(NS, "workflow", mesh.hub.hub_id), body)


async def test_a_workflow_is_cancelled_by_its_namespace_and_operators_only(
    mesh: Mesh, as_identity: Any
) -> None:
    """``reach.hub.<ns>.cancel`` changes a workflow's outcome: a caller of the namespace and
    an operator may send it; another namespace's caller and the agents may not (the server
    refuses), and the cancel one hub passes to the owner is for hubs only."""
    release = asyncio.Event()
    worker = Agent(ROGUE, settings=mesh.settings("agent", ROGUE))

    @worker.handler("rogue:hold:v1")
    async def hold(task: Task[Any]) -> Any:
        await release.wait()
        return 1

    since = time.time()
    async with worker, Client(settings=mesh.settings("caller", NS)) as c:
        first = await c.submit_fanout([Step(agent_id=ROGUE)], timeout=30)
        second = await c.submit_fanout([Step(agent_id=ROGUE)], timeout=30)
        body = json.dumps({"workflow_id": first}).encode()
        other = await as_identity("caller", "other")
        await other.publish_denied(protocol.hub_subject(NS, "cancel"), body)
        rogue = await as_identity("agent", ROGUE)
        await rogue.publish_denied(protocol.hub_subject(NS, "cancel"), body)
        for role, name in [("caller", NS), ("agent", ROGUE), ("operator", "admin")]:
            conn = await as_identity(role, name)
            await conn.publish_denied(protocol.hub_peer(NS, "cancel", mesh.hub.hub_id), body)
        # Asked in its own namespace, another tenant finds nothing of that id.
        out = await ask(other, protocol.hub_subject("other", "cancel"), body)
        assert out["error"]["code"] == "REACH_UNKNOWN_WORKFLOW", out
        mine = await c.cancel_workflow(first, reason="by its caller")
        assert mine.final and mine.cancelled and mine.result is not None, mine
        assert mine.result.error is not None
        assert mine.result.error.message == "cancelled on request: by its caller"  # not another's
        async with Client(settings=mesh.settings("operator", "admin")) as op:
            theirs = await op.cancel_workflow(second, namespace=NS, reason="by the operator")
        assert theirs.final and theirs.cancelled and theirs.result is not None, theirs
        assert theirs.result.error is not None
        assert theirs.result.error.message == "cancelled on request: by the operator"
        release.set()
    # Each audited with who asked, as the hub tells it from the reply subject.
    events = await audited(mesh, "cancel", since, 2)
    assert {(e["workflow_id"], e.get("requester"), e.get("reason")) for e in events} == {
        (first, f"caller.{NS}", "by its caller"),
        (second, "operator.admin", "by the operator"),
    }


async def test_agent_reads_only_its_own_results_and_namespace(mesh: Mesh, as_identity: Any) -> None:
    """An agent reads back its own final statuses from ``REACH_STATUS`` after a restart (a
    named consumer whose filter the server checks) and cannot open a consumer on another
    agent's status subjects, nor read the task records of another namespace."""
    rogue_settings = mesh.settings("agent", ROGUE)

    def rogue_agent() -> Agent:
        a = Agent(ROGUE, settings=rogue_settings)

        @a.handler("rogue:own:v1")
        async def own(task: Task[Any]) -> Any:
            return {"n": task.payload}

        return a

    async with rogue_agent(), Client(settings=mesh.settings("caller", NS)) as c:
        res = await c.fanout([Step(agent_id=ROGUE, payload=7)], timeout=15)
        assert res.state is TaskState.SUCCEEDED
        task_id = res.steps[0].task_id
    again = rogue_agent()
    async with again:
        # Loaded from the last event of its own status subjects.
        entry = again._results[task_id]
        assert entry.reply is not None and entry.reply.state is TaskState.SUCCEEDED
        assert entry.reply.result == {"n": 7}
    await eventually(lambda: ROGUE not in mesh.hub.registry.agents)
    rogue = await as_identity("agent", ROGUE)
    api = "$JS.API.CONSUMER.CREATE"
    stream = protocol.STREAM_STATUS
    await rogue.publish_denied(f"{api}.{stream}")
    await rogue.publish_denied(f"{api}.{stream}.peek.{protocol.task_status(VICTIM, '*')}")
    await rogue.publish_denied(f"{api}.{stream}.peek.{protocol.task_status('*.*.*', '*')}")
    await rogue.publish_denied(f"{api}.{stream}.peek.reach.status.>")
    # Its own filter under any name but its own, or the victim's consumer: refused (nobody
    # but the victim can re-point or delete the consumer the victim reads its results with).
    own = protocol.task_status(ROGUE, "*")
    await rogue.publish_denied(f"{api}.{stream}.peek.{own}")
    await rogue.publish_denied(f"{api}.{stream}.{protocol.status_consumer(VICTIM)}.{own}")
    await rogue.publish_denied(
        f"$JS.API.CONSUMER.DELETE.{stream}.{protocol.status_consumer(VICTIM)}"
    )
    await rogue.publish_denied(f"$JS.API.CONSUMER.INFO.{stream}.{protocol.status_consumer(VICTIM)}")
    await rogue.publish_denied(
        f"$JS.API.DIRECT.GET.KV_{protocol.KV_TASKS}.$KV.{protocol.KV_TASKS}.other.x"
    )
    await rogue.publish_denied(f"$JS.API.CONSUMER.CREATE.{protocol.STREAM_WORK}")
    await rogue.publish_denied(
        f"$JS.API.CONSUMER.MSG.NEXT.{protocol.STREAM_WORK}.{protocol.work_consumer(VICTIM)}"
    )
    # Replies go to hubs and to callers of its own namespace, not into another agent's inbox.
    await rogue.publish_denied(f"_INBOX.agent.{VICTIM}.x")
    await rogue.publish_denied("_INBOX.caller.other.x")


async def test_reply_speaking_for_another_agent_refused(mesh: Mesh, as_identity: Any) -> None:
    """An agent answering a proxied task in another agent's name: the hub does not pass the
    answer on (nor count it for the victim)."""
    from reach_mesh.models import AgentCard, RegisterRequest, TaskReply

    rogue = await as_identity("agent", ROGUE)

    async def answer(msg: Any) -> None:
        env = json.loads(msg.data)
        fake = TaskReply(
            task_id=env["task_id"],
            attempt=env["attempt"],
            agent_id=VICTIM,
            state=TaskState.SUCCEEDED,
            result="forged",
        )
        await rogue.nc.publish(msg.reply, protocol.encode(fake))

    await rogue.nc.subscribe(protocol.agent_task(ROGUE), queue="reach-agent", cb=answer)
    req = RegisterRequest(
        card=AgentCard(agent_id=ROGUE, capabilities=["rogue:raw:v1"]),
        session="raw",
        heartbeat_interval=20,
        lease_timeout=60,
    )
    out = await ask(rogue, protocol.hub_agent_subject(ROGUE, "register"), protocol.encode(req))
    assert out["state"] == "ONLINE", out
    rejected = mesh.hub.metrics.identity_rejected_total.labels("reply")
    before = rejected._value.get()
    async with Client(settings=mesh.settings("caller", NS)) as c:
        with pytest.raises(IdentityMismatchError):
            await c.request(agent_id=ROGUE, payload=1)
    assert rejected._value.get() == before + 1
    bye = protocol.encode(UnregisterRequest(agent_id=ROGUE, session="raw"))
    assert (await ask(rogue, protocol.hub_agent_subject(ROGUE, "unregister"), bye))["removed"]


async def test_up_secure_serves_only_known_identities(tmp_path: Path) -> None:
    """``reach-mesh up --secure DIR``: the embedded server enforces DIR's identities and the
    hub serves as the hub identity."""
    import os
    import signal
    import subprocess
    import sys

    d = tmp_path / "auth"
    AuthDir(d).init(namespace=NS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    cmd = [sys.executable, "-m", "reach_mesh.cli", "up", "--secure", str(d), "--http-port", "-1"]
    cmd += ["--nats-port", "-1"]

    def start(argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    proc = await asyncio.to_thread(start, cmd)
    try:
        assert proc.stdout is not None
        line = b""
        while not line.startswith(b"reach-mesh up: NATS "):
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
            assert line, "up exited before printing its NATS URL"
        url = line.decode().split("NATS ", 1)[1].split(";", 1)[0]
        with pytest.raises((nats.errors.Error, OSError, TimeoutError)):
            await asyncio.wait_for(nats.connect(url, max_reconnect_attempts=0), 5)
        async with Client(settings=AuthDir(d).settings("caller", NS, nats_url=url)) as c:
            assert await c.agents() == []
        # An identity added while it runs (`reach-mesh auth add-agent`) connects without a
        # reload by hand: `up` reloads its server when auth.conf changes. (Before, it was
        # refused "Authorization Violation" until the user found the nats-server's pid.)
        added = f"{NS}.later.a1"
        AuthDir(d).add("agent", added)

        async def work(task: Task[Any]) -> Any:
            return None

        t0 = time.monotonic()
        while True:
            later = Agent(added, settings=AuthDir(d).settings("agent", added, nats_url=url))
            later.handler(CAP)(work)
            try:
                await later.start()
                break
            except NotPermittedError:
                assert time.monotonic() - t0 < 10, "the added identity is still refused"
                await asyncio.sleep(0.5)
        await later.close()
        while not line.startswith(b"auth.conf changed: nats-server asked to reload it"):
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 10)
            assert line, "up exited"
        assert b"nats.log says why" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 15)


async def test_up_reads_auth_conf_off_its_loop_and_says_when_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``up --secure``'s poll of auth.conf: each read runs off the event loop its hubs share
    (the file is ~1.6 kB an agent identity: 16 MB, ~7 ms a read and compare, for 10k), a file
    gone is said once and the server keeps serving the identities it loaded, and the file back
    with an identity added is reloaded. Before: read in the loop, and a file gone was passed
    over in silence (or, gone at the first read, ended the poll for good). A broken file is
    reloaded too and refused by nats-server, which keeps the old identities (as up says)."""
    from reach_mesh import _cli_serve

    d = tmp_path / "auth"
    auth = AuthDir(d)
    auth.init(namespace=NS)
    monkeypatch.setattr(_cli_serve, "AUTH_POLL", 0.05)
    loop_thread = threading.get_ident()
    readers: list[int] = []
    said: list[str] = []

    def read() -> bytes:
        readers.append(threading.get_ident())
        return auth.auth_conf.read_bytes()

    def stderr() -> str:
        said.append(capsys.readouterr().err)
        return "".join(said)

    async def connects(role: str, name: str) -> bool:
        s = auth.settings(role, name)
        try:
            nc = await nats.connect(
                server.url, nkeys_seed=s.nats_nkey_seed, max_reconnect_attempts=0
            )
        except (nats.errors.Error, OSError):
            return False
        await nc.close()
        return True

    async with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:
        reload = server.reload
        reloads = 0

        def counted() -> None:
            nonlocal reloads
            reloads += 1
            reload()

        monkeypatch.setattr(server, "reload", counted)
        watching = asyncio.create_task(_cli_serve._reload_on_change(server, read))
        try:
            await eventually(lambda: len(readers) >= 3)
            assert loop_thread not in readers, "auth.conf read in the event loop's thread"
            kept = auth.auth_conf.read_bytes()
            auth.auth_conf.unlink()
            await eventually(lambda: "auth.conf cannot be read" in stderr())
            polls = len(readers)
            await eventually(lambda: len(readers) >= polls + 5)
            assert stderr().count("auth.conf cannot be read") == 1
            assert reloads == 0 and not watching.done()
            assert await connects("operator", "admin")  # the identities it loaded
            # Back, with an identity added meanwhile: reloaded once, and it connects.
            added = f"{NS}.later.a1"
            auth.add("agent", added)
            assert auth.auth_conf.read_bytes() != kept
            await eventually(lambda: reloads == 1)
            await eventually(lambda: connects("agent", added))
            assert "nats-server asked to reload it" in stderr()
            # A broken file: asked to reload, refused; the old identities still connect.
            auth.auth_conf.write_text("authorization { users = [ {")
            await eventually(lambda: reloads == 2)
            await asyncio.sleep(0.3)  # (a SIGHUP is handled asynchronously by the server)
            assert server.proc is not None and server.proc.poll() is None
            assert await connects("agent", added)
            assert await connects("operator", "admin")
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


async def test_a_caller_may_ask_whether_the_workflow_stream_exists(tmp_path: Path) -> None:
    """A submission that meets no stream (no hub ever ran, or a cluster electing the stream's
    leader) has the ``Client`` ask JetStream whether ``REACH_WF`` exists; a caller identity may.
    Once it could not: the refused question waited its 5 s and said "cannot tell", so with no
    hub a secure caller retried for 15 s and was told JetStream had not taken the workflow
    (``tests/test_mistakes.py`` has the open-mode twin), and in the chaos suite's ``node_kill``
    in secure mode each no-stream answer during an election cost those 5 s of the submission's
    budget: 283 submissions given up on and asked again, 327 ``Publish Violation`` lines."""
    d = tmp_path / "auth"
    auth = AuthDir(d)
    auth.init(namespace=NS)
    async with (
        EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server,
        Client(settings=auth.settings("caller", NS, nats_url=server.url)) as c,
    ):
        t0 = time.monotonic()
        with pytest.raises(MeshUnavailableError, match=r"no workflow stream: is a hub"):
            await c.fanout([Step(capability=CAP, payload={})], timeout=30)
        assert time.monotonic() - t0 < 5.0
    log = (tmp_path / "store" / "nats.log").read_text()
    assert "Violation" not in log


async def test_micro_discovery_in_secure_mode(mesh: Mesh, as_identity: Any) -> None:
    """The hub identity serves $SRV (its micro service started under its permissions); the
    operator may discover the hubs and ask their agents endpoint; a caller may not."""
    from reach_mesh.hub._micro import discover_hubs

    operator = await as_identity("operator", "admin")
    (found,) = [
        h for h in await discover_hubs(operator.nc) if h["metadata"]["hub_id"] == mesh.hub.hub_id
    ]
    assert VICTIM in [a["agent_id"] for a in found["fleet"]["agents"]]
    assert not operator.errors
    caller = await as_identity("caller", NS)
    await caller.publish_denied(f"$SRV.INFO.{protocol.MICRO_HUB_SERVICE}")


async def _cli(*argv: str, config: Path, cwd: Path | None = None) -> tuple[int, str, float]:
    """``reach-mesh ARGV`` in a process of its own, as the identity of ``config``
    (``REACH_CONFIG``): exit code, stderr, seconds it took."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "OTEL_"))}
    env["REACH_CONFIG"] = str(config)
    if cwd is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "reach_mesh.cli",
        *argv,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode(), time.monotonic() - t0


async def test_hubs_with_a_caller_identity_is_not_permitted_at_once(mesh: Mesh) -> None:
    """`reach-mesh hubs` (and `agents --via-micro`) asks $SRV.INFO, an operator read: with a
    caller identity the server refuses the publish, and the command says so at once
    (REACH_NOT_PERMITTED, exit code 2), not "no hub answered ... is a hub running?" (exit 3)
    while one is. The operator identity lists the hub."""
    from reach_mesh.hub._micro import discover_hubs

    url = mesh.server.url
    caller = mesh.auth.settings_file("caller", NS)
    for argv in (("hubs",), ("hubs", "--json"), ("agents", "--via-micro")):
        code, err, took = await _cli(*argv, "--nats", url, config=caller)
        assert code == 2, (argv, err)
        assert "REACH_NOT_PERMITTED" in err and "$SRV.INFO.reach-hub" in err, err
        assert "operator identity" in err and "no hub answered" not in err, err
        assert took < 10, took  # (a process start; the refusal itself is at once)
    code, err, _ = await _cli(
        "hubs", "--nats", url, config=mesh.auth.settings_file("operator", "admin")
    )
    assert code == 0, err
    # The library call behind them, on a connection of reach_mesh's own.
    async with Client(settings=mesh.settings("caller", NS)) as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(NotPermittedError) as refused:
            await discover_hubs(c.nc, wait=5.0)
        assert loop.time() - t0 < 2.0
        assert refused.value.details["subject"] == f"$SRV.INFO.{protocol.MICRO_HUB_SERVICE}"


async def test_doctor_checks_everything_as_the_operator_and_says_what_a_caller_may_not(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """``reach-mesh doctor`` as the operator makes every check (its role may read account,
    stream and queue info, and nothing more); as a caller it makes those its role allows and
    says which it could not — a warning, not a failure of the mesh."""
    from reach_mesh._cli_doctor import diagnose

    operator = {f.check: f for f in await diagnose(mesh.settings("operator", "admin"))}
    assert not [f for f in operator.values() if f.status != "ok"], operator
    assert "secure mode" in operator["security"].detail
    assert "every namespace" in operator["agents"].detail
    with caplog.at_level(logging.WARNING, logger="reach_mesh"):
        caller = {f.check: f for f in await diagnose(mesh.settings("caller", NS))}
    # The checks' refusals are answers, not faults: no "NATS refused" line for them.
    refused = [r.getMessage() for r in caplog.records if "NATS refused" in r.getMessage()]
    assert not [m for m in refused if "$js.api" in m or "$srv" in m], refused
    assert not [f for f in caller.values() if f.status == "fail"], caller
    for check in ("jetstream", "workflow queue", "hubs"):
        assert caller[check].status == "warn" and "not checked" in caller[check].detail, check
    assert f"namespace {NS!r}" in caller["agents"].detail, caller["agents"]
    # The streams it may not ask about are one line, not a warning per stream.
    streams = caller["streams"]
    assert streams.status == "warn" and "not checked" in streams.detail, streams
    assert "run the doctor as the operator" in streams.detail
    assert not [f for f in caller.values() if f.check.startswith(("REACH_", "KV_"))], caller
    code, err, _ = await _cli(
        "doctor", "--nats", mesh.server.url, config=mesh.auth.settings_file("operator", "admin")
    )
    assert code == 0, err


async def test_flushed_returns_once_the_server_has_the_subscriptions(as_identity: Any) -> None:
    """``flushed`` returns once the server has the SUBs sent before it: its refusal of one
    has come back. (``nc.flush()`` alone does not promise it: nats-py queues a SUB for its
    flusher task, and writes a flush's PING straight to the socket, ahead of it.)"""
    conn = await as_identity("caller", NS)
    ctl = protocol.agent_ctl(VICTIM)  # an agent's own: never a caller's
    await conn.nc.subscribe(ctl)
    assert conn.nc.pending_data_size > 0  # the SUB waits for the flusher
    await flushed(conn.nc)
    refused = f'permissions violation for subscription to "{ctl.lower()}"'
    assert any(refused in e for e in conn.errors), conn.errors


async def test_an_agent_with_another_identity_is_not_permitted_at_once(
    mesh: Mesh, tmp_path: Path
) -> None:
    """An agent started with a caller's identity (or another agent's) is refused its own
    subjects by the server: it fails at once with REACH_NOT_PERMITTED naming the subject and
    the identity it needs (exit code 2), not after 30 s with "no hub answered the
    registration ... is a hub running?" while one is."""
    from reach_mesh.cli import EXIT_USAGE, exit_code

    stray = f"{NS}.stray.a1"
    for role, name in (("caller", NS), ("agent", ROGUE)):
        agent = Agent(stray, settings=mesh.settings(role, name))

        @agent.handler(CAP)
        async def work(task: Task[Any]) -> Any:
            return None

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(NotPermittedError) as refused:
            await agent.start()
        # At once, not after 30 s: the server refuses its subscriptions before its answer to
        # the PING the agent's start sends after them (``flushed``).
        assert loop.time() - t0 < 3.0
        message = refused.value.message
        assert f"may not register agent id {stray}" in message, message
        assert f"reach-mesh auth add-agent {stray}" in message, message
        assert refused.value.details["subject"].startswith(f"reach.agent.{stray}.")
        assert exit_code(refused.value) == EXIT_USAGE
        assert stray not in mesh.hub.registry.agents
    # The command an operator runs: `reach-mesh agent module:attr` with REACH_CONFIG.
    (tmp_path / "stray_agent.py").write_text(
        "from reach_mesh.agent import Agent\n"
        f"agent = Agent({stray!r})\n"
        f"@agent.handler({CAP!r})\n"
        "async def work(task):\n"
        "    return None\n"
    )
    code, err, took = await _cli(
        "agent",
        "stray_agent:agent",
        "--nats",
        mesh.server.url,
        config=mesh.auth.settings_file("caller", NS),
        cwd=tmp_path,
    )
    assert code == 2, err
    assert "REACH_NOT_PERMITTED" in err and f"may not register agent id {stray}" in err, err
    assert "no hub answered" not in err, err
    # The WARNING before it names the likely cause too, not an old auth.conf alone.
    assert "an identity not issued for this agent id" in err, err
    assert took < 15, took


# --------------------------------------------------------------------------- what NATS cannot check


async def _kv_value(mesh: Mesh, bucket: str, key: str) -> bytes | None:
    kv = await mesh.hub.nc.jetstream().key_value(bucket)
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return entry.value


async def test_hub_answers_only_on_inboxes(mesh: Mesh, as_identity: Any) -> None:
    """A request names its reply subject and NATS checks it against nothing, while the hub may
    write every KV record: requests asking to be answered on ``$KV....`` (every verb an
    identity may send the hub, a batch line, the micro service) are dropped unread."""
    from reach_mesh._guard import refused_total
    from reach_mesh._nats import refused_messages
    from reach_mesh.models import RouteRequest

    before = await agent_snapshot(mesh)
    refused = refused_total()
    rogue = await as_identity("agent", ROGUE)
    beat = protocol.encode(Heartbeat(agent_id=ROGUE, session="x"))
    victim_record = f"$KV.{protocol.KV_AGENTS}.{VICTIM}"
    await rogue.nc.publish(
        protocol.hub_agent_subject(ROGUE, "heartbeat"), beat, reply=victim_record
    )
    caller = await as_identity("caller", NS)
    route = protocol.encode(RouteRequest(capability=CAP))
    forged = [f"{NS}.forged-{i}" for i in range(4)]
    await caller.nc.publish(
        protocol.hub_subject(NS, "route"), route, reply=f"$KV.{protocol.KV_TASKS}.{forged[0]}"
    )
    await caller.nc.publish(
        protocol.hub_subject(NS, "agents"), b"{}", reply=f"$KV.{protocol.KV_TASKS}.{forged[1]}"
    )
    line = protocol.batch_line(f"$KV.{protocol.KV_TASKS}.{forged[2]}", "-", route)
    await caller.nc.publish(
        protocol.hub_subject(NS, "route_batch"), line, reply=caller.nc.new_inbox()
    )
    operator = await as_identity("operator", "admin")
    await operator.nc.publish("$SRV.PING", b"", reply=f"$KV.{protocol.KV_TASKS}.{forged[3]}")
    for conn in (rogue, caller, operator):
        await conn.nc.flush()
    await eventually(lambda: refused_total() >= refused + 4)
    metrics = mesh.hub.metrics.render().decode()
    # The hub's own refusals, on its four connections (the process's count has its agents'
    # and clients' too); the routes came on the one of their own.
    hub = mesh.hub
    own = sum(refused_messages(c) for c in hub._connections.values() if c is not None)
    assert refused_messages(mesh.hub._route_nc) >= 1
    assert f"reach_messages_refused_total {float(own)}" in metrics
    await asyncio.sleep(0.3)  # an answer, had one been sent, would be stored by now
    for key in forged:
        assert await _kv_value(mesh, protocol.KV_TASKS, key) is None, key
    assert await agent_snapshot(mesh) == before
    assert not rogue.errors and not caller.errors and not operator.errors
    # The same requests with their own inboxes are answered.
    out = await ask(caller, protocol.hub_subject(NS, "agents"), b"{}")
    assert VICTIM in [a["agent_id"] for a in out["agents"]]


async def test_a_malformed_message_does_not_deafen_a_hubs_connection(
    mesh: Mesh, as_identity: Any
) -> None:
    """nats-server passes on a publisher's subject, reply subject and header block as they
    came. nats-py raised on bytes that are not UTF-8 or a header block shorter than its
    version line, in its read loop, which then ended: the hub's connection stayed up but read
    nothing until its PINGs went unanswered (seconds). One caller's report (every hub reads
    them) or one agent's status on its own subject did that to every hub. Such messages are
    dropped and counted; the connection reads on."""
    from reach_mesh._nats import refused_messages
    from reach_mesh.models import RouteRequest

    hub = mesh.hub
    main, statuses = refused_messages(hub.nc), refused_messages(hub._status_nc)
    routes = refused_messages(hub._route_nc)  # (callers' requests and reports come on it)
    caller = await as_identity("caller", NS)
    report = protocol.hub_subject(NS, "report").encode()

    def hpub(subject: bytes, header: bytes, reply: bytes = b"") -> bytes:
        size = f" {len(header)} {len(header) + 2}\r\n".encode()
        return b"HPUB " + subject + (b" " + reply if reply else b"") + size + header + b"{}\r\n"

    for cmd in (
        b"PUB " + report + b" \xff\xfe 2\r\n{}\r\n",  # a reply subject
        hpub(report, b"\r\n\r\n"),  # a header block shorter than "NATS/1.0"
        hpub(report, b"NATS/1.0 \xff\xfe\r\n\r\n"),  # a status line
        hpub(report, b"NATS/1.0 503 \xff\r\n\r\n"),  # a status description
    ):
        await caller.nc._send_command(cmd)
    rogue = await as_identity("agent", ROGUE)
    status = protocol.task_status(ROGUE, "x").encode()[:-1] + b"\xff"
    stored = rogue.nc.new_inbox()
    rogue_acked = await rogue.nc.subscribe(stored, max_msgs=1)
    # A subject (stored too: taken out below, so that the rogue's own loads never meet it).
    await rogue.nc._send_command(b"PUB " + status + f" {stored} 2\r\n{{}}\r\n".encode())
    status_seq = json.loads((await rogue_acked.next_msg(timeout=2)).data)["seq"]
    await hub.nc.jetstream().delete_msg(protocol.STREAM_STATUS, status_seq)
    # Callers of its namespace reach an agent's task subject (direct mode).
    victim = refused_messages(mesh.victim.nc)
    await caller.nc._send_command(hpub(protocol.agent_task(VICTIM).encode(), b"\r\n\r\n"))
    for conn in (caller, rogue):
        await conn.nc.flush()
    await eventually(lambda: refused_messages(mesh.victim.nc) >= victim + 1)
    await eventually(lambda: refused_messages(hub._route_nc) >= routes + 4)
    await eventually(lambda: refused_messages(hub._status_nc) >= statuses + 1)
    assert not caller.errors and not rogue.errors
    # The connection reads on: answered at once (deaf, it answered after its PINGs failed).
    out = json.loads((await caller.nc.request(protocol.hub_subject(NS, "agents"), b"{}", 1)).data)
    assert VICTIM in [a["agent_id"] for a in out["agents"]]
    route = protocol.encode(RouteRequest(agent_id=VICTIM, capability=CAP, payload=1, timeout=1))
    answer = await caller.nc.request(protocol.hub_subject(NS, "route"), route, 1)
    assert json.loads(answer.data)["task"]["result"] == {"by": VICTIM, "in": 1}
    # Stored, such a submission came back to the hubs after every ack wait, and every hub
    # that pulled it went deaf again: every namespace's workflows (and heartbeats) stopped.
    # Now the hub that pulls it drops it and ends it on the stream.
    inbox = caller.nc.new_inbox()
    acked = await caller.nc.subscribe(inbox, max_msgs=1)
    submit = protocol.wf_submit(NS).encode()
    # (JetStream stores this header block as it came; a bad status line it drops.)
    await caller.nc._send_command(hpub(submit, b"\r\n\r\n", inbox.encode()))
    poison = json.loads((await acked.next_msg(timeout=2)).data)["seq"]
    js = hub.nc.jetstream()

    async def gone() -> bool:
        try:
            await js.get_msg(protocol.STREAM_WF, poison)
        except nats.js.errors.NotFoundError:  # no message found
            return True
        return False

    try:
        await eventually(gone, timeout=3.0)
        assert refused_messages(hub.nc) == main + 1
        async with Client(settings=mesh.settings("caller", NS)) as c:
            res = await c.fanout([Step(agent_id=VICTIM, payload=2)], timeout=2)
        assert res.state is TaskState.SUCCEEDED
        assert refused_messages(hub.nc) == main + 1  # (it did not come back)
    finally:
        with contextlib.suppress(nats.js.errors.APIError):
            await js.delete_msg(protocol.STREAM_WF, poison)


async def test_an_agent_consumes_only_its_own_work_subject(mesh: Mesh, as_identity: Any) -> None:
    """An agent creates its work consumer by name with the filter in the API subject, and
    may name only its own work subject there: one filtering another agent's steps (or
    created without the filter in the subject) is refused by the server."""
    rogue = await as_identity("agent", ROGUE)
    durable = protocol.work_consumer(ROGUE)
    stream = protocol.STREAM_WORK
    theft = {
        "stream_name": stream,
        "config": {
            "name": durable,
            "durable_name": durable,
            "filter_subject": protocol.work_subject(NS, VICTIM),
            "ack_policy": "explicit",
        },
    }
    body = json.dumps(theft).encode()
    victims = protocol.work_subject(NS, VICTIM)
    await rogue.publish_denied(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{victims}", body)
    await rogue.publish_denied(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.reach.work.>", body)
    await rogue.publish_denied(f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}", body)


async def test_only_hubs_store_work_messages_and_batches(mesh: Mesh, as_identity: Any) -> None:
    """A work message — a single step or a work batch (``Reach-Work-Batch``) — stored on an
    agent's work subject is run by it: only hubs may store one. Another agent of its namespace
    or of another, the agent itself (on its own subject), a caller of its namespace or of
    another and the operator are refused by the server, and the victim runs nothing of it;
    the same batch stored by the hub's identity runs (what the others were kept from)."""
    wf = f"wbsec{time.time_ns()}"

    def batch(payload: str) -> tuple[bytes, dict[str, str]]:
        env = TaskEnvelope(
            task_id=f"{wf}-{payload}",
            capability=CAP,
            payload=payload,
            namespace=NS,
            workflow_id=wf,
            step=0,
        )
        traceparent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        body = _work_batch.join([_work_batch.line(traceparent, protocol.encode(env))])
        return body, {
            protocol.HDR_MSG_ID: f"{NS}.{wf}-{payload}#1+1",
            protocol.HDR_EXPECTED_STREAM: protocol.STREAM_WORK,
            protocol.HDR_WORK_BATCH: "1",
        }

    victims = protocol.work_subject(NS, VICTIM)
    body, headers = batch("forged")
    single = {k: v for k, v in headers.items() if k != protocol.HDR_WORK_BATCH}
    for role, name in [
        *wrong_identities(),
        ("agent", VICTIM),
        ("agent", FLOODER),
        ("operator", "admin"),
    ]:
        conn = await as_identity(role, name)
        await conn.publish_denied(victims, body, headers)
        await conn.publish_denied(victims, protocol.encode(TaskEnvelope(task_id=f"{wf}-s")), single)
        if role == "agent":  # its own work subject too
            own = protocol.work_subject(protocol.namespace_of(name), name)
            await conn.publish_denied(own, body, headers)
    hub = await as_identity("hub", "main")
    body, headers = batch("by-hub")
    await hub.nc.jetstream().publish(victims, body, headers=headers)
    await eventually(lambda: "by-hub" in mesh.ran, timeout=10)
    assert "forged" not in mesh.ran and hub.errors == []
    # A line naming another namespace (whose task records the victim may not read: it ran
    # unfenced, a fresh delivery reading none) is refused; its batch is acked.
    work = mesh.victim.work
    assert work is not None
    foreign = work.foreign
    body, headers = batch("beside")
    env = TaskEnvelope(task_id=f"{wf}-far", capability=CAP, payload="far", namespace=FLOOD)
    headers[protocol.HDR_WORK_BATCH] = "2"
    line = _work_batch.line("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", protocol.encode(env))
    await hub.nc.jetstream().publish(victims, _work_batch.join([line, body]), headers=headers)
    await eventually(lambda: "beside" in mesh.ran and work.foreign == foreign + 1, timeout=10)
    js = mesh.hub.nc.jetstream()
    durable = protocol.work_consumer(VICTIM)

    async def acked() -> bool:
        info = await js.consumer_info(protocol.STREAM_WORK, durable)
        return not info.num_ack_pending and not info.num_pending

    await eventually(acked, timeout=10)
    assert "far" not in mesh.ran


async def test_no_tenant_rolls_up_or_schedules_into_a_shared_stream(
    mesh: Mesh, as_identity: Any
) -> None:
    """What a caller (its submissions, ``REACH_WF``) and an agent (its statuses,
    ``REACH_STATUS``) store may carry headers JetStream acts on, which no permission can
    check: ``Nats-Rollup: all`` would purge the whole stream — every namespace's waiting
    submissions, every agent's statuses — with one message of one's own subject, and a
    ``Nats-Schedule`` would have the server publish into another subject of the stream
    (another namespace's submit subject, another agent's status). The streams allow neither
    (nor per-message TTLs, counters or atomic batches): each such publish is refused, and
    nothing is purged (nats-server 2.15.1)."""
    js = mesh.hub.nc.jetstream()
    async with Client(settings=mesh.settings("caller", NS)) as c:
        done = await c.fanout([Step(capability=CAP, payload="stored")], timeout=15)
    assert done.state is TaskState.SUCCEEDED  # (its statuses are in REACH_STATUS)
    stored = (await js.stream_info(protocol.STREAM_STATUS)).state.messages
    assert stored > 0
    caller = await as_identity("caller", "other")
    rogue = await as_identity("agent", ROGUE)
    headers: list[dict[str, str]] = [
        {"Nats-Rollup": "all"},
        {"Nats-Rollup": "sub"},
        {"Nats-TTL": "1s"},
        {"Nats-Incr": "1"},
        {"Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1", "Nats-Batch-Commit": "1"},
    ]
    for conn, subject, other_subject in (
        (caller, protocol.wf_submit("other"), protocol.wf_submit(NS)),
        (rogue, protocol.task_status(ROGUE, "t1"), protocol.task_status(VICTIM, "t1")),
    ):
        schedule = {"Nats-Schedule": "@every 1s", "Nats-Schedule-Target": other_subject}
        for h in (*headers, schedule):
            answer = json.loads((await conn.nc.request(subject, b"{}", headers=h, timeout=5)).data)
            assert answer.get("error", {}).get("err_code") in (10111, 10166, 10168, 10174, 10188), (
                h,
                answer,
            )
        assert conn.errors == []
    assert (await js.stream_info(protocol.STREAM_STATUS)).state.messages >= stored  # none purged
    for stream in (protocol.STREAM_WF, protocol.STREAM_STATUS):
        config = (await js.stream_info(stream)).config
        assert not config.allow_rollup_hdrs and not config.allow_msg_ttl


async def test_a_jetstream_request_body_never_widens_what_its_subject_allows(
    mesh: Mesh, as_identity: Any
) -> None:
    """Permissions check the API subject, never the body; nats-server must hold the body to
    the subject. A direct get "of its namespace" whose body asks for another key or sequence,
    a consumer created "on its own subject" whose body lists other filters
    (``filter_subjects``), an ack on its own consumer naming the stream sequence of another
    agent's step (REACH_WORK is a work queue: an ack removes the message), and push
    deliveries of its own statuses to ``$KV.`` and ``$JS.API.`` subjects (nats-server does not
    check a deliver subject): all refused or without effect (nats-server 2.15.1)."""
    rogue = await as_identity("agent", ROGUE)
    other = await as_identity("caller", "other")
    get = "$JS.API.DIRECT.GET"
    for conn, stream, key in (
        (rogue, f"KV_{protocol.KV_TASKS}", f"$KV.{protocol.KV_TASKS}.{NS}.x"),
        (other, f"KV_{protocol.KV_WORKFLOWS}", f"$KV.{protocol.KV_WORKFLOWS}.other.x"),
    ):
        for body in (b'{"seq": 1}', b'{"last_by_subj": "$KV.>"}', b'{"next_by_subj": "$KV.>"}'):
            answer = await conn.nc.request(f"{get}.{stream}.{key}", body, timeout=2)
            assert answer.headers is not None and answer.headers.get("Status") == "408", body
    create = "$JS.API.CONSUMER.CREATE"
    own_status = protocol.task_status(ROGUE, ">")
    own_work = protocol.work_subject(NS, ROGUE)
    for conn, api, widened in (
        (
            rogue,
            f"{protocol.STREAM_STATUS}.{protocol.status_consumer(ROGUE)}.{own_status}",
            ["reach.status.>"],
        ),
        (
            rogue,
            f"{protocol.STREAM_WORK}.{protocol.work_consumer(ROGUE)}.{own_work}",
            [own_work, "reach.work.>"],
        ),
        (other, f"{protocol.STREAM_WF_EVENTS}.peek.reach.wf.other.>", [f"reach.wf.{NS}.>"]),
    ):
        config = {"name": api.split(".")[1], "filter_subjects": widened, "ack_policy": "none"}
        body = json.dumps({"stream_name": api.split(".")[0], "config": config}).encode()
        answer = json.loads((await conn.nc.request(f"{create}.{api}", body, timeout=2)).data)
        assert answer["error"]["err_code"] == 10137, answer  # "cannot use subject based API"
    # The victim's step, waiting in REACH_WORK (the victim's agent is not taking steps).
    js = mesh.hub.nc.jetstream()
    step = await js.publish(protocol.work_subject(NS, VICTIM) + ".probe", b"{}")
    durable = protocol.work_consumer(ROGUE)
    work = {"name": durable, "filter_subject": own_work, "ack_policy": "explicit"}
    body = json.dumps({"stream_name": protocol.STREAM_WORK, "config": work}).encode()
    made = await rogue.nc.request(f"{create}.{protocol.STREAM_WORK}.{durable}.{own_work}", body, 2)
    assert "error" not in json.loads(made.data), made.data
    # Its own status consumer, pushed to where only hubs publish.
    name = protocol.status_consumer(ROGUE)
    await rogue.nc.publish(protocol.task_status(ROGUE, "pushed"), b"{}")
    kv_before = await agent_snapshot(mesh)
    try:
        ack = f"$JS.ACK.{protocol.STREAM_WORK}.{durable}.1.{step.seq}.1.{time.time_ns()}.0"
        await rogue.nc.publish(ack, b"")
        await rogue.nc.publish(ack, b"+TERM")
        for target in (
            f"$KV.{protocol.KV_AGENTS}.{VICTIM}",
            f"$JS.API.STREAM.PURGE.KV_{protocol.KV_AGENTS}",
            f"$JS.API.STREAM.DELETE.{protocol.STREAM_WORK}",
        ):
            push = {
                "name": name,
                "filter_subject": own_status,
                "deliver_subject": target,
                "deliver_policy": "last",
                "ack_policy": "none",
            }
            body = json.dumps({"stream_name": protocol.STREAM_STATUS, "config": push}).encode()
            api = f"{protocol.STREAM_STATUS}.{name}.{own_status}"
            made = json.loads((await rogue.nc.request(f"{create}.{api}", body, 2)).data)
            assert "error" not in made, made
            await asyncio.sleep(0.2)
            await rogue.nc.request(f"$JS.API.CONSUMER.DELETE.{protocol.STREAM_STATUS}.{name}")
        assert (await js.get_msg(protocol.STREAM_WORK, step.seq)).data == b"{}"
        assert await agent_snapshot(mesh) == kv_before
        assert not rogue.errors and not other.errors
    finally:
        await js.delete_msg(protocol.STREAM_WORK, step.seq)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(protocol.STREAM_WORK, durable)


async def test_a_wary_agent_reads_its_namespaces_records_at_the_leader_through_a_hub(
    mesh: Mesh, as_identity: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verb ``record`` under the per-identity permissions: the victim's wary fence read, its
    replica check failing, is read at the stream's leader by the hub — asked on its own
    subject, answered into its private inbox — and the step's record is the one it gets. An
    agent asks on its own subject only: another agent's is refused by the server
    (``test_agent_verbs_for_another_id_refused_by_server[record]``), and so is its own
    service and instance under another namespace, a wildcard subject, and the verb from a
    caller or the operator. On its own subject it reads what its direct gets read, its
    namespace's records (of any agent: the namespace is the boundary), and no body names
    another namespace's key."""
    from reach_mesh.agent._work import WorkConsumer
    from reach_mesh.models import TaskEnvelope
    from reach_mesh.workflow import TaskRecord

    tasks = await mesh.hub.nc.jetstream().key_value(protocol.KV_TASKS)
    mine = TaskRecord(task_id="sec-rec", workflow_id="wf", step=0, namespace=NS, attempt=2)
    rev = await tasks.put(protocol.task_key(NS, "sec-rec"), protocol.encode(mine))
    theirs = mine.model_copy(update={"namespace": "other", "attempt": 9})
    await tasks.put(protocol.task_key("other", "sec-rec"), protocol.encode(theirs))
    victim = mesh.victim
    work = victim.work
    assert isinstance(work, WorkConsumer)
    await eventually(lambda: work._tasks_kv is not None and work._jsc is not None)
    assert work._jsc is not None
    env = TaskEnvelope(task_id="sec-rec", capability=CAP, namespace=NS, workflow_id="wf", step=0)

    async def behind(bucket: str, *, heard_within: float) -> None:
        raise MeshUnavailableError("KV_reach_tasks: replica(s) n1 behind its leader n0")

    found = mesh.hub.metrics.record_reads_total.labels("found")._value.get()
    answered = work.leader_reads.answered
    monkeypatch.setattr(work._jsc, "replicas_caught_up", behind)
    victim._be_wary(10.0)
    got = await work._record(env)
    assert got is not None and got.attempt == 2 and got.namespace == NS
    assert work.leader_reads.answered == answered + 1 and victim.wary()
    assert mesh.hub.metrics.record_reads_total.labels("found")._value.get() == found + 1
    monkeypatch.undo()
    await asyncio.sleep(0.3)  # (a failed check answers for the next ones for 0.25 s)
    assert (await work._record(env)) is not None and not victim.wary()  # (as it was)

    rogue = await as_identity("agent", ROGUE)
    own = protocol.hub_agent_subject(ROGUE, "record")
    out = await ask(rogue, own, b'{"task_id": "sec-rec"}')
    assert out["revision"] == rev and out["record"]["attempt"] == 2, out
    out = await ask(rogue, own, json.dumps({"task_id": "other.sec-rec"}).encode())
    assert out["error"]["code"] == "REACH_BAD_REQUEST", out
    assert not rogue.errors
    elsewhere = protocol.hub_agent_subject(f"other.{ROGUE.split('.', 1)[1]}", "record")
    await rogue.publish_denied(elsewhere, b'{"task_id": "sec-rec"}')
    await rogue.publish_denied("reach.hub.*.record.rogue.a1", b'{"task_id": "sec-rec"}')
    for role, name in (("caller", NS), ("caller", "other"), ("operator", "admin")):
        conn = await as_identity(role, name)
        await conn.publish_denied(own, b'{"task_id": "sec-rec"}')
        await conn.publish_denied(elsewhere, b'{"task_id": "sec-rec"}')


@pytest.mark.parametrize("target", ["task", "ctl"])
async def test_a_push_delivery_to_another_agents_subject_is_dropped(
    mesh: Mesh, as_identity: Any, target: str
) -> None:
    """nats-server does not check a push consumer's deliver subject against its creator's
    permissions: an agent may have its own stored status messages delivered to the victim's
    ``.task`` (a task it could not send) or ``.ctl``. They keep their stored subject, and the
    victim drops them unread."""
    from reach_mesh._guard import refused_total

    rogue = await as_identity("agent", ROGUE)
    tag = f"inject-{target}"
    stored = protocol.task_status(ROGUE, tag)
    if target == "task":
        body: dict[str, Any] = {
            "task_id": tag,
            "capability": CAP,
            "payload": "injected",
            "namespace": NS,
        }
        deliver = protocol.agent_task(VICTIM)
    else:
        body = {"op": "cancel", "task_id": tag, "attempt": 1}
        deliver = protocol.agent_ctl(VICTIM)
    await rogue.nc.publish(stored, json.dumps(body).encode())
    await rogue.nc.flush()
    refused = refused_total()
    # The one consumer name its permissions allow it on REACH_STATUS (any other is refused).
    name = protocol.status_consumer(ROGUE)
    await rogue.publish_denied(
        f"$JS.API.CONSUMER.CREATE.{protocol.STREAM_STATUS}.push{target}.{stored}"
    )
    config: dict[str, Any] = {
        "name": name,
        "filter_subject": stored,
        "deliver_subject": deliver,
        "ack_policy": "none",
        "deliver_policy": "all",
    }
    if target == "task":
        config["deliver_group"] = "reach-agent"
    create = f"$JS.API.CONSUMER.CREATE.{protocol.STREAM_STATUS}.{name}.{stored}"
    req = {"stream_name": protocol.STREAM_STATUS, "config": config}
    answer = json.loads((await rogue.nc.request(create, json.dumps(req).encode(), timeout=5)).data)
    try:
        assert "error" not in answer, answer  # the server lets the agent make it
        await eventually(lambda: refused_total() > refused)
        await asyncio.sleep(0.2)
        if target == "task":
            assert "injected" not in mesh.ran
    finally:
        delete = f"$JS.API.CONSUMER.DELETE.{protocol.STREAM_STATUS}.{name}"
        await rogue.nc.request(delete, b"", timeout=5)


async def test_http_api_closed_in_secure_mode_without_a_token(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub with a NATS identity acts with the hub's rights: without ``http_token`` its
    ``/api/``, ``/mcp`` and ``/a2a/`` routes refuse everyone (probes and metrics stay open),
    which it says once at its start; with one, they want it."""
    import urllib.error
    import urllib.request

    def get(url: str, token: str | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(url)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    base = mesh.auth.settings("hub", "main", nats_url=mesh.server.url, **FAST)
    token = "t" * 32
    for settings, want in (
        (base.model_copy(update={"http_port": 0}), None),
        (base.model_copy(update={"http_port": 0, "http_token": token}), token),
    ):
        async with Hub(settings=settings) as hub:
            assert hub.http_url is not None
            status, body = await asyncio.to_thread(get, f"{hub.http_url}/api/agents")
            assert status == 401, body
            said = [r.getMessage() for r in caplog.records if "is closed" in r.getMessage()]
            if want is None:
                assert b"secure mode" in body
                assert len(said) == 1 and "REACH_HTTP_TOKEN" in said[0], said
                caplog.clear()
            else:
                assert said == []
                status, body = await asyncio.to_thread(get, f"{hub.http_url}/api/agents", want)
                assert status == 200, body
            for open_path in ("/healthz", "/metrics"):
                status, _ = await asyncio.to_thread(get, f"{hub.http_url}{open_path}")
                assert status == 200, open_path


async def test_a_pushed_done_does_not_end_a_callers_wait(mesh: Mesh, as_identity: Any) -> None:
    """An agent learns workflow ids from its tasks, stores a forged result on its own status
    subject and has it — then a push consumer's idle heartbeats — delivered to a workflow's
    ``.done`` subject. The caller's wait takes neither (they are not stored as that ``.done``)
    and ends with the real result."""
    from reach_mesh._guard import refused_total
    from reach_mesh.workflow import WorkflowResult

    mesh.release.clear()
    async with Client(settings=mesh.settings("caller", NS)) as c:
        wf_id = await c.submit_fanout([Step(capability=CAP, payload="hold")], timeout=30)
        waiting = asyncio.ensure_future(c.workflow(wf_id, timeout=20))
        await eventually(lambda: mesh.victim.inflight == 1 and len(c._done_waits) == 1)
        rogue = await as_identity("agent", ROGUE)
        stored = protocol.task_status(ROGUE, "fake-done")
        forged = WorkflowResult(
            workflow_id=wf_id, kind="fanout", state=TaskState.SUCCEEDED, result="forged"
        )
        await rogue.nc.publish(stored, protocol.encode(forged))
        await rogue.nc.flush()
        refused = refused_total()
        name = protocol.status_consumer(ROGUE)  # the one its permissions allow
        config = {
            "name": name,
            "filter_subject": stored,
            "deliver_subject": protocol.wf_done(NS, wf_id),
            "ack_policy": "none",
            "deliver_policy": "all",
            "idle_heartbeat": 100_000_000,  # ns
        }
        create = f"$JS.API.CONSUMER.CREATE.{protocol.STREAM_STATUS}.{name}.{stored}"
        req = {"stream_name": protocol.STREAM_STATUS, "config": config}
        answer = json.loads(
            (await rogue.nc.request(create, json.dumps(req).encode(), timeout=5)).data
        )
        try:
            assert "error" not in answer, answer
            await eventually(lambda: refused_total() >= refused + 3)  # the result, heartbeats
            assert not waiting.done()
            mesh.release.set()
            result = await waiting
        finally:
            delete = f"$JS.API.CONSUMER.DELETE.{protocol.STREAM_STATUS}.{name}"
            await rogue.nc.request(delete, b"", timeout=5)
    assert result.state is TaskState.SUCCEEDED
    assert result.steps[0].result == {"by": VICTIM, "in": "hold"}


@pytest.mark.parametrize(
    ("url", "printed", "credentials"),
    [
        ("nats://u:p@h:4222", "nats://h:4222", True),
        ("u:p@h:4222", "h:4222", True),  # nats-py takes URLs without a scheme too
        ("nats://user:p@ss@h", "nats://h", True),  # an '@' in the password
        ("nats://h:4222,nats://u:p@h2:4222", "nats://h:4222,nats://h2:4222", True),
        ("tls://h:4222", "tls://h:4222", False),
    ],
)
def test_urls_are_printed_without_credentials(url: str, printed: str, credentials: bool) -> None:
    """What logs and errors print of a NATS URL, and whether a hub's HTTP API then counts as
    acting for a NATS identity (closed without a token)."""
    from reach_mesh._nats import has_credentials, has_identity, shown

    assert shown(url) == printed
    assert has_credentials(url) is credentials
    assert has_identity(MeshSettings(nats_url=url)) is credentials
    assert has_identity(MeshSettings(nats_url="nats://h", nats_tls_cert="c.pem"))


def test_seeds_go_only_into_new_files_of_a_private_directory(tmp_path: Path) -> None:
    """A file (or link) planted where a new identity's seed goes is refused, not written
    through; a new auth directory is the owner's only."""
    import os
    import stat

    from reach_mesh.errors import BadRequestError

    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=NS)
    assert stat.S_IMODE(os.stat(auth.path).st_mode) == 0o700
    planted = auth.seed_file("agent", VICTIM)
    planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadRequestError, match="exists but is no issued identity's seed"):
        auth.add("agent", VICTIM)
    assert not (tmp_path / "elsewhere").exists()
    assert all(i.name != VICTIM for i in auth.identities())


def test_auth_conf_is_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auth add-* replaces auth.conf by a rename, never rewrites it in place: a server reading it
    meanwhile (up --secure's poll, an operator's kill -HUP) sees the old file or the new one,
    and a write that fails midway (a full disk) leaves the old one whole, no temporary behind."""
    import os

    from reach_mesh import _auth

    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=NS)
    before = auth.auth_conf.read_text()
    mode = os.stat(auth.auth_conf).st_mode
    with auth.auth_conf.open() as reading:  # a reader that opened it just before the write
        inode = os.stat(auth.auth_conf).st_ino
        auth.add("agent", VICTIM)
        assert reading.read() == before  # (written in place it read the new text, or none)
    after = auth.auth_conf.read_text()
    assert VICTIM in after and os.stat(auth.auth_conf).st_ino != inode
    assert os.stat(auth.auth_conf).st_mode == mode
    assert (auth.seed_file("agent", VICTIM).stat().st_mode & 0o777) == 0o600

    def cannot_be_written(identities: list[_auth.Identity]) -> str:
        return "half written\n\udc80"  # not encodable: the write fails after it began

    monkeypatch.setattr(_auth, "auth_config", cannot_be_written)
    with pytest.raises(UnicodeEncodeError):
        auth.add("agent", f"{NS}.other.a")
    assert auth.auth_conf.read_text() == after
    assert not [p.name for p in auth.path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file another owner takes root")
def test_replaced_auth_files_keep_their_owner(tmp_path: Path) -> None:
    """A file auth add-* replaces keeps the owner and group of the one it replaces: an auth.conf
    of group nats, mode 0640, read by a nats-server running as that user, was replaced by a
    file of the writer's group (root's, by `sudo reach-mesh auth add-agent`), which that
    server's next reload could not read — every identity added since refused."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=NS)
    theirs = (4321, 4322)  # (no such user needed: ids are what a file holds)
    for f in (auth.auth_conf, auth.path / "identities.json"):
        os.chown(f, *theirs)
        os.chmod(f, 0o640)
    auth.add("agent", VICTIM)
    for f in (auth.auth_conf, auth.path / "identities.json"):
        st = os.stat(f)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*theirs, 0o640), f
    assert VICTIM in auth.auth_conf.read_text()
    # A new file is the writer's, as before.
    st = os.stat(auth.settings_file("agent", VICTIM))
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())


def test_identities_added_at_once_are_all_issued(tmp_path: Path) -> None:
    """auth add-* run at once (a provisioning script's jobs) each issue their identity: each
    reads identities.json, adds to it and writes it and auth.conf again, so run together they
    lost each other's (a seed file written, the server refusing it, and its add again refused
    as a seed that is no identity's)."""
    import threading

    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=NS)
    ids = [f"{NS}.fleet.a{i}" for i in range(16)]
    together = threading.Barrier(len(ids))

    def add(agent_id: str) -> None:
        together.wait()
        AuthDir(auth.path).add("agent", agent_id)

    threads = [threading.Thread(target=add, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i.name for i in auth.identities() if i.role == "agent") == sorted(ids)
    conf = auth.auth_conf.read_text()
    assert all(f"# agent {i}\n" in conf for i in ids)


def test_agent_ids_never_share_a_consumer_name() -> None:
    """An agent's consumers are named after its id, and the name is all its permissions bind:
    two ids that made one name would let either agent delete or re-point the other's
    consumer. Ids too long for a name whole (agent ids may take 194 characters) keep a 128-bit
    digest; shorter ones keep the names they always had."""
    long_ids = [
        f"{'n' * 64}.{'s' * 64}.{'i' * 64}",
        f"{'n' * 64}.{'s' * 64}.{'i' * 63}j",
        f"{'n' * 64}.{'s' * 64}.{'i' * 10}",
        f"{'n' * 62}_n.{'s' * 64}.{'i' * 64}",
        f"{'n' * 62}.n_{'s' * 62}.{'i' * 64}",
    ]
    for agent_id in long_ids:
        protocol.validate_agent_id(agent_id)
    for make in (protocol.work_consumer, protocol.status_consumer):
        names = [make(agent_id) for agent_id in long_ids]
        assert len(set(names)) == len(names), names
        assert all(len(name) <= 200 for name in names)
        digest = hashlib.sha256(long_ids[0].encode()).hexdigest()
        assert names[0].endswith(f"-{digest[:32]}")

    # Two 192-character ids that differ only in where a dot and an underscore stand (one
    # name but for the digest), picked so that the 2 hex digits the old cut left agree.
    def twins() -> tuple[str, str]:
        for a, b, d in itertools.product(string.ascii_lowercase, repeat=3):
            one = f"{a * 64}.{b * 62}.c_{d * 62}"
            two = f"{a * 64}.{b * 62}_c.{d * 62}"
            if hashlib.sha256(one.encode()).digest()[0] == hashlib.sha256(two.encode()).digest()[0]:
                return one, two
        raise AssertionError("no twins")

    one, two = twins()
    protocol.validate_agent_id(one)
    protocol.validate_agent_id(two)

    def old_cut(agent_id: str) -> str:  # the names before: cut at 200, digest included
        digest = hashlib.sha256(agent_id.encode()).hexdigest()[:10]
        return f"work-{agent_id.replace('.', '_')}-{digest}"[:200]

    assert old_cut(one) == old_cut(two)
    assert protocol.work_consumer(one) != protocol.work_consumer(two)
    assert protocol.status_consumer(one) != protocol.status_consumer(two)
    short = "shop.svc.a1"
    digest = hashlib.sha256(short.encode()).hexdigest()[:10]
    assert protocol.work_consumer(short) == f"work-shop_svc_a1-{digest}"
    assert protocol.status_consumer(short) == f"status-shop_svc_a1-{digest}"


def _take_away(conf: Path, allowed: str) -> None:
    """Drop one allowed subject of ``conf`` (an ``auth.conf``), as an operator's edit would."""
    text = conf.read_text()
    assert allowed in text
    conf.write_text(text.replace(allowed, ""))


@contextlib.asynccontextmanager
async def _secure_victim(
    tmp_path: Path,
) -> AsyncIterator[tuple[AuthDir, EmbeddedNats, Hub, Agent]]:
    """A secure-mode nats-server of its own with a hub, and the victim agent (not started;
    its handler echoes the payload)."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(namespace=NS)
    auth.add("agent", VICTIM)
    with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:
        hub = Hub(settings=auth.settings("hub", "main", nats_url=server.url, **FAST))
        await hub.start()
        agent = Agent(VICTIM, settings=auth.settings("agent", VICTIM, nats_url=server.url, **FAST))

        @agent.handler(CAP)
        async def work(task: Task[Any]) -> Any:
            return task.payload

        try:
            yield auth, server, hub, agent
        finally:
            await hub.close()


async def test_an_agent_whose_subscription_is_taken_away_stops_instead_of_going_deaf(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's permissions change, reloaded into nats-server, takes away a running
    agent's subscription to its own task subjects: nats-server drops the subscription and
    says so, while the agent's heartbeats would still be allowed — a deaf agent that hubs keep
    routing to. The agent stops instead: it leaves the registry, and ``serve()`` ends with
    ``NotPermittedError`` (a supervisor restarts it; ``start()`` then says what is wrong)."""
    from reach_mesh.agent._run import serve
    from reach_mesh.logs import SUBSCRIPTION_REFUSED

    async with _secure_victim(tmp_path) as (auth, server, hub, agent):
        serving = asyncio.create_task(serve(agent))
        try:
            await eventually(lambda: VICTIM in hub.registry.agents, timeout=10)
            async with Client(settings=auth.settings("caller", NS, nats_url=server.url)) as c:
                assert (await c.request(capability=CAP, payload=1)).result == 1
            _take_away(Path(auth.auth_conf), f'"reach.agent.{VICTIM}.>",')  # a mistake
            server.reload()
            with pytest.raises(NotPermittedError, match=f"reach.agent.{VICTIM}"):
                await asyncio.wait_for(serving, 15)
            assert agent.fault is not None and agent.status.value == "closed"
            assert VICTIM not in hub.registry.agents  # its goodbye: routed to no more
            lines = [r for r in caplog.records if getattr(r, "event", None) == SUBSCRIPTION_REFUSED]
            assert len(lines) == 1 and lines[0].levelno == logging.ERROR
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)


async def test_an_agent_asking_under_an_old_auth_conf_is_refused_and_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under an ``auth.conf`` from before agents could ask their own ctl subject, the question
    an agent asks when a hub no longer knows its registration (or after a long silence) is
    refused: nobody could be asked, and the agent serves on — before, the refusal was taken
    for a subscription NATS had taken away, and the agent stopped."""
    async with _secure_victim(tmp_path) as (auth, server, _hub, agent):
        try:
            await agent.start()
            _take_away(Path(auth.auth_conf), f'"{protocol.agent_ctl(VICTIM)}",')  # (its publish)
            server.reload()
            await asyncio.sleep(0.5)  # (the reload applied)
            await agent.confirm_identity(live=True)
            assert agent.fault is None and agent.status.value == "running", agent.fault
            async with Client(settings=auth.settings("caller", NS, nats_url=server.url)) as c:
                assert (await c.request(capability=CAP, payload=1)).result == 1
        finally:
            await agent.close()


async def test_a_second_process_of_an_agent_identity_waits_for_the_first(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """One process per agent id, in secure mode: the ping a starting agent sends its own ctl
    subject, and the running process's answer into the new one's inbox, are allowed — the
    second process of the victim's identity waits (no "starting without the check") and takes
    none of its tasks meanwhile."""
    twin = Agent(VICTIM, settings=mesh.settings("agent", VICTIM))

    @twin.handler(CAP)
    async def work(task: Task[Any]) -> Any:
        raise AssertionError("the twin took a task while the victim served")

    starting = asyncio.ensure_future(twin.start())
    try:
        await eventually(
            lambda: any(getattr(r, "event", None) == AGENT_ID_IN_USE for r in caplog.records),
            timeout=5,
        )
        async with Client(settings=mesh.settings("caller", NS)) as caller:
            for n in range(4):
                res = await caller.request(capability=CAP, payload=n, timeout=5)
                assert res.state is TaskState.SUCCEEDED and res.agent_id == VICTIM
        assert not starting.done()
        assert "without the check" not in caplog.text
    finally:
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await twin.close()


async def test_a_revoked_identity_is_cut_off_and_says_why_a_rotated_one_connects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``reach-mesh auth revoke agent ID`` takes the identity out of auth.conf (and its seed
    and settings files out of the directory): at the server's reload its live connection is
    cut off, and, reconnecting, says at once (ERROR) that the server refuses its credentials —
    not, 30 s later, that NATS is "unreachable" (the drill's revoked agent did). A new
    ``add-agent`` of the same id issues another seed (a rotation), which connects after the
    next reload."""
    import shutil

    from reach_mesh._nats import connect
    from reach_mesh.cli import main

    d = tmp_path / "auth"
    auth = AuthDir(d)
    auth.init(namespace=NS)
    agent_id = f"{NS}.revoked.r1"
    old_key = auth.add("agent", agent_id).public_key
    host_seed = tmp_path / "host.nk"  # the copy on the agent's host (step 3 of "Secure mode")
    shutil.copy(auth.seed_file("agent", agent_id), host_seed)
    with EmbeddedNats(tmp_path / "store", auth_config=auth.auth_conf) as server:
        settings = auth.settings(
            "agent", agent_id, nats_url=server.url, nats_nkey_seed=str(host_seed), **FAST
        )
        nc = await connect(server.url, name=agent_id, settings=settings)
        try:
            caplog.set_level(logging.WARNING, logger="reach_mesh.nats")
            revoke = ["auth", "revoke", "agent", agent_id, "--dir", str(d)]
            assert await asyncio.to_thread(main, revoke) == 0
            assert old_key not in auth.auth_conf.read_text()
            assert not auth.seed_file("agent", agent_id).exists()
            assert not auth.settings_file("agent", agent_id).exists()
            assert [i.name for i in auth.identities()] == ["main", "admin", NS]
            # One not issued (any more): said, with what was (exit 2).
            assert await asyncio.to_thread(main, revoke) == 2
            server.reload()

            def said() -> list[str]:
                return [
                    r.getMessage()
                    for r in caplog.records
                    if r.levelno == logging.ERROR
                    and "refuses this connection's credentials" in r.getMessage()
                ]

            await eventually(lambda: bool(said()), timeout=10)
            assert "revoked" in said()[0]
            assert not nc.is_connected
            assert not any("still unreachable" in r.getMessage() for r in caplog.records)
            # Rotated: a new seed, copied where the process reads it; a process started
            # with it connects (one running since before keeps the public key it began
            # with — nats-py's — so it is restarted: docs/operations.md).
            add = ["auth", "add-agent", agent_id, "--dir", str(d)]
            assert await asyncio.to_thread(main, add) == 0
            assert auth.identities()[-1].public_key != old_key
            shutil.copy(auth.seed_file("agent", agent_id), host_seed)
            server.reload()
            for _ in range(50):
                try:
                    fresh = await connect(server.url, name=agent_id, settings=settings)
                    break
                except NotPermittedError:  # (the reload takes a moment)
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("the rotated identity could not connect")
            await fresh.close()
        finally:
            await nc.close()


# --------------------------------------------------------------------------- a hostile sweep

# What an agent, a caller of the victim's namespace or of another one, and the operator try
# against the JetStream API, the buckets, the hubs' own consumer and subjects, and every wide
# subscription: refused by the server each time (docs/security.md, "Threat model").

_API = "$JS.API"
#: What changes, reads whole, or moves a stream: no role but the hub's has any of them.
_STREAM_VERBS = (
    "STREAM.MSG.DELETE",
    "STREAM.PURGE",
    "STREAM.DELETE",
    "STREAM.UPDATE",
    "STREAM.CREATE",
    "STREAM.LEADER.STEPDOWN",
    "STREAM.SNAPSHOT",
    "STREAM.MSG.GET",
    "DIRECT.GET",
    "CONSUMER.NAMES",
    "CONSUMER.LIST",
)
_HUBS = f"{protocol.STREAM_WF}.{protocol.CONSUMER_HUBS}"
REFUSED_PUBLISH = (
    *(f"{_API}.{verb}.{stream}" for stream in protocol.MESH_STREAMS for verb in _STREAM_VERBS),
    # The hubs' submissions consumer: deleted, re-pointed, pulled from, acked, moved.
    f"{_API}.CONSUMER.DELETE.{_HUBS}",
    f"{_API}.CONSUMER.CREATE.{_HUBS}.{protocol.wf_submit('*')}",
    f"{_API}.CONSUMER.MSG.NEXT.{_HUBS}",
    f"{_API}.CONSUMER.LEADER.STEPDOWN.{_HUBS}",
    f"$JS.ACK.{_HUBS}.1.1.1.1.0",
    # An operator's cordon lifted, a sticky session moved, by a KV write.
    f"$KV.{protocol.KV_CORDONS}.{VICTIM}",
    f"$KV.{protocol.KV_SESSIONS}.somekey",
    f"{_API}.STREAM.NAMES",
    f"{_API}.STREAM.LIST",
    f"{_API}.ACCOUNT.PURGE",
    f"{_API}.SERVER.REMOVE",
    f"{_API}.META.LEADER.STEPDOWN",
    protocol.hub_broadcast(NS, "breaker"),
    protocol.hub_broadcast(NS, "pins"),
)
#: Reading what others send: other tenants' routes and payloads, statuses, work, replies, API.
REFUSED_SUBSCRIBE = (
    ">",
    "reach.hub.>",
    "reach.hubs.>",
    "reach.status.>",
    "reach.work.>",
    "reach.agent.>",
    "reach.wf.>",
    "reach.micro.>",
    "_INBOX.>",
    "_INBOX.hub.>",
    "$JS.API.>",
    "$JS.ACK.>",
    "$KV.>",
    "$SRV.>",
)


@pytest.mark.parametrize(
    ("role", "name"),
    [("agent", ROGUE), ("caller", NS), ("caller", "other"), ("operator", "admin")],
)
async def test_no_role_but_the_hub_changes_a_stream_or_reads_others_subjects(
    mesh: Mesh, as_identity: Any, role: str, name: str
) -> None:
    """Each identity but the hub's: every stream's delete, purge, update, creation, leader
    move, snapshot, whole reads and consumer lists; the hubs' submissions consumer deleted,
    re-pointed, pulled from, acked or moved; a cordon lifted or a session moved by a KV write;
    account and server verbs; the hubs' breaker and pins subjects; and every wide subscription
    (other tenants' routes and payloads, statuses, work, replies, the API, the buckets)."""
    conn: Conn = await as_identity(role, name)
    for subject in REFUSED_PUBLISH:
        await conn.nc.publish(subject, b"{}")
    for subject in REFUSED_SUBSCRIBE:
        await conn.nc.subscribe(subject)
    await conn.nc.flush()
    wanted = [f'publish to "{s.lower()}"' for s in REFUSED_PUBLISH]
    wanted += [f'subscription to "{s.lower()}"' for s in REFUSED_SUBSCRIBE]

    def missing() -> list[str]:
        said = "\n".join(conn.errors)
        return [w for w in wanted if w not in said]

    try:
        await eventually(lambda: not missing(), timeout=5.0)
    except AssertionError:
        raise AssertionError(f"{role} {name}: not refused: {missing()}") from None


async def test_a_route_or_step_naming_another_namespaces_agent_is_refused_alike(
    mesh: Mesh, as_identity: Any
) -> None:
    """A caller of ``other`` names the victim (namespace ``sec``) in a route — plain, dry run
    with an explanation, or as the retry of a task that timed out there (``after_attempt``,
    which admits an agent whatever its breaker or cordon say) — or in a workflow step: refused
    by the hub, nothing runs, and the answer is the one a made-up id of ``sec`` gets (no word
    of whether the agent exists, nor of its state)."""
    other = await as_identity("caller", "other")
    ran = len(mesh.ran)
    subject = protocol.hub_subject("other", "route")
    for extra in (
        {"payload": "x"},
        {"dry_run": True, "explain": True},
        {"payload": "x", "task_id": "red-held", "after_attempt": 1},
    ):
        answers = []
        for agent_id in (VICTIM, f"{NS}.nobody.a1"):
            body = {"agent_id": agent_id, "capability": CAP, **extra}
            out = await ask(other, subject, json.dumps(body).encode())
            assert out["error"]["code"] == "REACH_BAD_REQUEST", out
            answers.append(json.dumps(out).replace(agent_id, "<id>"))
        assert answers[0] == answers[1], answers
    async with Client(settings=mesh.settings("caller", "other")) as c:
        with pytest.raises(WorkflowSpecError, match="not in namespace 'other'"):
            await c.fanout([Step(agent_id=VICTIM, payload="x")], timeout=5)
    await asyncio.sleep(0.2)
    assert len(mesh.ran) == ran


async def test_a_consumer_pushing_outside_every_inbox_is_deleted_by_the_hubs(
    mesh: Mesh, as_identity: Any
) -> None:
    """A caller of ``other`` may create consumers of its own workflow events under any name,
    and nats-server does not check their deliver subject: one whose idle heartbeats (100 ms
    apart) go to the victim's ``.task``, an agent of ``sec`` it may not publish to, went on
    after the caller left (measured: 201 of them, 2,000 messages a second, each read and
    dropped by the victim). The hubs delete a consumer that pushes outside every inbox within
    their sweep (``hub/_push_sweep.py``); one that pushes to an inbox stays."""
    from reach_mesh._guard import refused_total
    from reach_mesh.hub import _push_sweep

    caller = await as_identity("caller", "other")
    stream = protocol.STREAM_WF_EVENTS
    filt = "reach.wf.other.>"
    made = {
        "red-flood": protocol.agent_task(VICTIM),
        "red-inbox": f"{protocol.INBOX_PREFIX}caller.other.red",
    }
    for name, deliver in made.items():
        config = {
            "name": name,
            "filter_subject": filt,
            "deliver_subject": deliver,
            "ack_policy": "none",
            "idle_heartbeat": 100_000_000,
            "inactive_threshold": 60_000_000_000,  # (the inbox one has nobody reading it)
        }
        if deliver == protocol.agent_task(VICTIM):
            config["deliver_group"] = "reach-agent"
        req = json.dumps({"stream_name": stream, "config": config}).encode()
        subject = f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filt}"
        answer = json.loads((await caller.nc.request(subject, req, timeout=5)).data)
        assert "error" not in answer, answer  # the server lets the caller make both
    await caller.nc.close()  # the caller leaves
    refused = refused_total()
    await eventually(lambda: refused_total() > refused)  # the victim reads the heartbeats
    js = mesh.hub.nc.jetstream()

    async def names() -> set[str]:
        return {c.name for c in await js.consumers_info(stream)}

    async def swept() -> bool:
        return "red-flood" not in await names()

    await eventually(swept, timeout=_push_sweep.SWEEP_INTERVAL * 2 + 2)
    assert "red-inbox" in await names()
    await asyncio.sleep(0.3)  # (a heartbeat sent before the delete may still be on its way)
    refused = refused_total()
    await asyncio.sleep(1.0)
    assert refused_total() == refused
    with contextlib.suppress(NotFoundError):
        await js.delete_consumer(stream, "red-inbox")
