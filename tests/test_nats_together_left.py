"""``Together``'s memory of a server its connections left as cut off, without a cluster: the
bookkeeping ``tests/test_cut_off_nodes.py`` exercises on a real one, in the order that made it
forget the server (all the connections up again before the first is told back)."""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import urlparse

from nats.aio.client import Client as NATS

from reach_mesh._nats_together import Together

_NAMES = ("main", "routes", "statuses", "agents")


class _Conn:
    """What ``Together`` reads of a connection: where it is up (None: reconnecting)."""

    def __init__(self, leaves: list[str], name: str) -> None:
        self._server_info: dict[str, Any] = {}
        self.connected_url: Any = None
        self.is_connected = False
        self._leaves = leaves
        self._name = name
        self.on_cut_off = self.leave

    def up(self, netloc: str, server: str) -> None:
        self.connected_url = urlparse(f"nats://{netloc}")
        self._server_info = {"server_id": server}
        self.is_connected = True

    def leave(self) -> bool:
        self._leaves.append(self._name)
        self.connected_url, self.is_connected = None, False
        return True


def _together() -> tuple[Together, dict[str, _Conn], list[str]]:
    together = Together("hub-t")
    leaves: list[str] = []
    conns = {name: _Conn(leaves, name) for name in _NAMES}
    for name, conn in conns.items():
        conn.up("localhost:4222", "N1")
        together.add(name, cast(NATS, conn))
    return together, conns, leaves


def test_a_server_left_is_not_forgotten_when_all_land_on_it_under_its_other_name() -> None:
    """All four leave N1 (given as ``localhost``), and all four are up on it again under the
    address it advertises before the first is told back (``_back``). That was taken for
    "together again, elsewhere": the server left was forgotten, each left it again under the
    address only, and the next reconnection went back under ``localhost`` — where they stayed
    for the whole cut, the hub served nowhere on the majority's side."""
    together, conns, leaves = _together()
    assert together._cut_off("main")
    assert sorted(leaves) == sorted(_NAMES)
    assert together.shunned("localhost:4222")
    for conn in conns.values():
        conn.up("127.0.0.1:4222", "N1")  # (the same server, its other name)
    for name in _NAMES:
        together._back(name)
        # Still the server left: no target there for a sibling, and its first name still last.
        assert together.shunned("localhost:4222"), name
        assert together.target("routes") is None, name
        assert together.target("main") is None, name
    # Each leaves it again (``back_where_left``): both names last.
    for name in _NAMES:
        together._cut_off(name)
    assert together.shunned("localhost:4222") and together.shunned("127.0.0.1:4222")
    # Together on another server: the one left is forgotten.
    for conn in conns.values():
        conn.up("127.0.0.1:4223", "N0")
    for name in _NAMES:
        together._back(name)
    assert not together.shunned("localhost:4222") and not together.shunned("127.0.0.1:4222")
    assert together.target("routes") == "127.0.0.1:4223"


def test_a_server_left_and_stayed_on_is_forgotten_once_all_are_back_on_it() -> None:
    """All four leave N1, find no other server (the process is on the minority's side of the
    cut too) and are all up on it again under the name they left it under: they stay there
    (``_Connection.back_where_left``). Then it is no longer a server being left: a sibling
    that reconnects alone later (a slow consumer cut, after the cut healed) must be sent back
    to main's server. Kept shunned, the sibling's target was None, it went to another server
    and every rejoin move sent it there again — the hub's connections apart for good."""
    together, conns, leaves = _together()
    assert together._cut_off("main")
    assert sorted(leaves) == sorted(_NAMES)
    for conn in conns.values():
        conn.up("localhost:4222", "N1")  # (the same server, the same name: nothing else took it)
    for name in _NAMES:
        together._back(name)
    assert not together.shunned("localhost:4222")
    assert together.target("routes") == "localhost:4222"
    assert together.target("main") == "localhost:4222"
