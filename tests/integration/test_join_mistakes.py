"""A donor's mistakes against a real bootstrap keeping a real run record (``owner init``'s): a wrong owner id, a
wrong run id and an unreachable bootstrap are each refused within seconds, exit 1, with what is wrong; and a
node whose clock is far off the bootstrap's is refused at the DHT start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from echo_p2p.local_keys import free_port_below_ephemeral
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.run_record import JoinAddress
from tests.conftest import LOOPBACK, read_log, wait_until
from tests.integration.test_owner_walkthrough import owner_init

pytestmark = pytest.mark.timeout(120)

#: What a refusal may take here, from the command to its exit, three peers started at once (each imports torch
#: first) on 2 cores that another test file's swarm shares (scripts/test.sh runs two files at a time): 26 s was
#: seen there. The goal is 10 s for one peer on a machine of its own; what this bound guards against is the
#: silent wait of the join deadline (600 s) a wrong owner or run id used to get. An unreachable bootstrap used to
#: print its hint ~20 times and exit after 34-60 s: its error names the 5 s knock deadline and comes once
REFUSED_WITHIN = 60.0


def join(address: str) -> subprocess.Popen:
    args = ["-m", "echo_p2p.peer", "--role", "inference", "--join", address, "--host-maddrs", LOOPBACK]
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def test_a_wrong_owner_a_wrong_run_id_and_an_unreachable_bootstrap_are_named_at_once(procs, tmp_path):
    port = free_port_below_ephemeral()
    address, lines = owner_init(tmp_path, "--run-id", "demo", "--port", str(port))
    boot = procs.start(*lines["bootstrap"], name="bootstrap")
    wait_until(lambda: "--join demo:" in read_log(boot) or boot.poll() is not None, 30, what="bootstrap")
    good = JoinAddress.parse(address)
    stranger = load_or_create_identity(None).peer_id
    cases = {
        "owner": (
            str(JoinAddress("demo", stranger, good.initial_peers)),
            f"the run's record is signed by {good.owner}, not by the owner {stranger} of your address",
        ),
        "run": (
            str(JoinAddress("nodemo", good.owner, good.initial_peers)),
            "no run named 'nodemo' on this bootstrap",
        ),
        "unreachable": (
            str(
                JoinAddress(
                    "demo", good.owner, (f"/ip4/127.0.0.1/tcp/{port + 1}/p2p/{good.initial_peers[0][-46:]}",)
                )
            ),
            "none of the initial peers answered within 5 s",
        ),
    }
    t0 = time.monotonic()
    started = {name: join(wrong) for name, (wrong, _) in cases.items()}  # at once: the test stays short
    try:
        for name, proc in started.items():
            _, stderr = proc.communicate(timeout=60)
            took = time.monotonic() - t0
            print(f"{name}: exit {proc.returncode} after {took:.1f} s")
            assert proc.returncode == 1, (name, proc.returncode, stderr[-2000:])
            assert stderr.count(f"error: {cases[name][1]}") == 1, (name, stderr[-2000:])
            assert "Traceback" not in stderr
            assert took < REFUSED_WITHIN, (name, took)
    finally:
        for proc in started.values():  # left only by a failure: its whole group (DHT child, p2pd)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
    assert boot.poll() is None  # the bootstrap served throughout


def test_a_clock_far_off_the_bootstraps_is_refused_at_once_with_the_offset(monkeypatch):
    """A real bootstrap node, and a joining node whose DHT clock runs 5 minutes ahead (hivemind's DHT time,
    patched before its DHT process forks): the join is refused in seconds, naming the offset and the fix."""
    import hivemind.dht.protocol

    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import NodeStartError, start_dht, stop_dht, visible_maddrs

    boot_identity, peer_identity = load_or_create_identity(None), load_or_create_identity(None)
    boot = start_dht(NetworkConfig(host_maddrs=[LOOPBACK]), boot_identity)
    try:
        maddr = visible_maddrs(boot)[0]
        monkeypatch.setattr(hivemind.dht.protocol, "get_dht_time", lambda: time.time() + 300)
        t0 = time.monotonic()
        with pytest.raises(
            NodeStartError, match=r"this machine's clock is \+300 s off the bootstrap's"
        ) as err:
            stop_dht(start_dht(NetworkConfig(host_maddrs=[LOOPBACK], initial_peers=[maddr]), peer_identity))
        assert "set the clock" in str(err.value)
        assert time.monotonic() - t0 < 10
    finally:
        stop_dht(boot)
        boot_identity.cleanup()
        peer_identity.cleanup()
