"""``reach-mesh``: run the mesh, talk to it, inspect it.

Every command that talks to a mesh takes ``--nats URL`` (default: ``$REACH_NATS_URL``).
``up`` and ``demo`` start an embedded nats-server unless given ``--nats``. An error is one
line on stderr (``--debug``: the traceback and the error's details) and an exit code that says
what kind it is: :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn, TextIO

from reach_mesh import __version__, _runner
from reach_mesh._auth import AuthDir
from reach_mesh._cli_doctor import cmd_doctor
from reach_mesh._cli_fleet import (
    add_admin_commands,
    cmd_agents,
    cmd_audit,
    cmd_hubs,
    cmd_inspect,
    cmd_snapshot,
    cmd_tools,
    print_table,
    settings_of,
)
from reach_mesh._cli_serve import (
    DEFAULT_NATS_PORT,
    cmd_agent,
    cmd_demo,
    cmd_hub,
    cmd_up,
)
from reach_mesh._cli_workflows import _within, add_workflow_commands
from reach_mesh.client import Client
from reach_mesh.errors import (
    AgentBusyError,
    BadRequestError,
    MeshTimeoutError,
    MeshUnavailableError,
    NoHandlerError,
    NoMatchError,
    NotPermittedError,
    ReachError,
    ThrottledError,
    UnknownAgentError,
    UnknownNamespaceError,
    UnknownWorkflowError,
)
from reach_mesh.hub.strategies import STRATEGIES
from reach_mesh.logs import configure_logging
from reach_mesh.models import RouteDecision
from reach_mesh.tracing import configure_tracing

if TYPE_CHECKING:
    pass

__all__ = ["main"]


#: The exit codes of every command (README.md, "Running a mesh"; docs/operations.md, "Operator
#: CLI").
#: ``audit --since`` at most (ten years: the stream's own age limit, ``audit_max_age``, is
#: the operator's to set) and ``--limit`` at most.
_AUDIT_SINCE_MAX: Final = 10 * 365 * 86400.0
_AUDIT_LIMIT_MAX: Final = 100_000

EXIT_OK: Final = 0
#: The task or workflow did not succeed (its result says why), or an error listed nowhere below.
EXIT_FAILED: Final = 1
#: Usage or bad input: argparse's own errors, ``REACH_BAD_*`` and every other ``BadRequestError``.
EXIT_USAGE: Final = 2
#: Unavailable or transient: worth trying again later.
EXIT_UNAVAILABLE: Final = 3
#: Nothing of that name, or nothing matches.
EXIT_NOT_FOUND: Final = 4
#: No answer in time: the outcome is unknown (the task may still run, or have run).
EXIT_TIMEOUT: Final = 5

_EXIT_BY_CODE: Final[Mapping[str, int]] = {
    MeshUnavailableError.code: EXIT_UNAVAILABLE,
    ThrottledError.code: EXIT_UNAVAILABLE,
    AgentBusyError.code: EXIT_UNAVAILABLE,
    NoMatchError.code: EXIT_NOT_FOUND,
    UnknownNamespaceError.code: EXIT_NOT_FOUND,
    UnknownAgentError.code: EXIT_NOT_FOUND,
    UnknownWorkflowError.code: EXIT_NOT_FOUND,
    NoHandlerError.code: EXIT_NOT_FOUND,
    MeshTimeoutError.code: EXIT_TIMEOUT,
    NotPermittedError.code: EXIT_USAGE,
}

EXIT_CODES: Final = f"""\
exit codes:
  {EXIT_OK}  ok
  {EXIT_FAILED}  the task or workflow did not succeed (its result says why), or an
     error not listed below
  {EXIT_USAGE}  usage or bad input: a wrong option or argument, REACH_BAD_* (a bad
     setting, selector, payload, ...), REACH_NOT_PERMITTED (NATS refused this identity)
  {EXIT_UNAVAILABLE}  unavailable, try again later: REACH_UNAVAILABLE (NATS unreachable, no
     hub answers; `hubs` when none does), REACH_THROTTLED, REACH_AGENT_BUSY
  {EXIT_NOT_FOUND}  not found: REACH_NO_MATCH (REACH_UNKNOWN_NAMESPACE), REACH_UNKNOWN_AGENT,
     REACH_UNKNOWN_WORKFLOW, REACH_NO_HANDLER
  {EXIT_TIMEOUT}  no answer in time, the outcome is unknown: REACH_TIMEOUT
"""


def exit_code(err: BaseException) -> int:
    """The exit code for an error that ended a command (:data:`EXIT_CODES`)."""
    if isinstance(err, BadRequestError):
        return EXIT_USAGE
    if isinstance(err, ReachError):
        return _EXIT_BY_CODE.get(err.code, EXIT_FAILED)
    return EXIT_FAILED


# ---------------------------------------------------------------------------- commands


def _payload(given: str | None) -> Any:
    """``--payload``: JSON text, ``@FILE`` (read from the file: a payload past the shell's
    argument limit, ~128 KiB) or ``-`` (read from stdin). Neither can start JSON text."""
    if not given:
        return None
    named = "--payload"
    text = given
    if given == "-" or given.startswith("@"):
        named = "stdin" if given == "-" else f"--payload file {given[1:]}"
        try:
            text = sys.stdin.read() if given == "-" else Path(given[1:]).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise BadRequestError(f"cannot read {named}: {err}") from err
    try:
        return json.loads(text)
    except ValueError as err:
        raise BadRequestError(f"{named} is not valid JSON: {err}") from err


async def cmd_reach(args: argparse.Namespace) -> int:
    if not (args.agent or args.selector or args.capability):
        raise BadRequestError("reach needs a target: --agent, --capability or --selector")
    payload = _payload(args.payload)
    # A dry run prints its decision table; otherwise stdout is the JSON answer alone.
    table_to = sys.stdout if args.dry_run else sys.stderr
    with _explained(args.dry_run or args.show_decision, table_to):
        async with Client(settings=settings_of(args), namespace=args.namespace) as c:
            if args.dry_run:
                decision = await c.route(
                    agent_id=args.agent,
                    capability=args.capability,
                    selector=args.selector,
                    strategy=args.strategy,
                    session_id=args.session,
                )
                print_decision(decision, file=table_to)
                return 0
            res = await c.request(
                agent_id=args.agent,
                capability=args.capability,
                selector=args.selector,
                payload=payload,
                timeout=args.timeout,
                strategy=args.strategy,
                session_id=args.session,
                explain=args.show_decision,
                mode=args.mode,
            )
    out: dict[str, Any] = {
        "state": res.state.value,
        "agent_id": res.agent_id,
        "task_id": res.task_id,
        "attempt": res.attempt,
        "result": res.result,
        "error": None if res.error is None else res.error.to_wire()["error"],
        "duration_ms": round(res.duration * 1000, 3),
        "trace_id": res.trace_id,
    }
    if args.show_decision and res.decision is not None:
        # The table for a reader (stderr); stdout stays one JSON document, the decision in it.
        print_decision(res.decision, file=sys.stderr)
        out["decision"] = res.decision.model_dump(mode="json")
    print(json.dumps(out, indent=2))
    return 0 if res.ok else 1


@contextlib.contextmanager
def _explained(explain: bool, file: TextIO) -> Iterator[None]:
    """With ``explain``: a no-match (which carries the hub's decision) prints that decision —
    which filter removed each candidate — to ``file``, before its error line."""
    try:
        yield
    except NoMatchError as err:
        decision = err.details.get("decision")
        if explain and isinstance(decision, dict):
            with contextlib.suppress(ValueError):
                print_decision(RouteDecision.model_validate(decision), file=file)
        raise


def print_decision(d: RouteDecision, file: TextIO | None = None) -> None:
    """The explain output as a readable table, to ``file`` (default: stdout)."""
    out = sys.stdout if file is None else file
    print(f"request {d.request_id} on {d.hub_id}: {d.target}", file=out)
    print(
        f"  strategy {d.strategy}, sticky {d.sticky}, {len(d.candidates)} candidate(s), "
        f"decided in {d.elapsed_us:.0f} us",
        file=out,
    )
    rows = [("AGENT", "VERDICT", "DETAIL")]
    filtered = {f.agent_id: f.reason for f in d.filtered}
    for agent_id in d.candidates:
        if agent_id == d.chosen:
            rows.append((agent_id, "CHOSEN", f"score {d.scores.get(agent_id, 0):g}"))
        elif agent_id in filtered:
            rows.append((agent_id, "filtered", filtered[agent_id]))
        else:
            rows.append((agent_id, "candidate", f"score {d.scores.get(agent_id, 0):g}"))
    listed = set(d.candidates)
    rows += [(f.agent_id, "filtered", f.reason) for f in d.filtered if f.agent_id not in listed]
    print_table(rows, indent="  ", file=out)
    if d.fallback:
        print(f"  fallback: {d.fallback}", file=out)
    for what, near in (d.nearest or {}).items():
        if near:  # (an empty part says nothing: none is printed)
            print(f"  nearest, {what.replace('_', ' ')}: {json.dumps(near)}", file=out)


async def cmd_auth(args: argparse.Namespace) -> int:
    """``auth init DIR`` / ``auth add-agent ID`` / ``auth add-caller NS`` / ``auth add-operator
    NAME`` / ``auth add-hub NAME`` / ``auth revoke ROLE NAME`` (docs/security.md)."""
    # Only a URL given on this command line goes into the settings files, never
    # $REACH_NATS_URL: that is where this shell talks to, not where each identity will.
    nats_url = args.auth_nats or args.nats_flag
    auth = AuthDir(getattr(args, "init_dir", None) or args.dir, nats_url=nats_url)
    if args.auth_command == "init":
        issued = auth.init(namespace=args.namespace, host=args.host, port=args.port)
        print(f"server config: {auth.nats_conf} (includes {auth.auth_conf})")
    elif args.auth_command == "revoke":
        gone = auth.revoke(args.role, args.identity)
        print(
            f"revoked {gone.role} {gone.name} (public key {gone.public_key}) in "
            f"{auth.auth_conf}; its seed and settings files here are deleted. Copy auth.conf "
            "to every server and reload each (kill -HUP <pid>, or nats-server --signal "
            "reload=<pid>; `reach-mesh up --secure` reloads its own within seconds): "
            "connections that use it are cut off then, and refused from then on. To rotate "
            f"it instead: `reach-mesh auth add-{gone.role} {gone.name}` issues a new seed"
        )
        return 0
    else:
        role = args.auth_command.removeprefix("add-")
        if not auth.identities():
            # Not a directory `auth init` made (a forgotten --dir): a partial one here would
            # hold no hub and no server config, and `up --secure` on it fails later.
            raise BadRequestError(
                f"no identities issued in {auth.path}: run `reach-mesh auth init DIR` first, "
                f"and pass --dir DIR (or set REACH_AUTH_DIR) to add to it"
            )
        before = {(i.role, i.name) for i in auth.identities()}
        issued = [auth.add(role, args.identity)]
        done = f"added to {auth.auth_conf}"
        if (role, args.identity) in before:
            # (an add of an issued identity is how auth.conf is rewritten: say what it did)
            done = (
                f"{role} {args.identity} was issued already (its seed is unchanged; a new "
                f"one: auth revoke {role} {args.identity}, then add it again): rewrote "
                f"{auth.auth_conf} from identities.json"
            )
        print(
            f"{done}: reload each running server "
            "(kill -HUP <pid>, or nats-server --signal reload=<pid>; `reach-mesh up --secure` "
            "reloads its own within seconds)"
        )
    for ident in issued:
        where = auth.settings_file(ident.role, ident.name)
        print(f"  {ident.role:<8} {ident.name:<32} REACH_CONFIG={where}")
    return 0


# ---------------------------------------------------------------------------- parser


_TRACE_HELP = "span exporter (default: the OTEL_* environment; off when unset)"


#: Commands a new user tries first, from other tools, and the reach-mesh command for each.
_FAMILIAR: Final[Mapping[str, str]] = {
    "status": "doctor",
    "health": "doctor",
    "check": "doctor",
    "explain": "reach --dry-run",
    "route": "reach --dry-run",
    "send": "reach",
    "request": "reach",
    "call": "reach",
    "list": "agents",
    "ls": "agents",
    "fleet": "agents",
    "get": "inspect",
    "describe": "inspect",
    "logs": "audit",
    "events": "audit",
    "server": "up",
    "start": "up",
    "run": "up",
}
_INVALID_COMMAND: Final = re.compile(r"argument COMMAND: invalid choice: '([^']*)'")


class _Parser(argparse.ArgumentParser):
    """The top-level parser: an unknown command also says which one was meant."""

    def error(self, message: str) -> NoReturn:
        wrong = _INVALID_COMMAND.search(message)
        if wrong is not None:
            given = wrong.group(1).lower()
            meant = _FAMILIAR.get(given)
            if meant is None:  # a typo, of a command or of a familiar name
                close = difflib.get_close_matches(given, [*_commands(self), *_FAMILIAR], n=1)
                meant = _FAMILIAR.get(close[0], close[0]) if close else None
            if meant is not None:
                message = f"unknown command {wrong.group(1)!r}: did you mean `reach-mesh {meant}`?"
            else:
                message += " (reach-mesh --help says what each does)"
        elif "required: COMMAND" in message:
            # `reach-mesh` alone: the commands, as --help lists them, rather than a bare
            # "required" (a first-time user types the name to see what it does).
            self.print_help(sys.stderr)
            self.exit(2, "\nreach-mesh: a COMMAND is needed: start with `reach-mesh up --demo`\n")
        super().error(message)


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def build_parser() -> argparse.ArgumentParser:
    # Global options may come before or after the subcommand (`reach-mesh --nats URL agents`):
    # both parsers have them, and SUPPRESS keeps a subcommand from resetting what came before.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--nats",
        default=argparse.SUPPRESS,
        help="NATS URL(s), comma separated (default: $REACH_NATS_URL; up and demo start an "
        "embedded server instead)",
    )
    common.add_argument(
        "--config", default=argparse.SUPPRESS, help="YAML settings file (default: $REACH_CONFIG)"
    )
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        help="DEBUG, INFO, WARNING (default), ERROR (default: $REACH_LOG_LEVEL)",
    )
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the traceback of an error (normally one line)",
    )
    p = _Parser(
        prog="reach-mesh",
        description="Run the mesh, talk to it, inspect it.\n"
        "`reach-mesh COMMAND --help`: one command's options.",
        parents=[common],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"reach-mesh {__version__}")
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=argparse.ArgumentParser
    )

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help, description=help, parents=[common])
        command.set_defaults(_parser=command)  # (its usage for an unrecognized argument)
        return command

    up = cmd(
        "up", "run the mesh until Ctrl-C: an embedded NATS unless --nats (not $REACH_NATS_URL)"
    )
    up.add_argument("--demo", action="store_true", help="also run the demo agents (demo.*)")
    up.add_argument("--hubs", type=int, default=1, help="hub instances to run (default 1)")
    up.add_argument(
        "--nats-port",
        type=_within(int, -1, 65535),
        default=DEFAULT_NATS_PORT,
        help=f"embedded NATS port (default {DEFAULT_NATS_PORT}, a free one if busy; -1 = any); "
        "JetStream is kept between runs in $REACH_STATE_DIR (~/.local/state/reach-mesh)",
    )
    up.add_argument(
        "--http-port",
        type=_within(int, -1, 65535),
        default=0,
        help="first hub's HTTP port for /metrics, REST, dashboard (0 = any free port; -1 = off)",
    )
    up.add_argument("--data-dir", help="JetStream store dir for the embedded server")
    up.add_argument("--trace", choices=["none", "console", "otlp"], default=None, help=_TRACE_HELP)
    up.add_argument(
        "--secure",
        metavar="DIR",
        help="enforce the identities of `reach-mesh auth init DIR` (default: open dev mode)",
    )
    up.add_argument("--hub-name", default="main", help="hub identity in the --secure DIR")
    up.set_defaults(func=cmd_up)

    auth = sub.add_parser("auth", help="NATS identities and permissions for a secure mesh")
    auth.set_defaults(func=cmd_auth)
    auth_sub = auth.add_subparsers(dest="auth_command", required=True)

    def auth_cmd(name: str, help: str) -> argparse.ArgumentParser:
        sp = auth_sub.add_parser(name, help=help, description=help)
        sp.set_defaults(_parser=sp)  # (its usage for an unrecognized argument)
        sp.add_argument(
            "--dir",
            default=os.environ.get("REACH_AUTH_DIR", "reach-auth"),
            help="auth directory (default: $REACH_AUTH_DIR or ./reach-auth)",
        )
        sp.add_argument(
            "--nats",
            dest="auth_nats",
            default=None,
            help="NATS URL written into the settings files (default: none; not $REACH_NATS_URL)",
        )
        return sp

    init = auth_cmd("init", "server config + credentials for a hub, an operator and a caller")
    init.add_argument("init_dir", nargs="?", metavar="DIR", help="auth directory (or --dir)")
    init.add_argument("--namespace", default="default", help="the caller's namespace")
    init.add_argument("--host", default="0.0.0.0", help="listen address in nats.conf")
    init.add_argument(
        "--port", type=_within(int, 0, 65535), default=4222, help="client port in nats.conf"
    )
    for role, what, metavar in (
        ("agent", "credentials for one agent id", "AGENT_ID"),
        ("caller", "credentials for a caller of one namespace", "NAMESPACE"),
        (
            "operator",
            "credentials for one operator (a person or a tool: the audit names it as the "
            "requester of its actions)",
            "NAME",
        ),
        ("hub", "credentials for one more hub instance", "NAME"),
    ):
        auth_cmd(f"add-{role}", what).add_argument("identity", metavar=metavar)
    revoke = auth_cmd(
        "revoke",
        "take an identity out of auth.conf and delete its seed and settings files: the "
        "servers refuse it from their next reload (add it again for a new seed: a rotation)",
    )
    revoke.add_argument("role", choices=("agent", "caller", "operator", "hub"))
    revoke.add_argument("identity", metavar="NAME", help="agent id, namespace or name")

    hub = cmd("hub", "run one hub instance against an existing NATS")
    hub.add_argument(
        "--http-port",
        type=_within(int, 0, 65535),
        default=None,
        help="HTTP port for /metrics, REST, dashboard ($REACH_HTTP_PORT; 0 = any; default off)",
    )
    hub.add_argument("--trace", choices=["none", "console", "otlp"], default=None, help=_TRACE_HELP)
    hub.set_defaults(func=cmd_hub)

    agent = cmd("agent", "run the Agent(s) named by module:attribute until SIGTERM/Ctrl-C")
    agent.add_argument(
        "target",
        help="module:attribute — an Agent, a list of Agents, or a function of no arguments "
        "returning either (e.g. myagents:agent, reach_mesh.demo:demo_agents)",
    )
    agent.add_argument(
        "--metrics-port",
        type=_within(int, 0, 65535),
        default=None,
        metavar="PORT",
        help="serve each agent's Prometheus /metrics and readiness /healthz: the first on "
        "PORT, the next on PORT+1, ... (0 = any free port; default off)",
    )
    agent.add_argument(
        "--metrics-host", default="127.0.0.1", help="address for --metrics-port (default loopback)"
    )
    agent.set_defaults(func=cmd_agent)

    demo = cmd("demo", "start a hub and three demo agents, send tasks, print results")
    demo.add_argument(
        "--trace", choices=["none", "console", "otlp"], default=None, help=_TRACE_HELP
    )
    demo.set_defaults(func=cmd_demo)

    agents = cmd("agents", "list agents of every namespace: state, load, lease, capabilities")
    agents.add_argument("--namespace", default=None, help="only this namespace")
    agents.add_argument("--all", action="store_true", help=argparse.SUPPRESS)  # the default now
    agents.add_argument("--json", action="store_true", help="print JSON")
    agents.add_argument(
        "--state",
        action="append",
        metavar="STATE",
        help="only agents in this state (ONLINE, SUSPECT, ...; repeat for several)",
    )
    agents.add_argument("--capability", metavar="CAP", help="only agents serving this capability")
    agents.add_argument(
        "--attention",
        action="store_true",
        help="only agents that need an operator's look (late heartbeats, breaker not closed, "
        "low health, capabilities down, saturated, unreached), with why",
    )
    agents.add_argument(
        "--limit", type=int, metavar="N", help="at most N agents (default: as many as fit)"
    )
    agents.add_argument(
        "--offset",
        type=int,
        default=0,
        metavar="K",
        help="skip the first K matching agents (in agent id order)",
    )
    agents.add_argument(
        "--after",
        metavar="AGENT_ID",
        help="only agents whose id sorts after AGENT_ID: the next page, from the last one shown",
    )
    agents.add_argument(
        "--via-micro",
        action="store_true",
        help="discover the hubs by NATS micro ($SRV.INFO.reach-hub) and list what each knows",
    )
    agents.set_defaults(func=cmd_agents)

    hubs = cmd("hubs", "list the live hubs (NATS micro discovery): id, version, HTTP, agents known")
    hubs.add_argument("--json", action="store_true", help="print JSON")
    hubs.set_defaults(func=cmd_hubs)

    doctor = cmd(
        "doctor",
        "check the mesh and say what to do: NATS, security mode, JetStream and every stream "
        "(replicas, leader, space), the workflow queue, hubs, agents; exit 1 if a check fails",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(func=cmd_doctor)

    inspect = cmd("inspect", "one agent in detail")
    inspect.add_argument("agent_id", help="namespace.service.instance, e.g. demo.calc.c1")
    inspect.set_defaults(func=cmd_inspect)

    reach = cmd("reach", "send one task through the mesh and print the result")
    target = reach.add_mutually_exclusive_group()
    target.add_argument("--agent", help="agent id (its namespace is the id's first segment)")
    target.add_argument("--selector", help="e.g. 'cap=email:send:v1 AND region=eu'")
    reach.add_argument("--capability", help="capability (alone, or the handler with --agent)")
    reach.add_argument("--payload", help="JSON payload; @FILE: read from FILE; -: read from stdin")
    reach.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the result (default: request_timeout, 30)",
    )
    reach.add_argument(
        "--strategy",
        choices=list(STRATEGIES),
        default=None,
        metavar="NAME",
        help=f"{', '.join(STRATEGIES)} (default: the hub's default_strategy)",
    )
    reach.add_argument("--session", default=None, help="sticky session id")
    reach.add_argument(
        "--mode",
        choices=["proxy", "direct"],
        default="proxy",
        help="proxy: through a hub; direct: the hub decides, the client sends (default proxy)",
    )
    reach.add_argument(
        "--namespace",
        default=None,
        help="namespace of --capability/--selector (default: $REACH_NAMESPACE or 'default')",
    )
    reach.add_argument("--show-decision", action="store_true", help="print the routing decision")
    reach.add_argument("--dry-run", action="store_true", help="decide only, send nothing")
    reach.set_defaults(func=cmd_reach)

    audit = cmd("audit", "show audit events: routing decisions, registrations, state changes")
    audit.add_argument("--request-id", help="one routing decision")
    audit.add_argument("--agent", help="events about one agent")
    audit.add_argument("--trace-id", help="events of one trace")
    audit.add_argument("--task-id", help="events of one task")
    audit.add_argument("--namespace", help="only this namespace (default: every one)")
    audit.add_argument(
        "--since",
        type=_within(float, 0.0, _AUDIT_SINCE_MAX, low_open=True),
        default=3600.0,
        help="seconds back (default 1 h; the stream keeps audit_max_age, 7 days by default)",
    )
    audit.add_argument(
        "--limit",
        type=_within(int, 1, _AUDIT_LIMIT_MAX),
        default=1000,
        help=f"most events shown (default 1000, at most {_AUDIT_LIMIT_MAX})",
    )
    audit.add_argument("--json", action="store_true", help="print JSON")
    audit.set_defaults(func=cmd_audit)

    add_workflow_commands(cmd)

    snapshot = cmd("snapshot", "export the registry (states, health, heartbeat age) as JSON")
    snapshot.add_argument("-o", "--output", help="file to write (default: stdout)")
    snapshot.set_defaults(func=cmd_snapshot)

    tools = cmd("tools", "the mesh's tool menu: tools offered by live agents")
    tools.add_argument("--namespace", help="only this namespace (default: every one)")
    tools.add_argument("--json", action="store_true", help="print JSON")
    tools.set_defaults(func=cmd_tools)

    add_admin_commands(cmd)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Said by the command's own parser (its usage, not the top level's), with the likely
        # cause: a reason of several words not quoted.
        command = getattr(args, "_parser", parser)
        hint = ""
        if getattr(args, "reason", None) is not None:
            hint = f" (a reason of several words goes in quotes: --reason '{args.reason} ...')"
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    args.nats_flag = getattr(args, "nats", None)
    args.nats = args.nats_flag or os.environ.get("REACH_NATS_URL")
    args.config = getattr(args, "config", None)
    args.debug = getattr(args, "debug", False)
    level = getattr(args, "log_level", None) or os.environ.get("REACH_LOG_LEVEL", "WARNING")
    try:
        configure_logging(level)
    except ValueError:
        source = "--log-level" if getattr(args, "log_level", None) else "$REACH_LOG_LEVEL"
        _print_error(
            BadRequestError(
                f"unknown log level {level!r} ({source}): use DEBUG, INFO, WARNING or ERROR",
                field="log_level",
            ),
            details=False,
        )
        return EXIT_USAGE
    provider = None
    try:
        # --trace wins; without it the standard OTEL_* environment decides (off when unset).
        # The agents of `reach-mesh agent` set tracing up themselves, named for their service.
        if args.command != "agent":
            provider = configure_tracing(
                f"reach-mesh-{args.command}", exporter=getattr(args, "trace", None)
            )
        code: int = _runner.run(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `reach-mesh ... | head`: the reader left; say nothing more, like other CLI tools.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # one line for the user; the traceback with --debug only
        if args.debug:
            traceback.print_exc()
        _print_error(err, details=args.debug)
        if _prints_json(args):
            # Where a script reads the answer: the error as the wire says it.
            wire = (
                err if isinstance(err, ReachError) else ReachError(f"{type(err).__name__}: {err}")
            )
            body = wire.to_wire()
            with contextlib.suppress(OSError):
                print(json.dumps(body))
        return exit_code(err)
    finally:
        if provider is not None:
            provider.shutdown()  # flush batched spans before the process exits
    return code


def _prints_json(args: argparse.Namespace) -> bool:
    """Whether the command's answer is JSON on stdout: ``--json``, and ``reach`` (but for a
    ``--dry-run``, which prints its decision table)."""
    if getattr(args, "json", False):
        return True
    return bool(args.command == "reach" and not getattr(args, "dry_run", False))


def _print_error(err: Exception, *, details: bool) -> None:
    if isinstance(err, ReachError):
        print(f"error {err.code}: {err.message}", file=sys.stderr)
        if details and err.details:
            print(json.dumps(err.details, indent=2, default=str), file=sys.stderr)
    else:
        print(
            f"error: {err or type(err).__name__} ({type(err).__name__}; --debug shows where)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
