"""Training figures where ML people look: TensorBoard event files and wandb runs (offline), beside the JSON lines.

Owned here: ``ReportConfig`` (the trainer's ``report`` section: ``--report-to tensorboard wandb``,
``--report-dir DIR``), the names a trainer's figures take there (``TRL_NAMES``: the ones TRL's GRPO trainer
logs, ``train/reward``, ``train/kl``, ...), and ``open_trackers``, which the trainer peer calls once at
start and then feeds once per training step (``Trackers.log``). Both packages are optional
(``pip install 'echo_p2p[tensorboard]'``, ``pip install wandb``): asking for one that is not installed is a
config error that prints the install line, before anything starts. wandb always runs offline (nothing leaves
the machine; ``wandb sync`` uploads later). A tracker that fails while writing is closed with one log line;
it never stops training. Imports torch's TensorBoard writer and wandb only when a tracker opens; no hivemind.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from echo_p2p.paths import UserPath

logger = logging.getLogger(__name__)

TrackerName = Literal["tensorboard", "wandb"]

#: How to install each tracker's package (printed when ``--report-to`` names a missing one).
INSTALL = {
    "tensorboard": "pip install 'echo_p2p[tensorboard]'  (or: pip install tensorboard==2.21.0)",
    "wandb": "pip install wandb",
}

#: Trainer figure (the keys of its metrics line) -> tracker tag, with the names TRL's GRPO trainer uses.
#: ``kl`` is the KL to the reference model (only when ``kl_beta`` > 0); ``behaviour_kl`` is how far the
#: samplers' policy was from the trainer's (k1 estimate on the sampled tokens), which staleness drives.
TRL_NAMES = {
    "reward_mean": "train/reward",
    "reward_std": "train/reward_std",
    "kl": "train/kl",
    "behaviour_kl": "train/behaviour_kl",
    "clip_frac": "train/clip_ratio",
    "completion_length": "train/completion_length",
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "staleness_mean": "train/staleness",
    "tokens_per_second": "train/tokens_per_second",
    "rollouts_consumed": "train/rollouts_consumed",
    "version": "train/policy_version",
    "policy_drift": "train/policy_drift",
    "logprob_gap_max": "train/logprob_gap_max",
    # held-out evaluation (train.evaluation), as TRL's evaluation loop names its figures
    "eval_reward": "eval/reward",
    "eval_reward_std": "eval/reward_std",
    "eval_accuracy": "eval/accuracy",
    "eval_greedy_reward": "eval/greedy_reward",
    "eval_pass_at_k": "eval/pass_at_k",
    "eval_completion_length": "eval/completion_length",
}


def is_installed(package: str) -> bool:
    """Whether ``package`` can be imported (checked without importing it)."""
    return importlib.util.find_spec(package) is not None


class ReportConfig(BaseModel):
    """Where a trainer reports its figures besides its JSON lines."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    report_to: list[TrackerName] = Field(
        default_factory=list,
        description="Trackers to write to: tensorboard (event files), wandb (an offline run); none by default",
    )
    dir: UserPath | None = Field(
        default=None,
        description="Folder of the trackers' files; default <metrics_dir>/tensorboard (runs/tensorboard "
        "without a metrics dir); each trainer writes into its own trainer-<peer id> folder inside",
    )

    @field_validator("report_to")
    @classmethod
    def _installed(cls, value: list[str]) -> list[str]:
        value = list(dict.fromkeys(value))
        for name in value:
            if not is_installed(name):
                raise ValueError(
                    f"--report-to {name} needs the {name} package, which is not installed: {INSTALL[name]}"
                )
        return value


class Tracker(Protocol):
    name: str

    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in ``logdir``, one scalar per tag and step (read them with ``tensorboard --logdir``)."""

    name = "tensorboard"

    def __init__(self, logdir: str, hparams: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir, flush_secs=10)
        text = "\n".join(f"{k}: {v}" for k, v in sorted(hparams.items()))
        self.writer.add_text("run/config", f"```\n{text}\n```", 0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """An offline wandb run in ``logdir`` (``wandb sync`` uploads it later, if one wants to)."""

    name = "wandb"

    def __init__(self, logdir: str, run_name: str, project: str, hparams: Mapping[str, Any]):
        import wandb

        self.run = wandb.init(
            mode="offline", dir=logdir, project=project, name=run_name, config=dict(hparams)
        )

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers a trainer opened; ``log`` maps its figures to ``TRL_NAMES`` and drops non-numbers."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, figures: Mapping[str, Any], step: int) -> None:
        scalars = tracker_scalars(figures)
        if not scalars:
            return
        for tracker in list(self.trackers):
            try:
                tracker.log(scalars, step)
            except Exception as exc:  # a full disk or a broken tracker must not stop training
                logger.error("the %s tracker failed (%r); no more figures go to it", tracker.name, exc)
                self._drop(tracker)

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._drop(tracker)

    def _drop(self, tracker: Tracker) -> None:
        self.trackers.remove(tracker)
        try:
            tracker.close()
        except Exception:
            logger.debug("closing the %s tracker failed", tracker.name, exc_info=True)


def step_figures(stats: Mapping[str, float], staleness: Mapping[int, int], step_s: float) -> dict[str, float]:
    """The figures of one training step that the trainer adds to its metrics line for ``TRL_NAMES``, from
    the learner's stats and the batch's staleness histogram (versions behind -> groups)."""
    groups = sum(staleness.values())
    out = {
        "staleness_mean": round(sum(k * n for k, n in staleness.items()) / max(groups, 1), 3),
        "behaviour_kl": round(float(stats.get("behaviour_kl", 0.0)), 6),
        "completion_length": round(float(stats.get("completion_len_mean_seq", 0.0)), 2),
        "grad_norm": round(float(stats.get("grad_norm", 0.0)), 5),
        "tokens_per_second": round(float(stats.get("num_tokens", 0.0)) / max(step_s, 1e-9), 1),
    }
    if "kl" in stats:  # the KL to a reference model (only with kl_beta > 0)
        out["kl"] = round(float(stats["kl"]), 6)
    return out


def tracker_scalars(figures: Mapping[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of the figures that have a tracker name and a finite numeric value."""
    out = {}
    for key, tag in TRL_NAMES.items():
        value = figures.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        out[tag] = float(value)
    return out


def open_trackers(
    config: ReportConfig, default_dir: str, run_name: str, project: str, hparams: Mapping[str, Any]
) -> Trackers:
    """Open the trackers of ``config`` in ``<config.dir or default_dir>/<run_name>``."""
    if not config.report_to:
        return Trackers([])
    logdir = os.path.join(config.dir or default_dir, run_name)
    os.makedirs(logdir, exist_ok=True)
    opened: list[Tracker] = []
    for name in config.report_to:
        if name == "tensorboard":
            opened.append(TensorBoardTracker(logdir, hparams))
        else:
            opened.append(WandbTracker(logdir, run_name, project, hparams))
        if name == "tensorboard":  # the command that shows them, with every trainer of this folder
            root = config.dir or default_dir
            logger.info(
                "reporting training figures to tensorboard in %s: tensorboard --logdir %s", logdir, root
            )
        else:
            logger.info("reporting training figures to %s in %s", name, logdir)
    return Trackers(opened)
