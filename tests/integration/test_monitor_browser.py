"""The monitor page in a real browser (headless Chromium over its DevTools protocol): peer-supplied strings
made of markup (a fake status from hostile records) end up as text, never as elements, and run no script.
Skipped, with the install line, where Chromium is absent. The page of a live local swarm is
``test_local_run.py``'s (one run serves that page and the learning checks).
"""

from __future__ import annotations

import json
import time

import pytest

from echo_p2p.guard.trust import RunTrust, TrustedTrainers
from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.server import MonitorServer
from echo_p2p.monitor.status import Snapshot, build_status
from echo_p2p.net.run_record import RunRecord
from tests.browser import INSTALL_LINE, Browser, chromium_path
from tests.unit.monitor.fakes import INF_A, TRAINER, bans, peer, trainer

pytestmark = [pytest.mark.timeout(180)]

CHROMIUM = chromium_path()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason=f"needs Chromium: {INSTALL_LINE}")

HOSTILE_SOFTWARE = '<img src=x onerror="window.pwned=1">'
HOSTILE_ID = '<svg onload="window.pwned=3">'
HOSTILE_MODEL = "<script>window.pwned=4</script>"


class StaticSource:
    def __init__(self, status: dict):
        self.status = status

    def latest(self) -> dict:
        return self.status

    def history(self, after: float, limit: int) -> list[dict]:
        t = self.status["time"]
        return [{"time": t - 10 + i, "reward": 0.1 * i, "rollouts_consumed": 10 * i} for i in range(10)][
            -limit:
        ]


@needs_chromium
async def test_peer_supplied_markup_is_shown_as_text_and_never_runs(tmp_path):
    record = RunRecord(
        run_id="r",
        owner_key="ssh-rsa AAAA",
        trainers=[TRAINER],
        serial=1,
        issued_at=0.0,
        expires_at=time.time() + 100,
        model=HOSTILE_MODEL,
        note='"><iframe src="javascript:window.pwned=5">',
    )
    trust = RunTrust(owner="QmOwner", run_id="r")
    trust.record = record
    trust.fixed = TrustedTrainers(frozenset([TRAINER]))
    status = build_status(
        Snapshot(
            run_id="r",
            time=time.time(),
            peers=[
                trainer(software_version=HOSTILE_SOFTWARE),
                trainer(HOSTILE_ID, maddrs=['/ip4/1.2.3.4/tcp/1/"><script>window.pwned=2</script>']),
                peer(INF_A, software_version="</td><td><b>x</b>"),
            ],
            bans=[bans(TRAINER, "<b id=pwn>", reason="<i onclick=x>y</i>")],
            trust=trust,
        ),
        MonitorConfig(),
    )
    assert {a["code"] for a in status["alerts"]} == {"impostor", "banned_peers"}
    server = MonitorServer(StaticSource(status), MonitorConfig(port=0))
    url = server.start()
    browser = Browser(tmp_path / "profile", CHROMIUM)
    try:
        await browser.start()
        await browser.navigate(url)
        await browser.wait_for("document.body.dataset.state === 'ok'", 30, "the page's first status")
        found = json.loads(
            await browser.evaluate(
                """JSON.stringify({
                  pwned: window.pwned === undefined ? null : window.pwned,
                  elements: document.querySelectorAll('img, iframe, b, i, td svg, li svg, script:not([src])').length,
                  handlers: document.querySelectorAll('[onload], [onerror], [onclick]').length,
                  software: [...document.querySelectorAll('td.software')].map(td => td.textContent),
                  ids: [...document.querySelectorAll('td.peer')].map(td => td.title),
                  model: document.getElementById('model').textContent,
                  alerts: document.getElementById('alerts').textContent,
                  cells: document.querySelector('#peers tbody tr').children.length,
                })"""
            )
        )
    finally:
        await browser.close()
        server.stop()
    assert found["pwned"] is None
    assert found["elements"] == 0 and found["handlers"] == 0
    assert HOSTILE_SOFTWARE in found["software"] and "</td><td><b>x</b>" in found["software"]
    assert HOSTILE_ID in found["ids"] and found["model"] == HOSTILE_MODEL
    assert "<i onclick=x>y</i>" in found["alerts"]
    assert found["cells"] == 12  # the injected </td><td> made no cell
    assert browser.errors == [], browser.errors
