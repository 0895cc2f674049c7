"""Export from a live run, on real processes on 127.0.0.1: a bootstrap with the owner's run record, a
trainer and an inference peer train the tiny model for a few versions; ``python -m echo_p2p.export --join``
fetches the newest version through the swarm as an inference peer does (trusted, signed manifests) and
writes a model directory that ``from_pretrained`` loads offline, equal to the trainer's own final checkpoint
exported with ``--checkpoint``; an export that trusts another trainer finds nothing and fails in time.

The trainer publishes a ``patch`` stream, after which receivers hold its weights cast to bf16 exactly. The
default ``auto`` stream may send a version as an int8 delta (the tiny model's large steps), which receivers
hold within the int8 error of that cast until the next patch or keyframe (docs/protocol.md section 3.6): a
live export is what the inference peers run, a checkpoint export the trainer's own weights.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import LOOPBACK, metrics_lines, read_log, wait_until, write_run_record

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow(40)]

RUN = "export"
REPO = Path(__file__).resolve().parents[2]


def export(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echo_p2p.export", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_a_live_run_exports_its_newest_trusted_version_exactly_as_its_trainer_holds_it(procs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo_p2p.export.checkpoint import export_checkpoint
    from echo_p2p.export.config import ExportConfig
    from echo_p2p.guard.trust import trainer_key_line
    from echo_p2p.ml.models import build_tiny_policy
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.train.checkpoint import CheckpointManager
    from echo_p2p.train.forward import rounded_weights
    from echo_p2p.train.grpo import token_logprobs

    metrics, checkpoints = tmp_path / "metrics", tmp_path / "ckpt"
    owner = load_or_create_identity(str(tmp_path / "owner.id"))
    trainer_id = load_or_create_identity(str(tmp_path / "trainer.id"))
    record = write_run_record(tmp_path / "run.record", RUN, owner, [trainer_id.peer_id])
    boot, maddr = procs.bootstrap("--run-record", str(record))
    join = f"{RUN}:{owner.peer_id}@{maddr}"
    common = ["--threads", "1", "--metrics-dir", str(metrics), "--heartbeat-period", "1"]
    lossless = tmp_path / "trainer.yaml"
    lossless.write_text("trainer:\n  encoding:\n    encoding: patch\n")
    trainer = procs.peer(
        "trainer", RUN, maddr, "--run-record", str(record), "--identity-path", trainer_id.path,
        "--checkpoint-dir", str(checkpoints), "--config", str(lossless), *common,
    )  # fmt: skip
    inference = procs.start(
        "-m", "echo_p2p.peer", "--role", "inference", "--join", join, "--host-maddrs", LOOPBACK, *common,
        name="inference",
    )  # fmt: skip

    def steps() -> list[dict]:
        for name, proc in (("bootstrap", boot), ("trainer", trainer)):
            assert proc.poll() is None, f"{name} exited: {read_log(proc)[-3000:]}"
        return [x for x in metrics_lines(metrics, trainer_id.peer_id) if "step" in x]

    wait_until(lambda: (s := steps()) and s[-1]["version"] >= 3, 150, 0.5, "version 3")
    inference.send_signal(signal.SIGTERM)  # no more rollouts: the trainer stays at the version it reaches
    assert inference.wait(timeout=60) == 0, read_log(inference)[-3000:]
    wait_until(lambda: time.time() - steps()[-1]["time"] > 3, 60, 0.5, "the trainer to run out of rollouts")
    version = steps()[-1]["version"]

    live = tmp_path / "live"
    done = export(
        "--join", join, "--out", str(live), "--host-maddrs", LOOPBACK, "--timeout", "90",
        "--min-version", str(version),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"exported policy version {version} (bfloat16) from run {RUN}" in done.stdout
    info = json.loads((live / "echo_p2p_export.json").read_text())
    assert (info["source"], info["version"], info["publisher"]) == ("run", version, trainer_id.peer_id)

    # a reader that trusts another trainer takes nothing from this one, and says so within its deadline
    stranger = tmp_path / "stranger.txt"
    stranger.write_text(trainer_key_line(load_or_create_identity(str(tmp_path / "stranger.id"))) + "\n")
    t0 = time.monotonic()
    refused = export(
        "--run-id", RUN, "--initial-peers", maddr, "--trusted-trainers", str(stranger),
        "--out", str(tmp_path / "none"), "--host-maddrs", LOOPBACK, "--timeout", "6",
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "no trusted trainer published a policy version" in refused.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "none").exists()

    # the trainer's final checkpoint holds the same version: its export is the same model, bit for bit
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=60) == 0, read_log(trainer)[-3000:]
    assert CheckpointManager(checkpoints).latest().version == version
    result = export_checkpoint(checkpoints, ExportConfig(out=str(tmp_path / "from-ckpt")))
    assert (result.version, result.dtype) == (version, "bfloat16")
    ours, theirs = (
        load_file(live / "model.safetensors"),
        load_file(tmp_path / "from-ckpt" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # loaded offline, the live export computes exactly the trainer's policy (bf16 weights, fp32 compute)
    model = AutoModelForCausalLM.from_pretrained(live, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(live, local_files_only=True)
    policy = build_tiny_policy(seed=1)[0]
    policy.load_state_dict(CheckpointManager(checkpoints).load().model_state)
    ids = torch.tensor([tokenizer("3a=aaa", add_special_tokens=False)["input_ids"]])
    with torch.no_grad(), rounded_weights(policy, "bf16"):
        expected = token_logprobs(policy(ids).logits, ids)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model(ids).logits, ids), expected)
