"""Held-out evaluation: a policy's figures on its task's held-out prompts, on a schedule with a time budget.

Owned here: ``EvalConfig`` (when and how much), ``EvalSchedule`` (the rule: an evaluation is due every
``every_versions`` versions or ``every_seconds`` seconds, whichever comes first, and never sooner than keeps
the evaluator within ``max_share`` of wall-clock time), ``evaluate`` (the figures of one policy) and
``Evaluator`` (the two together, for a caller that holds a policy). The prompts are the first ``prompts`` ids
of ``Task.held_out_ids()``, the same every time, so that the figures of two versions compare; the sampled
completions use one fixed seed for the same reason.

Figures (TRL's names under ``eval/`` on TensorBoard/wandb, ``train.trackers.TRL_NAMES``):
``eval_accuracy`` share of the prompts whose greedy completion is correct (``Task.is_correct``: reward 1 for
the built-in tasks), ``eval_greedy_reward`` their mean reward, ``eval_reward`` / ``eval_reward_std`` mean
and spread of the reward of ``samples`` completions per prompt sampled at the run's temperature (top-p,
top-k), ``eval_pass_at_k`` share of the prompts with a correct one among them (k = ``samples``),
``eval_completion_length`` their mean length in tokens, ``eval_seconds`` what the evaluation took.

Called by the publishing trainer (``roles.trainer``) and the co-located loop (``colocated``) between two
training steps, on the training thread: nothing else touches the weights meanwhile, and the budget rule
bounds what it takes from training. Must not import hivemind; torch only through the engine it is given.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

    from echo_p2p.ml.engine import Engine, SamplingParams
    from echo_p2p.tasks.base import Task

logger = logging.getLogger(__name__)


class EvalConfig(BaseModel):
    """When the held-out prompts are scored, how many, and the share of time it may take."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Score held-out prompts during the run")
    every_seconds: float | None = Field(
        default=5.0, gt=0, description="Evaluate at least this often (seconds; None: only every_versions)"
    )
    every_versions: int | None = Field(
        default=None, ge=1, description="Evaluate every this many policy versions (None: only every_seconds)"
    )
    max_share: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="Most share of wall-clock time evaluation may take: after an evaluation of d seconds the "
        "next waits at least d * (1 - max_share) / max_share seconds, whatever the schedule says",
    )
    prompts: int = Field(
        default=32, ge=1, description="Held-out prompts scored per evaluation (the first ones of the split)"
    )
    samples: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Completions sampled per prompt at the run's temperature (eval_reward; pass@k with k = "
        "samples), besides the one greedy completion (eval_accuracy)",
    )
    seed: int = Field(default=0, description="Seed of the sampled completions (the same every evaluation)")


class EvalSchedule:
    """Whether an evaluation is due (the module docstring's rule). The first is due at once."""

    def __init__(self, config: EvalConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.last_version: int | None = None
        self.last_end: float | None = None
        self.last_seconds = 0.0

    def due(self, version: int) -> bool:
        if self.last_version is None or self.last_end is None:
            return True
        if version == self.last_version:
            return False
        share = self.config.max_share
        elapsed = self.clock() - self.last_end
        if elapsed < self.last_seconds * (1.0 - share) / share:
            return False
        every_v, every_s = self.config.every_versions, self.config.every_seconds
        return bool(
            (every_v is not None and version - self.last_version >= every_v)
            or (every_s is not None and elapsed >= every_s)
        )

    def done(self, version: int, seconds: float) -> None:
        self.last_version, self.last_end, self.last_seconds = version, self.clock(), seconds


def evaluate(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompt_ids: list[int],
    prompt_token_ids: list[list[int]],
    sampling: SamplingParams,
    samples: int,
) -> dict[str, Any]:
    """The figures (module docstring) of the policy ``engine`` holds on ``prompt_ids`` (whose token ids are
    ``prompt_token_ids``): one greedy completion and ``samples`` completions with ``sampling`` per prompt."""
    from echo_p2p.ml.tokenizer import decode_completion

    t0 = time.perf_counter()
    greedy = engine.sample(prompt_token_ids, 1, sampling.model_copy(update={"temperature": 0.0}))
    drawn = engine.sample(prompt_token_ids, samples, sampling)

    def scores(groups) -> list[list[float]]:
        out = []
        for pid, group in zip(prompt_ids, groups, strict=True):
            texts = [decode_completion(tokenizer, s.token_ids) for s in group]
            out.append(task.score_batch([pid] * len(texts), texts, [s.token_ids for s in group]))
        return out

    greedy_rewards = [g[0] for g in scores(greedy)]
    drawn_rewards = scores(drawn)
    flat = [r for group in drawn_rewards for r in group]
    mean = sum(flat) / len(flat)
    return {
        "eval_accuracy": round(sum(task.is_correct(r) for r in greedy_rewards) / len(prompt_ids), 4),
        "eval_greedy_reward": round(sum(greedy_rewards) / len(prompt_ids), 4),
        "eval_reward": round(mean, 4),
        "eval_reward_std": round(math.sqrt(sum((r - mean) ** 2 for r in flat) / len(flat)), 4),
        "eval_pass_at_k": round(
            sum(any(task.is_correct(r) for r in group) for group in drawn_rewards) / len(prompt_ids), 4
        ),
        "eval_k": samples,
        "eval_completion_length": round(
            sum(len(s.token_ids) for group in drawn for s in group) / len(flat), 2
        ),
        "eval_prompts": len(prompt_ids),
        "eval_seconds": round(time.perf_counter() - t0, 4),
    }


class Evaluator:
    """Scores the policy an engine holds on the task's held-out prompts when ``EvalSchedule`` says so.

    ``maybe(version)`` returns the figures (plus ``eval_version``) when it evaluated, else None. Off when
    the config says so or the task has no held-out prompts (logged once, at construction).
    ``seconds_total`` is what every evaluation took together (the cost the caller reports).
    """

    def __init__(
        self,
        config: EvalConfig,
        task: Task,
        tokenizer: PreTrainedTokenizerBase,
        engine: Engine,
        sampling: SamplingParams,
        use_chat_template: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from echo_p2p.ml.tokenizer import encode_prompts

        self.config = config
        self.task = task
        self.tokenizer = tokenizer
        self.engine = engine
        self.sampling = sampling.model_copy(update={"seed": config.seed})
        self.schedule = EvalSchedule(config, clock)
        self.prompt_ids = list(task.held_out_ids()[: config.prompts]) if config.enabled else []
        self.prompt_token_ids = encode_prompts(
            tokenizer, [task.prompt(i) for i in self.prompt_ids], use_chat_template
        )
        self.seconds_total = 0.0
        self.evaluations = 0
        self.last: dict[str, Any] | None = None
        if config.enabled and not self.prompt_ids:
            logger.warning(
                "task %s has no held-out prompts: no evaluation (a plug-in task takes eval_prompts or "
                "eval_split)",
                task.name,
            )

    @property
    def enabled(self) -> bool:
        return bool(self.prompt_ids)

    def maybe(self, version: int) -> dict[str, Any] | None:
        """Evaluate the engine's policy, tagged ``version``, if an evaluation is due."""
        if not self.enabled or not self.schedule.due(version):
            return None
        figures = evaluate(
            self.engine,
            self.tokenizer,
            self.task,
            self.prompt_ids,
            self.prompt_token_ids,
            self.sampling,
            self.config.samples,
        )
        self.schedule.done(version, figures["eval_seconds"])
        self.seconds_total += figures["eval_seconds"]
        self.evaluations += 1
        self.last = {"eval_version": version, **figures}
        return self.last

    def maybe_record(self, version: int, metrics: Any, label: str, **extra: Any) -> dict[str, Any] | None:
        """``maybe``, and when it evaluated, the two records every caller makes of it: one metrics line
        (``"event": "eval"``, with ``extra`` and the total seconds so far; ``metrics`` is an
        ``echo_p2p.metrics.MetricsWriter``) and one log line prefixed ``label``."""
        figures = self.maybe(version)
        if figures is None:
            return None
        metrics.write(version, event="eval", eval_s_total=round(self.seconds_total, 3), **extra, **figures)
        logger.info(
            "%s held-out evaluation of version %d: accuracy %.3f, reward %.3f (%d prompts, %.2f s)",
            label,
            version,
            figures["eval_accuracy"],
            figures["eval_reward"],
            figures["eval_prompts"],
            figures["eval_seconds"],
        )
        return figures
