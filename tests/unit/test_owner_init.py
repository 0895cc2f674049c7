"""``python -m echo_p2p.owner init``: the keys, the signed record, the join address and the start lines."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from echo_p2p.guard.trust import TrustedTrainers
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.run_record import JoinAddress, read_file
from echo_p2p.owner import init_run, start_lines


def test_init_makes_every_key_signs_the_record_and_prints_lines_that_use_them(tmp_path):
    run = init_run("demo", tmp_path, trainers=2, port=23456, model="tiny", task="count", mode="sync")
    record, _, _ = read_file(run.record)
    owner = load_or_create_identity(str(tmp_path / "identities" / "owner.id"))
    trainers = [load_or_create_identity(str(p)).peer_id for p in run.trainer_identities]
    boot = load_or_create_identity(str(run.bootstrap_identity))
    assert record.owner_peer_id() == owner.peer_id == run.owner
    assert sorted(record.trainers) == sorted(trainers)
    assert TrustedTrainers.from_file(tmp_path / "trusted-trainers.txt").peer_ids == set(trainers)
    assert (record.run_id, record.model, record.task, record.mode) == ("demo", "tiny", "count", "sync")
    assert record.seeded_sampling is True  # the peers' default: a donor without seeds (vLLM) is told at join
    join = JoinAddress.parse(run.join_address)
    assert (join.run_id, join.owner) == ("demo", owner.peer_id)
    assert join.initial_peers == (f"/ip4/127.0.0.1/tcp/23456/p2p/{boot.peer_id}",)
    assert (tmp_path / "join-address").read_text().strip() == run.join_address
    lines = start_lines(run, python="python")
    assert lines["bootstrap"][-2:] == ["--run-record", str(run.record)]
    assert "/ip4/127.0.0.1/tcp/23456" in lines["bootstrap"]
    for i, path in enumerate(run.trainer_identities):
        line = lines[f"trainer-{i}"]
        assert line[line.index("--identity-path") + 1] == str(path)
        assert line[line.index("--join") + 1] == run.join_address
    donor = lines["inference"]
    assert donor[donor.index("--join") + 1] == run.join_address and "--run-record" not in donor
    assert donor[donor.index("--mode") + 1] == "sync"
    # again: the same keys (trainers keep their identity), a new record with a higher serial
    again = init_run("demo", tmp_path, trainers=2, port=23456, mode="sync")
    renewed = read_file(again.record)[0]
    assert renewed.serial >= record.serial and join.min_serial == record.serial
    assert again.join_address == str(JoinAddress(join.run_id, join.owner, join.initial_peers, renewed.serial))


def test_a_public_bootstrap_listens_on_every_interface_and_announces_the_given_address(tmp_path):
    run = init_run("demo", tmp_path, host="203.0.113.7")
    lines = start_lines(run, python="python")
    boot = lines["bootstrap"]
    assert boot[boot.index("--host-maddrs") + 1] == "/ip4/0.0.0.0/tcp/31337"
    assert boot[boot.index("--announce-maddrs") + 1] == "/ip4/203.0.113.7/tcp/31337"
    assert "@/ip4/203.0.113.7/tcp/31337/p2p/" in run.join_address
    assert "--host-maddrs" not in lines["inference"]  # the peer's own default: every interface


def test_init_cli_refuses_a_bad_run_id_and_host_with_exit_2(tmp_path):
    for flags in (["--run-id", "bad id"], ["--run-id", "ok", "--host", "example.org"]):
        r = subprocess.run(
            [sys.executable, "-m", "echo_p2p.owner", "init", "--dir", str(tmp_path), *flags],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2 and r.stderr.startswith("error: "), r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "echo_p2p.owner", "init", "--run-id", "demo", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    join = (tmp_path / "join-address").read_text().strip()
    assert f"join address: {join}" in r.stdout
    printed = [shlex.split(line) for line in r.stdout.splitlines() if line.startswith("  ")]
    python = {sys.executable, os.path.relpath(sys.executable)}  # relative when run inside the clone
    modules = [args[2] for args in printed if args[0] in python]
    assert modules == ["echo_p2p.bootstrap", "echo_p2p.peer", "echo_p2p.peer"]
    assert any(args[:2] == ["bash", "scripts/join.sh"] and join in args for args in printed)
