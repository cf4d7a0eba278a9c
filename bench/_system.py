"""Machine facts, versions, and per-process CPU/RSS read from /proc (no psutil needed)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

__all__ = ["ChildProcess", "CpuSample", "cpu_sample", "machine_info", "rss_mb"]

_TICK = os.sysconf("SC_CLK_TCK")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(nats_server: str | None) -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        mem_gb = round(int(first.split()[1]) / 1024 / 1024, 1)
    server_version = None
    if nats_server:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [nats_server, "--version"], capture_output=True, text=True, timeout=10
            )
            server_version = (out.stdout or out.stderr).strip()
    uvloop_version = _version("uvloop")
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu_model": model,
        "memory_gb": mem_gb,
        "kernel": platform.release(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            "python": platform.python_version(),
            "nats-py": _version("nats-py"),
            "nats-server": server_version,
            "reach-mesh": _version("reach-mesh"),
            "pydantic": _version("pydantic"),
            "uvloop": uvloop_version,
            "agentbus": _version("agentbus"),
            "taskiq": _version("taskiq"),
            "taskiq-nats": _version("taskiq-nats"),
            "pyinstrument": _version("pyinstrument"),
            "opentelemetry-sdk": _version("opentelemetry-sdk"),
        },
    }


@dataclass(frozen=True, slots=True)
class CpuSample:
    cpu_s: float
    wall: float


def cpu_sample(pid: int) -> CpuSample | None:
    """utime + stime of ``pid`` in seconds, with the wall time it was read at."""
    import time

    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    # After the ")" of comm: state is fields[0]; utime, stime are stat fields 14, 15.
    return CpuSample((int(fields[11]) + int(fields[12])) / _TICK, time.perf_counter())


#: What :func:`proc_counts` reads: /proc/PID/io's read and write system calls and bytes (the
#: ``read``/``write`` family only: a socket written with ``send`` is not counted — uvloop and
#: Go write sockets with ``write``/``writev``, asyncio's own loop with ``send``), and the
#: context switches of every thread (voluntary: each wait for a message or a lock; the wake-ups).
PROC_COUNTS: Final = ("syscr", "syscw", "rchar", "wchar", "ctxsw_vol", "ctxsw_invol")


def proc_counts(pid: int) -> dict[str, int] | None:
    """``pid``'s :data:`PROC_COUNTS` so far (None when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/io").read_text()
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    out = {k: 0 for k in PROC_COUNTS}
    for line in raw.splitlines():
        key, _, value = line.partition(": ")
        if key in out:
            out[key] = int(value)
    for thread in threads:
        try:
            status = (thread / "status").read_text()
        except OSError:
            continue  # (a thread that ended meanwhile)
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out["ctxsw_vol"] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                out["ctxsw_invol"] += int(line.split()[1])
    return out


def cpu_share(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """CPU seconds per wall second between two samples (1.0 = one core busy)."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    return round((after.cpu_s - before.cpu_s) / (after.wall - before.wall), 4)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError):
        return None
    return None


class ChildProcess:
    """A child process (own process group) that prints a ready line; stopped by its pid only."""

    def __init__(self, argv: list[str], *, name: str, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.name = name
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.ready_line = ""
        self.lines: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, ready_prefix: str, timeout: float = 30.0) -> str:
        env = {**os.environ, **(self.env or {})}
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        # Keep reading the child's output so that a chatty child never blocks on a full pipe.
        self._reader = asyncio.create_task(self._read(self.proc))
        try:
            self.ready_line = await self.wait_line(ready_prefix, timeout)
        except BaseException:
            await self.stop()
            raise
        return self.ready_line

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())
            if len(self.lines) > 2000:
                del self.lines[:1000]

    async def wait_line(self, prefix: str, timeout: float) -> str:
        """The first output line starting with ``prefix`` (polled; bounded by ``timeout``)."""
        deadline = asyncio.get_running_loop().time() + timeout
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if line.startswith(prefix):
                    return line
            seen = len(self.lines)
            if self.proc is None or (self._reader is not None and self._reader.done()):
                tail = "\n".join(self.lines[-30:])
                raise RuntimeError(f"{self.name} exited without printing {prefix!r}:\n{tail}")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{self.name} did not print {prefix!r} within {timeout:g}s")
            await asyncio.sleep(0.02)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM this child (by pid), then SIGKILL it if it has not exited in ``timeout``."""
        import signal

        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 2)
        self.proc = None


def python() -> str:
    return sys.executable
