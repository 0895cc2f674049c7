"""The monitor page in a real browser (headless Chromium over its DevTools protocol).

1. A live local swarm (``python -m echo_p2p.local --monitor``): the page shows the trainer and both inference
   peers and a policy version that increases, with no script error or CSP refusal; a screenshot is saved
   (``ECHO_MONITOR_SCREENSHOT=docs/monitor.png`` also writes it there: that is how the README's was taken).
   The same run's trainer gets ``--report-to tensorboard``: its event files are read back afterwards.
2. Peer-supplied strings made of markup (a fake status from hostile records) end up as text, never as
   elements, and run no script.
Skipped, with the install line, where Chromium is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from echo_p2p.guard.trust import RunTrust, TrustedTrainers
from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.server import MonitorServer
from echo_p2p.monitor.status import Snapshot, build_status
from echo_p2p.net.run_record import RunRecord
from tests.browser import INSTALL_LINE, Browser, chromium_path
from tests.conftest import wait_until
from tests.unit.monitor.fakes import INF_A, TRAINER, bans, peer, trainer

pytestmark = [pytest.mark.timeout(180)]

CHROMIUM = chromium_path()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason=f"needs Chromium: {INSTALL_LINE}")

PAGE_STATE = """JSON.stringify({
  state: document.body.dataset.state,
  roles: [...document.querySelectorAll('#peers tbody td.role')].map(td => td.textContent).sort(),
  version: document.getElementById('version').textContent,
  rewardPoints: (document.querySelector('#chart-reward polyline')?.getAttribute('points') || '')
    .split(' ').filter(Boolean).length,
  evalPoints: (document.querySelector('#chart-eval polyline.eval-accuracy')?.getAttribute('points') || '')
    .split(' ').filter(Boolean).length,
  evalAccuracy: document.getElementById('eval-accuracy').textContent,
  alerts: [...document.querySelectorAll('#alerts li')].map(li => li.dataset.code || li.textContent),
})"""


async def page_state(browser: Browser) -> dict:
    return json.loads(await browser.evaluate(PAGE_STATE))


def stop_group(proc: subprocess.Popen, grace: float = 40.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the local run stops its peers, then writes its report
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@needs_chromium
async def test_the_page_of_a_live_local_swarm_shows_its_peers_and_a_rising_version(tmp_path):
    workdir = tmp_path / "run"
    log = tmp_path / "local.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "echo_p2p.local",
            *("--monitor", "--duration", "120", "--status-period", "10", "--workdir", str(workdir)),
            "--peer-args=--report-to tensorboard",
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=str(tmp_path),
    )
    browser = Browser(tmp_path / "profile", CHROMIUM)
    try:
        found = wait_until(
            lambda: (
                re.search(r"monitor: (http://127\.0\.0\.1:\d+/)", log.read_text()) or proc.poll() is not None
            ),
            60,
            what="the monitor's URL",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        url = found.group(1)
        await browser.start()
        await browser.navigate(url)
        await browser.wait_for("document.body.dataset.state === 'ok'", 30, "the page's first status")

        async def peers_and_version() -> dict | None:
            state = await page_state(browser)
            return (
                state
                if state["roles"] == ["inference", "inference", "trainer"] and state["version"].isdigit()
                else None
            )

        first = await _wait(peers_and_version, 90, "the trainer, two inference peers and a version")
        v1 = int(first["version"])
        rising = await _wait(
            lambda: _later(
                browser,
                lambda s: (
                    s["version"].isdigit()
                    and int(s["version"]) >= v1 + 2
                    and s["rewardPoints"] >= 5
                    and s["evalPoints"] >= 2
                ),
            ),
            60,
            "a version that increases, a reward curve of 5 points and a held-out curve of 2",
        )
        assert float(rising["evalAccuracy"]) >= 0  # the card shows the publisher's held-out accuracy
        assert int(rising["version"]) > v1
        assert "no_trainer" not in rising["alerts"] and "dht_unreachable" not in rising["alerts"]
        # the table is the API's peer list
        api = json.loads(await browser.evaluate("fetch('/api/status').then(r => r.text())"))
        shown = await browser.evaluate(
            "[...document.querySelectorAll('#peers tbody td.peer')].map(td => td.title)"
        )
        assert sorted(shown) == sorted(p["peer_id"] for p in api["peers"])
        assert api["run"]["model"] == "tiny" and api["run"]["task"] == "count"
        png = await browser.screenshot(tmp_path / "monitor.png")
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
        if os.environ.get("ECHO_MONITOR_SCREENSHOT"):
            shutil.copyfile(tmp_path / "monitor.png", os.environ["ECHO_MONITOR_SCREENSHOT"])
        assert browser.errors == [], browser.errors  # no script error, no CSP refusal
    finally:
        await browser.close()
        stop_group(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
    # --report-to tensorboard reached the trainer: its event files hold the reward under TRL's name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = (workdir / "metrics" / "tensorboard").glob("trainer-*")
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert {"train/reward", "train/clip_ratio", "train/staleness"} <= set(acc.Tags()["scalars"])
    assert {"eval/reward", "eval/accuracy", "eval/pass_at_k"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("train/reward")) >= 2


async def _later(browser: Browser, predicate) -> dict | None:
    state = await page_state(browser)
    return state if predicate(state) else None


async def _wait(probe, timeout: float, what: str):
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


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
