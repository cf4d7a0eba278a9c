"""The ``reach-mesh`` commands that read the fleet: ``agents``, ``hubs``, ``inspect``,
``tools``, ``snapshot``, ``audit`` — and the tables they print (``_cli_workflows`` has the
workflow commands).
``reach_mesh.cli`` parses the command line and runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from reach_mesh import protocol
from reach_mesh._client_fleet import AgentList
from reach_mesh._nats import shown
from reach_mesh.client import Client
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import BadRequestError, MeshUnavailableError
from reach_mesh.models import AgentInfo

__all__ = [
    "add_admin_commands",
    "cell",
    "cmd_admin",
    "cmd_agents",
    "cmd_audit",
    "cmd_hubs",
    "cmd_inspect",
    "cmd_snapshot",
    "cmd_tools",
    "lease_cell",
    "print_table",
    "settings_of",
]


def settings_of(args: argparse.Namespace, **extra: Any) -> MeshSettings:
    """The settings a command runs with: ``--config`` / ``$REACH_CONFIG``, the environment,
    ``--nats``, then ``extra``."""
    extra.setdefault("nats_url", args.nats)
    return load_settings(getattr(args, "config", None), **extra)


async def cmd_agents(args: argparse.Namespace) -> int:
    if args.via_micro:
        return await _agents_via_micro(args)
    async with Client(settings=settings_of(args), namespace=args.namespace) as c:
        # One query, one hub's view: its agents and those it declared LOST lately.
        fleet = await c.fleet(
            all_namespaces=args.namespace is None,
            state=args.state,
            capability=args.capability,
            limit=args.limit,
            offset=args.offset,
            after=args.after,
            attention=args.attention,
        )
    infos = AgentList.of(fleet)
    lost: list[dict[str, Any]] = fleet.get("recently_lost") or []
    if args.json:
        print(json.dumps([i.model_dump(mode="json") for i in infos], indent=2))
        if infos.truncated:  # stdout stays the list a script reads
            print(_cut(infos, paged=True), file=sys.stderr)
        return 0
    _print_agents(infos)
    if not infos and args.namespace is not None:
        print(f"(no agents in namespace {args.namespace!r}; without --namespace: every one)")
    elif not infos and not infos.truncated:
        print("(no agents)" if not infos.total else f"(none of {infos.total} agents match)")
    if infos.truncated:
        print(_cut(infos, paged=True))
    if infos.attention_total and not args.attention:
        print(
            f"({infos.attention_total} of {infos.total} agents need attention: "
            "see them with --attention)"
        )
    if lost:
        # They are in no listing any more: say where they went.
        print("\nrecently LOST (no heartbeat for their lease; kept 15 min):")
        now = time.time()
        rows = [("AGENT", "LOST", "CAPABILITIES")]
        rows += [
            (e["agent_id"], f"{now - e['lost_at']:.0f}s ago", ",".join(e["capabilities"]))
            for e in lost
        ]
        print_table(rows)
        held = int(fleet.get("recently_lost_total", len(lost)))
        if held > len(lost):
            print(f"(showing {len(lost)} of {held} recently LOST agents, newest first)")
    return 0


def _cut(infos: AgentList, *, paged: bool = False) -> str:
    """What a cut fleet answer left out, and how to see the rest."""
    start = (infos.next_offset or infos.matched) - len(infos)  # (where the page began)
    shown_ = f"{start + 1}-{start + len(infos)}" if start > 0 and infos else str(len(infos))
    counts = ", ".join(f"{n} {s}" for s, n in sorted(infos.by_state.items(), key=lambda kv: -kv[1]))
    text = (
        f"showing {shown_} of {infos.matched} agents"
        + (f" ({infos.total} in all: {counts})" if counts else "")
        + "; one answer holds what fits in one NATS message (max_payload)"
    )
    if paged:
        text += ": narrow with --namespace, --state or --capability"
        if infos.next_after is not None:
            text += f", or see the next page with --after {infos.next_after}"
    return text


async def _discover_hubs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every hub answering NATS micro discovery (``$SRV.INFO.reach-hub``), with its view of
    the fleet; ``MeshUnavailableError`` (exit code 3) when none answers."""
    from reach_mesh.hub._micro import discover_hubs

    async with Client(settings=settings_of(args)) as c:
        hubs = await discover_hubs(c.nc)
    if not hubs:
        raise MeshUnavailableError(
            f"no hub answered $SRV.INFO.{protocol.MICRO_HUB_SERVICE}: is `reach-mesh hub` "
            f"(or `reach-mesh up`) running on {shown(c.nats_url)}?"
        )
    return hubs


def _print_hubs(hubs: Sequence[dict[str, Any]]) -> None:
    rows = [("HUB", "VERSION", "HTTP", "AGENTS")]
    for hub in hubs:
        meta = hub.get("metadata") or {}
        fleet = hub.get("fleet") or {}
        known = fleet.get("agents")
        count = fleet.get("total", None if known is None else len(known))
        rows.append(
            (
                str(meta.get("hub_id", "?")),
                str(hub.get("version", "?")),
                str(meta.get("http_url") or "-"),
                "?" if count is None else str(count),
            )
        )
    if len(rows) > 1:
        print_table(rows)


async def cmd_hubs(args: argparse.Namespace) -> int:
    hubs = await _discover_hubs(args)
    if args.json:
        print(json.dumps({"hubs": hubs}, indent=2))
        return 0
    _print_hubs(hubs)
    return 0


async def _agents_via_micro(args: argparse.Namespace) -> int:
    """The fleet as NATS micro discovery sees it: every hub answering ``$SRV.INFO.reach-hub``
    and the agents each one knows."""
    hubs = await _discover_hubs(args)
    seen: dict[str, AgentInfo] = {}
    for hub in hubs:
        for raw in (hub.get("fleet") or {}).get("agents", []):
            info = AgentInfo.model_validate(raw)
            if args.namespace is None or protocol.namespace_of(info.agent_id) == args.namespace:
                seen.setdefault(info.agent_id, info)
    if args.json:
        print(json.dumps({"hubs": hubs}, indent=2))
        return 0
    _print_hubs(hubs)
    print()
    _print_agents(list(seen.values()))
    if not seen:
        print("(no agents)")
    for hub in hubs:
        fleet = hub.get("fleet") or {}
        if fleet.get("truncated"):
            print(
                f"hub {fleet.get('hub_id', '?')}: {_cut(AgentList.of(fleet))}: see them "
                "all with reach-mesh agents (--offset pages)"
            )
    return 0


def _print_agents(infos: Sequence[AgentInfo]) -> None:
    """The agents as a table; an ATTENTION column when any of them needs an operator's look
    (before CAPABILITIES, the last column, which a terminal cuts)."""
    concerned = any(i.attention for i in infos)
    head = ("NS", "AGENT", "STATE", "LOAD", "INFLIGHT", "LEASE", "HEALTH")
    rows: list[tuple[str, ...]] = [(*head, *(("ATTENTION",) if concerned else ()), "CAPABILITIES")]
    for i in sorted(infos, key=lambda i: i.agent_id):
        row = (
            protocol.namespace_of(i.agent_id),
            i.agent_id,
            i.state.value,
            f"{i.load:.2f}",
            _inflight(i),
            lease_cell(i.lease_left),
            f"{i.health:g}",
        )
        why = (",".join(i.attention) or "-",) if concerned else ()
        # Capabilities it reports it cannot serve now (a dependency down; every one while its
        # slots are held by handlers past their timeout) are marked.
        caps = ",".join(c + " (down)" if c in i.unavailable else c for c in i.capabilities)
        rows.append((*row, *why, caps))
    if len(rows) > 1:
        print_table(rows)


def lease_cell(lease_left: float) -> str:
    """What is left of an agent's lease (``AgentInfo.lease_left``), as an operator reads it:
    ``12.9s``; once it lapsed (a ``SUSPECT`` agent, or a cordoned or draining one that stopped
    beating), ``lapsed 6.2s ago`` — a bare ``-6.2s`` read as a bug, or as time to go."""
    if lease_left >= 0:
        return f"{lease_left:.1f}s"
    return f"lapsed {-lease_left:.1f}s ago"


def _inflight(info: AgentInfo) -> str:
    """Tasks running of ``max_concurrency``, and those past it apart (queued behind them), as
    the dashboard shows them: ``2/2 +12``, never ``14/2``."""
    cap = info.max_concurrency
    over = info.inflight - cap
    return f"{min(info.inflight, cap)}/{cap}" + (f" +{over}" if over > 0 else "")


def cell(text: str, width: int) -> str:
    """``text`` on one line (whitespace and control characters folded into single spaces), cut
    to ``width`` with an ellipsis."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def print_table(
    rows: Sequence[Sequence[str]], indent: str = "", file: TextIO | None = None
) -> None:
    """Columns padded to their widest cell; on a terminal, the last column is cut to fit
    (``--json`` has everything). To ``file`` (default: stdout)."""
    out = sys.stdout if file is None else file
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    room = None
    if out.isatty():
        used = len(indent) + sum(w + 2 for w in widths[:-1])
        room = max(shutil.get_terminal_size().columns - used, 12)
    for r in rows:
        cells = list(r)
        if room is not None and len(cells[-1]) > room:
            cells[-1] = cells[-1][: room - 1] + "…"
        line = indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        print(line.rstrip(), file=out)


async def cmd_inspect(args: argparse.Namespace) -> int:
    async with Client(settings=settings_of(args)) as c:
        info = await c.inspect(args.agent_id)
    print(json.dumps(info.model_dump(mode="json"), indent=2))
    return 0


async def cmd_audit(args: argparse.Namespace) -> int:
    async with Client(settings=settings_of(args)) as c:
        events = await c.audit(
            request_id=args.request_id,
            agent_id=args.agent,
            trace_id=args.trace_id,
            task_id=args.task_id,
            namespace=args.namespace,
            since=args.since,
            limit=args.limit,
        )
    if args.json:
        print(json.dumps(events, indent=2))
        return 0
    for ev in events:
        ts = time.strftime("%H:%M:%S", time.localtime(ev.get("ts", 0)))
        rest = {k: v for k, v in ev.items() if k not in ("ts", "kind", "seq", "hub_id")}
        if ev.get("kind") in ("admin", "cancel"):
            # Who and why last; no requester: open mode, no identity the hub could name.
            rest["requester"] = rest.pop("requester", "anonymous")
            if "reason" in rest:
                rest["reason"] = rest.pop("reason")
        print(
            f"{ts} #{ev.get('seq')} {ev.get('kind', '?'):<10} {ev.get('hub_id', '')}  "
            + " ".join(f"{k}={_field(v)}" for k, v in rest.items())
        )
    if not events:
        print("(no matching audit events)")
    return 0


def _field(value: Any) -> str:
    """An audit field's value: text that holds spaces, quotes or ``=`` (a reason) quoted as
    JSON, so that where one field ends stays plain."""
    if isinstance(value, str) and (not value or any(c.isspace() or c in '"=' for c in value)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


#: Pages of agents one snapshot reads at most (each as many agents as one NATS message holds:
#: ~2,500 at 1 MiB).
SNAPSHOT_PAGES = 100


async def cmd_snapshot(args: argparse.Namespace) -> int:
    seen: dict[str, AgentInfo] = {}
    async with Client(settings=settings_of(args)) as c:
        # Page by page: one answer holds what fits in one NATS message. Each page is asked
        # after the last agent id of the one before: an agent there all along is in one page
        # whoever came or went meanwhile; ``total`` is the first page's count.
        first = page = await c.agents(all_namespaces=True)
        for _ in range(SNAPSHOT_PAGES):
            for info in page:
                seen.setdefault(info.agent_id, info)
            if page.next_after is None:
                break
            page = await c.agents(all_namespaces=True, after=page.next_after)
    infos = sorted(seen.values(), key=lambda i: i.agent_id)
    by_state: dict[str, int] = {}
    for info in infos:
        by_state[info.state.value] = by_state.get(info.state.value, 0) + 1
    snap = {
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "by_state": by_state,
        "total": first.total,
        "truncated": page.next_after is not None,
        "agents": [i.model_dump(mode="json") for i in infos],
    }
    text = json.dumps(snap, indent=2)
    if args.output:
        try:
            await asyncio.to_thread(Path(args.output).write_text, text + "\n")
        except OSError as err:
            raise BadRequestError(
                f"cannot write {args.output}: {err.strerror or err}", field="output"
            ) from err
        print(f"wrote {len(infos)} agents to {args.output}")
    else:
        print(text)
    if snap["truncated"]:
        print(
            f"snapshot cut: {len(infos)} of {first.total} agents in {SNAPSHOT_PAGES} pages",
            file=sys.stderr,
        )
    return 0


async def cmd_tools(args: argparse.Namespace) -> int:
    async with Client(settings=settings_of(args), namespace=args.namespace) as c:
        infos = await c.agents(all_namespaces=args.namespace is None)
    if infos.truncated:
        print(f"tools of the agents shown: {_cut(infos)}", file=sys.stderr)
    menu: dict[str, list[str]] = {}
    described: dict[str, str] = {}
    for info in infos:
        for tool in info.tools:
            menu.setdefault(tool.name, []).append(info.agent_id)
            described[tool.name] = tool.description
    if args.json:
        listing = [
            {"tool": name, "description": described[name], "agents": menu[name]}
            for name in sorted(menu)
        ]
        print(json.dumps(listing, indent=2))
        return 0
    rows = [("TOOL", "DESCRIPTION", "AGENTS")]
    rows += [(name, cell(described[name], 60), ", ".join(menu[name])) for name in sorted(menu)]
    if menu:
        print_table(rows)
    else:
        print("(no tools)")
    return 0


async def cmd_admin(args: argparse.Namespace) -> int:
    async with Client(settings=settings_of(args)) as c:
        out = await c.admin(args.command, args.agent_id, reason=args.reason)
    print(json.dumps(out))
    return 0


def add_admin_commands(cmd: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The operator actions on one agent (``cordon``, ``uncordon``, ``quarantine``,
    ``release``, ``remove``), each with what it does and for how long."""
    # What each does and for how long (docs/operations.md, "Dashboard"), and who may.
    for op, text, more in (
        (
            "cordon",
            "stop routing new work to an agent, until uncordon",
            "Work it holds runs on. Kept by agent id (the reach_cordons bucket: every hub "
            "follows, hubs started later too): it stays cordoned through its restarts, a clean "
            "stop, remove or LOST, until uncordon. From its next heartbeat the agent itself "
            "refuses new tasks, also those a caller sends it directly.",
        ),
        (
            "uncordon",
            "route new work to a cordoned agent again",
            "Every hub follows. Also for an agent not registered now (its cordon is lifted).",
        ),
        (
            "quarantine",
            "open the agent's circuit breaker on every hub: no new work for "
            "breaker_open_timeout (30 s by default), then one probe task",
            "A probe that succeeds closes the breaker, one that fails opens it for another "
            "breaker_open_timeout. Held by the running hubs only (a hub started later does "
            "not know it); release ends it at once.",
        ),
        ("release", "close the agent's circuit breaker on every hub now", "Ends a quarantine."),
        (
            "remove",
            "force-remove an agent from the registry (a live agent re-registers at its next "
            "heartbeat: stop it first)",
            "Its registration is deleted from every hub.",
        ),
    ):
        sp = cmd(op, text)
        sp.description = (
            f"{text[0].upper()}{text[1:]}. {more} Audited (reach-mesh audit: kind admin) with "
            "--reason and who asked. In secure mode it needs the operator identity "
            "(REACH_CONFIG=<auth dir>/operator.admin.yaml)."
        )
        sp.add_argument("agent_id", help="namespace.service.instance, e.g. demo.calc.c1")
        sp.add_argument(
            "--reason",
            metavar="TEXT",
            help=f"why (at most {protocol.REASON_MAX} printable characters; kept in the audit)",
        )
        sp.set_defaults(func=cmd_admin)
