"""Fleet queries and operator actions from the caller's side: :class:`FleetMixin` is a base
of :class:`~reach_mesh.client.Client` that lists and inspects agents, acts on them as an
operator, reports calls made outside the mesh and reads the audit stream."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from reach_mesh import protocol
from reach_mesh._client_audit import read_audit
from reach_mesh._client_base import HubAsks
from reach_mesh.models import AgentInfo, FailureReport


class AgentList(list[AgentInfo]):
    """What :meth:`FleetMixin.agents` returns: a list of :class:`AgentInfo`, and what the
    answer says of those it left out. ``truncated``: more agents matched than it holds (cut to
    fit one NATS message, or by ``limit``); ``matched``: the agents that match the query,
    ``total``: those in its scope, ``by_state``: theirs by state; ``next_after``: the agent id
    to ask the next page ``after`` (None: none left), ``next_offset`` its ``offset``;
    ``attention_total``: the agents in scope that need an operator's look."""

    truncated: bool = False
    total: int = 0
    matched: int = 0
    next_after: str | None = None
    next_offset: int | None = None
    attention_total: int = 0
    by_state: dict[str, int]

    @classmethod
    def of(cls, fleet: dict[str, Any]) -> AgentList:
        """The list of a fleet answer (``FleetMixin.fleet``); an older hub's, which sends no
        counts, counts what it holds."""
        out = cls(AgentInfo.model_validate(a) for a in fleet.get("agents") or [])
        out.total = int(fleet.get("total", len(out)))
        out.matched = int(fleet.get("matched", len(out)))
        out.truncated = bool(fleet.get("truncated", False))
        nxt = fleet.get("next_offset")
        out.next_offset = nxt if isinstance(nxt, int) else None
        after = fleet.get("next_after")
        out.next_after = after if isinstance(after, str) else None
        concerned = fleet.get("attention_total")
        out.attention_total = (
            concerned if isinstance(concerned, int) else sum(1 for i in out if i.attention)
        )
        counted = fleet.get("by_state")
        if not isinstance(counted, dict):
            counted = {}
            for info in out:
                counted[info.state.value] = counted.get(info.state.value, 0) + 1
        out.by_state = counted
        return out


class FleetMixin(HubAsks):
    """The fleet half of :class:`~reach_mesh.client.Client`."""

    #: Names this client in its failure reports (``Client.__init__``).
    _reporter: str

    async def agents(
        self,
        *,
        all_namespaces: bool = False,
        state: str | Sequence[str] | None = None,
        capability: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        after: str | None = None,
        attention: bool = False,
    ) -> AgentList:
        """The agents of this client's namespace (``all_namespaces``: of every one, an
        operator query), in ``agent_id`` order: as many as one answer carries (one NATS
        message: ~2,500 agents at nats-server's default ``max_payload`` of 1 MiB). A list of
        :class:`AgentInfo` whose ``truncated`` says agents were left out (``matched``
        of them in all; ask again with ``after=next_after`` for the next page, which misses
        nobody for agents coming or going meanwhile, as ``offset=next_offset`` may), with
        ``total``, ``by_state`` and ``attention_total`` counting every agent in scope.
        ``state`` (names), ``capability``, ``attention`` (only agents that need an operator's
        look: their ``AgentInfo.attention`` says why), ``limit``, ``after`` (an agent id: those
        sorting after it) and ``offset`` narrow it (docs/protocol.md, "Fleet queries")."""
        fleet = await self.fleet(
            all_namespaces=all_namespaces,
            state=state,
            capability=capability,
            limit=limit,
            offset=offset,
            after=after,
            attention=attention,
        )
        return AgentList.of(fleet)

    async def recently_lost(self, *, all_namespaces: bool = False) -> list[dict[str, Any]]:
        """Agents the answering hub declared LOST in the last 15 minutes (no heartbeat for
        their lease and grace) and that are not back: they are in no listing any more.
        ``agent_id``, ``lost_at`` (the hub's clock), ``capabilities``; newest first (as many
        as fit in an eighth of an answer: ``recently_lost_total`` of ``fleet()`` counts them
        all)."""
        fleet = await self.fleet(all_namespaces=all_namespaces, limit=0)
        return list(fleet.get("recently_lost") or [])

    async def fleet(
        self,
        *,
        all_namespaces: bool = False,
        state: str | Sequence[str] | None = None,
        capability: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        after: str | None = None,
        attention: bool = False,
    ) -> dict[str, Any]:
        """One hub's answer to the fleet query, as sent: ``hub_id``, ``agents`` (AgentInfo
        objects as JSON, as many as fit), ``total``, ``by_state``, ``attention_total``,
        ``matched``, ``offset``,
        ``truncated``, ``next_after``, ``next_offset``, ``recently_lost`` and
        ``recently_lost_total`` (docs/protocol.md, "Fleet queries")."""
        body: dict[str, Any] = {}
        if state is not None:
            body["state"] = state if isinstance(state, str) else list(state)
        if capability is not None:
            body["capability"] = capability
        if limit is not None:
            body["limit"] = limit
        if offset:
            body["offset"] = offset
        if after is not None:
            body["after"] = after
        if attention:
            body["attention"] = True
        if all_namespaces:  # an operator query (docs/security.md)
            data = await self._query("admin", {"op": "agents", **body})
        else:
            data = await self._query("agents", body)
        fleet: dict[str, Any] = json.loads(data)
        return fleet

    async def inspect(self, agent_id: str) -> AgentInfo:
        protocol.validate_agent_id(agent_id)
        data = await self._query(
            "agents", {"agent_id": agent_id}, ns=protocol.namespace_of(agent_id)
        )
        return AgentInfo.model_validate_json(data)

    async def admin(self, op: str, agent_id: str, reason: str | None = None) -> dict[str, Any]:
        """An operator action (``cordon``, ``uncordon``, ``quarantine``, ``release``,
        ``remove``) on ``agent_id``, as ``reach-mesh <op>`` does it; its answer
        ``{"agent_id", "op", "state"}``. ``reason`` (printable, at most ``protocol.REASON_MAX``
        characters) is kept in the audit event, with who asked as the hub tells it (secure
        mode: this client's identity, e.g. ``operator.admin``). Asked again if NATS reconnects
        before the answer (audited once per ask), but ``remove``: it raises
        ``MeshTimeoutError`` saying so, since it may have been done."""
        protocol.validate_agent_id(agent_id)
        body: dict[str, Any] = {"op": op, "agent_id": agent_id}
        reason = protocol.validate_reason(reason)
        if reason is not None:
            body["reason"] = reason
        # Asked again after a reconnection, but for ``remove``: asked twice, it would answer
        # "unknown agent" for the agent it removed the first time.
        data = await self._query(
            "admin", body, ns=protocol.namespace_of(agent_id), repeatable=op != "remove"
        )
        out: dict[str, Any] = json.loads(data)
        return out

    async def report(
        self,
        agent_id: str,
        *,
        success: bool,
        code: str | None = None,
        task_id: str | None = None,
    ) -> None:
        """Tell every hub how a call to ``agent_id`` went (feeds its circuit breaker).

        The SDK does this itself in direct mode; use it for calls made outside the mesh."""
        report = FailureReport(
            agent_id=agent_id,
            success=success,
            code=code,
            task_id=task_id,
            reporter=self._reporter,
        )
        await self.nc.publish(
            protocol.hub_subject(protocol.namespace_of(agent_id), "report"),
            protocol.encode(report),
        )

    async def audit(
        self,
        *,
        request_id: str | None = None,
        agent_id: str | None = None,
        trace_id: str | None = None,
        task_id: str | None = None,
        namespace: str | None = None,
        since: float = 3600.0,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """Audit events of the last ``since`` seconds matching every given filter, oldest
        first (at most ``limit``, the newest ones). ``MeshUnavailableError`` when there is no
        audit stream at all (no hub ever ran on this NATS, or audit is off)."""
        return await read_audit(
            self.nc,
            request_id=request_id,
            agent_id=agent_id,
            trace_id=trace_id,
            task_id=task_id,
            namespace=namespace,
            since=since,
            limit=limit,
        )
