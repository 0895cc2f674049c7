"""A trainer peer with a KL penalty (``--kl-beta``, TRL's ``beta``) on real processes: it starts (it used to
fail: no reference model was built), trains against a frozen copy of the starting policy and reports ``kl``;
restarted with ``--resume`` it rebuilds the same reference from the run's model spec, not from the resumed
weights (the KL of its first step is then that of the trained policy, not 0)."""

from __future__ import annotations

import signal

import pytest

from echo_p2p.metrics import read_metrics
from tests.conftest import read_log, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def kl_steps(metrics) -> list[dict]:
    lines: list[dict] = []
    for path in metrics.glob("trainer-*.jsonl"):
        lines += [x for x in read_metrics(str(path)) if "step" in x and "kl" in x]
    return sorted(lines, key=lambda x: x["time"])


def test_trainer_with_kl_beta_trains_and_a_resumed_one_keeps_the_starting_reference(procs, tmp_path) -> None:
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.transport.trust import trainer_key_line

    _, maddr = procs.bootstrap()
    ident = str(tmp_path / "trainer.id")
    trusted = tmp_path / "trusted.txt"
    trusted.write_text(trainer_key_line(load_or_create_identity(ident)) + "\n")
    metrics = tmp_path / "metrics"
    common = ("--threads", "1", "--metrics-dir", str(metrics), "--heartbeat-period", "1")
    trainer_args = ("--identity-path", ident, "--checkpoint-dir", str(tmp_path / "ckpt"), "--kl-beta", "0.05")
    trainer = procs.peer("trainer", "kl", maddr, *trainer_args, *common)
    procs.peer("inference", "kl", maddr, "--trusted-trainers", str(trusted), *common)
    wait_until(lambda: len(kl_steps(metrics)) >= 8 or trainer.poll() is not None, 180, what="8 steps")
    assert trainer.poll() is None, read_log(trainer)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=60) == 0, read_log(trainer)
    before = kl_steps(metrics)
    assert before[0]["kl"] == 0.0, before[0]  # version 0: the policy is its reference
    assert before[-1]["kl"] > 0, [s["kl"] for s in before]

    trainer2 = procs.peer("trainer", "kl", maddr, *trainer_args, "--resume", *common)
    wait_until(
        lambda: len(kl_steps(metrics)) > len(before) or trainer2.poll() is not None, 120, what="a step"
    )
    assert trainer2.poll() is None, read_log(trainer2)
    assert "resuming from checkpoint version" in read_log(trainer2)
    first_after = kl_steps(metrics)[len(before)]
    assert first_after["version"] >= before[-1]["version"]
    # a reference taken from the resumed weights would give exactly 0 here
    assert first_after["kl"] > 0.5 * before[-1]["kl"], (first_after, before[-1])
