"""nats-py's header codec, the same bytes in and out at less CPU (``HeaderCodec``, the base of
every connection reach-mesh makes: ``_nats._Connection``).

Every workflow message but the acks carries headers (a fanout(3) parses ~4 header blocks on
the hub and writes ~8): nats-py's regex check of each name on every publish, and a generator
over each received name's characters, were ~2 % of a hub's CPU per workflow. Here a name is
checked and encoded once and kept, a value's newlines replaced only when it has one, and a
received name searched for whitespace with one regex. ``tests/test_nats_header_codec.py``
compares both with nats-py's own, byte for byte and dict for dict.
"""

from __future__ import annotations

import re
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.errors import BadHeaderError
from nats.protocol.command import hpub_cmd

__all__ = ["HeaderCodec"]

#: A header name as nats-py accepts one to send (its ``_HEADER_KEY_RE``: an HTTP token).
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Whitespace inside a received header name, as ``str.isspace`` finds it (``\s`` on a str
#: pattern is the same class).
_SPACE: Final = re.compile(r"\s")
#: Each header name sent, as it is written (``b"Name: "``), validated once; ``b""``: blank,
#: skipped. Bounded (``_HEADER_NAMES_KEPT``): names are the mesh's own few and trace context.
_header_names: dict[str, bytes] = {}
_HEADER_NAMES_KEPT: Final = 256


class HeaderCodec(NATS):
    """A nats-py client whose header writing and parsing cost less CPU (see the module)."""

    async def _send_publish(
        self,
        subject: str,
        reply: str,
        payload: bytes,
        payload_size: int,
        headers: dict[str, Any] | None,
    ) -> None:
        if headers is None or subject == "":
            await super()._send_publish(subject, reply, payload, payload_size, headers)
            return
        hdr = bytearray(b"NATS/1.0\r\n")
        for k, v in headers.items():
            name = _header_names.get(k)
            if name is None:
                name = _header_name(k)
            if name:
                hdr += name
                value = v.strip()
                if "\r" in value or "\n" in value:
                    value = value.replace("\r", " ").replace("\n", " ")
                hdr += value.encode()
                hdr += b"\r\n"
        hdr += b"\r\n"
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += payload_size
        await self._send_command(hpub_cmd(subject, reply, hdr, payload))
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if _SPACE.search(key) is not None:
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out


def _header_name(key: str) -> bytes:
    """``key`` as nats-py writes a header name (``b"Name: "``; ``b""`` when blank, which it
    skips), kept for the next publish; ``BadHeaderError`` when it is no valid name."""
    name = key.strip()
    if name and not _HEADER_NAME.fullmatch(name):
        raise BadHeaderError(name)
    out = name.encode() + b": " if name else b""
    if len(_header_names) < _HEADER_NAMES_KEPT:
        _header_names[key] = out
    return out
