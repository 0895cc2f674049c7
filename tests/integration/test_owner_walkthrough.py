"""The README's walk-through, followed literally on 127.0.0.1: the owner runs ``owner init`` and the lines it
prints (the bootstrap, the trainer), a donor joins with the printed inference line, and a training step
happens (the trainer publishes policy version 1)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from echo_p2p.local_keys import free_port_below_ephemeral
from tests.conftest import LOOPBACK, read_log, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow(25)]


def owner_init(tmp_path, *flags: str) -> tuple[str, dict[str, list[str]]]:
    """Run ``owner init`` and return the join address and the printed lines by role."""
    r = subprocess.run(
        [sys.executable, "-m", "echo_p2p.owner", "init", "--dir", str(tmp_path / "demo"), *flags],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    join = next(line.split(": ", 1)[1] for line in r.stdout.splitlines() if line.startswith("join address: "))
    lines: dict[str, list[str]] = {}
    script: list[str] = []
    for line in r.stdout.splitlines():
        args = shlex.split(line) if line.startswith("  ") else []
        if args[:2] == ["bash", "scripts/join.sh"]:
            script = args
        elif args[:2] == [sys.executable, "-m"]:
            role = args[args.index("--role") + 1] if "--role" in args else "bootstrap"
            lines.setdefault(role, args[1:])  # the first trainer's line
    # the donor's one command from a fresh clone (scripts/join.sh: set-up, then this peer) is the same peer
    assert script[2:] == lines["inference"][4:], (script, lines["inference"])
    return join, lines


def test_owner_init_then_the_printed_lines_make_a_run_a_donor_joins_and_trains(procs, tmp_path):
    port = free_port_below_ephemeral()
    join, lines = owner_init(tmp_path, "--run-id", "demo", "--port", str(port))
    assert set(lines) == {"bootstrap", "trainer", "inference"}
    boot = procs.start(*lines["bootstrap"], name="bootstrap")
    # the bootstrap prints the very address the owner was given; the owner starts the others once it is up,
    # as the printed steps say (a peer knocks for 5 s: a forked one is up before a bootstrap still importing)
    wait_until(lambda: f"--join {join}" in read_log(boot) or boot.poll() is not None, 30, what="bootstrap")
    assert f"--join {join}" in read_log(boot), read_log(boot)
    trainer = procs.start(*lines["trainer"], name="trainer")
    donor = procs.start(*lines["inference"], name="inference")
    stepped = re.compile(r"published version [1-9]")  # version 1 is the first step's (later ones are summed)
    # the first step needs a batch from the one donor: on 2 busy cores (a fresh-clone suite run) the trainer
    # joined 30 s and the donor 41 s after launch, then sampled ~1 group/s, and 75 s ran out with 5 of the
    # 16 groups buffered; the wait ends on the step
    wait_until(
        lambda: stepped.search(read_log(trainer)) or trainer.poll() is not None or donor.poll() is not None,
        150,
        what="the first training step",
    )
    assert stepped.search(read_log(trainer)), read_log(trainer)[-3000:] + read_log(donor)[-3000:]
    assert "applied version" in read_log(donor), read_log(donor)[-3000:]
    # with the run up, every hop of a join passes the doctor (trainer reachable, a weight manifest, a room query)
    r = subprocess.run(
        [sys.executable, "-m", "echo_p2p.doctor", "--join", join, "--host-maddrs", LOOPBACK],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    hops = [row.split(":")[0] for row in r.stdout.splitlines()]
    assert hops == [
        f"ok   {h}"
        for h in ("bootstrap", "clock", "run record", "trainers", "trainer reachable", "weights", "room")
        + ("this machine",)
    ], r.stdout
    assert "can dial it directly: /ip4/127.0.0.1/" in r.stdout  # a run on loopback: its scope
