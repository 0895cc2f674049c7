"""The local run's end: the trainers' newest checkpoint becomes ``<workdir>/model`` (or nothing, said so)."""

from __future__ import annotations

import json

import torch

from echo_p2p.config import RunSettings
from echo_p2p.export.policy_files import policy_files, policy_meta
from echo_p2p.local import LocalSwarm, LocalSwarmConfig, export_final
from echo_p2p.ml.models import build_tiny_policy
from echo_p2p.train.checkpoint import CheckpointManager


def test_the_newest_trainer_checkpoint_is_exported_into_the_workdir(tmp_path, capsys):
    torch.set_num_threads(1)
    swarm = LocalSwarm(LocalSwarmConfig(workdir=str(tmp_path)))
    assert export_final(swarm) == (None, False)
    assert "no trainer checkpoint" in capsys.readouterr().out
    model, tokenizer = build_tiny_policy(seed=0)
    files, meta = policy_files(model, tokenizer), policy_meta(RunSettings(), "bf16")
    for trainer, version in (("trainer-0", 8), ("trainer-1", 9)):
        CheckpointManager(tmp_path / "checkpoints" / trainer).save(
            version, model.state_dict(), None, meta, files=files
        )
    written, failed = export_final(swarm)
    assert not failed and written == {"path": str(tmp_path / "model"), "version": 9, "dtype": "bfloat16"}
    info = json.loads((tmp_path / "model" / "echo_p2p_export.json").read_text())
    assert info["checkpoint"].endswith("v000000000009") and "trainer-1" in info["checkpoint"]
    assert export_final(swarm)[0]["version"] == 9  # a second export replaces the first
    swarm.config.export = False
    assert export_final(swarm) == (None, False)


def test_an_export_that_fails_is_reported_not_raised(tmp_path, capsys):
    swarm = LocalSwarm(LocalSwarmConfig(workdir=str(tmp_path)))
    model, _ = build_tiny_policy(seed=0)
    CheckpointManager(tmp_path / "checkpoints" / "trainer-0").save(3, model.state_dict())  # no model files
    assert export_final(swarm) == (None, True)
    assert "exporting the final policy failed" in capsys.readouterr().err
