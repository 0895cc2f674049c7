"""Home inference peers behind NAT, on an emulated internet (``tests/netlab.py``): real network namespaces,
nftables masquerade routers with no port forward, 20 Mbit/s uplinks; the bootstrap and the trainer in public.

With no flag, each home peer finds out (AutoNAT) that nobody can dial it, reserves a slot on the bootstrap's
relay, announces only its relayed address, follows the policy, delivers rollouts (async: pushes them; sync:
the trainer asks it for samples through its relayed address) so that the trainer, fed by them alone,
learns, and serves weight chunks to the other home peer through the relay; no fetch pays a failed dial on a
private address.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from echo_p2p.metrics import read_metrics
from tests.conftest import fork_server, write_run_record
from tests.netlab import NetLab, skip_reason

SKIP = skip_reason()
pytestmark = [
    pytest.mark.netlab,
    pytest.mark.slow(100),
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]

RUN = "natlab"


def last_lines(metrics: Path, role: str) -> dict[str, dict]:
    """The newest metrics line of every peer of ``role`` (peer id -> line)."""
    out = {}
    for path in metrics.glob(f"{role}-*.jsonl"):
        lines = read_metrics(str(path))  # skips a line the peer is writing now (a torn line failed a run)
        if lines:
            out[lines[-1]["peer_id"]] = lines[-1]
    return out


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_home_peers_behind_two_nats_train_and_serve_each_other_through_a_relay(tmp_path, mode):
    from echo_p2p.net.identity import load_or_create_identity

    metrics, logs = tmp_path / "metrics", tmp_path / "logs"
    logs.mkdir()
    owner = load_or_create_identity(str(tmp_path / "owner.id"))
    trainer_id = load_or_create_identity(str(tmp_path / "trainer.id"))
    record = write_run_record(tmp_path / "run.bin", RUN, owner, [trainer_id.peer_id], mode=mode)
    with NetLab(forks=fork_server()) as lab:
        boot_host, trainer_host = lab.public_host("bootstrap"), lab.public_host("trainer")
        homes = [lab.home_host(f"home{i}", uplink_mbit=20, downlink_mbit=100) for i in (1, 2)]
        maddrs_file = tmp_path / "bootstrap.maddrs"
        boot = lab.spawn(
            boot_host,
            [
                sys.executable,
                "-m",
                "echo_p2p.bootstrap",
                "--host-maddrs",
                f"/ip4/{boot_host.address}/tcp/31337",
            ]
            + ["--maddrs-file", str(maddrs_file), "--run-record", str(record)],
            logs / "bootstrap.log",
        )
        deadline = time.monotonic() + 60
        while not maddrs_file.exists():
            assert boot.poll() is None and time.monotonic() < deadline, (logs / "bootstrap.log").read_text()
            time.sleep(0.2)
        bootstrap = next(m for m in maddrs_file.read_text().split() if boot_host.address in m)
        config = tmp_path / "peer.yaml"
        config.write_text("metrics_period: 2\n")  # the wait below reads the peers' metrics lines
        common = ["--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--metrics-dir", str(metrics), "--threads", "1"]
        common += ["--config", str(config)]
        common += ["--heartbeat-period", "2", "--mode", mode]
        procs = {
            "trainer": lab.spawn(
                trainer_host,
                [sys.executable, "-m", "echo_p2p.peer", "--role", "trainer", "--run-id", RUN, *common]
                + ["--initial-peers", bootstrap, "--run-record", str(record)]
                + ["--identity-path", trainer_id.path],
                logs / "trainer.log",
            )
        }
        for i, home in enumerate(homes):
            procs[home.name] = lab.spawn(
                home,
                [sys.executable, "-m", "echo_p2p.peer", "--role", "inference", *common]
                + ["--join", f"{RUN}:{owner.peer_id}@{bootstrap}", "--seed", str(i)],
                logs / f"{home.name}.log",
            )

        def served_each_other() -> tuple[bool, dict]:
            peers = last_lines(metrics, "inference")
            trainers = last_lines(metrics, "trainer")
            ids = set(peers)
            ok = (
                len(peers) == 2
                and all(p["reachability"] == "relayed" for p in peers.values())
                and any(set(p["weights"]["bytes_by_provider"]) & (ids - {pid}) for pid, p in peers.items())
                and all((p.get("version") or 0) >= 5 and delivered(p) > 0 for p in peers.values())
                and learning()
            )
            return ok, {"inference": peers, "trainer": trainers}

        def delivered(line: dict) -> int:
            """Groups that reached the trainer: pushed and acked (async), or sampled on its request (sync:
            the trainer reached the home peer through its relayed address)."""
            if mode == "async":
                return line.get("rollouts_acked", 0)
            return (line.get("sample_rpc") or {}).get("groups_sent", 0)

        def learning() -> bool:
            """The trainer, fed only by the home peers, learns: its last 5 steps' mean reward is above its
            first 5 steps' by 0.05 (the tiny model on ``count`` starts near 0.01)."""
            path = next(iter(metrics.glob("trainer-*.jsonl")), None)
            steps = [x for x in read_metrics(str(path)) if "step" in x] if path else []
            rewards = [x["reward_mean"] for x in steps if x.get("reward_mean") is not None]
            return len(rewards) >= 10 and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05

        deadline = time.monotonic() + 180
        ok, state = served_each_other()
        while not ok and time.monotonic() < deadline:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited: " + (logs / f"{name}.log").read_text()[-3000:]
            time.sleep(2)
            ok, state = served_each_other()
        assert ok, json.dumps(state, indent=1)[-6000:]

        for peer_id, line in state["inference"].items():
            # it announced only what others can dial: its relayed address, never a private or loopback one
            logged = (logs / "home1.log").read_text() + (logs / "home2.log").read_text()
            assert "all dials failed" not in logged
            failures = line["weights"]["failures"]
            assert not failures, (peer_id, failures)  # no fetch paid a failed dial
