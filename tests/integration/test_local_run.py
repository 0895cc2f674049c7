"""The README's main job, ``python -m echo_p2p.local`` (async, the built-in default, with its monitor), as one
run on real processes on 127.0.0.1, observed from two sides in turn:

1. while it runs: the monitor page in a real browser (headless Chromium over its DevTools protocol) shows the
   trainer and both inference peers and a policy version that increases, with no script error or CSP refusal;
   a screenshot is saved (``ECHO_MONITOR_SCREENSHOT=docs/monitor.png`` also writes it there: that is how the
   README's was taken). Skipped, with the install line, where Chromium is absent;
2. until it has learned: the reward the trainer measured (re-scored by its own verifier) rises clearly; then
   the SIGTERM a fixed ``--duration`` would have ended it with, and its report, held-out evaluations, plot and
   TensorBoard event files (the trainer gets ``--report-to tensorboard``) are read back.

One run serves both (a swarm start costs ~15 s of the 2-core machine); the sync mode and ``--until-reward``
are ``test_training_run.py``'s.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.browser import INSTALL_LINE, Browser, chromium_path
from tests.conftest import eval_lines, mean, trainer_steps, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow(55)]

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


@dataclass
class LocalRun:
    proc: subprocess.Popen
    workdir: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def assert_running(self) -> None:
        assert self.proc.poll() is None, self.output()[-3000:]


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


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Iterator[LocalRun]:
    """The run: ``--duration`` is only a deadline, the tests below end it."""
    root = tmp_path_factory.mktemp("local-run")
    workdir, log = root / "run", root / "local.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "echo_p2p.local", "--mode", "async", "--monitor", "--duration", "220"]
        + ["--status-period", "5", "--workdir", str(workdir), "--peer-args=--report-to tensorboard"],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=str(root),
    )
    try:
        yield LocalRun(proc, workdir, log)
    finally:
        stop_group(proc)


async def page_state(browser: Browser) -> dict:
    return json.loads(await browser.evaluate(PAGE_STATE))


@needs_chromium
async def test_the_page_of_a_live_local_swarm_shows_its_peers_and_a_rising_version(local_run, tmp_path):
    browser = Browser(tmp_path / "profile", CHROMIUM)
    try:
        found = wait_until(
            lambda: (
                re.search(r"monitor: (http://127\.0\.0\.1:\d+/)", local_run.output())
                or local_run.proc.poll() is not None
            ),
            60,
            what="the monitor's URL",
        )
        local_run.assert_running()
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
    local_run.assert_running()


def test_tiny_model_learns_the_count_task_in_the_local_swarm(local_run):
    metrics = local_run.workdir / "metrics"

    def learned() -> bool:
        local_run.assert_running()
        steps = trainer_steps(metrics)
        if len(steps) < 20 or steps[-1]["version"] < 15:
            return False
        first, last = (
            mean([s["reward_mean"] for s in steps[:10]]),
            mean([s["reward_mean"] for s in steps[-10:]]),
        )
        return last >= 0.3 and last > first + 0.15

    wait_until(learned, 180, 1, "20 steps, version 15 and a last-10 reward of 0.3, 0.15 above the first")
    local_run.proc.send_signal(signal.SIGTERM)
    assert local_run.proc.wait(timeout=90) == 0, local_run.output()[-3000:]
    out = local_run.output()
    steps = trainer_steps(metrics)
    first, last = mean([s["reward_mean"] for s in steps[:10]]), mean([s["reward_mean"] for s in steps[-10:]])
    assert last > first + 0.15, f"reward {first:.3f} -> {last:.3f}"
    versions = [s["version"] for s in steps]
    assert versions == sorted(versions) and versions[-1] >= 15
    assert "summary:" in out and "rollout groups consumed" in out, out[-2000:]
    summary = json.loads((local_run.workdir / "summary.json").read_text())
    assert summary["kind"] == "swarm" and summary["steps"] == len(steps)
    assert summary["reward_final"] > summary["reward_first"] + 0.15
    assert (local_run.workdir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the publishing trainer scored the held-out prompts (the first time before its first update)
    evals = eval_lines(metrics)
    assert evals and evals[0]["eval_version"] == 0 and evals[0]["eval_prompts"] == 6, evals[:1]
    assert all(0 <= e["eval_accuracy"] <= 1 and 0 <= e["eval_reward"] <= 1 for e in evals)
    assert (
        summary["evaluations"] == len(evals) and summary["eval_accuracy_first"] == evals[0]["eval_accuracy"]
    )
    assert summary["eval_reward_final"] == evals[-1]["eval_reward"] and "held-out accuracy" in out
    assert not any(s.get("rejected", {}).get("held_out") for s in steps)  # honest samplers never draw them
    # --report-to tensorboard reached the trainer: its event files hold the reward under TRL's name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = (metrics / "tensorboard").glob("trainer-*")
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
