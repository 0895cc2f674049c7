"""A killed trainer loses no rollout group it acknowledged (``train/journal.py``), over real processes.

A bootstrap, an async trainer that never completes a step (4,096 groups per step) and an inference peer
pushing the tiny model's rollouts over real P2P streams. The inference peer stops gracefully, so its last
metrics line says exactly how many distinct groups the trainer acknowledged; the trainer is then SIGKILLed
and restarted with ``--resume``: it must have every one of them back in its buffer, none too stale (its
version never moved).
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.conftest import newest_line, read_log, wait_until, write_run_record

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow(16)]

RUN = "journal"


def test_a_sigkilled_trainer_gets_back_every_group_it_acknowledged(procs, tmp_path) -> None:
    from echo_p2p.net.identity import load_or_create_identity

    metrics = tmp_path / "metrics"
    config = tmp_path / "peer.yaml"
    config.write_text("metrics_period: 1\n")
    trainer_id = load_or_create_identity(str(tmp_path / "trainer.id"))
    inference_id = load_or_create_identity(str(tmp_path / "inference.id"))
    owner = load_or_create_identity(str(tmp_path / "owner.id"))
    record = write_run_record(tmp_path / "run.record", RUN, owner, [trainer_id.peer_id])
    boot, maddr = procs.bootstrap("--run-record", str(record))
    common = ["--config", str(config), "--threads", "1", "--metrics-dir", str(metrics)]
    common += ["--run-record", str(record)]
    trainer_args = [
        "--identity-path", trainer_id.path, "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--prompts-per-step", "4096", *common,
    ]  # fmt: skip
    trainer = procs.peer("trainer", RUN, maddr, *trainer_args)
    inference = procs.peer("inference", RUN, maddr, "--identity-path", inference_id.path, *common)

    def acked(line) -> int:
        # distinct groups: a resend answered DUPLICATE (its first ack was lost) counts once
        return (line or {}).get("rollouts_acked", 0)

    def pushed_enough() -> bool:
        for proc in (boot, trainer, inference):
            assert proc.poll() is None, read_log(proc)[-3000:]
        return acked(newest_line(metrics, inference_id.peer_id, "rollouts_acked")) >= 20

    wait_until(pushed_enough, 150, what="20 groups acknowledged by the trainer")
    inference.send_signal(signal.SIGTERM)  # graceful: its last line has the exact totals
    inference.wait(timeout=60)
    final = newest_line(metrics, inference_id.peer_id, "final")
    assert final is not None, read_log(inference)[-3000:]
    delivered = acked(final)
    assert delivered >= 20
    procs.kill_group(trainer, signal.SIGKILL)
    trainer.wait(timeout=30)

    restarted_at = time.time()
    trainer = procs.peer("trainer", RUN, maddr, *trainer_args, "--resume")

    def recovered():
        assert trainer.poll() is None, read_log(trainer)[-3000:]
        return newest_line(metrics, trainer_id.peer_id, "journal_recovered", restarted_at)

    line = wait_until(recovered, 120, what="the restarted trainer's metrics")
    assert line["journal_recovered"] == delivered, (line, final)
    assert line["journal_recovered_stale"] == 0
    assert line["journal"]["live"] == delivered
    assert line["version"] == 0 and line["steps"] == 0
    assert f"recovered {delivered} acknowledged groups" in read_log(trainer)
