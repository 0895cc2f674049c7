"""The monitor's web server on 127.0.0.1 (a real aiohttp server in its thread, a fake status source): routes,
4xx for bad paths and parameters, no traceback ever, CSP and the other headers, the Host check."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator

import pytest

from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.server import CSP, MonitorServer, host_allowed

pytestmark = pytest.mark.timeout(60)

STATUS = {
    "run_id": "r",
    "time": 1.0,
    "summary": {},
    "peers": [{"software_version": "<b>x</b>"}],
    "alerts": [],
}


class FakeSource:
    def __init__(self, latest=STATUS, fail: bool = False):
        self._latest, self.fail = latest, fail
        self.asked: list[tuple[float, int]] = []

    def latest(self):
        if self.fail:
            raise RuntimeError("secret internals /srv/whatever")
        return self._latest

    def history(self, after: float, limit: int):
        self.asked.append((after, limit))
        return [{"time": after + 1, "version": 3}]


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(source=None, **config) -> MonitorServer:
        server = MonitorServer(source or FakeSource(), MonitorConfig(port=0, **config))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def get(server: MonitorServer, path: str, method: str = "GET", host: str | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    headers = {"Host": host} if host is not None else {}
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response, body


def test_page_script_and_style_are_served_with_a_strict_csp(serve):
    server = serve()
    assert server.url == f"http://127.0.0.1:{server.port}/"
    response, body = get(server, "/")
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/html")
    assert response.getheader("Content-Security-Policy") == CSP
    assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP and "default-src 'none'" in CSP
    assert response.getheader("X-Content-Type-Options") == "nosniff"
    assert response.getheader("X-Frame-Options") == "DENY"
    assert b'<script src="/static/monitor.js" defer></script>' in body
    assert b"<b>x</b>" not in body  # no peer data is ever written into the page by the server
    assert b"http://" not in body.replace(b"http://www.w3.org", b"") and b"https://" not in body  # no CDN
    response, body = get(server, "/static/monitor.js")
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/javascript")
    assert b"innerHTML" not in body and b"insertAdjacentHTML" not in body and b"eval(" not in body
    assert b"https://" not in body and b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
    response, _ = get(server, "/static/monitor.css")
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/css")
    assert get(server, "/favicon.ico")[0].status == 204


def test_api_status_serves_the_sources_latest_status_as_json(serve):
    server = serve()
    response, body = get(server, "/api/status")
    assert response.status == 200 and response.getheader("Content-Type").startswith("application/json")
    assert json.loads(body) == STATUS
    assert response.getheader("Cache-Control") == "no-store"
    response, body = get(serve(FakeSource(latest=None)), "/api/status")
    assert response.status == 503 and json.loads(body) == {"error": "no read of the DHT yet"}


def test_api_history_validates_its_parameters(serve):
    source = FakeSource()
    server = serve(source, history_size=100)
    response, body = get(server, "/api/history?since=12.5&limit=7")
    assert response.status == 200 and json.loads(body) == {"samples": [{"time": 13.5, "version": 3}]}
    assert source.asked == [(12.5, 7)]
    assert json.loads(get(server, "/api/history")[1]) and source.asked[-1] == (0.0, 100)
    for bad in (
        "since=abc",
        "since=nan",
        "since=inf",
        "limit=0",
        "limit=101",
        "limit=1.5",
        "since=1&since=2",
        "bogus=1",
        "since=" + "9" * 5000,
    ):
        response, body = get(server, f"/api/history?{bad}")
        assert response.status == 400, bad
        assert b"Traceback" not in body and body.startswith(b"400: ")
    assert get(server, "/api/status?x=1")[0].status == 400
    assert get(server, "/?x=1")[0].status == 400


def test_bad_paths_and_methods_get_4xx_and_errors_a_bare_500(serve):
    server = serve()
    for path in ("/nope", "/static/../server.py", "/static/", "/api/status/extra", "/%00", "/api//status"):
        response, body = get(server, path)
        assert 400 <= response.status < 500, path
        assert b"Traceback" not in body
        assert response.getheader("Content-Security-Policy") == CSP  # on errors too
    response, body = get(server, "/api/status", method="POST")
    assert response.status == 405 and b"Traceback" not in body
    assert get(server, "/api/status", method="HEAD")[0].status == 200
    response, body = get(serve(FakeSource(fail=True)), "/api/status")
    assert response.status == 500 and body == b"500: internal error\n"  # nothing of the error leaks


def test_host_header_must_name_this_machine_or_an_allowed_name(serve):
    server = serve(allowed_hosts=["monitor.example.org"])
    port = server.port
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        "localhost",
        f"[::1]:{port}",
        "monitor.example.org",
    ):
        assert get(server, "/api/status", host=host)[0].status == 200, host
    for host in (
        f"evil.example:{port}",
        "127.0.0.1.nip.io",
        "",
        "localhost.evil.example",
        "monitor.example.org.x",
    ):
        response, body = get(server, "/api/status", host=host)
        assert response.status == 403, host
        assert b"run_id" not in body


def test_host_allowed_parses_ports_and_ipv6():
    assert host_allowed("10.1.2.3:8470", []) and host_allowed("[fe80::1]:80", []) and host_allowed("::1", [])
    assert not host_allowed(None, []) and not host_allowed("a" * 400, [])
    assert host_allowed("Proxy.Example:443", ["proxy.example"])


def test_a_busy_port_is_an_oserror_and_the_server_binds_loopback_by_default(serve):
    server = serve()
    with pytest.raises(OSError):
        MonitorServer(FakeSource(), MonitorConfig(port=server.port)).start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass
    assert MonitorConfig().host == "127.0.0.1"
