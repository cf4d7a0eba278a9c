"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
fd 3 in, fd 4 out, JSON messages ending in NUL), stdlib only — no websocket client, no driver.

Blocking by design: tests call it through ``asyncio.to_thread`` so the hub under test keeps
serving on the event loop. Tests that need it are marked :data:`needs_chromium`.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import pytest

CHROMIUM: Final = Path("/usr/bin/chromium")
needs_chromium: Final = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} is absent: install the Debian package 'chromium' "
    "(.ci/run does) to run the browser tests",
)
FLAGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


class Chromium:
    """``with Chromium() as browser: browser.open(url); browser.evaluate("1 + 1")``."""

    def __init__(self, *extra_flags: str, timeout: float = 20.0) -> None:
        self._extra = extra_flags
        self._timeout = timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._profile = ""
        self._to: int = -1
        self._from: int = -1
        self._buffer = b""
        self._next_id = 0
        self._session = ""
        #: DevTools events received so far (console messages, exceptions, log entries).
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Chromium:
        self._profile = tempfile.mkdtemp(prefix="reach-chromium-")
        to_read, self._to = os.pipe()  # we write commands, Chromium reads fd 3
        self._from, from_write = os.pipe()  # Chromium writes fd 4, we read

        def plumb() -> None:  # in the child, before exec: the pipe ends become fds 3 and 4
            os.dup2(to_read, 3)
            os.dup2(from_write, 4)

        self._proc = subprocess.Popen(
            [
                str(CHROMIUM),
                *FLAGS,
                f"--user-data-dir={self._profile}",
                "--remote-debugging-pipe",
                *self._extra,
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=plumb,
        )
        os.close(to_read)
        os.close(from_write)
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                self._send("Browser.close", {}, None)
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
                proc.wait()
        for fd in (self._to, self._from):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def open(self, url: str) -> None:
        """Navigate the tab to ``url`` and wait until the page has loaded."""
        self._call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            state = self.evaluate("document.readyState + ' ' + location.href")
            if state.startswith("complete ") and state.split(" ", 1)[1].startswith(
                url.split("#")[0]
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"page {url} did not load")

    def watch_console(self) -> None:
        """Record the page's console messages, uncaught exceptions and browser log entries
        (failed loads, 404s) from now on; read them with :meth:`console_errors`."""
        self._call("Runtime.enable", session=True)
        self._call("Log.enable", session=True)

    def console_errors(self) -> list[str]:
        """Errors seen since :meth:`watch_console`: ``console.error``, uncaught exceptions,
        and browser log entries of level error (a resource that failed to load)."""
        self.evaluate("0")  # take in the events sent so far
        errors = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a)) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                errors.append(str(params.get("exceptionDetails")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                errors.append(f"{entry.get('text')} {entry.get('url', '')}".strip())
        return errors

    def screenshot(self, path: Path, width: int = 1440, height: int = 1000) -> Path:
        """Save the whole page (``width`` wide, at least ``height`` tall) as a PNG at ``path``."""
        self._call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = self._call(
            "Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def click_in_frame(self, selector: str, wait: float = 5.0) -> bool:
        """Click, as a user does, the middle of the first element ``selector`` finds in the
        page's first child frame (of another origin too) once it is there, within ``wait``
        seconds; False when it never is (a frame the browser refused to show holds no
        document of its own). Not waited on: a dialog the click opens would hold it."""
        self._call("Page.enable", session=True)
        self._call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=1440,
            height=1000,
            deviceScaleFactor=1,
            mobile=False,
        )
        where = f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
          if (!e) return null; const r = e.getBoundingClientRect();
          return [r.x + r.width / 2, r.y + r.height / 2]; }})()"""
        deadline = time.monotonic() + wait
        found = None
        while found is None and time.monotonic() < deadline:
            tree = self._call("Page.getFrameTree", session=True)["frameTree"]
            for child in tree.get("childFrames", [])[:1]:
                frame = child["frame"]
                world = self._call("Page.createIsolatedWorld", session=True, frameId=frame["id"])
                found = self._call(
                    "Runtime.evaluate",
                    session=True,
                    contextId=world["executionContextId"],
                    returnByValue=True,
                    expression=where,
                )["result"].get("value")
            if found is None:
                time.sleep(0.1)
        if found is None:
            return False
        click = {"x": found[0], "y": found[1], "button": "left", "clickCount": 1}
        self._call("Input.dispatchMouseEvent", session=True, type="mousePressed", **click)
        self._send("Input.dispatchMouseEvent", {"type": "mouseReleased", **click}, self._session)
        return True

    def accept_dialog(self, wait: float = 5.0) -> str | None:
        """Accept the JavaScript dialog the page opens within ``wait`` seconds (after
        :meth:`click_in_frame`), as a user pressing Enter does (a prompt answered empty): its
        message, or None when none opened."""
        deadline = time.monotonic() + wait
        while True:
            opened = [e for e in self.events if e.get("method") == "Page.javascriptDialogOpening"]
            if opened:
                self._send(
                    "Page.handleJavaScriptDialog", {"accept": True, "promptText": ""}, self._session
                )
                message: str = opened[0]["params"].get("message", "")
                return message
            try:
                event = self._receive(deadline)
            except TimeoutError:
                return None
            if "method" in event:
                self.events.append(event)

    def evaluate(self, expression: str) -> Any:
        """Run ``expression`` in the page (awaiting a promise) and return its JSON value."""
        result = self._call(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def once(self, expression: str) -> Any:
        """The value of ``expression`` in the page once it is truthy (polled every 50 ms: the
        page asks the hub, then draws); the browser's timeout bounds the wait."""
        return self.evaluate(
            f"""new Promise(ok => {{ const t = setInterval(() => {{
              const v = ({expression}); if (v) {{ clearInterval(t); ok(v); }} }}, 50); }})"""
        )

    def _call(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        msg_id = self._send(method, params, self._session if session else None)
        deadline = time.monotonic() + self._timeout
        while True:
            message = self._receive(deadline)
            if "method" in message and len(self.events) < 10_000:
                self.events.append(message)
            if message.get("id") != msg_id:
                continue  # an event, or an answer we no longer wait for
            if "error" in message:
                raise RuntimeError(f"{method}: {message['error']}")
            result: dict[str, Any] = message.get("result", {})
            return result

    def _send(self, method: str, params: dict[str, Any], session: str | None) -> int:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to, data) :]
        return self._next_id

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self._from, 1 << 16)
            if not chunk:
                raise ConnectionError("Chromium closed its DevTools pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        return message
