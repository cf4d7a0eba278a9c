"""What a query or an operator's request asks, read and checked: its body (a JSON object of
bounded size) and the states it names. Shared by the hub's queries (``_control``), the fleet
query (``_fleet``) and the micro service (``_micro``)."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

from reach_mesh import protocol
from reach_mesh.errors import BadRequestError, PayloadTooLargeError

__all__ = ["asked_states", "json_object"]

E = TypeVar("E", bound=Enum)


def json_object(data: bytes) -> dict[str, Any]:
    """The body of a query or an operator's request: a JSON object (empty: ``{}``), of at
    most ``protocol.QUERY_MAX`` bytes — measured before it is parsed."""
    if len(data) > protocol.QUERY_MAX:
        raise PayloadTooLargeError(
            f"a request of {len(data)} bytes exceeds the maximum of {protocol.QUERY_MAX} "
            "bytes for a query or an operator's request",
            size=len(data),
            max_size=protocol.QUERY_MAX,
        )
    if not data.strip():
        return {}
    return protocol.loads_object(data)


def asked_states(body: dict[str, Any], kind: type[E]) -> frozenset[E]:
    """The ``state`` of ``body``: a state name of ``kind`` or a list of them, in any case
    (none: every state); ``REACH_BAD_REQUEST`` naming the field otherwise."""
    raw = body.get("state", [])
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequestError("state must be a state name or a list of them", field="state")
    try:
        return frozenset(kind(n.upper()) for n in names)
    except ValueError:
        raise BadRequestError(
            f"state must be among {', '.join(str(s.value) for s in kind)}", field="state"
        ) from None
