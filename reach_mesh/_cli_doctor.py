"""``reach-mesh doctor``: is this mesh healthy, and if not, what to do — one command that reads
what an operator would otherwise piece together from ``nats stream report``, ``reach-mesh
hubs`` and ``reach-mesh agents``.

Each check is one :class:`Finding` (``ok``, ``warn`` or ``fail``, and a line saying what was
seen and, when it is not ok, what to do). Nothing is changed: every check is a read (server
and account info, JetStream stream and consumer info, NATS micro discovery, a fleet query).
A check the identity may not make (a caller's, in secure mode) is a warning saying so, not a
failure of the mesh. ``reach_mesh.cli`` parses the command line and runs :func:`cmd_doctor`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import shutil
import textwrap
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import StreamInfo
from nats.js.errors import Error as JetStreamError
from nats.js.errors import NotFoundError, ServiceUnavailableError

from reach_mesh import __version__, protocol
from reach_mesh._cli_fleet import settings_of
from reach_mesh._client_fleet import AgentList
from reach_mesh._nats import has_identity, hosts, refused_first
from reach_mesh._nats_together import server_name
from reach_mesh._nats_urls import servers
from reach_mesh.client import Client
from reach_mesh.config import MeshSettings
from reach_mesh.errors import NotPermittedError, ReachError
from reach_mesh.models import AgentState, TaskState
from reach_mesh.workflow import WorkflowSummary

__all__ = ["Finding", "cmd_doctor", "diagnose"]

T = TypeVar("T")

Status = Literal["ok", "warn", "fail"]

#: The streams a mesh keeps (the KV buckets' streams are ``KV_<bucket>``), created by hubs.
STREAMS: Final = protocol.MESH_STREAMS
#: A hub's clock this far off the NATS server's (seconds) is a warning.
CLOCK_SKEW: Final = 1.0
#: What a stream (or the hubs' consumer) not found means.
#: How a check this identity may not make begins (NATS refused it the API subject).
NOT_ASKED: Final = "not checked: this identity may not ask "
MISSING: Final = "hubs create them when they start (has a hub of this version run here?)"
#: A stream or an account this full is a warning: writes are refused at its limit.
FULL: Final = 0.8
#: How long one read may take before it counts as not answered.
READ_TIMEOUT: Final = 5.0
#: Agent states that need an operator's look (SUSPECT: beats late; QUARANTINED: breaker open),
#: as a hub of an earlier version, which sends no ``AgentInfo.attention``, is read.
TROUBLED: Final = (AgentState.SUSPECT, AgentState.QUARANTINED)


@dataclass(frozen=True, slots=True)
class Finding:
    """One check's verdict."""

    check: str
    status: Status
    detail: str


async def diagnose(settings: MeshSettings) -> list[Finding]:
    """Every check, on a connection made with ``settings``; raises ``MeshUnavailableError``
    (from the connection) when NATS cannot be reached at all."""
    async with Client(settings=settings) as client:
        nc = client.nc
        found = [_server(nc, client.nats_url), _security(settings, client.nats_url)]
        found.append(await _jetstream(nc))
        if found[-1].status != "fail":
            kept = [n for n in STREAMS if settings.audit_enabled or n != protocol.STREAM_AUDIT]
            found += await _streams(nc, kept)
            found.append(await _workflow_queue(nc))
        hubs, answering = await _hubs(nc)
        found.append(hubs)
        if answering is not None and not answering:
            # nobody to ask: a fleet query would wait out its deadline
            found.append(Finding("agents", "warn", "not checked: no hub answers"))
        else:
            if answering:  # (None: discovery refused — who is alive cannot be told)
                found.append(await _workflows(client, answering))
            found.append(await _agents(client))
    return found


def _server(nc: NATS, url: str | None) -> Finding:
    """The server this check is connected to — not the URLs given, which read as if every
    one of them answered (a cluster with a node down said `connected to` all three) — and,
    of several given, how many."""
    v = nc.connected_server_version
    given = servers(url)
    here = nc.connected_url  # (its user and password left out)
    on = "?" if here is None else f"{here.scheme}://{here.hostname}:{here.port}"
    name = server_name(nc)
    if name is not None and name not in on:
        on += f" (server {name})"
    of = f", one of {len(given)} URLs given" if len(given) > 1 else ""
    return Finding(
        "nats", "ok", f"connected to {on}{of}, nats-server {v.major}.{v.minor}.{v.patch}"
    )


def _security(settings: MeshSettings, url: str | None) -> Finding:
    if settings.nats_nkey_seed or settings.nats_creds or settings.nats_tls_cert:
        return Finding("security", "ok", "secure mode: this connection has its own identity")
    if has_identity(settings):  # a token, or a user and password in the URL
        return Finding(
            "security",
            "warn",
            "a shared secret (token or password) lets this connection in, but tells no "
            "identity apart: whoever holds it may act as any agent or operator (secure mode: "
            "reach-mesh auth init, docs/security.md)",
        )
    if all(_loopback(h) for h in hosts(url)):
        return Finding("security", "ok", "open dev mode, on this machine only")
    return Finding(
        "security",
        "warn",
        "open mode on a network address: anyone who reaches NATS can register agents, forge "
        "results and act as an operator (secure mode: reach-mesh auth init, docs/security.md)",
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _jetstream(nc: NATS) -> Finding:
    js = nc.jetstream(timeout=READ_TIMEOUT)
    got = await _read(nc, "jetstream", "$JS.API.INFO", js.account_info)
    if isinstance(got, Finding):
        return got
    storage, limit = got.storage, got.limits.max_storage
    used = f"{_size(storage)} stored" + (f" of {_size(limit)}" if limit > 0 else "")
    detail = f"enabled: {used}, {got.streams} streams, {got.consumers} consumers"
    if limit > 0 and storage > FULL * limit:
        return Finding(
            "jetstream", "warn", f"{detail}: the account's store is nearly full (writes fail)"
        )
    return Finding("jetstream", "ok", detail)


async def _streams(nc: NATS, names: list[str]) -> list[Finding]:
    """A finding for each of the streams ``names`` that is not ok, after one for them all
    (the audit stream is left out where the settings turn the audit off)."""
    js = nc.jetstream(timeout=READ_TIMEOUT)

    async def one(name: str) -> tuple[Finding, StreamInfo | None]:
        got = await _read(nc, name, f"$JS.API.STREAM.INFO.{name}", lambda: js.stream_info(name))
        return (got, None) if isinstance(got, Finding) else (_stream(got), got)

    found = await asyncio.gather(*(one(name) for name in names))
    if all(i is None and f.detail == MISSING for f, i in found):
        return [Finding("streams", "warn", f"none of the {len(names)} exists: {MISSING}")]
    # Those this identity may not ask about (a caller's, an agent's): one line for them all.
    denied = [f.check for f, _ in found if f.detail.startswith(NOT_ASKED)]
    bad = [f for f, _ in found if f.status != "ok" and f.check not in denied]
    infos = [i for _, i in found if i is not None]
    replicas = sorted({i.config.num_replicas or 1 for i in infos})
    stored = sum(i.state.bytes for i in infos)
    checked = len(names) - len(denied)
    detail = (
        f"{checked - len(bad)} of {checked} ok"
        + (f" (R{'/R'.join(map(str, replicas))})" if replicas else "")
        + f", {_size(stored)} stored"
    )
    if bad:
        detail += ": " + ", ".join(f.check for f in bad) + " below"
    servers = sorted({name for i in infos for name in _silent(i)})
    if servers:
        # A server down shows in every stream it holds a replica of: say it once, first.
        detail += (
            f"; server {', '.join(servers)} not heard from by the streams' leaders: down or cut "
            "off (restart it; docs/operations.md, 'A NATS node is lost')"
        )
    statuses = [f.status for f in bad]
    if denied:
        statuses.append("warn")
        detail += (
            f"; {len(denied)} not checked, this identity may not ask about them "
            f"({', '.join(denied)}): run the doctor as the operator"
        )
    return [Finding("streams", _worst(statuses), detail), *bad]


def _stream(info: StreamInfo) -> Finding:
    cfg, state, cluster = info.config, info.state, info.cluster
    name = cfg.name or "?"
    replicas = cfg.num_replicas or 1
    detail = f"R{replicas}, {state.messages:,} messages, {_size(state.bytes)}"
    problems: list[tuple[Status, str]] = []
    clustered = cluster is not None and cluster.name is not None
    leader = None if cluster is None else cluster.leader
    if cluster is not None and not leader:
        problems.append(("fail", "no leader: an election is under way, or its quorum is lost"))
    elif clustered:
        detail += f", leader {leader}"
    silent = _silent(info)
    for peer in (cluster.replicas or []) if cluster is not None else []:
        if peer.offline:
            problems.append(("warn", f"replica {peer.name} offline"))
        elif peer.name in silent:
            heard = silent[peer.name]
            problems.append(
                (
                    "warn",
                    f"replica {peer.name} not heard from "
                    + ("since its leader was elected" if heard is None else f"for {heard:.0f} s")
                    + ": its server is down or cut off",
                )
            )
        elif not peer.current:
            problems.append(("warn", f"replica {peer.name} behind by {peer.lag or 0} operations"))
    if clustered and replicas == 1:
        problems.append(
            (
                "warn",
                "one replica in a cluster: the loss of its server loses it (kv_replicas: 3 "
                "on the hubs, which scale it up at start)",
            )
        )
    if cfg.max_bytes and cfg.max_bytes > 0 and state.bytes > FULL * cfg.max_bytes:
        problems.append(("warn", f"nearly full ({_size(cfg.max_bytes)} at most)"))
    if not problems:
        return Finding(name, "ok", detail)
    status = _worst(s for s, _ in problems)
    return Finding(name, status, f"{detail}: " + "; ".join(p for _, p in problems))


#: A replica not current and not heard from for this long is taken for a server down or cut
#: off, not one catching up (its leader hears from a live one every second or so).
SILENT_S: Final = 5.0


def _silent(info: StreamInfo) -> dict[str, float | None]:
    """The replicas of a stream not heard from by its leader for ``SILENT_S`` (seconds since,
    or None: never since the leader was elected). nats-server seldom marks a killed server's
    replicas ``offline``: they only fall behind, and silent."""
    cluster = info.cluster
    out: dict[str, float | None] = {}
    for peer in (cluster.replicas or []) if cluster is not None else []:
        if peer.current or peer.offline or peer.name is None:
            continue
        if not peer.active:
            out[peer.name] = None
        elif peer.active / 1e9 >= SILENT_S:
            out[peer.name] = peer.active / 1e9
    return out


def _worst(statuses: Iterable[Status]) -> Status:
    """``fail`` if one is, else ``warn`` if one is, else ``ok``."""
    seen = set(statuses)
    return "fail" if "fail" in seen else "warn" if "warn" in seen else "ok"


async def _workflow_queue(nc: NATS) -> Finding:
    js = nc.jetstream(timeout=READ_TIMEOUT)
    subject = f"$JS.API.CONSUMER.INFO.{protocol.STREAM_WF}.{protocol.CONSUMER_HUBS}"
    got = await _read(
        nc,
        "workflow queue",
        subject,
        lambda: js.consumer_info(protocol.STREAM_WF, protocol.CONSUMER_HUBS),
    )
    if isinstance(got, Finding):
        return got
    waiting, held = got.num_pending or 0, got.num_ack_pending or 0
    return Finding(
        "workflow queue",
        "ok",
        f"{waiting:,} submissions not yet delivered to a hub, {held:,} held by hubs "
        f"(running or deferred), {got.num_redelivered or 0:,} delivered again",
    )


async def _hubs(nc: NATS) -> tuple[Finding, set[str] | None]:
    """The hubs' finding, and the ids of those that answered micro discovery (None: not
    asked)."""
    from reach_mesh.hub._micro import discover_hubs

    try:
        # Each hub's health and counts; not its list of agents.
        hubs = await discover_hubs(nc, expected=True, fleet_ask=b'{"limit":0}')
    except NotPermittedError:
        why = "not checked: this identity may not use micro discovery"
        return Finding("hubs", "warn", why), None
    return _hubs_seen(hubs), {str((h.get("metadata") or {}).get("hub_id")) for h in hubs}


def _hubs_seen(hubs: list[dict[str, Any]]) -> Finding:
    if not hubs:
        return Finding(
            "hubs",
            "fail",
            f"no hub answers $SRV.INFO.{protocol.MICRO_HUB_SERVICE}: start one "
            "(reach-mesh hub, or reach-mesh up); callers' requests wait for it meanwhile",
        )
    # Each hub's id, version and fleet answer (``discover_hubs``: None if it did not answer).
    seen = [
        (
            str((h.get("metadata") or {}).get("hub_id", "?")),
            str(h.get("version", "?")),
            h.get("fleet") or {},
        )
        for h in hubs
    ]
    versions = {version for _, version, _ in seen}
    detail = f"{len(hubs)} answering: " + ", ".join(sorted(f"{h} ({v})" for h, v, _ in seen))
    blind = {hub: fleet.get("blind_reason") for hub, _, fleet in seen if fleet.get("blind")}
    if blind:
        why = "; ".join(f"{hub}: {reason}" for hub, reason in sorted(blind.items()) if reason)
        full = any("storage is full" in str(reason) for reason in blind.values())
        runbook = "JetStream storage is full" if full else "A hub cannot reach JetStream"
        return Finding(
            "hubs",
            "fail",
            f"{detail}: {', '.join(sorted(blind))} cannot read or write the registry in "
            f"JetStream, or reach NATS{f'; last failure of {why}' if why else ''} "
            f"(reach_registry_blind; docs/operations.md, {runbook})",
        )
    skewed = sorted(
        f"{hub} {skew:+.1f}s"
        for hub, _, fleet in seen
        if abs(skew := float(fleet.get("clock_skew_s") or 0.0)) > CLOCK_SKEW
    )
    if skewed:
        return Finding(
            "hubs",
            "warn",
            f"{detail}: clock off the NATS server's: {', '.join(skewed)} — deadlines hold (hubs "
            "read the server's), but their logs', audit's and metrics' times are off: fix "
            "NTP on those hosts",
        )
    if len(versions) > 1:
        return Finding("hubs", "warn", f"{detail}: versions differ (a rolling upgrade?)")
    if __version__ not in versions:
        return Finding("hubs", "ok", f"{detail} (this CLI is {__version__})")
    return Finding("hubs", "ok", detail)


async def _workflows(client: Client, answering: set[str]) -> Finding:
    """Running workflows whose owner hub did not answer discovery (``answering``): a dead,
    stopped or cut-off hub's, which wait for another hub to take them over — for
    ``workflow_ack_wait`` after their owner's last renewal, or for ever when no hub can
    (``reach-mesh workflows`` marks their owner "(not answering)"; this said OK)."""
    asked = ((True, "every namespace"), (False, f"namespace {client.namespace!r}"))
    for every, of in asked:  # every namespace is the operator's list; else its own
        try:
            listed = await client.list_workflows(
                state=TaskState.RUNNING, limit=protocol.WORKFLOW_LIST_MAX, all_namespaces=every
            )
            scope = of
            break
        except NotPermittedError:
            continue
        except ReachError as err:
            return Finding(
                "workflows", "warn", f"not checked: the list of running workflows: {err.code}"
            )
    else:
        return Finding("workflows", "warn", "not checked: this identity may not list workflows")
    running = [w for w in listed.workflows if w.state is TaskState.RUNNING]
    cut = " (or more: the list was cut)" if listed.truncated else ""
    orphans: dict[str, list[WorkflowSummary]] = {}
    for w in running:
        if w.owner and w.owner not in answering:
            orphans.setdefault(w.owner, []).append(w)
    if not orphans:
        return Finding(
            "workflows", "ok", f"{len(running)} running in {scope}{cut}, every owner answers"
        )
    now = time.time()
    owners = []
    for owner, ws in sorted(orphans.items()):
        oldest = min(ws, key=lambda w: w.submitted_at or now)
        ran = "" if oldest.submitted_at is None else f", running {now - oldest.submitted_at:.0f} s"
        owners.append(
            f"{owner} ({len(ws)}; e.g. {oldest.workflow_id} in {oldest.namespace or '?'}{ran})"
        )
    n = sum(len(ws) for ws in orphans.values())
    return Finding(
        "workflows",
        "warn",
        f"{len(running)} running in {scope}{cut}; {n} owned by hubs that do not answer "
        f"discovery (stopped, died, cut off or busy): {'; '.join(owners)}. Another hub takes "
        "each over within workflow_ack_wait (30 s by default) of its owner's last renewal and "
        "resumes it from its records; still said a minute from now, no hub takes them: check "
        "that the others run and are not full (reach-mesh hubs; the workflow queue line; "
        "alert ReachWorkflowBacklog), then reach-mesh workflow ID --namespace NS "
        "(docs/operations.md, 'A hub is lost')",
    )


async def _agents(client: Client) -> Finding:
    """The fleet's states, counted by the answering hub (``by_state``): the agents that need
    an operator's look only are listed (five of them, with why: ``AgentInfo.attention``), so a
    fleet of any size is checked in one small answer."""
    asked = ((True, "every namespace"), (False, f"namespace {client.namespace!r}"))
    for every, of in asked:  # every namespace is the operator's list; else its own
        try:
            fleet = await client.fleet(all_namespaces=every, attention=True, limit=5)
            infos = AgentList.of(fleet)
            scope = of
            break
        except NotPermittedError:
            continue
        except ReachError as err:  # a hub answered discovery, and then not the fleet query
            return Finding(
                "agents", "fail", f"no answer to the fleet query: {err.code}: {err.message}"
            )
    else:
        return Finding("agents", "warn", "not checked: this identity may not list agents")
    states = {AgentState(s): n for s, n in infos.by_state.items() if n}
    total = sum(states.values())
    lost = _recently_lost(fleet)
    if not total:
        return Finding(
            "agents",
            "warn",
            f"no agent registered ({scope}): start one (reach-mesh agent module:attribute)" + lost,
        )
    detail = f"{total} in {scope}: " + ", ".join(
        f"{n} {s.value}" for s, n in sorted(states.items(), key=lambda kv: -kv[1])
    )
    # (an older hub ignores the filter and sends every agent, and no ``attention``)
    troubled = [i for i in infos if i.attention or i.state in TROUBLED]
    if troubled:
        count = max(infos.attention_total, len(troubled))
        shown = ", ".join(
            f"{i.agent_id} ({', '.join(i.attention) or i.state.value})" for i in troubled[:5]
        )
        if count > 5:
            shown += f" and {count - 5} more"
        return Finding(
            "agents",
            "warn",
            f"{detail}; {count} need attention: {shown} "
            "(reach-mesh agents --attention; reach-mesh inspect AGENT_ID)" + lost,
        )
    if not states.get(AgentState.ONLINE):
        return Finding("agents", "warn", f"{detail}: none ONLINE, nothing can be routed" + lost)
    if lost:
        return Finding("agents", "warn", detail + lost)
    return Finding("agents", "ok", detail)


def _recently_lost(fleet: dict[str, Any]) -> str:
    """The sentence on the agents the answering hub declared LOST lately and that did not
    come back (``recently_lost``: no heartbeat for their lease and ``suspect_timeout``, no
    goodbye — crashed, hung or cut off), or "" when none. They are in no listing but
    ``reach-mesh agents``' recently LOST table: a process killed or hung since is otherwise
    invisible to this check (it said OK 9 s after a hung agent was declared LOST)."""
    entries = [e for e in fleet.get("recently_lost") or [] if isinstance(e, dict)]
    total = fleet.get("recently_lost_total")
    count = total if isinstance(total, int) and total >= len(entries) else len(entries)
    if not count:
        return ""
    now = time.time()
    named = []
    for e in entries[:5]:
        at = e.get("lost_at")
        ago = ""
        if isinstance(at, (int, float)):
            secs = max(0.0, now - at)
            ago = f" ({secs:.0f} s ago)" if secs < 120 else f" ({secs / 60:.0f} min ago)"
        named.append(f"{e.get('agent_id')}{ago}")
    more = f" and {count - 5} more" if count > 5 else ""
    return (
        f"; {count} declared LOST in the last 15 min and not back (no heartbeat, no goodbye: "
        f"crashed, hung or cut off): {', '.join(named)}{more} — check their processes and "
        "restart them if they should run (reach-mesh agents lists them)"
    )


async def _read(
    nc: NATS, check: str, subject: str, read: Callable[[], Awaitable[T]]
) -> T | Finding:
    """``read()`` (a JetStream API request on ``subject``), or the finding of ``check`` that
    says why it gave nothing: refused to this identity, not found, or no answer."""
    try:
        return await refused_first(nc, subject, read(), expected=True)
    except NotPermittedError:
        return Finding(check, "warn", f"{NOT_ASKED}{subject}")
    except NotFoundError:
        return Finding(check, "warn", MISSING)
    except (NoRespondersError, ServiceUnavailableError):
        return Finding(
            check,
            "fail",
            "JetStream does not answer: not enabled on this server or account (nats-server "
            "-js), or its cluster has no quorum",
        )
    except (TimeoutError, NatsTimeoutError):
        return Finding(
            check,
            "fail",
            f"no answer within {READ_TIMEOUT:g}s (JetStream overloaded, or an election)",
        )
    except JetStreamError as err:
        return Finding(check, "fail", f"JetStream refused: {err}")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


async def cmd_doctor(args: argparse.Namespace) -> int:
    found = await diagnose(settings_of(args))
    failed = sum(f.status == "fail" for f in found)
    warned = sum(f.status == "warn" for f in found)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(f) for f in found]}, indent=2))
    else:
        _print(found)
        plural = "" if warned == 1 else "s"
        print(f"\n{failed} failed, {warned} warning{plural}, {len(found) - failed - warned} ok")
    return 1 if failed else 0


def _print(found: list[Finding]) -> None:
    """One finding a line, its detail wrapped under itself (the detail is the point: never
    cut, unlike a table's last column)."""
    width = max(len(f.check) for f in found)
    columns = max(shutil.get_terminal_size().columns, 60)
    for f in found:
        head = f"{f.status.upper():<4}  {f.check:<{width}}  "
        lines = textwrap.wrap(f.detail, max(columns - len(head), 30), break_on_hyphens=False) or [
            ""
        ]
        print(head + lines[0])
        for line in lines[1:]:
            print(" " * len(head) + line)
