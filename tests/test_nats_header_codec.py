"""``_Connection``'s header codec writes and reads what nats-py's own does, byte for byte."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.errors import BadHeaderError

from reach_mesh._nats import _Connection

HEADERS: list[dict[str, Any]] = [
    {},
    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    {"Nats-Msg-Id": "ns.t-1.2", "Nats-Expected-Stream": "REACH_WORK", "tracestate": "a=b"},
    {" padded ": "  value  ", "": "blank name", "  ": "also blank"},
    {"multi": "line\r\nvalue\rwith\nbreaks", "x": "\r\n"},
    {"unicode": "déjà vu ✓", "Empty": ""},
]


def _written(send: Any, nc: NATS, headers: dict[str, Any] | None) -> list[bytes]:
    out: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        out.append(cmd)

    nc._send_command = capture  # type: ignore[method-assign]
    nc._flush_queue = None
    asyncio.run(send(nc, "a.subject", "_INBOX.x", b'{"x":1}', 7, headers))
    return out


@pytest.mark.parametrize("headers", HEADERS)
def test_publish_headers_as_nats_py_writes_them(headers: dict[str, Any]) -> None:
    ours, theirs = _Connection(), NATS()
    assert _written(_Connection._send_publish, ours, headers) == _written(
        NATS._send_publish, theirs, headers
    )
    assert ours.stats["out_msgs"] == theirs.stats["out_msgs"] == 1
    assert ours.stats["out_bytes"] == theirs.stats["out_bytes"]


def test_no_headers_and_bad_names_as_nats_py() -> None:
    ours = _written(_Connection._send_publish, _Connection(), None)
    assert ours == _written(NATS._send_publish, NATS(), None)
    for bad in ("sp ace", "colon:", "ü"):
        for nc, send in ((_Connection(), _Connection._send_publish), (NATS(), NATS._send_publish)):
            with pytest.raises(BadHeaderError):
                _written(send, nc, {bad: "v"})


def test_received_headers_as_nats_py_reads_them() -> None:
    blocks = [
        b"",
        b"traceparent: 00-abc-def-01\r\nNats-Msg-Id: x\r\n\r\n",
        b"Nats-Stream: REACH_STATUS\r\nNats-Sequence: 42\r\nNats-Subject: a.b\r\n\r\n",
        b"NoColon\r\n: empty name\r\nName:Value\r\nName2:\tTabbed \r\n",
        b"bad\xffname: v\r\nok: \xff\xfe bad utf8\r\n",
        b"a b: inner space\r\nx\x1fy: unit separator\r\nz\x0bw: vtab\r\n dup: 1\r\ndup: 2\r\n",
    ]
    blocks += [b"k" + bytes([c]) + b"k: v\r\n" for c in range(128)]
    for raw in blocks:
        assert _Connection._parse_header_lines(raw) == NATS._parse_header_lines(raw), raw
