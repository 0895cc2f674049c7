"""A bootstrap and peers as real processes on 127.0.0.1: joining, status, leaving, dying, restarting."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import LOOPBACK, read_log, status_reader, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow(17)]


def status_json(maddr: str, run_id: str) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo_p2p.swarm",
            "status",
            "--run-id",
            run_id,
            "--initial-peers",
            maddr,
            "--host-maddrs",
            LOOPBACK,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def running_roles(status: dict) -> dict[str, str]:
    return {p["peer_id"]: p["role"] for p in status["peers"] if p["state"] == "running"}


def roles_seen(maddr: str, run_id: str) -> dict[str, str]:
    """As the CLI prints them (a process per call)."""
    return running_roles(status_json(maddr, run_id))


def peer_id_from_log(proc) -> str:
    log = read_log(proc)
    marker = "/p2p/"
    line = next(line for line in log.splitlines() if "joined run" in line)
    return line.rsplit(marker, 1)[1].split()[0].strip(",")


def test_status_lists_peers_with_roles_then_forgets_killed_and_stopped_ones(procs, tmp_path):
    boot, maddr = procs.bootstrap()
    trusted = tmp_path / "trusted.txt"
    from echo_p2p.guard.trust import trainer_key_line
    from echo_p2p.net.identity import load_or_create_identity

    trusted.write_text(trainer_key_line(load_or_create_identity(str(tmp_path / "someone.id"))) + "\n")
    fast = (
        "--heartbeat-period",
        "0.5",
        "--record-ttl",
        "2",
        "--threads",
        "1",
        "--trusted-trainers",
        str(trusted),
    )
    trainer = procs.peer("trainer", "run-a", maddr, *fast)
    inf1 = procs.peer("inference", "run-a", maddr, *fast)
    inf2 = procs.peer("inference", "run-a", maddr, *fast)
    other_run = procs.peer("inference", "run-b", maddr, *fast)
    for p in (trainer, inf1, inf2, other_run):
        wait_until(lambda p=p: "joined run" in read_log(p) or p.poll() is not None, 60, what="peer join")
        assert p.poll() is None, read_log(p)
    ids = {peer_id_from_log(p): p for p in (trainer, inf1, inf2)}
    reader = status_reader(maddr, ["run-a", "run-b"], tmp_path)  # the CLI's read, without a process per poll
    try:
        _status_follows_joins_kills_and_stops(procs, maddr, reader, trainer, inf1, inf2, ids)
    finally:
        reader.close()


def _status_follows_joins_kills_and_stops(procs, maddr, reader, trainer, inf1, inf2, ids) -> None:
    def seen_by_reader(run_id: str = "run-a") -> dict[str, str]:
        return running_roles(reader.status(run_id))

    def three_peers():
        seen = seen_by_reader()
        return seen if len(seen) == 3 else None

    seen = wait_until(three_peers, 30, what="3 peers")
    assert seen == {pid: ("trainer" if p is trainer else "inference") for pid, p in ids.items()}
    assert roles_seen(maddr, "run-a") == seen  # the CLI prints the same
    assert list(seen_by_reader("run-b").values()) == ["inference"]  # runs do not mix

    # SIGKILL (whole process group: the machine is gone): the record expires after its TTL
    killed_id = peer_id_from_log(inf1)
    procs.kill_group(inf1, signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: killed_id not in seen_by_reader(), 30, what="killed peer to expire")
    assert time.monotonic() - t0 < 15

    # SIGTERM to the peer's own process: it leaves cleanly, exit 0, no child process (DHT, p2pd) left
    children = psutil.Process(inf2.pid).children(recursive=True)
    assert children, "a peer runs its DHT in child processes"
    stopped_id = peer_id_from_log(inf2)
    inf2.send_signal(signal.SIGTERM)
    assert inf2.wait(timeout=30) == 0, read_log(inf2)

    def alive():
        return [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    # torch's shared-memory manager exits by itself about 2 s after its last client
    wait_until(lambda: not alive(), 15, what=f"children to exit: {alive()}")
    assert "left the run" in read_log(inf2)
    wait_until(lambda: stopped_id not in seen_by_reader(), 30, what="stopped peer to vanish")
    assert set(seen_by_reader()) == {peer_id_from_log(trainer)}


def test_bootstrap_restarted_with_same_identity_keeps_its_peer_id(procs, tmp_path):
    identity = str(tmp_path / "bootstrap.id")
    boot, maddr1 = procs.bootstrap(identity=identity)
    boot.send_signal(signal.SIGTERM)
    assert boot.wait(timeout=30) == 0, read_log(boot)
    boot2, maddr2 = procs.bootstrap(identity=identity)
    assert maddr1.rsplit("/p2p/", 1)[1] == maddr2.rsplit("/p2p/", 1)[1]
    # and peers can join through the restarted bootstrap
    peer = procs.peer("trainer", "run-r", maddr2)
    wait_until(lambda: "joined run" in read_log(peer) or peer.poll() is not None, 60, what="join")
    assert peer.poll() is None, read_log(peer)
    wait_until(
        lambda: list(roles_seen(maddr2, "run-r").values()) == ["trainer"], 30, what="trainer in status"
    )
    assert "Peers join this swarm with:\n  --initial-peers /ip4/127.0.0.1/" in read_log(boot2)
