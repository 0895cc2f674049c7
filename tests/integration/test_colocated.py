"""The co-located baseline's config guards, its standalone and KL paths, and its lean ``--help``. That its
CLI learns ``count`` with the tiny preset is checked through the launcher that runs it, in
``test_training_run.py`` (``local --colocated``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from echo_p2p.metrics import read_metrics
from tests.conftest import REPO

pytestmark = [pytest.mark.timeout(150)]


def test_help_does_not_import_torch() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['colocated', '--help']\n"
        "try:\n"
        "    runpy.run_module('echo_p2p.colocated', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "--duration" in out.stdout and out.stdout.strip().endswith("NO-TORCH"), out.stdout + out.stderr


def test_config_guards() -> None:
    from echo_p2p.colocated import ColocatedConfig
    from echo_p2p.train.config import GRPOConfig

    cfg = ColocatedConfig()
    assert isinstance(cfg.grpo, GRPOConfig) and cfg.optimizer.lr == 1e-3 and cfg.steps == 300
    assert ColocatedConfig(optimizer={"lr": 2e-3}).optimizer.betas == (0.9, 0.999)  # defaults fill the rest
    with pytest.raises(ValueError, match="temperature"):
        ColocatedConfig(temperature=0)  # one temperature for sampling and the loss: nothing to disagree
    with pytest.raises(ValueError, match="needs an end"):
        ColocatedConfig(steps=None, duration=None)
    with pytest.raises(ValueError):
        ColocatedConfig(grpo={"no_such_knob": 1})


def test_standalone_trainer_trains_on_a_pool_sampled_before_the_clock(tmp_path: Path) -> None:
    """``--standalone N``: N steps' worth of groups sampled once, then only training, round after round (the
    ceiling arm of benchmarks/modes.py): no sampling time in any step, and the pool's groups come back."""
    from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer

    trainer = ColocatedTrainer(
        ColocatedConfig(group_size=4, prompts_per_step=2, steps=5, standalone_pool=2, threads=1, seed=3)
    )
    sampled = []
    real_sample = trainer.sample_groups
    trainer.sample_groups = lambda step, **kw: sampled.append(step) or real_sample(step, **kw)
    trained = []
    real_step = trainer.learner.step
    trainer.learner.step = lambda groups, opt, **kw: trained.append(groups) or real_step(groups, opt, **kw)
    records = trainer.run()
    assert sampled == [-1, -2]  # the whole pool, before the first step; never again
    assert len(records) == 5 and all(r["sampling_s"] == 0 and r["training_s"] > 0 for r in records)
    assert [id(g) for g in trained] == [id(trained[0]), id(trained[1])] * 2 + [id(trained[0])]
    assert trained[0] is not trained[1] and records[-1]["rollouts_consumed"] == 10


def test_kl_penalty_trains_against_a_frozen_copy_of_the_starting_policy(tmp_path: Path) -> None:
    """``--kl-beta`` > 0 (TRL's ``beta``): the loop builds the reference, trains, and reports ``kl``: 0 at the
    first step (the policy is the reference), then positive as the policy moves away from it."""
    import torch

    from echo_p2p.colocated import ColocatedTrainer, config_from_args, parse_args

    args = parse_args(["--kl-beta", "0.04", "--steps", "6", "--threads", "1", "--prompts-per-step", "4"])
    args.metrics_dir = str(tmp_path)
    config = config_from_args(args)
    assert config.grpo.kl_beta == 0.04
    trainer = ColocatedTrainer(config)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    records = trainer.run()
    assert len(records) == 6 and all("kl" in r for r in records)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert records[-1]["kl"] > 1e-5
    reference = trainer.learner.ref_model
    assert all(torch.equal(p, start[n]) for n, p in reference.named_parameters())
    steps = [r for r in read_metrics(str(tmp_path / "colocated-baseline.jsonl")) if "step" in r]
    assert [r["kl"] for r in steps] == [r["kl"] for r in records]
    assert "kl" not in ColocatedTrainer(config_from_args(parse_args(["--steps", "1"]))).run()[0]
