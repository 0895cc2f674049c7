"""Start-up failures give a clear message, a non-zero exit, no traceback wall, and never hang."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import LOOPBACK

pytestmark = pytest.mark.timeout(120)
SILENT_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmVBs4rtbHeMREzjEUBfqKvRsHfvPFy9RFAZMr9K23gFyb"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_initial_peers_that_do_not_answer_fail_at_the_deadline_with_a_clear_error():
    t0 = time.monotonic()
    r = run(
        "-m",
        "echo_p2p.peer",
        "--role",
        "trainer",
        "--run-id",
        "r",
        "--initial-peers",
        SILENT_PEER.format(port=free_port()),
        "--host-maddrs",
        LOOPBACK,
        "--startup-timeout",
        "5",
    )
    assert r.returncode == 1
    assert "none of the initial peers answered" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_a_peer_started_before_its_bootstrap_joins_once_the_bootstrap_is_up(tmp_path):
    """A peer keeps knocking until its start-up deadline (the local runner starts every process at once; a
    bootstrap may be restarting): the same node joins once the bootstrap listens."""
    import threading

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import neighbour_counts, start_dht, stop_dht

    port = free_port()
    boot_identity = load_or_create_identity(str(tmp_path / "bootstrap.id"))
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_identity.peer_id}"
    joined: list = []
    peer = threading.Thread(
        target=lambda: joined.append(
            start_dht(
                NetworkConfig(
                    initial_peers=[address], host_maddrs=[LOOPBACK], startup_timeout=40, knock_timeout=40
                ),
                load_or_create_identity(None),
            )
        ),
        daemon=True,
    )
    t0 = time.monotonic()
    peer.start()
    time.sleep(4)  # the peer's first attempts find nobody
    assert not joined
    boot = start_dht(
        NetworkConfig(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], startup_timeout=20), boot_identity
    )
    try:
        peer.join(45)
        assert joined, "the peer did not join once the bootstrap was up"
        try:
            assert time.monotonic() - t0 < 40
            deadline = time.monotonic() + 15
            while neighbour_counts(boot)[0] < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert neighbour_counts(boot)[0] >= 1  # the bootstrap knows the peer: it really joined
        finally:
            stop_dht(joined[0])
    finally:
        stop_dht(boot)


def test_port_already_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run("-m", "echo_p2p.bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert r.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    assert "Traceback" not in r.stderr


def test_unreadable_identity_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "id.key"
    bad.write_bytes(b"\x00garbage")
    r = run("-m", "echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(bad))
    assert r.returncode == 1
    assert "not a valid libp2p RSA private key" in r.stderr
    assert "Traceback" not in r.stderr
