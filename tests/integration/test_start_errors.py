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


def test_initial_peers_that_do_not_answer_fail_fast_with_a_clear_error():
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
        "20",
    )
    assert r.returncode == 1
    assert "none of the initial peers answered" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


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
