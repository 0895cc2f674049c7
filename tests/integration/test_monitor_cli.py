"""The monitor against a real DHT: ``bootstrap --monitor-port``, ``python -m echo_p2p.monitor --join`` and
``swarm status --json`` (real processes on 127.0.0.1), the alerts they raise from records real nodes stored,
the Host check, the DHT going away under the monitor, and the command line's errors."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time

import pytest

from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.network_config import NetworkConfig
from echo_p2p.net.node import start_dht, stop_dht
from echo_p2p.net.records import Ban, BanRecord, PeerRecord, PolicyRecord
from tests.conftest import LOOPBACK, read_log, wait_until, write_run_record

pytestmark = pytest.mark.timeout(180)
RUN = "mon-run"


def url_in_log(proc, what: str) -> str:
    found = wait_until(
        lambda: (
            re.search(r"monitor of run [\w-]+: (http://127\.0\.0\.1:\d+/)", read_log(proc))
            or proc.poll() is not None
        ),
        60,
        what=what,
    )
    assert proc.poll() is None, read_log(proc)[-3000:]
    return found.group(1)


def get(url: str, path: str, host: str | None = None) -> tuple[int, bytes]:
    port = int(url.rsplit(":", 1)[1].strip("/"))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Host": host} if host else {})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body


def api_status(url: str) -> dict | None:
    status, body = get(url, "/api/status")
    return json.loads(body) if status == 200 else None


def alert_codes(status: dict | None) -> set[str]:
    return {a["code"] for a in status["alerts"]} if status else set()


def test_bootstrap_and_monitor_cli_serve_the_runs_alerts_from_real_records(procs, tmp_path):
    owner = load_or_create_identity(str(tmp_path / "owner.id"))
    trainer = load_or_create_identity(str(tmp_path / "trainer.id"))
    impostor = load_or_create_identity(str(tmp_path / "impostor.id"))
    record_file = write_run_record(tmp_path / "run.bin", RUN, owner, [trainer.peer_id])
    boot, maddr = procs.bootstrap("--run-record", str(record_file), "--monitor-port", "0")
    boot_url = url_in_log(boot, "the bootstrap's monitor URL")
    first = wait_until(lambda: api_status(boot_url), 30, what="the bootstrap monitor's first status")
    assert first["run"]["model"] == "tiny" and first["run"]["serial"] == 1
    assert alert_codes(first) == {"no_trainer"}
    assert get(boot_url, "/api/status", host="rebind.example:80")[0] == 403

    # the run's trainer (with a ban), an impostor trainer and its policy record, stored by real nodes. The
    # bootstrap knows the run's trainers and refuses the impostor's records; the impostor's own node (a full
    # node never told the run's trainers, as a stranger's would be) keeps them and serves them
    keys = SwarmKeys(RUN)
    network = NetworkConfig(initial_peers=[maddr], host_maddrs=[LOOPBACK])
    nodes = []
    try:
        nodes.append(start_dht(network, trainer, [keys], client_mode=True))
        nodes.append(start_dht(network, impostor, [keys]))
        honest = SwarmDirectory(nodes[0], keys, trainer)
        rogue = SwarmDirectory(nodes[1], keys, impostor)
        assert honest.announce(PeerRecord(peer_id=trainer.peer_id, role="trainer", policy_version=7), ttl=120)
        banned = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
        ban = Ban(peer_id=banned, until=time.time() + 300, reason="logprob_gap")
        assert honest.announce_bans(BanRecord(peer_id=trainer.peer_id, bans=[ban]), ttl=120)
        rogue.announce(PeerRecord(peer_id=impostor.peer_id, role="trainer", policy_version=900), ttl=120)
        rogue.announce_policy(PolicyRecord(peer_id=impostor.peer_id, stream_id="x", version=900), ttl=120)

        join = f"{RUN}:{owner.peer_id}@{maddr}"
        mon = procs.start(
            *("-m", "echo_p2p.monitor", "--join", join, "--port", "0", "--poll-period", "0.5"),
            *("--host-maddrs", LOOPBACK),
            name="monitor",
        )
        mon_url = url_in_log(mon, "the monitor CLI's URL")
        expected = {"impostor", "untrusted_manifests", "banned_peers"}
        # the monitor CLI's node stores and reads what anyone serves: it shows the impostor for what it is;
        # the bootstrap's node, told the run's trainers, neither stores nor accepts the impostor's records
        for url, codes in ((mon_url, expected), (boot_url, {"banned_peers"})):
            status = wait_until(
                lambda url=url, codes=codes: (s := api_status(url)) and alert_codes(s) == codes and s,
                30,
                what=f"the alerts at {url}",
            )
            assert status["summary"]["newest_version"] == 7  # the impostor's 900 is not the run's
            alerts = {a["code"]: a for a in status["alerts"]}
            if url == mon_url:
                assert alerts["impostor"]["peers"] == [impostor.peer_id]
                assert alerts["untrusted_manifests"]["peers"] == [impostor.peer_id]
            assert alerts["banned_peers"]["peers"] == [banned]
            assert status["dht"]["ok"] is True

        # swarm status --json prints the same status (one function builds both)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "echo_p2p.swarm",
                "status",
                "--join",
                join,
                "--json",
                "--host-maddrs",
                LOOPBACK,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(tmp_path),
        )
        assert r.returncode == 0, r.stderr
        once = json.loads(r.stdout)
        served = api_status(mon_url)
        assert set(once) == set(served) and set(once["summary"]) == set(served["summary"])
        assert alert_codes(once) == expected
        assert {p["peer_id"] for p in once["peers"]} == {p["peer_id"] for p in served["peers"]}
        status, body = get(mon_url, "/api/history?since=0&limit=5")
        assert status == 200 and 1 <= len(json.loads(body)["samples"]) <= 5
        assert get(mon_url, "/api/history?limit=x")[0] == 400

        # the DHT goes away under the monitor: it says so (and keeps serving)
        for node in nodes:
            stop_dht(node)
        nodes.clear()
        procs.kill_group(boot)
        down = wait_until(
            lambda: (s := api_status(mon_url)) and "dht_unreachable" in alert_codes(s) and s,
            60,
            what="dht_unreachable",
        )
        assert down["dht"]["ok"] is False and down["alerts"][0]["code"] == "dht_unreachable"
        assert "no_trainer" not in alert_codes(down)
    finally:
        for node in nodes:
            stop_dht(node)
        for ident in (owner, trainer, impostor):
            ident.cleanup()


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "run_id"),
        (("--run-id", "r"), "initial_peers"),
        (("--join", "not-an-address"), "join address"),
        (("--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--port", "70000"), "port"),
    ],
)
def test_monitor_cli_errors_exit_2_before_any_network_start(args, message):
    r = subprocess.run(
        [sys.executable, "-m", "echo_p2p.monitor", *args], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_bootstrap_monitor_port_needs_a_run():
    r = subprocess.run(
        [sys.executable, "-m", "echo_p2p.bootstrap", "--monitor-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--monitor-port needs the run" in r.stderr
