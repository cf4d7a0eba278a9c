"""What a run cost, from the processes and the server's own statistics.

:class:`JsCounter` reads the JetStream account info (``$JS.API.INFO``: ``api.total``, the API
requests the server has served) and every stream's state (``$JS.API.STREAM.LIST``:
``last_seq``, ``messages``, ``bytes``) before and after a measured phase. The difference is:

* ``api_requests``: ``$JS.API`` requests (stream/consumer management, info, KV/stream ``get``
  through the API; the counter's own requests are subtracted). Direct gets
  (``$JS.API.DIRECT.GET``), pull requests (``CONSUMER.MSG.NEXT``) and acks are not API requests
  in the server's count;
* ``stored``: messages written into each stream (``last_seq`` delta, so a work-queue stream's
  acked messages and a KV key's overwritten revisions count too);
* ``bytes_kept``: the change of each stream's ``bytes``: what stays stored for the stream's
  retention (a work queue's acked messages are gone again, a KV bucket keeps its last revision).

:class:`ClientMessages` reads the server's monitoring endpoint (``/connz``): messages every
client connection sent to the server (``in_msgs``: publishes, KV writes, direct-get and pull
requests, acks — every operation a client asks of the server, reads included).

:class:`CpuCounter` reads utime + stime of named processes from ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext

from bench._system import CpuSample, cpu_sample, proc_counts

__all__ = ["COUNTER_NAME", "ClientMessages", "CpuCounter", "JsCounter", "free_port", "per_unit"]

#: The name of the counters' own NATS connection (left out of the client message count).
COUNTER_NAME = "bench-js-stats"


def free_port() -> int:
    """A free TCP port on loopback (for the server's monitoring endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class _StreamState:
    last_seq: int
    messages: int
    bytes: int


async def _streams(js: JetStreamContext) -> dict[str, _StreamState]:
    out: dict[str, _StreamState] = {}
    offset = 0
    while True:
        page = await js.streams_info(offset)
        for info in page:
            name, st = info.config.name, info.state
            if name is not None:
                out[name] = _StreamState(st.last_seq, st.messages, st.bytes)
        if len(page) < 256:  # the server's page size
            return out
        offset += len(page)


class JsCounter:
    """JetStream work between :meth:`start` and :meth:`stop`, from the server's counters."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._own = 0  # API requests one account-info read adds to the count it reads
        self._api0 = 0
        self._streams0: dict[str, _StreamState] = {}

    async def _api_total(self) -> int:
        return int((await self._js.account_info()).api.total)

    async def start(self) -> None:
        first = await self._api_total()
        self._own = await self._api_total() - first
        self._streams0 = await _streams(self._js)
        # Read last, so that the stream listing is not counted.
        self._api0 = await self._api_total()

    async def stop(self, settle: float = 0.3) -> dict[str, Any]:
        """The deltas since :meth:`start`; waits ``settle`` s first for trailing writes."""
        await asyncio.sleep(settle)
        api = await self._api_total() - self._api0 - self._own
        after = await _streams(self._js)
        streams: dict[str, dict[str, int]] = {}
        for name, st in sorted(after.items()):
            old = self._streams0.get(name, _StreamState(0, 0, 0))
            stored = st.last_seq - old.last_seq
            kept = st.bytes - old.bytes
            if stored or kept:
                streams[name] = {"stored": stored, "bytes_kept": kept}
        return {
            "api_requests": api,
            "stored": sum(s["stored"] for s in streams.values()),
            "bytes_kept": sum(s["bytes_kept"] for s in streams.values()),
            "streams": streams,
        }


class ClientMessages:
    """Messages the clients sent to the server between :meth:`start` and :meth:`stop`, from
    ``/connz`` (open connections; the counter's own connection is left out)."""

    def __init__(self, monitor_url: str) -> None:
        self._url = monitor_url.rstrip("/") + "/connz?limit=4096"
        self._before: dict[int, int] = {}

    def _read(self) -> dict[int, int]:
        with urllib.request.urlopen(self._url, timeout=10) as resp:
            conns = json.load(resp).get("connections") or []
        return {c["cid"]: c["in_msgs"] for c in conns if c.get("name") != COUNTER_NAME}

    async def start(self) -> None:
        self._before = await asyncio.to_thread(self._read)

    async def stop(self) -> int:
        after = await asyncio.to_thread(self._read)
        return sum(n - self._before.get(cid, 0) for cid, n in after.items())


class CpuCounter:
    """CPU seconds (utime + stime) of named processes between :meth:`start` and :meth:`stop`,
    and what else they did meanwhile (:attr:`counts`: ``bench._system.PROC_COUNTS``)."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self._pids = {k: v for k, v in pids.items() if v is not None}
        self._before: dict[str, CpuSample | None] = {}
        self._counts_before: dict[str, dict[str, int] | None] = {}
        #: Per process, after :meth:`stop`: system calls, bytes and context switches meanwhile.
        self.counts: dict[str, dict[str, int]] = {}

    def start(self) -> None:
        self._before = {k: cpu_sample(pid) for k, pid in self._pids.items()}
        self._counts_before = {k: proc_counts(pid) for k, pid in self._pids.items()}

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self._pids.items():
            before, after = self._before.get(name), cpu_sample(pid)
            if before is not None and after is not None:
                out[name] = round(after.cpu_s - before.cpu_s, 3)
            then, now = self._counts_before.get(name), proc_counts(pid)
            if then is not None and now is not None:
                self.counts[name] = {k: now[k] - then[k] for k in now}
        return out


def per_unit(
    js: dict[str, Any],
    cpu_s: dict[str, float],
    units: int,
    client_msgs: int | None = None,
    counts: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """JetStream operations, client messages, bytes kept, CPU µs and (``counts``:
    ``CpuCounter.counts``) system calls, bytes and context switches per completed unit."""
    n = max(units, 1)
    return {
        "units": units,
        "client_msgs": None if client_msgs is None else round(client_msgs / n, 2),
        "js_ops": round((js["api_requests"] + js["stored"]) / n, 2),
        "js_api_requests": round(js["api_requests"] / n, 2),
        "js_stored": round(js["stored"] / n, 2),
        "js_bytes_kept": round(js["bytes_kept"] / n, 1),
        "js_stored_by_stream": {k: round(v["stored"] / n, 2) for k, v in js["streams"].items()},
        "js_bytes_by_stream": {k: round(v["bytes_kept"] / n, 1) for k, v in js["streams"].items()},
        "cpu_us": {k: round(v * 1e6 / n, 1) for k, v in cpu_s.items()},
        "proc_counts": {
            name: {k: round(v / n, 2) for k, v in c.items()} for name, c in (counts or {}).items()
        },
    }
