"""A real browser for tests: headless Chromium driven through its DevTools protocol over a websocket.

``Browser`` starts ``chromium`` (Debian's package) in its own process group with a fresh profile, the flags
that keep it off the network (no background networking, component updates, sync or QUIC: this machine's
network refuses such connections) and a DevTools port on 127.0.0.1 chosen by Chromium itself; it talks to
one page over aiohttp's websocket client, records uncaught exceptions and console errors, and is stopped by
process-group id. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

INSTALL_LINE = "apt-get install -y chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1280,1000",
)


def chromium_path() -> str | None:
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
    )


class Browser:
    def __init__(self, profile_dir: Path, binary: str):
        self.profile_dir = profile_dir
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.errors: list[str] = []  # uncaught exceptions and console errors of the page
        self._session = None
        self._ws = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._page_session: str | None = None

    async def start(self, timeout: float = 60.0) -> Browser:
        import aiohttp

        self.profile_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.profile_dir.parent / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, *FLAGS, f"--user-data-dir={self.profile_dir}", "about:blank"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = self.profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()}); see chromium.log")
            await asyncio.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(
            f"ws://127.0.0.1:{port}{path}",
            max_msg_size=64 * 2**20,
            timeout=aiohttp.ClientWSTimeout(ws_close=5),
        )
        self._reader = asyncio.create_task(self._read())
        target = await self.send("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
        )
        self._page_session = attached["sessionId"]
        await self.send("Runtime.enable")
        await self.send("Log.enable")
        await self.send("Page.enable")
        return self

    async def _read(self) -> None:
        async for message in self._ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.errors.append(
                    str(details.get("exception", {}).get("description") or details.get("text"))
                )
            elif data.get("method") == "Log.entryAdded" and data["params"]["entry"]["level"] == "error":
                self.errors.append(data["params"]["entry"]["text"])
            elif data.get("method") == "Runtime.consoleAPICalled" and data["params"]["type"] == "error":
                self.errors.append(" ".join(str(a.get("value")) for a in data["params"]["args"]))

    async def send(
        self, method: str, params: dict | None = None, page: bool = True, timeout: float = 30.0
    ) -> dict[str, Any]:
        msg_id = next(self._ids)
        message: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if page:
            message["sessionId"] = self._page_session
        future = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        await self._ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluating {expression[:60]!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll ``expression`` in the page until it is truthy; its value, or AssertionError at the deadline.
        An expression that throws (the page is still loading: no ``document.body`` yet) counts as not yet."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            try:
                value = await self.evaluate(expression)
            except RuntimeError as exc:
                value = exc
            else:
                if value:
                    return value
            await asyncio.sleep(0.5)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")

    async def screenshot(self, path: Path) -> bytes:
        shot = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        png = base64.b64decode(shot["data"])
        path.write_bytes(png)
        return png

    async def close(self) -> None:
        if self._ws is not None:
            try:
                await asyncio.wait_for(self._ws.close(), 5)
            except Exception:
                pass
        if self._reader is not None:
            self._reader.cancel()
        if self._session is not None:
            await self._session.close()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # chromium and its helper processes: one group
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
