"""The hub as a NATS micro service (``nats.micro``): ``$SRV.PING``, ``$SRV.INFO`` and
``$SRV.STATS`` list every hub of the fleet, with what it serves, so ``nats micro ls`` and any
micro client see it.

The hub's own request subjects keep their queue subscriptions (``_hub.py``); the service adds
one endpoint per hub, ``agents`` on ``reach.micro.<hub_id>.agents`` (this hub's view of the
fleet), and names the routing subjects in its metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service, ServiceConfig

from reach_mesh import __version__, protocol
from reach_mesh._guard import guarded
from reach_mesh._nats import not_permitted, refused_first, refused_since
from reach_mesh.errors import ReachError
from reach_mesh.hub._asked import json_object
from reach_mesh.hub._fleet import fleet_answer, fleet_asked

if TYPE_CHECKING:
    from reach_mesh.hub._hub import Hub

__all__ = ["discover_hubs", "start_micro"]


class _Answerable:
    """The hub's connection as the micro service sees it (``add_service`` subscribes through
    it): the service's handlers answer with the hub's rights, so they get only requests whose
    reply subject is an inbox (``reach_mesh/_guard.py``); one without a reply subject has
    nobody to answer and is dropped too."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nc, name)

    async def subscribe(
        self,
        subject: str,
        queue: str = "",
        cb: Callable[[Msg], Awaitable[None]] | None = None,
        **kwargs: Any,
    ) -> Subscription:
        assert cb is not None
        inner = guarded(subject, cb)

        async def on_msg(msg: Msg) -> None:
            if msg.reply:
                await inner(msg)

        return await self._nc.subscribe(subject, queue=queue, cb=on_msg, **kwargs)


async def start_micro(hub: Hub) -> Service:
    """Register ``hub`` as a ``reach-hub`` micro service; ``await service.stop()`` withdraws it."""
    service = await add_service(
        # On the connection of the other requests an operator may send (its discovery and
        # ``agents`` asks): a flood of them must not cut the main one (``Hub._start``).
        cast(NATS, _Answerable(hub.route_nc)),
        ServiceConfig(
            name=protocol.MICRO_HUB_SERVICE,
            version=__version__,
            description="reach-mesh hub: registry, routing, durable workflows",
            metadata={
                "hub_id": hub.hub_id,
                "http_url": hub.http_url or "",
                "route": protocol.hub_subject("<ns>", "route"),
                "agents": protocol.hub_subject("<ns>", "agents"),
            },
        ),
    )

    async def agents(request: Request) -> None:
        try:
            ask = fleet_asked(json_object(request.data))
        except ReachError as err:
            body = protocol.encode_error(err)
        else:
            body = fleet_answer(
                hub.registry,
                hub.hub_id,
                None,
                ask,
                hub.nc.max_payload,
                {
                    # Cannot read or write the registry lately (``reach_registry_blind``), and
                    # why.
                    "blind": hub.registry.blind(),
                    "blind_reason": hub.registry.blind_reason(),
                    # This hub's wall clock minus the NATS server's, as it estimates it
                    # (seconds).
                    "clock_skew_s": round(hub.registry.server_clock.skew, 3),
                },
            )
        # _Answerable passes only requests with a reply subject; one too large to send is
        # answered REACH_PAYLOAD_TOO_LARGE (``Hub.sendable``).
        await request.respond(hub.sendable(request.subject, body))

    await service.add_endpoint(
        EndpointConfig(
            name="agents",
            subject=protocol.micro_subject(hub.hub_id, "agents"),
            handler=agents,
            metadata={
                "description": "this hub's view of the fleet (AgentInfo list, as many as fit)"
            },
        )
    )
    return service


async def discover_hubs(
    nc: Any, wait: float = 0.5, *, expected: bool = False, fleet_ask: bytes = b""
) -> list[dict[str, Any]]:
    """Every hub's ``$SRV.INFO`` answer within ``wait`` seconds, each with ``"fleet"``: the
    answer of its ``agents`` endpoint (``{"hub_id", "agents"}``, or ``None`` if it did not).
    ``expected``: a refusal is an answer, not logged (``refused_first``). ``fleet_ask``: the
    body of the ``agents`` request (``b'{"limit":0}'``: the counts and the hub's health only).

    An identity NATS may not let ask (a caller's, in secure mode: discovery is an operator
    read) gets :class:`~reach_mesh.errors.NotPermittedError` as soon as the server refuses the
    publish, rather than an empty list that reads as "no hub is running" (on a connection
    made by ``reach_mesh._nats.connect``, which keeps the server's refusals)."""
    subject = f"$SRV.INFO.{protocol.MICRO_HUB_SERVICE}"
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    infos: list[dict[str, Any]] = []

    async def collect() -> None:
        await nc.publish(subject, b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:  # nats' TimeoutError: the window is over
                break
            if msg.data:  # not the server's "no responders" status
                with contextlib.suppress(ReachError):
                    infos.append(protocol.loads_object(msg.data))

    asked_at = time.monotonic()
    try:
        await refused_first(nc, subject, collect(), expected=expected)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if not infos and (refused := refused_since(nc, asked_at, subject)) is not None:
        raise not_permitted(refused)  # refused as the window closed

    async def fleet(info: dict[str, Any]) -> None:
        subject = next(
            (e["subject"] for e in info.get("endpoints") or [] if e.get("name") == "agents"), None
        )
        info["fleet"] = None
        if subject is not None:
            try:
                info["fleet"] = json.loads((await nc.request(subject, fleet_ask, timeout=5)).data)
            except Exception:  # a hub that went away meanwhile: listed without its fleet
                info["fleet"] = None

    await asyncio.gather(*(fleet(i) for i in infos))
    return sorted(infos, key=lambda i: str((i.get("metadata") or {}).get("hub_id", "")))
