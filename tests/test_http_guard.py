"""The hub's HTTP guard: Host (DNS rebinding), Origin (cross-site requests), JSON-only POSTs and
the bearer token — as a pure check, against a real hub, and from pages in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from reach_mesh import Client, MeshSettings, _asgi
from reach_mesh._asgi import AsgiServer
from reach_mesh.agent import Agent, Task
from reach_mesh.hub import Hub
from reach_mesh.hub.http_guard import HttpGuard
from reach_mesh.models import AgentState

from .chromium import Chromium, needs_chromium
from .helpers import eventually, fetch

TOKEN = "s3cret-token-of-the-hub"
HOST = {"host": "127.0.0.1:8080"}
JSON = {"content-type": "application/json"}


def code_of(guard: HttpGuard, method: str, path: str, auth: bool = False, /, **headers: str) -> Any:
    refusal = guard.check(
        method, path, {k.replace("_", "-"): v for k, v in headers.items()}, auth=auth
    )
    return None if refusal is None else (refusal.status, refusal.error.code)


# --------------------------------------------------------------------------- the pure check


def test_host_must_name_this_hub() -> None:
    guard = HttpGuard(bind_host="127.0.0.1")
    for host in ("127.0.0.1:8080", "localhost:8080", "LOCALHOST.:8080", "[::1]:8080", "127.0.0.1"):
        assert code_of(guard, "GET", "/metrics", host=host) is None, host
    for host in ("evil.example:8080", "127.0.0.1.evil.example", "10.0.0.5:8080", "", "[::2]:80"):
        assert code_of(guard, "GET", "/metrics", host=host) == (403, "REACH_FORBIDDEN_HOST"), host
    assert code_of(guard, "GET", "/metrics") == (403, "REACH_FORBIDDEN_HOST")  # no Host at all
    # The bound address and the configured names pass; "*" turns the check off.
    bound = HttpGuard(bind_host="10.0.0.5", allowed_hosts=("hub-1", "Hub-2.internal."))
    for host in ("10.0.0.5:9464", "hub-1:9464", "hub-2.internal", "localhost"):
        assert code_of(bound, "GET", "/", host=host) is None, host
    assert code_of(bound, "GET", "/", host="hub-3:9464") == (403, "REACH_FORBIDDEN_HOST")
    wildcard = HttpGuard(bind_host="0.0.0.0")
    assert code_of(wildcard, "GET", "/", host="0.0.0.0:80") == (403, "REACH_FORBIDDEN_HOST")
    assert (
        code_of(HttpGuard(bind_host="0.0.0.0", allowed_hosts=("*",)), "GET", "/", host="x") is None
    )


def test_origin_must_be_the_hubs_own_for_state_changes_and_mcp() -> None:
    guard = HttpGuard(bind_host="127.0.0.1", allowed_origins=("https://ops.example.com/",))
    same = {"host": "127.0.0.1:8080", "content_type": "application/json"}
    for origin in ("http://127.0.0.1:8080", "HTTP://127.0.0.1:8080", "https://ops.example.com"):
        assert code_of(guard, "POST", "/api/route", origin=origin, **same) is None, origin
    assert code_of(guard, "POST", "/api/route", **same) is None  # not a browser: no Origin
    for origin in (
        "http://evil.example",
        "http://127.0.0.1:9999",  # another port is another origin
        "http://localhost:8080",  # another name for the same socket is another origin too
        "null",  # sandboxed frames, file: pages
        "http://127.0.0.1:8080/path",
        "ftp://127.0.0.1:8080",
    ):
        got = code_of(guard, "POST", "/api/route", origin=origin, **same)
        assert got == (403, "REACH_FORBIDDEN_ORIGIN"), origin
    for method in ("PUT", "PATCH", "DELETE"):
        assert code_of(guard, method, "/x", origin="http://evil.example", host=same["host"])
    # A cross-origin read is the browser's to block (no CORS headers); /mcp is checked anyway.
    assert code_of(guard, "GET", "/api/agents", origin="http://evil.example", **HOST) is None
    got = code_of(guard, "GET", "/mcp", origin="http://evil.example", **HOST)
    assert got == (403, "REACH_FORBIDDEN_ORIGIN")


def test_post_must_be_json() -> None:
    guard = HttpGuard(bind_host="127.0.0.1")
    for content_type in ("application/json", "Application/JSON; charset=utf-8"):
        assert code_of(guard, "POST", "/mcp", content_type=content_type, **HOST) is None
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/jsonx"):
        got = code_of(guard, "POST", "/mcp", content_type=content_type, **HOST)
        assert got == (415, "REACH_UNSUPPORTED_MEDIA_TYPE"), content_type
    assert code_of(guard, "POST", "/mcp", **HOST) == (415, "REACH_UNSUPPORTED_MEDIA_TYPE")
    assert code_of(guard, "GET", "/metrics", **HOST) is None


def test_bearer_scheme_is_case_insensitive() -> None:
    guard = HttpGuard(bind_host="127.0.0.1", token=TOKEN)
    for value in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f" Bearer  {TOKEN} "):
        assert code_of(guard, "GET", "/api/agents", True, authorization=value, **HOST) is None
    for value in (TOKEN, f"Basic {TOKEN}", "Bearer wrong-token-of-the-hub", "Bearer", ""):
        got = code_of(guard, "GET", "/api/agents", True, authorization=value, **HOST)
        assert got == (401, "REACH_UNAUTHORIZED"), value
    assert code_of(guard, "GET", "/metrics", False, **HOST) is None  # open route: no token
    # Origin and Host are judged before the token: a stranger learns nothing about it.
    got = code_of(
        guard,
        "POST",
        "/mcp",
        True,
        origin="http://evil.example",
        content_type="application/json",
        **HOST,
    )
    assert got == (403, "REACH_FORBIDDEN_ORIGIN")


def test_a_declared_body_over_the_bound_is_refused_after_the_other_checks() -> None:
    guard = HttpGuard(bind_host="127.0.0.1", token=TOKEN, max_body=100)
    ok = {"content_type": "application/json", "authorization": f"Bearer {TOKEN}", **HOST}
    assert code_of(guard, "POST", "/api/x", True, content_length="100", **ok) is None
    for length in ("101", str(1 << 40), "-1", "1e9"):
        got = code_of(guard, "POST", "/api/x", True, content_length=length, **ok)
        assert got == (413, "REACH_PAYLOAD_TOO_LARGE"), length
    # A stranger without the token learns nothing more: 401 first.
    got = code_of(guard, "POST", "/api/x", True, content_length="101", **JSON, **HOST)
    assert got == (401, "REACH_UNAUTHORIZED")
    assert (
        code_of(
            HttpGuard(bind_host="127.0.0.1"), "POST", "/x", content_length="9" * 30, **JSON, **HOST
        )
        is None
    )


def test_refusals_are_typed_in_the_settings_too() -> None:
    s = MeshSettings(http_allowed_hosts="hub-1, hub-2", http_allowed_origins="https://a.example")
    assert s.http_allowed_hosts == ("hub-1", "hub-2")
    assert s.http_allowed_origins == ("https://a.example",)
    assert MeshSettings().http_host == "127.0.0.1"  # loopback unless told otherwise


# --------------------------------------------------------------------------- a real hub


def echo_agent(agent_id: str, settings: MeshSettings) -> Agent:
    agent = Agent(agent_id, settings=settings)

    @agent.handler("work:echo:v1", tool="echo")
    async def echo(task: Task[Any]) -> Any:
        return task.payload

    return agent


@pytest.fixture
async def open_hub(settings: MeshSettings) -> AsyncIterator[Hub]:
    """A hub with HTTP on and no token (the default the issue was found with)."""
    async with Hub(settings=settings.model_copy(update={"http_port": 0})) as hub:
        yield hub


def refused(hub: Hub, code: str) -> float:
    value: float = hub.metrics.http_refused_total.labels(code)._value.get()
    return value


async def test_a_websocket_never_passes_the_guard(settings: MeshSettings, namespace: str) -> None:
    """The hub serves no websocket, and the guard judges HTTP requests: a websocket handshake
    (which browsers send across origins without asking, and uvicorn turns into a websocket
    scope when the ``websockets`` package is installed) went on to the app unjudged — no
    Host, Origin or token check — into the A2A mount, which answered 404
    ``REACH_UNKNOWN_NAMESPACE`` for a namespace without agents and raised for one with (an
    ERROR traceback each): any web page could list the hub's tenants. It is closed before
    any route, as no route takes it."""
    from reach_mesh.hub.http import GuardMiddleware

    token = settings.model_copy(update={"http_port": 0, "http_token": TOKEN})
    async with Hub(settings=token) as hub:
        entered: list[str] = []

        async def inner(scope: Any, receive: Any, send: Any) -> None:
            entered.append(scope["path"])

        guard = GuardMiddleware(inner, hub.http)
        for path in (f"/a2a/{namespace}/", "/mcp", "/api/agents", "/"):
            sent: list[MutableMapping[str, Any]] = []

            async def send(message: MutableMapping[str, Any]) -> None:
                sent.append(message)  # noqa: B023 - awaited within the iteration

            async def receive() -> dict[str, Any]:
                return {"type": "websocket.connect"}

            scope = {"type": "websocket", "path": path, "headers": [(b"host", b"127.0.0.1")]}
            await guard(scope, receive, send)
            assert [m["type"] for m in sent] == ["websocket.close"], (path, sent)
        assert entered == []


async def test_hub_refuses_cross_origin_rebinding_and_non_json_posts(
    open_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)
    async with agent:
        base = open_hub.http_url
        assert base is not None
        own = base.removeprefix("http://")
        cordon = f"{base}/api/agents/{agent.agent_id}/cordon"
        view = open_hub.registry.agents[agent.agent_id]
        attempts: list[tuple[dict[str, str], int, str]] = [
            ({"Origin": "http://evil.example"}, 403, "REACH_FORBIDDEN_ORIGIN"),
            ({"Origin": "null"}, 403, "REACH_FORBIDDEN_ORIGIN"),
            ({"Content-Type": "text/plain"}, 415, "REACH_UNSUPPORTED_MEDIA_TYPE"),
            ({"Host": f"rebind.example:{open_hub.http.port}"}, 403, "REACH_FORBIDDEN_HOST"),
        ]
        for headers, status, code in attempts:
            got, body = await fetch(cordon, "POST", b"{}", headers=headers)
            assert (got, json.loads(body)["error"]["code"]) == (status, code), headers
        rpc = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
        got, body = await fetch(f"{base}/mcp", "POST", rpc, {"Origin": "http://evil.example"})
        assert got == 403 and json.loads(body)["error"]["code"] == "REACH_FORBIDDEN_ORIGIN"
        got, _ = await fetch(f"{base}/metrics", headers={"Host": "rebind.example"})
        assert got == 403
        await asyncio.sleep(0.1)
        assert view.state is AgentState.ONLINE  # none of them did anything
        assert refused(open_hub, "REACH_FORBIDDEN_ORIGIN") == 3
        assert refused(open_hub, "REACH_UNSUPPORTED_MEDIA_TYPE") == 1
        assert refused(open_hub, "REACH_FORBIDDEN_HOST") == 2
        # The hub's own origin (the dashboard) and non-browser clients (no Origin) may act.
        got, body = await fetch(cordon, "POST", b"{}", {"Origin": f"http://{own}"})
        assert got == 200, body
        await eventually(lambda: view.state is AgentState.CORDONED)
        got, body = await fetch(f"{base}/api/agents/{agent.agent_id}/uncordon", "POST")
        assert got == 200, body
        init = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"},
                },
            }
        ).encode()
        mcp_headers = {"Origin": f"http://{own}", "Accept": "application/json, text/event-stream"}
        got, body = await fetch(f"{base}/mcp", "POST", init, mcp_headers)
        assert got == 200 and b'"listChanged":true' in body, body


async def _post_raw(
    port: int,
    path: str,
    body: bytes,
    *,
    chunked: bool,
    headers: str = "Content-Type: application/json\r\n",
    pause: float = 0.0,
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One POST on a socket of its own: the body with its ``Content-Length``, or chunked (64 KiB
    chunks, no length said), ``pause`` seconds between its halves; the status, (lower-case)
    headers and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
        writer.write(f"{head}{framing}\r\n\r\n".encode())
        if chunked:
            body = b"".join(
                b"%x\r\n%s\r\n" % (len(part), part)
                for part in (body[i : i + 64 * 1024] for i in range(0, len(body), 64 * 1024))
            )
            body += b"0\r\n\r\n"
        half = len(body) // 2 if pause else len(body)
        for part in (body[:half], body[half:]):
            writer.write(part)
            await writer.drain()  # a client still sending when it is reset: ConnectionError
            await asyncio.sleep(pause)
        return await _answer(reader)
    finally:
        writer.close()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    status_line, _, rest = (await reader.readuntil(b"\r\n\r\n")).partition(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in rest.split(b"\r\n") if b": " in line)
    answer = await reader.readexactly(int(headers[b"content-length"]))
    return int(status_line.split()[1]), headers, answer


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
async def test_a_body_over_the_bound_is_refused_before_any_route_reads_it(
    settings: MeshSettings, namespace: str, chunked: bool
) -> None:
    """The admin and cancel routes (FastAPI's body parsing) read a body of any size: 200 MB sent
    to ``/api/agents/<id>/cordon`` in open mode was read whole (the hub's RSS past 900 MB) and
    the cordon done, its padding ignored. Every route now takes at most ``max_payload`` and
    64 KiB, declared or chunked: past it 413 with the typed body, and nothing done."""
    s = settings.model_copy(update={"http_port": 0, "max_payload": 4096})
    async with Hub(settings=s) as hub, echo_agent(f"{namespace}.w.a1", settings) as agent:
        view = hub.registry.agents[agent.agent_id]
        limit = hub.http.guard.max_body
        assert limit == 4096 + 64 * 1024
        pad = json.dumps({"reason": "big", "pad": "x" * (limit + 100 * 1024)}).encode()
        paths = [
            f"/api/agents/{agent.agent_id}/cordon",
            f"/api/workflows/wf-1/cancel?namespace={namespace}",
            f"/api/route?namespace={namespace}",
            "/mcp",
            f"/a2a/{namespace}/",
        ]
        for path in paths:
            status, _, answer = await _post_raw(hub.http.port, path, pad, chunked=chunked)
            assert status == 413, (path, answer[:300])
            error = json.loads(answer)["error"]
            if path.startswith("/a2a/"):  # JSON-RPC's shape there: an invalid request
                assert error["code"] == -32600 and "over this hub's limit" in error["message"]
                continue
            assert error["code"] == "REACH_PAYLOAD_TOO_LARGE", (path, error)
            assert error["details"]["max_size"] == limit, (path, error)
        assert refused(hub, "REACH_PAYLOAD_TOO_LARGE") == len(paths)
        await asyncio.sleep(0.1)
        assert view.state is AgentState.ONLINE  # the cordon was not done
        # Within the bound, chunked or not, the route reads the body as sent.
        small = json.dumps({"reason": "within", "pad": "x" * 1000}).encode()
        path = f"/api/agents/{agent.agent_id}/cordon"
        status, _, answer = await _post_raw(hub.http.port, path, small, chunked=chunked)
        assert status == 200, answer
        await eventually(lambda: view.state is AgentState.CORDONED)


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
async def test_a_client_still_sending_a_refused_body_reads_the_answer(
    settings: MeshSettings, namespace: str, chunked: bool
) -> None:
    """The guard answered a body over the bound before reading it, and uvicorn closed the
    connection (the client said ``Connection: close``, as urllib does) with the body's bytes
    unread under it: the client, still sending, got the connection reset instead of the 413
    (ci179, the fuzz test). The refused body is now read and dropped before the answer — here
    1 MiB over the bound, its second half sent after the first was refused — and every refusal
    reaches the client, 413 or another (415), its connection closed cleanly after it."""
    s = settings.model_copy(update={"http_port": 0, "max_payload": 4096})
    async with Hub(settings=s) as hub:
        limit = hub.http.guard.max_body
        assert limit is not None
        big = b"x" * (limit + (1 << 20))
        cases = [
            (f"/api/agents/{namespace}.w.a1/cordon", big, "application/json", 413),
            (f"/a2a/{namespace}/", big, "application/json", 413),
            (f"/api/agents/{namespace}.w.a1/cordon", big[: 1 << 20], "text/plain", 415),
        ]
        for path, body, media, status in cases:
            got, headers, answer = await _post_raw(
                hub.http.port,
                path,
                body,
                chunked=chunked,
                headers=f"Content-Type: {media}\r\nConnection: close\r\n",
                pause=0.2,
            )
            assert got == status, (path, answer[:300])
            assert headers[b"connection"] == b"close"
            assert json.loads(answer)["error"], answer[:300]
        # And as the fuzz test's client sends it (urllib: its body whole, then the answer).
        for _ in range(20):
            got, answer = await fetch(f"{hub.http_url}/a2a/{namespace}/", "POST", big)
            assert got == 413 and json.loads(answer)["error"]["code"] == -32600, answer[:300]


async def test_a_body_too_large_to_drop_is_answered_unread_and_its_connection_closed(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the guard does not read for nothing, it answers at once, saying
    ``Connection: close`` (a client that goes on sending may then see a reset): a declared
    length past ``DISCARD_MIN``; a body whose client waits for ``100 Continue`` (it sends
    none when answered first); a body still coming after ``DISCARD_TIMEOUT``."""
    from reach_mesh.hub import http

    monkeypatch.setattr(http, "DISCARD_TIMEOUT", 0.3)
    s = settings.model_copy(update={"http_port": 0, "max_payload": 4096})
    async with Hub(settings=s) as hub:
        limit = hub.http.guard.max_body
        assert limit is not None
        head = (
            f"POST /api/agents/x.w.a1/cordon HTTP/1.1\r\nHost: 127.0.0.1:{hub.http.port}\r\n"
            "Content-Type: application/json\r\n"
        )
        sends = {
            "too large to drop": f"Content-Length: {http.DISCARD_MIN + 1}\r\n\r\n",
            "expecting 100": f"Content-Length: {limit + 1}\r\nExpect: 100-continue\r\n\r\n",
            "too slow": f"Content-Length: {limit + 1}\r\n\r\n" + "x" * 1000,
        }
        for case, rest in sends.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", hub.http.port)
            try:
                writer.write((head + rest).encode())
                status, headers, answer = await asyncio.wait_for(_answer(reader), 5)
                assert status == 413, (case, answer)
                assert headers[b"connection"] == b"close", (case, headers)
                assert await asyncio.wait_for(reader.read(), 5) == b"", case  # closed
            finally:
                writer.close()


async def test_a_request_head_is_bounded_in_bytes_and_time(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's head (request line and headers) arrives before the guard and any token
    check, and uvicorn's httptools protocol bounded it neither in bytes nor in time: one
    connection, no token, sent 160 MB of small headers and held the hub at 2.7 GB (its
    event loop up to 2.5 s late), and a connection with half a head, or none, stayed open for
    good (slowloris). Past ``HEAD_MAX`` bytes: a typed 431; past ``HEAD_TIMEOUT``: a typed
    408 (a connection that sent nothing is closed); what httptools cannot parse, a typed 400
    (it was uvicorn's plain text). A head within the bound, and a body of any allowed size
    after it, still pass."""
    monkeypatch.setattr(_asgi, "HEAD_TIMEOUT", 0.5)
    s = settings.model_copy(update={"http_port": 0, "http_token": TOKEN})
    async with Hub(settings=s) as hub:
        port = hub.http.port
        auth = f"Host: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"

        async def head(lines: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"GET /api/agents HTTP/1.1\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # a read of its own: the bound counts what follows
                writer.write(lines)
                await writer.drain()
                return await asyncio.wait_for(_answer(reader), 5)
            finally:
                writer.close()

        filler = b"X-Filler: abcdefgh\r\n"
        within = filler * (40_000 // len(filler))
        status, _, _ = await head(auth.encode() + within + b"\r\n")
        assert status == 200  # 40 KB of headers: within the bound
        status, headers, body = await head(
            auth.encode() + filler * (_asgi.HEAD_MAX // len(filler) + 100)
        )
        assert status == 431 and headers[b"connection"] == b"close"
        assert json.loads(body)["error"]["code"] == "REACH_PAYLOAD_TOO_LARGE"
        # Half a head, then nothing: answered when the time is up, not held open.
        started = asyncio.get_running_loop().time()
        status, _, body = await head(auth.encode())
        assert status == 408 and json.loads(body)["error"]["code"] == "REACH_TIMEOUT"
        assert asyncio.get_running_loop().time() - started < 3
        # A connection that sends nothing at all is closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # What httptools cannot parse is refused typed too, not in uvicorn's plain text.
        for garbage in (
            b"GARBAGE\r\n\r\n",
            b"POST /api/route HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n",
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(garbage)
            status, headers, body = await asyncio.wait_for(_answer(reader), 5)
            writer.close()
            assert (status, json.loads(body)["error"]["code"]) == (400, "REACH_BAD_REQUEST")
        # The bound is the head's: a body past it, on a connection of its own, still passes.
        status, _, body = await _post_raw(
            port,
            f"/api/route?namespace={settings.namespace}",
            json.dumps({"capability": "x:y:v1", "payload": "p" * 200_000}).encode(),
            chunked=False,
            headers=f"Content-Type: application/json\r\nAuthorization: Bearer {TOKEN}\r\n",
        )
        assert json.loads(body)["error"]["code"] == "REACH_NO_MATCH", (status, body)


async def test_idle_connections_past_the_cap_make_room_for_requests(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections were not bounded: 1,100 idle ones to a hub whose file-descriptor limit was
    1,024 (a common default) had 12 of its 13 routes over HTTP reset in 15 s (uvloop; on
    asyncio every one timed out and the loop logged 35,913 ``accept`` tracebacks in 20 s).
    Past the cap a new connection closes the one waiting longest for a request's head, so a
    flood of idle connections pushes out its own and a client that sends its request gets
    its answer."""
    monkeypatch.setattr(_asgi, "CONNECTIONS_MAX", 20)
    async with Hub(settings=settings.model_copy(update={"http_port": 0})) as hub:
        assert hub.http_url is not None
        idle = [await asyncio.open_connection("127.0.0.1", hub.http.port) for _ in range(40)]
        try:
            status, _ = await fetch(f"{hub.http_url}/healthz")
            assert status == 200

            async def closed(reader: asyncio.StreamReader) -> bool:
                try:
                    return await asyncio.wait_for(reader.read(), 2) == b""
                except (TimeoutError, ConnectionError):
                    return False

            shut = await asyncio.gather(*(closed(r) for r, _ in idle))
            # The oldest went first: at most the cap's worth are left open.
            assert sum(shut) >= 20 and all(shut[:20]), shut
        finally:
            for _, writer in idle:
                writer.close()


async def test_a_body_that_stops_coming_has_its_connection_closed(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request whose body stopped coming held its connection, and the route reading it, for
    good: a token holder (anyone, on a hub without a token) could fill the connection cap with
    them. After ``BODY_IDLE_TIMEOUT`` without a byte the connection is closed; the route sees
    the client gone and nothing is logged at ERROR."""
    monkeypatch.setattr(_asgi, "BODY_IDLE_TIMEOUT", 0.5)
    s = settings.model_copy(update={"http_port": 0, "http_token": TOKEN})
    async with Hub(settings=s) as hub:
        for path in ("/api/agents/x.y.z/cordon", f"/api/route?namespace={settings.namespace}"):
            reader, writer = await asyncio.open_connection("127.0.0.1", hub.http.port)
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                'Content-Length: 100\r\n\r\n{"reason":'.encode()
            )
            started = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 5) == b"", path
            assert asyncio.get_running_loop().time() - started < 3
            writer.close()
        await asyncio.sleep(0.1)
        status, _ = await fetch(f"{hub.http_url}/healthz")
        assert status == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_metrics_want_the_token_only_when_asked(settings: MeshSettings) -> None:
    """``/metrics`` names namespaces and capabilities, and stays open by default (scrapers
    without a token keep working); with ``http_metrics_auth`` it wants the API's bearer token,
    as Prometheus sends it (``authorization: {credentials: ...}``), and the OpenAPI document
    says so. ``/healthz`` stays open for probes either way."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for asked in (False, True):
        s = settings.model_copy(
            update={"http_port": 0, "http_token": TOKEN, "http_metrics_auth": asked}
        )
        async with Hub(settings=s) as hub:
            base = hub.http_url
            assert base is not None
            status, body = await fetch(f"{base}/metrics")
            if asked:
                assert status == 401, body
                assert json.loads(body)["error"]["code"] == "REACH_UNAUTHORIZED"
                status, body = await fetch(f"{base}/metrics", headers={"Authorization": "x"})
                assert status == 401, body
            else:
                assert status == 200 and b"reach_" in body, body[:200]
            status, body = await fetch(f"{base}/metrics", headers=bearer)
            assert status == 200 and b"reach_" in body, body[:200]
            assert (await fetch(f"{base}/healthz"))[0] == 200
            _, doc = await fetch(f"{base}/openapi.json")
            metrics = json.loads(doc)["paths"]["/metrics"]["get"]
            assert ("security" in metrics) is asked, metrics
            assert ("401" in metrics["responses"]) is asked, metrics["responses"]


# --------------------------------------------------------------------------- a real browser


async def _attacker_site(framing: str | None = None) -> AsgiServer:
    """Another origin on this machine: any page the operator happens to visit; ``framing``:
    with that page in a frame all but transparent over a button of its own."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    bait = (
        ""
        if framing is None
        else '<button style="position:absolute;left:0;top:0">claim your prize</button>'
        f'<iframe src="{framing}" style="position:absolute;left:0;top:0;width:1400px;'
        'height:1000px;opacity:0.05;border:0"></iframe>'
    )

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(f"<!doctype html><title>cat pictures</title>{bait}")

    site = AsgiServer(Starlette(routes=[Route("/", page)]))
    await site.start("127.0.0.1", 0)
    return site


@needs_chromium
async def test_page_from_another_origin_cannot_act_on_the_hub(
    open_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)
    site = await _attacker_site()
    try:
        async with agent:
            view = open_hub.registry.agents[agent.agent_id]
            hub_url = open_hub.http_url
            cordon = json.dumps(f"{hub_url}/api/agents/{agent.agent_id}/cordon")
            mcp = json.dumps(f"{hub_url}/mcp")
            call = json.dumps(
                json.dumps(
                    {
                        "jsonrpc": "2.0",
                        "id": 1,
                        "method": "tools/call",
                        "params": {"name": "echo", "arguments": {"x": 1}},
                    }
                )
            )
            # What the attacker page did, and its variants: simple requests the browser
            # sends without asking (no-cors, text/plain, a form), and a JSON one (preflighted).
            script = f"""(async () => {{
              const out = [];
              const tries = [
                () => fetch({cordon}, {{method: "POST", mode: "no-cors"}}),
                () => fetch({cordon}, {{method: "POST", mode: "no-cors", body: "{{}}",
                                        headers: {{"Content-Type": "text/plain"}}}}),
                () => fetch({mcp}, {{method: "POST", mode: "no-cors", body: {call}}}),
                () => fetch({cordon}, {{method: "POST", body: "{{}}",
                                        headers: {{"Content-Type": "application/json"}}}}),
              ];
              for (const t of tries) {{
                try {{ const r = await t(); out.push(r.type + " " + r.status); }}
                catch (e) {{ out.push("blocked " + e.name); }}
              }}
              return out;
            }})()"""

            def attack() -> Any:
                with Chromium() as browser:
                    browser.open(f"http://127.0.0.1:{site.port}/")
                    return browser.evaluate(script)

            outcomes = await asyncio.to_thread(attack)
            # The no-cors ones went out (opaque answers); the JSON one died in its preflight.
            assert outcomes[:3] == ["opaque 0"] * 3, outcomes
            assert outcomes[3] == "blocked TypeError", outcomes
            await asyncio.sleep(0.1)
            assert view.state is AgentState.ONLINE
            assert not view.record.cordoned
            # They did reach the hub, which refused them by Origin before anything ran.
            assert refused(open_hub, "REACH_FORBIDDEN_ORIGIN") == 3
    finally:
        await site.close()


async def test_no_page_of_the_hub_may_be_framed(settings: MeshSettings) -> None:
    """Every answer but the gateway's says no page may show it in a frame (``X-Frame-Options:
    DENY``, CSP ``frame-ancestors 'none'``): the dashboard at ``/`` and at
    ``/static/dashboard.html``, and the API's answers, refusals included."""
    hub_settings = settings.model_copy(update={"http_port": 0, "http_token": TOKEN})

    def headers_of(url: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.headers
        except urllib.error.HTTPError as err:
            return err.code, err.headers

    async with Hub(settings=hub_settings) as hub:
        for path in ("/", "/static/dashboard.html", "/healthz", "/api/agents"):
            status, headers = await asyncio.to_thread(headers_of, f"{hub.http_url}{path}")
            assert status in (200, 401), (path, status)
            assert headers.get("X-Frame-Options") == "DENY", path
            assert headers.get("Content-Security-Policy") == "frame-ancestors 'none'", path


@needs_chromium
async def test_a_page_of_another_origin_cannot_frame_the_dashboard(
    settings: MeshSettings, namespace: str
) -> None:
    """Clickjacking: a page of another origin (here another port of the same host — the same
    site, whose frames share the tab's storage) shows the dashboard in a frame of its own,
    all but transparent over a button of its own, and the user's click lands on the
    dashboard's ``cordon``; its prompt ("Cordon …? Why?") is answered with Enter. Before, the
    frame held the dashboard, with the token the operator opened it with earlier in the same
    tab (``sessionStorage``), and the agent was cordoned: the Origin, content-type and token
    checks all pass for the dashboard's own request. The hub's pages may not be framed now."""
    hub_settings = settings.model_copy(update={"http_port": 0, "http_token": TOKEN})
    async with Hub(settings=hub_settings) as hub, echo_agent(f"{namespace}.w.a1", settings) as a:
        view = hub.registry.agents[a.agent_id]
        button = f'button[data-op="cordon"][data-agent="{a.agent_id}"]'
        for page in ("/", "/static/dashboard.html"):
            site = await _attacker_site(framing=f"{hub.http_url}{page}")
            try:

                def clickjack(port: int = site.port) -> tuple[bool, str | None]:
                    with Chromium() as browser:
                        browser.open(f"{hub.http_url}/#token={TOKEN}")  # earlier, in this tab
                        browser.open(f"http://127.0.0.1:{port}/")
                        clicked = browser.click_in_frame(button, wait=3.0)
                        return clicked, browser.accept_dialog(2.0) if clicked else None

                clicked, asked = await asyncio.to_thread(clickjack)
                assert (clicked, asked) == (False, None), (page, asked)
                await asyncio.sleep(0.2)
                assert not view.record.cordoned and view.state is AgentState.ONLINE, page
            finally:
                await site.close()


@needs_chromium
async def test_dns_rebinding_page_is_refused_by_host(
    open_hub: Hub, settings: MeshSettings, namespace: str
) -> None:
    agent = echo_agent(f"{namespace}.w.a1", settings)
    async with agent:
        view = open_hub.registry.agents[agent.agent_id]
        port = open_hub.http.port
        path = json.dumps(f"/api/agents/{agent.agent_id}/cordon")
        script = f"""fetch({path}, {{method: "POST", body: "{{}}",
                         headers: {{"Content-Type": "application/json"}}}})
                     .then(async r => [r.status, (await r.json()).error.code])"""

        def rebound() -> Any:
            # rebind.test resolves to the hub's address, as an attacker's DNS would make it:
            # to the browser the page and the API are then one origin.
            with Chromium("--host-resolver-rules=MAP rebind.test 127.0.0.1") as browser:
                browser.open(f"http://rebind.test:{port}/healthz")
                return browser.evaluate(script)

        assert await asyncio.to_thread(rebound) == [403, "REACH_FORBIDDEN_HOST"]
        assert view.state is AgentState.ONLINE


@needs_chromium
async def test_dashboard_with_the_token_acts_from_its_own_origin(
    settings: MeshSettings, namespace: str
) -> None:
    hub_settings = settings.model_copy(update={"http_port": 0, "http_token": TOKEN})
    async with Hub(settings=hub_settings) as hub, echo_agent(f"{namespace}.w.a1", settings) as a:
        view = hub.registry.agents[a.agent_id]
        agent_id = json.dumps(a.agent_id)

        def operate() -> Any:
            with Chromium() as browser:
                browser.open(f"{hub.http_url}/#token={TOKEN}")
                # Without the token the API answers 401, even from the hub's own origin...
                bare = browser.evaluate(
                    f"""fetch("/api/agents/" + {agent_id} + "/cordon", {{method: "POST",
                         body: "{{}}", headers: {{"Content-Type": "application/json"}}}})
                         .then(r => r.status)"""
                )
                # ...and the dashboard's own cordon action (token from #token=) works, once
                # the operator confirms it.
                browser.evaluate("window.prompt = () => ''")
                browser.evaluate(f"act({agent_id}, 'cordon').then(() => 'done')")
                return bare

        assert await asyncio.to_thread(operate) == 401
        await eventually(lambda: view.state is AgentState.CORDONED)
        async with Client(settings=settings) as c:
            assert (await c.inspect(a.agent_id)).state is AgentState.CORDONED
