"""A peer whose DHT child is frozen (SIGSTOP): its watchdog logs the stall with what every thread waits on;
with ``--restart-on-stall`` it exits 75 and leaves no child behind, without it it keeps running, writes the
stall into its metrics and recovers once the child runs again (SIGCONT)."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from echo_p2p.cli import EXIT_STALLED
from echo_p2p.metrics import read_metrics
from tests.conftest import read_log, wait_until

pytestmark = pytest.mark.timeout(150)

DHT_DEADLINE = 5.0
EXIT_GRACE = 2.0


def config_file(tmp_path, name: str, restart: bool):
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        "metrics_period: 0.5\n"
        "network:\n  request_timeout: 1.5\n"
        f"watchdog:\n  dht_deadline: {DHT_DEADLINE}\n  work_deadline: 120\n"
        f"  exit_grace: {EXIT_GRACE}\n  restart_on_stall: {'true' if restart else 'false'}\n"
    )
    return path


def dht_child(pid: int) -> psutil.Process | None:
    """The peer's hivemind DHT process: its child that runs p2pd (found by parent pid, never by name alone)."""
    for child in psutil.Process(pid).children():
        try:
            if any("p2pd" in c.name() for c in child.children()):
                return child
        except psutil.Error:
            continue
    return None


def last_metrics(metrics_dir) -> dict | None:
    files = list(metrics_dir.glob("inference-*.jsonl"))
    lines = read_metrics(str(files[0])) if files else []
    return lines[-1] if lines else None


def test_a_frozen_dht_child_is_a_stall_exit_75_with_restart_on_stall_else_announced_and_recovered(
    procs, tmp_path
):
    from echo_p2p.guard.trust import trainer_key_line
    from echo_p2p.net.identity import load_or_create_identity

    _, maddr = procs.bootstrap()
    trusted = tmp_path / "trusted.txt"
    trusted.write_text(trainer_key_line(load_or_create_identity(str(tmp_path / "t.id"))) + "\n")
    common = ("--heartbeat-period", "0.5", "--threads", "1", "--trusted-trainers", str(trusted))
    metrics_a, metrics_b = tmp_path / "metrics-a", tmp_path / "metrics-b"

    def inference_peer(name: str, restart: bool, metrics):
        config = str(config_file(tmp_path, name, restart))
        return procs.peer(
            "inference", "wd", maddr, *common, "--config", config, "--metrics-dir", str(metrics)
        )

    restarting = inference_peer("a", True, metrics_a)
    staying = inference_peer("b", False, metrics_b)
    frozen: list[psutil.Process] = []
    try:
        for p in (restarting, staying):
            wait_until(lambda p=p: "joined run" in read_log(p) or p.poll() is not None, 90, what="peer join")
            assert p.poll() is None, read_log(p)
        children = [
            wait_until(lambda p=p: dht_child(p.pid), 10, what="DHT child") for p in (restarting, staying)
        ]
        time.sleep(1.0)  # a few records stored: the deadline counts from the last one
        for child in children:
            child.send_signal(signal.SIGSTOP)
            frozen.append(child)
        t0 = time.monotonic()

        # --restart-on-stall: the stall, the thread dump, exit 75, no child left behind
        code = restarting.wait(timeout=DHT_DEADLINE + EXIT_GRACE + 25)
        elapsed = time.monotonic() - t0
        log = read_log(restarting)
        assert code == EXIT_STALLED, log[-3000:]
        assert "stalled: announce no progress for" in log
        assert 'Thread "announcer"' in log and "what each thread waits on" in log
        assert "(stopped)" in log  # the frozen DHT child, in the dump's child processes
        assert DHT_DEADLINE <= elapsed <= DHT_DEADLINE + EXIT_GRACE + 20, elapsed
        gone = wait_until(lambda: not children[0].is_running() or children[0].status() == "zombie", 10)
        assert gone, "the stalled peer left its DHT child behind"

        # without it: still running, the stall in its metrics; SIGCONT: recovered
        wait_until(
            lambda: "announce" in ((last_metrics(metrics_b) or {}).get("stalled") or []),
            20,
            what="stall metrics",
        )
        assert staying.poll() is None and last_metrics(metrics_b)["stalls_total"] >= 1
        assert "stalled: announce no progress for" in read_log(staying)
        children[1].send_signal(signal.SIGCONT)
        wait_until(lambda: "recovered: announce" in read_log(staying), 30, what="recovery")
        wait_until(lambda: (last_metrics(metrics_b) or {}).get("stalled") == [], 20, what="metrics recovered")
        assert staying.poll() is None
    finally:
        for child in frozen:
            try:
                child.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
