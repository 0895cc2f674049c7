"""Command-line flags of the peer, the co-located baseline and the local swarm that shape a run."""

from __future__ import annotations

import argparse

import pytest

from echo_p2p.cli import task_option
from echo_p2p.colocated import config_from_args, parse_args
from echo_p2p.config import ConfigError
from echo_p2p.local import LocalSwarm, LocalSwarmConfig
from echo_p2p.peer import parse_config

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
