"""--report-to: TensorBoard event files with TRL's names (read back with tensorboard's own reader), wandb
offline, a clear install line when a package is missing, and a failing tracker that never stops training."""

from __future__ import annotations

import logging
import sys
import types
from collections import Counter

import pytest

from echo_p2p.config import ConfigError, PeerConfig, build_config
from echo_p2p.train import trackers
from echo_p2p.train.trackers import ReportConfig, Trackers, open_trackers, step_figures, tracker_scalars

MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/QmQAbD1EUxToUawWUKjh1doo9iC83FjbPVdhye9gwMeo2v"


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_trainer_figures_under_trl_names(tmp_path, caplog, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(logging.getLogger("echo_p2p"), "propagate", True)  # off once a CLI set up logging
    caplog.set_level(logging.INFO, logger="echo_p2p.train.trackers")
    opened = open_trackers(
        ReportConfig(report_to=["tensorboard"]), str(tmp_path), "trainer-Qm1", "echo_p2p-r", {"lr": 0.002}
    )
    # the trainer's log names the folder and the command that shows it (the README's line may not match a
    # run's --metrics-dir / --report-dir)
    assert f"tensorboard --logdir {tmp_path}" in caplog.text
    for step in (1, 2, 3):
        figures = {
            "reward_mean": 0.1 * step,
            "reward_std": 0.2,
            "clip_frac": 0.05,
            "loss": float("nan"),  # not a number: not logged
            "staleness_hist": {"0": 3},  # not a scalar: not logged
            **step_figures(
                {"behaviour_kl": 0.01, "completion_len_mean_seq": 4.5, "num_tokens": 100.0, "grad_norm": 1.5},
                Counter({0: 2, 2: 2}),
                step_s=0.5,
            ),
            "version": step + 10,
        }
        opened.log(figures, step)
    opened.close()
    found = scalars(tmp_path / "trainer-Qm1")
    assert found["train/reward"] == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
        (3, pytest.approx(0.3)),
    ]
    assert found["train/clip_ratio"][0] == (1, pytest.approx(0.05))
    assert found["train/completion_length"][0][1] == pytest.approx(4.5)
    assert found["train/staleness"][0][1] == pytest.approx(1.0)  # (0*2 + 2*2) / 4 groups
    assert found["train/tokens_per_second"][0][1] == pytest.approx(200.0)
    assert found["train/policy_version"][-1] == (3, 13.0)
    assert "train/loss" not in found and "train/kl" not in found  # no kl without a reference model
    assert set(found) <= set(trackers.TRL_NAMES.values())


def test_tracker_scalars_take_finite_numbers_only():
    out = tracker_scalars({"reward_mean": 1, "kl": float("inf"), "loss": True, "reward_std": "0.1"})
    assert out == {"train/reward": 1.0}
    assert step_figures({"kl": 0.25}, Counter({1: 1}), 1.0)["kl"] == 0.25


def test_report_to_a_missing_package_fails_with_the_install_line(monkeypatch):
    monkeypatch.setattr(trackers, "is_installed", lambda package: False)
    flags = {"role": "trainer", "run_id": "r", "network.initial_peers": [MADDR]}
    with pytest.raises(ConfigError) as err:
        build_config(PeerConfig, environ={}, flags={**flags, "trainer.report.report_to": ["tensorboard"]})
    assert "trainer.report.report_to" in str(err.value)
    assert "pip install 'echo_p2p[tensorboard]'" in str(err.value)
    with pytest.raises(ConfigError, match="pip install wandb"):
        build_config(PeerConfig, environ={}, flags={**flags, "trainer.report.report_to": ["wandb"]})
    assert build_config(PeerConfig, environ={}, flags=flags).trainer.report.report_to == []


def test_the_peer_cli_takes_report_to_and_report_dir():
    pytest.importorskip("tensorboard")
    from echo_p2p.peer import parse_config

    argv = ["--role", "trainer", "--run-id", "r", "--initial-peers", MADDR]
    config = parse_config([*argv, "--report-to", "tensorboard", "--report-dir", "/x/tb"], environ={})
    assert config.trainer.report.report_to == ["tensorboard"] and config.trainer.report.dir == "/x/tb"


def test_wandb_runs_offline(monkeypatch, tmp_path):
    calls: list = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setattr(trackers, "is_installed", lambda package: True)
    opened = open_trackers(
        ReportConfig(report_to=["wandb"]), str(tmp_path), "trainer-Qm1", "echo_p2p-r", {"a": 1}
    )
    opened.log({"reward_mean": 0.5, "kl": 0.01}, 4)
    opened.close()
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline"
    assert calls[0][1]["dir"] == str(tmp_path / "trainer-Qm1") and calls[0][1]["config"] == {"a": 1}
    assert calls[1] == ("log", {"train/reward": 0.5, "train/kl": 0.01}, 4)
    assert calls[2] == ("finish",)


def test_a_failing_tracker_is_dropped_and_training_goes_on():
    class Broken:
        name = "broken"
        closed = False

        def log(self, scalars, step):
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    opened = Trackers([Broken()])
    opened.log({"reward_mean": 0.5}, 1)  # must not raise
    assert not opened and Broken.closed
