"""``python -m echo_p2p.doctor --join``: against a real bootstrap keeping ``owner init``'s run record, each
address stops at the hop that is broken and names it (exit 1): an unreachable bootstrap at ``bootstrap``, a
wrong owner at ``run record`` (after the bootstrap and the clock passed), a run with no trainer running at
``trainers``. The later hops (a reachable trainer, a weight manifest, a room query) pass in the walk-through's
run (``test_owner_walkthrough``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from echo_p2p.local_keys import free_port_below_ephemeral
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.run_record import JoinAddress
from tests.conftest import LOOPBACK, read_log, wait_until
from tests.integration.test_owner_walkthrough import owner_init

pytestmark = pytest.mark.timeout(120)


def doctor(address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "echo_p2p.doctor", "--join", address, "--host-maddrs", LOOPBACK],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def test_the_doctor_names_the_first_hop_that_fails(procs, tmp_path):
    port = free_port_below_ephemeral()
    address, lines = owner_init(tmp_path, "--run-id", "demo", "--port", str(port))
    boot = procs.start(*lines["bootstrap"], name="bootstrap")
    wait_until(lambda: "--join demo:" in read_log(boot) or boot.poll() is not None, 30, what="bootstrap")
    good = JoinAddress.parse(address)
    stranger = load_or_create_identity(None).peer_id
    silent = f"/ip4/127.0.0.1/tcp/{port + 1}/p2p/{good.initial_peers[0].rsplit('/', 1)[1]}"
    cases = {  # address -> (hops that pass, the hop that fails, what it says)
        str(JoinAddress("demo", good.owner, (silent,))): (
            [],
            "bootstrap",
            "none of the initial peers answered",
        ),
        str(JoinAddress("demo", stranger, good.initial_peers)): (
            ["bootstrap", "clock"],
            "run record",
            f"the run's record is signed by {good.owner}, not by the owner {stranger}",
        ),
        address: (
            ["bootstrap", "clock", "run record"],
            "trainers",
            "none of the run's 1 trainer(s) is announced",
        ),
    }
    started = {a: doctor(a) for a in cases}
    for a, proc in started.items():
        out, err = proc.communicate(timeout=60)
        passed, failed, says = cases[a]
        assert proc.returncode == 1, (a, out, err)
        rows = out.splitlines()
        assert [r.split(":")[0] for r in rows] == [f"ok   {h}" for h in passed] + [f"FAIL {failed}"], out
        assert says in rows[-1], out
        assert "Traceback" not in err, err
