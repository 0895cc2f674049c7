"""The monitor's web server: one page, its script and style, and the JSON API, on aiohttp.

Owned here: ``make_app`` (routes, checks, headers) and ``MonitorServer`` (the app in a thread of its own with
its own event loop, so that synchronous callers — a bootstrap, the local run — can start and stop it).

Routes (GET and HEAD only; anything else is 405, an unknown path 404):

- ``/``: the page (static HTML: no peer data is ever written into it on the server side);
- ``/static/monitor.js``, ``/static/monitor.css``: its script and style, from this package;
- ``/api/status``: the newest status (``monitor.status``), 503 before the first read;
- ``/api/history?since=T&limit=N``: the samples newer than ``T`` (wall-clock seconds), at most ``N``;
- ``/favicon.ico``: 204 (there is none; browsers ask).

Every response carries a strict Content-Security-Policy (scripts, styles and fetches from this origin only;
no inline script, no frames, no forms), ``nosniff``, ``no-referrer`` and ``Cache-Control: no-store``.
Requests whose Host header names neither an IP address, ``localhost`` nor one of ``allowed_hosts`` are
refused (403): a web page on another site cannot reach the monitor through DNS rebinding. Unknown or bad
query parameters are 400. An error in a handler is logged and answered with a bare 500: no traceback leaves.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import threading
from importlib import resources
from typing import Any, Protocol

from echo_p2p.monitor.config import MonitorConfig

logger = logging.getLogger(__name__)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
#: path -> (file in static/, content type)
STATIC = {
    "/": ("index.html", "text/html"),
    "/static/monitor.js": ("monitor.js", "text/javascript"),
    "/static/monitor.css": ("monitor.css", "text/css"),
}


class StatusSource(Protocol):
    """What the server reads: ``monitor.poller.Poller`` (or a fake in tests)."""

    def latest(self) -> dict[str, Any] | None: ...

    def history(self, after: float, limit: int) -> list[dict[str, Any]]: ...


def host_allowed(host_header: str | None, allowed_hosts: list[str]) -> bool:
    """Whether a request's Host header names this machine in a way DNS rebinding cannot fake: an IP address
    literal, ``localhost``, or a name the operator allowed."""
    if not host_header or len(host_header) > 300:
        return False
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        name, _, _ = host[1:].partition("]")
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name in ("localhost", *[h.lower() for h in allowed_hosts]):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BadRequest(ValueError):
    """A query parameter that is unknown or out of range (answered 400 with the message)."""


def parse_history_query(query, history_size: int) -> tuple[float, int]:
    """``since`` (finite float, default 0) and ``limit`` (1..history_size, default history_size)."""
    unknown = set(query) - {"since", "limit"}
    if unknown:
        raise BadRequest(f"unknown parameter {sorted(unknown)[0][:40]!r}")
    if len(query.getall("since", [])) > 1 or len(query.getall("limit", [])) > 1:
        raise BadRequest("each parameter may be given once")
    try:
        since = float(query.get("since", "0"))
        limit = int(query.get("limit", str(history_size)))
    except ValueError:
        raise BadRequest("since must be a number of seconds and limit an integer") from None
    if not math.isfinite(since):
        raise BadRequest("since must be finite")
    if not 1 <= limit <= history_size:
        raise BadRequest(f"limit must be between 1 and {history_size}")
    return since, limit


def make_app(source: StatusSource, config: MonitorConfig):
    from aiohttp import web

    files = {
        path: (resources.files("echo_p2p.monitor").joinpath("static", name).read_bytes(), ctype)
        for path, (name, ctype) in STATIC.items()
    }

    def json_response(data: Any, status: int = 200) -> web.Response:
        return web.Response(
            status=status,
            body=json.dumps(data, allow_nan=False, separators=(",", ":")).encode(),
            content_type="application/json",
        )

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        if not host_allowed(request.headers.get("Host"), config.allowed_hosts):
            response: web.StreamResponse = web.Response(status=403, text="403: host not allowed\n")
        else:
            try:
                response = await handler(request)
            except BadRequest as exc:
                response = web.Response(status=400, text=f"400: {exc}\n")
            except web.HTTPException as exc:  # 404, 405 from the router
                response = web.Response(status=exc.status, text=f"{exc.status}: {exc.reason}\n")
            except Exception:
                logger.exception("monitor: error answering %s", request.path[:200])
                response = web.Response(status=500, text="500: internal error\n")
        response.headers.update(SECURITY_HEADERS)
        return response

    async def static(request: web.Request) -> web.Response:
        if request.query:
            raise BadRequest("this page takes no parameters")
        body, ctype = files[request.path]
        return web.Response(body=body, content_type=ctype, charset="utf-8")

    async def api_status(request: web.Request) -> web.Response:
        if request.query:
            raise BadRequest("/api/status takes no parameters")
        latest = source.latest()
        if latest is None:
            return json_response({"error": "no read of the DHT yet"}, status=503)
        return json_response(latest)

    async def api_history(request: web.Request) -> web.Response:
        since, limit = parse_history_query(request.query, config.history_size)
        return json_response({"samples": source.history(since, limit)})

    async def no_icon(request: web.Request) -> web.Response:
        return web.Response(status=204)

    app = web.Application(middlewares=[guard], client_max_size=4096)
    app.router.add_get("/favicon.ico", no_icon)
    for path in STATIC:
        app.router.add_get(path, static)
    app.router.add_get("/api/status", api_status)
    app.router.add_get("/api/history", api_history)
    return app


class MonitorServer:
    """``make_app`` served on ``config.host:config.port`` from a thread with its own event loop."""

    def __init__(self, source: StatusSource, config: MonitorConfig):
        self.source = source
        self.config = config
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.config.host
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return f"http://{host}:{self.port}/"
        if ip.is_unspecified:
            host = "127.0.0.1" if ip.version == 4 else "[::1]"
        elif ip.version == 6:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"

    def start(self, timeout: float = 15.0) -> str:
        """Listen and serve; returns the page's URL. ``OSError`` if the address cannot be bound."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # reported to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="monitor-http", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the monitor did not start listening within {timeout:.0f} s")
        if failure:
            raise failure[0]
        return self.url

    async def _serve(self) -> None:
        from aiohttp import web

        self._runner = web.AppRunner(make_app(self.source, self.config), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=False)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (idempotent); never waits longer than ``timeout``."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
