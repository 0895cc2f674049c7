"""Processes that never train start without torch: the bootstrap (with its run record and monitor page, serving
a peer's stores and the readers' reads), ``swarm status`` and the monitor, each checked in a process of its
own; and ``net.inprocess_dht``'s node (what they run) exchanges records with a peer's ``hivemind.DHT`` and
leaves no p2pd behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import LOOPBACK, REPO, Procs, wait_until

pytestmark = pytest.mark.timeout(180)

HEAVY = "[m for m in ('torch', 'scipy', 'transformers') if m in sys.modules]"


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=str(REPO)
    )


def _run_record(workdir: Path, run_id: str) -> tuple[Path, str]:
    from echo_p2p.local_keys import make_run_record

    return make_run_record(workdir, run_id, 1, "tiny", "count", "async")


def test_a_bootstrap_serves_its_run_record_and_monitor_without_torch(tmp_path: Path):
    record, _ = _run_record(tmp_path, "lean")
    code = (
        "import json, sys, time, urllib.request\n"
        "from echo_p2p import bootstrap\n"
        f"config, monitor = bootstrap.parse_args(['--host-maddrs', '{LOOPBACK}', '--run-record', r'{record}',"
        " '--monitor-port', '0'])\n"
        "peer = bootstrap.BootstrapPeer(config, monitor)\n"
        "try:\n"
        "    peer.start()\n"
        "    server, poller = peer._monitor\n"
        "    url = f'http://127.0.0.1:{server.port}/api/status'\n"
        "    deadline = time.monotonic() + 60\n"
        "    while True:\n"
        "        status = json.load(urllib.request.urlopen(url, timeout=10))\n"
        "        if status.get('run_id') or time.monotonic() > deadline:\n"
        "            break\n"
        "        time.sleep(0.5)\n"
        "    print('RUN', status.get('run_id'), 'RECORD', peer._run_trust is not None)\n"
        f"    print('HEAVY', {HEAVY})\n"
        "finally:\n"
        "    peer.shutdown()\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RUN lean RECORD True" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "HEAVY []" in r.stdout, r.stdout


#: Runs ``python -m MODULE ARGS`` and prints, at its exit, which heavy packages the process imported.
WRAPPER = (
    "import atexit, runpy, sys\n"
    f"atexit.register(lambda: print('HEAVY', {HEAVY}, flush=True))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)


def _stop_and_read(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)  # its clean stop, then the exit hook
    proc.wait(timeout=30)
    return proc.log_path.read_text()


def test_readers_and_the_bootstrap_they_read_run_without_torch(procs: Procs, tmp_path: Path):
    """The bootstrap serves reads (status, monitor) and a peer's stores; none of the three imports torch."""
    from hivemind.utils import get_dht_time

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht

    record, owner = _run_record(tmp_path, "lean")
    maddrs = tmp_path / "bootstrap.maddrs"
    boot = procs.start(
        *("-c", WRAPPER, "echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--run-record", str(record)),
        *("--maddrs-file", str(maddrs)),
        name="bootstrap",
    )
    wait_until(lambda: maddrs.exists() or boot.poll() is not None, 60, what="bootstrap start")
    maddr = maddrs.read_text().split()[0]
    join = f"lean:{owner}@{maddr}"
    peer = start_dht(
        NetworkConfig(host_maddrs=[LOOPBACK], initial_peers=[maddr]), load_or_create_identity(None)
    )
    try:  # a record stored on the bootstrap by a peer (validators and storage run there)
        assert peer.store("lean-check", "stored", get_dht_time() + 60, subkey="peer")
    finally:
        stop_dht(peer)
    status = subprocess.run(
        [sys.executable, "-c", WRAPPER, "echo_p2p.swarm", "status", "--join", join, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    assert status.returncode == 0, status.stderr[-3000:]
    body, heavy = status.stdout.rsplit("HEAVY", 1)
    assert json.loads(body)["run_id"] == "lean"
    assert heavy.strip() == "[]", status.stdout
    monitor = procs.start("-c", WRAPPER, "echo_p2p.monitor", "--join", join, "--port", "0", name="monitor")
    wait_until(lambda: b"monitor of run" in monitor.log_path.read_bytes(), 60, what="the monitor's URL")
    log = _stop_and_read(monitor)
    assert "HEAVY []" in log, log[-2000:]
    log = _stop_and_read(boot)
    assert "HEAVY []" in log, log[-2000:]


def test_an_in_process_node_and_a_hivemind_dht_exchange_records_and_stop_cleanly():
    import psutil
    from hivemind.utils import get_dht_time

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.inprocess_dht import InProcessDHT
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import neighbour_counts, start_dht, stop_dht, visible_maddrs

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    node = start_dht(NetworkConfig(host_maddrs=[LOOPBACK]), load_or_create_identity(None), in_process=True)
    peer = None
    try:
        assert isinstance(node, InProcessDHT)
        ours = {p.pid for p in psutil.Process().children(recursive=True)} - before
        assert ours, "its p2pd runs as a child of this process"
        network = NetworkConfig(host_maddrs=[LOOPBACK], initial_peers=visible_maddrs(node))
        peer = start_dht(network, load_or_create_identity(None))
        assert peer.store("key", "from the peer", get_dht_time() + 60, subkey="a")
        found = node.get("key", latest=True)
        assert found is not None and found.value["a"].value == "from the peer"
        assert node.store("key", "from the node", get_dht_time() + 60, subkey="b", return_future=True).result(
            10
        )
        wait_until(
            lambda: "b" in (peer.get("key", latest=True) or {"b": 0}).value, 10, what="the node's record"
        )
        table, connected = neighbour_counts(node)
        assert table >= 1 and connected >= 1
    finally:
        if peer is not None:
            stop_dht(peer)
        stop_dht(node)
    assert not node.is_alive()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in ours):
        time.sleep(0.1)
    assert not [pid for pid in ours if psutil.pid_exists(pid)], "p2pd outlived the node's shutdown"
