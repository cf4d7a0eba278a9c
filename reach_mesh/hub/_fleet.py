"""The answer to a fleet query (``reach.hub.<ns>.agents``, the ``agents`` admin op, the micro
service's ``agents`` endpoint): the agents asked for, in ``agent_id`` order, as many as fit in
one NATS message, with counts that say what was left out.

One answer is one NATS message: at most the server's ``max_payload`` (1 MiB by default,
~2,500 agents). The agents past what fits are left out — ``truncated``, with ``next_after``
(and ``next_offset``) to ask for the next page — and ``total``, ``matched`` and ``by_state``
count every one, so a caller that counts (``reach-mesh doctor``) never needs the list.

Which agents a listing holds — filters, counts, the page — is :func:`fleet_page`'s, whoever
lists them: the fleet query, ``GET /api/agents`` and the dashboard's fleet view.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Any

from reach_mesh import protocol
from reach_mesh.errors import BadRequestError, InvalidAgentIdError
from reach_mesh.hub._agent_view import AgentView
from reach_mesh.hub._asked import asked_states
from reach_mesh.hub.registry import Registry
from reach_mesh.models import AgentState

__all__ = ["FleetAsk", "FleetPage", "fleet_answer", "fleet_asked", "fleet_page"]

#: Share of an answer's bytes that ``recently_lost`` may take (the agents get the rest).
_LOST_SHARE = 8


@dataclass(frozen=True, slots=True)
class FleetAsk:
    """What a fleet query asks for: agents in ``states`` (empty: any) serving ``capability``
    (None: any), only those that need an operator's look when ``attention``
    (``AgentView.concerns``), in ``agent_id`` order those whose id sorts after ``after``
    (None: from the first), skipping ``offset`` of them, at most ``limit`` (None: as many as
    fit; 0: the counts only)."""

    states: frozenset[AgentState] = frozenset()
    capability: str | None = None
    limit: int | None = None
    offset: int = 0
    after: str | None = None
    attention: bool = False


def fleet_asked(body: dict[str, Any]) -> FleetAsk:
    """``state`` (a state name or a list of them), ``capability``, ``attention``, ``limit``,
    ``offset`` and ``after`` of a fleet query, checked (a ``BadRequestError`` naming the
    field)."""
    states = asked_states(body, AgentState)
    attention = body.get("attention", False)
    if not isinstance(attention, bool):
        raise BadRequestError("attention must be true or false", field="attention")
    capability = body.get("capability")
    if capability is not None:
        if not isinstance(capability, str):
            raise BadRequestError("capability must be a string", field="capability")
        capability = protocol.validate_capability(capability)
    limit = body.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise BadRequestError("limit must be an integer >= 0", field="limit")
    offset = body.get("offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise BadRequestError("offset must be an integer >= 0", field="offset")
    after = body.get("after")
    if after is not None:
        try:
            after = protocol.validate_agent_id(after)
        except InvalidAgentIdError as err:
            raise InvalidAgentIdError(f"after: {err.message}", field="after") from None
    return FleetAsk(states, capability, limit, offset, after, attention)


@dataclass(frozen=True, slots=True)
class FleetPage:
    """The agents a fleet query picked: ``total`` (agents in scope), ``by_state`` (theirs,
    whatever the filters), ``attention`` (those of them that need an operator's look, whatever
    the filters), ``matched`` (those the filters keep), ``start`` (where the page starts among
    them: past ``ask.after``, then ``ask.offset`` more) and ``views``, the page: at most
    ``ask.limit`` matched agents from ``start`` on, in ``agent_id`` order."""

    ask: FleetAsk
    total: int
    by_state: dict[str, int]
    attention: int
    matched: int
    start: int
    views: list[AgentView]


def fleet_page(registry: Registry, namespace: str | None, ask: FleetAsk) -> FleetPage:
    """The page ``ask`` picks of ``namespace``'s agents (None: every namespace's): the one
    selection of every fleet listing (the fleet query, ``GET /api/agents``, the dashboard)."""
    views = registry.views(namespace)
    by_state = Counter(v.state.value for v in views)
    concerned = sum(1 for v in views if v.concerns())
    cap = ask.capability
    matched = [
        v
        for v in views
        if (not ask.states or v.state in ask.states)
        and (cap is None or cap in v.record.card.capabilities)
        and (not ask.attention or v.concerns())
    ]
    start = 0 if ask.after is None else bisect.bisect_right(matched, ask.after, key=_agent_id)
    start += ask.offset
    page = matched[start:]
    if ask.limit is not None:
        page = page[: ask.limit]
    counts = dict(sorted(by_state.items()))
    return FleetPage(ask, len(views), counts, concerned, len(matched), start, page)


def fleet_answer(
    registry: Registry,
    hub_id: str,
    namespace: str | None,
    ask: FleetAsk,
    max_payload: int,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The answer to ``ask`` about ``namespace``'s agents (None: every namespace's), of at
    most ``max_payload`` less ``protocol.MESSAGE_ROOM`` bytes: ``hub_id``, ``total`` (agents
    in scope), ``by_state`` (theirs, whatever the filters), ``attention_total`` (those of them
    that need an operator's look, whatever the filters), ``matched`` (those the filters keep),
    ``offset``, ``agents`` (AgentInfo objects), ``truncated`` (matched agents past
    the page were left out, by ``limit`` or to fit), ``next_after`` (the last agent id of the
    page, which the next page is asked ``after``; null when none is left), ``next_offset`` (the
    page's end among the matched agents, null likewise), ``recently_lost`` (newest first, as
    many as fit in an eighth of the answer; those the ``state`` and ``capability`` filters
    keep) and ``recently_lost_total``; then ``extra``'s fields."""
    picked = fleet_page(registry, namespace, ask)
    cap = ask.capability
    budget = max_payload - protocol.MESSAGE_ROOM
    lost_all = registry.recently_lost(namespace)
    if ask.states and AgentState.LOST not in ask.states:
        lost_all = []  # (asked for other states: those LOST are none of them)
    elif cap is not None:
        lost_all = [e for e in lost_all if cap in e["capabilities"]]
    lost: list[dict[str, Any]] = []
    lost_bytes = 0
    for entry in lost_all:
        lost_bytes += len(protocol.dumps(entry)) + 1
        if lost_bytes > budget // _LOST_SHARE:
            break
        lost.append(entry)
    head: dict[str, Any] = {
        "hub_id": hub_id,
        "total": picked.total,
        "by_state": picked.by_state,
        "attention_total": picked.attention,
        "matched": picked.matched,
        "offset": ask.offset,
        "recently_lost": lost,
        "recently_lost_total": len(lost_all),
        **(extra or {}),
    }
    # (room for "truncated", "next_after" and "next_offset", written last)
    left = budget - len(protocol.dumps(head)) - 96 - protocol.AGENT_ID_MAX
    now = registry.now
    parts: list[bytes] = []
    for view in picked.views:
        part = protocol.encode(view.info(now))
        left -= len(part) + 1
        if left < 0 and parts:  # (the first always: a page moves on, or is too large to send)
            break
        parts.append(part)
    end = picked.start + len(parts)
    more = end < picked.matched
    head["truncated"] = more
    head["next_after"] = picked.views[len(parts) - 1].agent_id if more and parts else None
    head["next_offset"] = end if more else None
    return protocol.dumps(head)[:-1] + b',"agents":[' + b",".join(parts) + b"]}"


def _agent_id(view: AgentView) -> str:
    return view.agent_id
