"""Command-line flags of the peer, the co-located baseline and the local swarm that shape a run."""

from __future__ import annotations

import argparse

import pytest

from echo_p2p.cli import task_option
from echo_p2p.colocated import config_from_args, parse_args
from echo_p2p.config import ConfigError
from echo_p2p.local import LocalSwarm, LocalSwarmConfig
from echo_p2p.peer import parse_config
from echo_p2p.train.config import OptimizerConfig

MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/QmNMa1sxAWQsRdGFBa2Kyaxx8bZYuJPPtV4xgKh1Bi8bFp"


def test_task_option_reads_yaml_scalars():
    assert task_option("max_n=9") == ("max_n", 9)
    assert task_option("letters=abc") == ("letters", "abc")
    assert task_option(" flag = true") == ("flag", True)
    for bad in ("max_n", "=3", "x=[1"):
        with pytest.raises(argparse.ArgumentTypeError):
            task_option(bad)


def test_peer_flags_set_task_options_and_staleness():
    flags = "--role trainer --run-id r --task count --task-option max_n=9 --task-option max_new_tokens=12"
    config = parse_config([*flags.split(), "--max-staleness", "8", "--initial-peers", MADDR], environ={})
    assert config.run.task_options == {"max_n": 9, "max_new_tokens": 12}
    assert config.trainer.max_staleness == 8
    assert (
        parse_config(
            ["--role", "trainer", "--run-id", "r", "--initial-peers", MADDR], environ={}
        ).run.task_options
        == {}
    )


def test_a_bad_task_option_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="max_n"):
        parse_config(
            ["--role", "trainer", "--run-id", "r", "--initial-peers", MADDR, "--task-option", "max_n=99"],
            environ={},
        )


def test_colocated_takes_the_same_task_options():
    config = config_from_args(parse_args(["--task-option", "max_n=9", "--steps", "5"]))
    assert config.task_options == {"max_n": 9}


def test_local_swarm_passes_task_options_to_every_process(tmp_path):
    swarm = LocalSwarm(LocalSwarmConfig(task_options=("max_n=9", "letters=ab"), workdir=str(tmp_path)))
    assert swarm._task_option_flags() == ["--task-option", "max_n=9", "--task-option", "letters=ab"]


def test_local_swarm_hands_task_options_on_as_written_and_refuses_bad_ones(capsys):
    from echo_p2p.local import build_parser

    assert build_parser().parse_args(["--task-option", "letters='9'"]).task_option == ["letters='9'"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--task-option", "max_n"])
    assert exc.value.code == 2 and "KEY=VALUE" in capsys.readouterr().err


def test_smollm2_preset_brings_its_learning_rate_and_given_values_win(tmp_path):
    base = ["--role", "trainer", "--run-id", "r", "--initial-peers", MADDR]
    tiny = parse_config(base, environ={})
    smol = parse_config([*base, "--model", "smollm2"], environ={})
    assert tiny.trainer.optimizer == OptimizerConfig(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert smol.trainer.optimizer == tiny.trainer.optimizer.model_copy(update={"lr": 1e-6})
    # nothing else of the trainer's defaults moves
    assert smol.trainer.collab.target_batch_size == tiny.trainer.collab.target_batch_size == 16
    assert smol.trainer.grpo.micro_batch_size == tiny.trainer.grpo.micro_batch_size == 256
    assert (
        parse_config([*base, "--model", "smollm2", "--lr", "3e-6"], environ={}).trainer.optimizer.lr == 3e-6
    )
    yaml = tmp_path / "trainer.yaml"
    yaml.write_text("trainer:\n  optimizer:\n    lr: 5.0e-6\n")
    given = parse_config([*base, "--model", "smollm2", "--config", str(yaml)], environ={})
    assert given.trainer.optimizer.lr == 5e-6


def test_a_partial_trainer_section_keeps_the_sections_other_defaults(tmp_path):
    """``--lr`` alone (trainer.optimizer.lr) keeps every other default: a partial section once replaced the
    collab section with other defaults (the target batch went from 16 groups to 64)."""
    base = ["--role", "trainer", "--run-id", "r", "--initial-peers", MADDR]
    default = parse_config(base, environ={}).trainer
    lr_only = parse_config([*base, "--lr", "5e-4"], environ={}).trainer
    assert lr_only.optimizer.lr == 5e-4 and lr_only.optimizer.betas == default.optimizer.betas
    assert lr_only.collab.target_batch_size == default.collab.target_batch_size == 16
    yaml = tmp_path / "trainer.yaml"
    yaml.write_text("trainer:\n  grpo:\n    clip_high: 0.28\n  optimizer:\n    eps: 1.0e-6\n")
    trainer = parse_config([*base, "--config", str(yaml)], environ={}).trainer
    assert trainer.grpo.clip_high == 0.28 and trainer.grpo.micro_batch_size == 256
    assert (trainer.optimizer.lr, trainer.optimizer.eps) == (1e-3, 1e-6)
    smol = parse_config([*base, "--model", "smollm2", "--config", str(yaml)], environ={}).trainer
    assert (smol.optimizer.lr, smol.optimizer.eps) == (1e-6, 1e-6)  # the preset reaches a partial section


def test_local_swarm_gives_smollm2_peers_small_steps_that_peer_args_override(tmp_path):
    base = ["--role", "trainer", "--run-id", "r", "--initial-peers", MADDR, "--model", "smollm2"]
    smol = LocalSwarm(LocalSwarmConfig(model="smollm2", workdir=str(tmp_path)))._model_flags()
    config = parse_config([*base, *smol], environ={})
    assert (config.trainer.prompts_per_step, config.trainer.collab.target_batch_size) == (4, 4)
    assert config.inference.prompts_per_batch == 4
    config = parse_config([*base, *smol, "--prompts-per-step", "8"], environ={})
    assert config.trainer.prompts_per_step == 8
    assert LocalSwarm(LocalSwarmConfig(model="tiny", workdir=str(tmp_path)))._model_flags() == []


def test_colocated_smollm2_takes_the_preset_learning_rate():
    assert config_from_args(parse_args(["--model", "smollm2"])).optimizer.lr == 1e-6
    assert config_from_args(parse_args([])).optimizer == OptimizerConfig()  # a trainer peer's defaults
    assert config_from_args(parse_args(["--model", "smollm2", "--lr", "1e-5"])).optimizer.lr == 1e-5


def test_join_sets_run_owner_and_initial_peers_and_needs_nothing_else(tmp_path):
    owner = "QmQAbD1EUxToUawWUKjh1doo9iC83FjbPVdhye9gwMeo2v"
    config = parse_config(["--role", "inference", "--join", f"demo:{owner}@{MADDR}"], environ={})
    assert (config.run_id, config.run_owner, config.network.initial_peers) == ("demo", owner, [MADDR])
    with pytest.raises(ConfigError, match="differs"):
        parse_config(["--role", "inference", "--run-id", "x", "--join", f"demo:{owner}@{MADDR}"], environ={})
    with pytest.raises(ConfigError, match="--join"):
        parse_config(["--role", "inference", "--join", f"demo@{MADDR}"], environ={})
    trusted = tmp_path / "t.txt"
    trusted.write_text(owner + "\n")
    with pytest.raises(ConfigError, match="either"):
        parse_config(
            ["--role", "inference", "--join", f"demo:{owner}@{MADDR}", "--trusted-trainers", str(trusted)],
            environ={},
        )
    # an inference peer with no trust source at all is refused
    with pytest.raises(ConfigError, match="no trusted trainers"):
        parse_config(["--role", "inference", "--run-id", "r", "--initial-peers", MADDR], environ={})


def test_local_swarm_signs_a_run_record_of_its_trainers(tmp_path):
    from echo_p2p.net.run_record import read_file

    swarm = LocalSwarm(LocalSwarmConfig(trainers=2, workdir=str(tmp_path)))
    path, owner = swarm.make_run_record()
    record, _, _ = read_file(path)
    assert record.owner_peer_id() == owner and len(record.trainers) == 2
    assert (record.run_id, record.model, record.task, record.mode) == (
        swarm.config.run_id,
        swarm.config.model,
        swarm.config.task,
        swarm.config.mode,
    )


def test_a_peer_sampling_otherwise_than_the_run_record_says_does_not_take_part(tmp_path):
    """The run record fixes the sampling distribution (temperature, top-p, top-k) and the sampler precisions
    whose rollouts count: a peer configured otherwise stops before it wastes compute on refused rollouts."""
    import time

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.run_record import RunRecord
    from echo_p2p.roles.inference import InferencePeer
    from echo_p2p.roles.trainer.peer import TrainerPeer

    owner = load_or_create_identity(None)
    base = ["--run-id", "r", "--initial-peers", MADDR, "--trusted-trainers", str(tmp_path / "t")]
    (tmp_path / "t").write_text(owner.peer_id + "\n")
    record = RunRecord(
        run_id="r", owner_key=owner.public_key_bytes().decode(), trainers=[owner.peer_id], serial=1,
        issued_at=time.time(), expires_at=time.time() + 60, top_p=0.7, top_k=20,
        sampler_precisions=["float32", "8bit"],
    )  # fmt: skip

    def check(cls, *flags):
        config = parse_config(["--role", cls.role, *base, *flags], environ={})
        peer = cls(config, identity=owner)
        peer._check_run_settings(record)

    check(InferencePeer, "--top-p", "0.7", "--top-k", "20")
    check(InferencePeer, "--top-p", "0.7", "--top-k", "20", "--quantize", "8bit")
    with pytest.raises(ValueError, match="top_p 0.7"):
        check(InferencePeer, "--top-k", "20")
    with pytest.raises(ValueError, match="sampler precisions"):
        check(InferencePeer, "--top-p", "0.7", "--top-k", "20", "--quantize", "4bit")
    check(TrainerPeer, "--top-p", "0.7", "--top-k", "20", "--sampler-precisions", "8bit,float32")
    with pytest.raises(ValueError, match="sampler precisions"):
        check(TrainerPeer, "--top-p", "0.7", "--top-k", "20")
    owner.cleanup()


def test_a_model_or_task_unlike_the_run_records_is_refused_with_the_flags_that_fix_it(tmp_path):
    import time

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.run_record import RunRecord
    from echo_p2p.roles.inference import InferencePeer

    owner = load_or_create_identity(None)
    (tmp_path / "t").write_text(owner.peer_id + "\n")
    record = RunRecord(
        run_id="r", owner_key=owner.public_key_bytes().decode(), trainers=[owner.peer_id], serial=1,
        issued_at=time.time(), expires_at=time.time() + 60, model="smollm2", task="arithmetic", mode="async",
    )  # fmt: skip
    flags = ["--role", "inference", "--run-id", "r", "--initial-peers", MADDR, "--trusted-trainers"]
    config = parse_config([*flags, str(tmp_path / "t"), "--model", "tiny", "--task", "count"], environ={})
    with pytest.raises(ValueError) as err:
        InferencePeer(config, identity=owner)._check_run_settings(record)
    text = str(err.value)
    assert "model 'smollm2' (this peer: 'tiny')" in text and "task 'arithmetic' (this peer: 'count')" in text
    assert "start this peer with --model smollm2 --task arithmetic --mode async" in text
    owner.cleanup()


def test_a_peer_that_draws_otherwise_than_the_run_record_says_is_refused_at_join(tmp_path):
    """``seeded_sampling`` in the run record: a peer without seeds in a run that replays them (a vLLM donor
    would have every group refused as sampling_mismatch) and a seeding peer in a run that said off are told
    at join, with the flag or engine that fixes it; a record that does not say checks nothing."""
    import time

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.run_record import RunRecord
    from echo_p2p.roles.inference import InferencePeer
    from echo_p2p.roles.trainer.peer import TrainerPeer

    owner = load_or_create_identity(None)
    (tmp_path / "t").write_text(owner.peer_id + "\n")
    base = ["--run-id", "r", "--initial-peers", MADDR, "--trusted-trainers", str(tmp_path / "t")]

    def record(seeded):
        return RunRecord(
            run_id="r", owner_key=owner.public_key_bytes().decode(), trainers=[owner.peer_id], serial=1,
            issued_at=time.time(), expires_at=time.time() + 60, seeded_sampling=seeded,
        )  # fmt: skip

    def check(cls, seeded, *flags):
        config = parse_config(["--role", cls.role, *base, *flags], environ={})
        cls(config, identity=owner)._check_run_settings(record(seeded))

    for seeded in (True, None):
        check(InferencePeer, seeded)
        check(TrainerPeer, seeded)
    check(InferencePeer, None, "--no-seeded-sampling")
    check(InferencePeer, False, "--no-seeded-sampling")
    with pytest.raises(ValueError, match=r"seeded_sampling True \(this peer: False: the vLLM engine"):
        check(InferencePeer, True, "--no-seeded-sampling", "--engine", "vllm")
    with pytest.raises(ValueError, match=r"seeded_sampling True \(this peer: False\)"):
        check(TrainerPeer, True, "--no-seeded-sampling")
    with pytest.raises(ValueError, match="start this peer with --no-seeded-sampling"):
        check(InferencePeer, False)
    owner.cleanup()
