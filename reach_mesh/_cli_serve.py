"""The ``reach-mesh`` commands that serve: ``up`` (an embedded nats-server, hubs, the demo's
agents), ``hub``, ``agent`` (the agents a ``module:attribute`` names) and ``demo``; each runs
until a signal (``demo``: until it is done)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import importlib
import inspect
import os
import secrets
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Final

from reach_mesh import _runner
from reach_mesh._auth import AuthDir
from reach_mesh._cli_fleet import settings_of
from reach_mesh._nats import shown
from reach_mesh.errors import BadRequestError
from reach_mesh.server import EmbeddedNats

if TYPE_CHECKING:
    from reach_mesh.hub import Hub

__all__ = [
    "DEFAULT_NATS_PORT",
    "DEMO_NEXT",
    "cmd_agent",
    "cmd_demo",
    "cmd_hub",
    "cmd_up",
    "load_agents",
]


#: The demo's last line when it ran its own server: where the commands it printed work.
DEMO_NEXT: Final = (
    "the demo's mesh stopped with it: to try those commands, run `reach-mesh up --demo` in "
    'another terminal and export the REACH_NATS_URL it prints (README, "Running a mesh")'
)

#: ``up`` listens here unless told otherwise, so a restart comes back on the same URL and the
#: agents and hubs still connected to the last run reconnect by themselves.
DEFAULT_NATS_PORT = 4222


@contextlib.asynccontextmanager
async def _nats(args: argparse.Namespace) -> AsyncIterator[tuple[str, str | None]]:
    """The URL given with ``--nats``, else an embedded server for this run (with the identities
    of ``--secure DIR``, when given); and the directory that keeps the embedded server's
    JetStream for the next run on its port (``None``: a temporary one, or no embedded server).

    ``$REACH_NATS_URL`` is not read here: the README has users export the URL ``up`` prints,
    and ``up`` in that same shell must start its server again, not look for itself."""
    url = args.nats_flag
    if url:
        yield url, None
        return
    secure = getattr(args, "secure", None)
    auth = AuthDir(secure).auth_conf if secure else None
    if auth is not None and not auth.exists():
        raise BadRequestError(f"{auth} not found: run `reach-mesh auth init {secure}` first")
    if secure:
        AuthDir(secure).rewrite()  # this version's permissions for the identities issued
    port = getattr(args, "nats_port", None)
    data_dir = getattr(args, "data_dir", None)
    if port is not None and port > 0 and not _port_free(port):
        print(f"NATS port {port} is in use: using a free port instead", file=sys.stderr)
        port = -1
    elif port is not None and port > 0 and data_dir is None:
        data_dir = _state_dir(port)
    server = EmbeddedNats(data_dir, port=port if port is not None else -1, auth_config=auth)
    await server.astart()
    watching = None
    if auth is not None:
        watching = asyncio.create_task(_reload_on_change(server, auth.read_bytes))
    try:
        yield server.url, data_dir if port is not None and port > 0 else None
    finally:
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        await asyncio.to_thread(server.stop)


#: How often ``up --secure`` looks at its auth.conf for identities added since it started.
AUTH_POLL: Final = 1.0


async def _reload_on_change(server: EmbeddedNats, read: Callable[[], bytes]) -> None:
    """Reload ``server`` when the auth.conf ``read`` returns changes (``reach-mesh auth
    add-agent`` and the others rewrite it), once the file reads the same twice in a row:
    ``reach-mesh auth`` replaces it whole (a rename), but a hand edit or a copy may write it
    in place, and a reload of a half-written file would fail.

    ``read`` runs in a thread: auth.conf grows ~1.6 kB an agent identity (16 MB for 10k), and
    up's hubs share this event loop. A file gone or unreadable is said once (the server keeps
    the identities it loaded; a reload now would find no file) and read again each second."""
    loaded = last = await _read_auth(read, say=True)
    while True:
        await asyncio.sleep(AUTH_POLL)
        now = await _read_auth(read, say=last is not None)
        if now is None:
            last = None
            continue
        if now == last and now != loaded:
            with contextlib.suppress(OSError, RuntimeError):  # (a server gone: up is ending)
                await asyncio.to_thread(server.reload)
                loaded = now
                print(
                    "auth.conf changed: nats-server asked to reload it (a config it cannot read "
                    f"is refused, the old one kept: {server.store_dir / 'nats.log'} says why)",
                    file=sys.stderr,
                    flush=True,
                )
        last = now


async def _read_auth(read: Callable[[], bytes], *, say: bool) -> bytes | None:
    """auth.conf's bytes (in a thread), or ``None`` when it cannot be read, which is said when
    ``say`` (it read the time before: once per disappearance, not once a second)."""
    try:
        return await asyncio.to_thread(read)
    except OSError as err:
        if say:
            print(
                f"auth.conf cannot be read ({err.strerror or err}): nats-server keeps the "
                "identities it loaded; up reloads it once the file reads again, changed",
                file=sys.stderr,
                flush=True,
            )
        return None


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the server will bind: connections of the last run in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _state_dir(port: int) -> str:
    """Where ``up`` keeps JetStream between runs: ``$REACH_STATE_DIR``, else
    ``$XDG_STATE_HOME/reach-mesh`` (``~/.local/state/reach-mesh``), one directory per port."""
    base = os.environ.get("REACH_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "reach-mesh"
    )
    path = os.path.join(base, f"nats-{port}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return tempfile.mkdtemp(prefix="reach-nats-")
    return path


async def _until_signal() -> None:
    _runner.settle()  # started: what exists now stays for the life of the process
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def cmd_up(args: argparse.Namespace) -> int:
    from reach_mesh.hub import Hub

    if args.secure and args.demo:
        raise BadRequestError(
            "--demo runs agents without identities, which --secure refuses: "
            "give each agent its own with `reach-mesh auth add-agent ID` instead"
        )
    async with _nats(args) as (url, kept), contextlib.AsyncExitStack() as stack:
        made_token = False
        if args.secure:  # the hubs connect as the hub identity of the auth directory
            settings = AuthDir(args.secure).settings("hub", args.hub_name, nats_url=url)
            if settings.http_token is None and args.http_port >= 0:
                # With a NATS identity the HTTP API stays closed without a token: one for this
                # run, printed below (in the dashboard's address) for the operator only.
                settings = settings.model_copy(update={"http_token": secrets.token_urlsafe(24)})
                made_token = True
        else:
            settings = settings_of(args, nats_url=url)
        for i in range(args.hubs):
            port = None if args.http_port < 0 else (args.http_port if i == 0 else 0)
            hub = Hub(settings=settings.model_copy(update={"http_port": port}))
            await _start_hub(stack, hub, port)
            line = f"  hub {hub.hub_id}"
            if hub.http_url:
                page = f"{hub.http_url}/" + (f"#token={settings.http_token}" if made_token else "")
                line += f": dashboard {page}, metrics {hub.http_url}/metrics"
            print(line, flush=True)
        if args.demo:
            from reach_mesh.demo import demo_agents

            agents = demo_agents(settings)
            for agent in agents:
                await agent.start()
                stack.push_async_callback(agent.close)
            print("  agents " + ", ".join(a.agent_id for a in agents), flush=True)
        print(f"reach-mesh up: NATS {url}; Ctrl-C stops it", flush=True)
        print(f"export REACH_NATS_URL={url}", flush=True)
        if args.secure:
            op = AuthDir(args.secure).settings_file("operator", "admin")
            print(f"  secure: each process needs REACH_CONFIG=<identity>.yaml, e.g. {op}")
        await _until_signal()
    if kept is not None:
        # Stopped mid-workflow, a new user asks what became of the work: it is in JetStream.
        print(
            f"reach-mesh up: stopped; JetStream kept in {kept}: when up runs again on port "
            f"{args.nats_port}, unfinished workflows go on and agents still running reconnect",
            flush=True,
        )
    return 0


async def _start_hub(stack: contextlib.AsyncExitStack, hub: Hub, port: int | None) -> None:
    """Start ``hub`` (closed by ``stack``); a busy HTTP port is one clear error."""
    try:
        await hub.start()
    except OSError as err:
        with contextlib.suppress(Exception):
            await hub.close()
        if err.errno == errno.EADDRINUSE:
            raise BadRequestError(
                f"HTTP port {port} is already in use: pick another --http-port "
                "(0 = any free port), or none (up: --http-port -1; hub: leave it out)"
            ) from err
        raise
    stack.push_async_callback(hub.close)


async def cmd_hub(args: argparse.Namespace) -> int:
    from reach_mesh.hub import Hub

    settings = settings_of(args, http_port=args.http_port)
    async with contextlib.AsyncExitStack() as stack:
        hub = Hub(settings=settings)
        await _start_hub(stack, hub, settings.http_port)
        print(f"hub {hub.hub_id} serving on {shown(settings.nats_url)}", flush=True)
        if hub.http_url:
            print(f"  metrics {hub.http_url}/metrics, dashboard {hub.http_url}/", flush=True)
        else:
            print("  HTTP off: --http-port N for /metrics, the dashboard and the API", flush=True)
        await _until_signal()
    return 0


def load_agents(spec: str) -> list[Any]:
    """``module:attr`` → the Agent(s) it names: an ``Agent``, a list of them, or a function
    returning either (called with no arguments)."""
    from reach_mesh.agent import Agent

    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise BadRequestError(f"expected module:attribute, got {spec!r}")
    if not attr and module_name.endswith(".py"):
        # `reach-mesh agent myagents.py`: the module that file is, asked for its Agents below.
        module_name = _dotted(module_name)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError) as err:  # TypeError: a relative name, "./myagents"
        hint = ""
        if module_name.endswith(".py") or "/" in module_name or module_name.startswith("."):
            hint = f" (a module name, not a file: {_dotted(module_name)}:{attr or '<attribute>'})"
        if not attr:
            raise BadRequestError(f"expected module:attribute, got {spec!r}{hint}") from err
        raise BadRequestError(f"cannot import {module_name!r}: {err}{hint}") from err
    if not attr or not hasattr(module, attr):
        # `reach-mesh agent myagents` or a misspelled attribute: name what the module holds.
        named = _agents_in(module)
        hint = f"; did you mean {module_name}:{named[0]}?" if len(named) == 1 else ""
        if len(named) > 1:
            hint = "; its Agents: " + ", ".join(f"{module_name}:{n}" for n in named)
        if not attr:
            raise BadRequestError(f"expected module:attribute, got {spec!r}{hint}")
        if not named:
            hint = " (nor any Agent, list of Agents or function at module level)"
        raise BadRequestError(f"{module_name!r} has no attribute {attr!r}{hint}")
    obj = getattr(module, attr)
    if callable(obj) and not isinstance(obj, Agent):
        try:
            inspect.signature(obj).bind()
        except TypeError as err:
            raise BadRequestError(
                f"{spec!r} is a function that cannot be called without arguments ({err}): "
                "name an Agent, a list of Agents, or a function of no arguments"
            ) from err
        except ValueError:
            pass  # (no signature to read, a builtin: called as it is)
        obj = obj()  # what it raises is its own error, with its traceback
    agents = list(obj) if isinstance(obj, list | tuple) else [obj]
    if not agents or not all(isinstance(a, Agent) for a in agents):
        raise BadRequestError(f"{spec!r} is not an Agent or a list of Agents")
    return agents


def _dotted(path: str) -> str:
    """The module name a file path given for one most likely means (``./pkg/mod.py``)."""
    return path.removesuffix(".py").removeprefix("./").replace("/", ".")


def _agents_in(module: Any) -> list[str]:
    """The names in ``module`` that ``reach-mesh agent module:NAME`` could mean: its
    ``Agent`` objects and lists of them, else its public functions of no arguments."""
    from reach_mesh.agent import Agent

    names = sorted(n for n in vars(module) if not n.startswith("_"))
    agents = [
        n
        for n in names
        if isinstance(obj := getattr(module, n), Agent)
        or (isinstance(obj, list | tuple) and obj and all(isinstance(a, Agent) for a in obj))
    ]
    if agents:
        return agents
    own = [
        n
        for n in names
        if inspect.isfunction(obj := getattr(module, n)) and obj.__module__ == module.__name__
    ]
    return [n for n in own if _takes_no_arguments(getattr(module, n))]


def _takes_no_arguments(fn: Any) -> bool:
    try:
        inspect.signature(fn).bind()
    except (TypeError, ValueError):
        return False
    return True


async def cmd_agent(args: argparse.Namespace) -> int:
    from reach_mesh.agent._run import serve

    # Agents built at import time read their settings from the environment.
    if args.nats:
        os.environ["REACH_NATS_URL"] = args.nats
    if args.config:
        os.environ["REACH_CONFIG"] = args.config
    agents = load_agents(args.target)
    if args.metrics_port is not None:
        if args.metrics_port and args.metrics_port + len(agents) - 1 > 65535:
            raise BadRequestError(
                f"--metrics-port {args.metrics_port} leaves no room for {len(agents)} agents' "
                "ports (PORT, PORT+1, ...; at most 65535)",
                field="metrics_port",
            )
        for i, agent in enumerate(agents):
            port = args.metrics_port + i if args.metrics_port else 0
            agent.serve_metrics(port, args.metrics_host)

    def started() -> None:  # connected and registered: only now is it true
        print("serving " + ", ".join(a.agent_id for a in agents), flush=True)
        for a in agents:
            if a.metrics_url is not None:
                print(f"metrics of {a.agent_id}: {a.metrics_url}", flush=True)

    await serve(*agents, started=started)
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from reach_mesh.demo import run_demo

    async with _nats(args) as (url, _):
        failures = await run_demo(settings_of(args, nats_url=url))
    if not args.nats_flag:
        # The commands printed above need a mesh, and this one stopped with the demo.
        print(DEMO_NEXT, flush=True)
    return 1 if failures else 0
