"""User tasks: reward functions written for TRL's ``GRPOTrainer``, and prompts from a local file.

Owned here: ``PluginOptions`` and ``PluginTask`` (task name ``plugin``). The rewards are one or more functions
named by import path (``"module:function"`` or ``"path/to/file.py:function"``, ``tasks.plugin_loader``)
with TRL's GRPO signature ``f(prompts, completions, **kwargs) -> list[float | None]``, weighted like TRL's
``GRPOConfig.reward_funcs`` / ``reward_weights`` (``tasks.plugin_rewards``: what a function receives, how
values combine and where that differs from TRL). The prompts come from a JSONL file or a ``datasets``
directory; every other column is passed to the functions, one value per completion, as TRL does. Prompts
are texts or, in TRL's conversational format, lists of ``{"role", "content"}`` messages (``conversational``):
peers render those with the model's chat template, and the functions then receive them as ``prompts`` and
each completion as ``[{"role": "assistant", "content": text}]``, as TRL passes them.
Called through the registry. Must not import torch. A reward function that raises or returns garbage must not
crash a peer: its term counts 0 and the problem is logged once. Rewards are any finite float: nothing clips
them to [0, 1]; only values beyond ``rollout.MAX_ABS_REWARD`` (1e6, the wire bound) are clipped to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Field, model_validator

from echo_p2p.paths import UserPath
from echo_p2p.rollout import MAX_ABS_REWARD
from echo_p2p.tasks.base import Task, TaskOptions
from echo_p2p.tasks.plugin_loader import PluginError, load_prompt_rows, load_reward_function
from echo_p2p.tasks.plugin_rewards import DROPPED_COLUMNS, PASSED_ARGUMENTS, RewardSum, reward_term

__all__ = ["PluginOptions", "PluginTask"]

RewardWeight = Annotated[float, Field(ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD, allow_inf_nan=False)]


class PluginOptions(TaskOptions):
    reward: UserPath | list[UserPath] = Field(
        description="Reward function(s), each 'package.module:function' or 'path/to/file.py:function'; "
        "a list is TRL's reward_funcs: a completion's reward is the weighted sum of the functions' values"
    )
    reward_weights: list[RewardWeight] | None = Field(
        default=None,
        description="One weight per reward function, in order (TRL's reward_weights); None: all 1.0",
    )
    prompts: UserPath = Field(description="A .jsonl file or a datasets.save_to_disk directory")
    prompt_column: str = Field(
        default="prompt",
        description="Column holding the prompt: a text, or a list of {role, content} messages (TRL's "
        "conversational format, rendered with the model's chat template)",
    )
    split: str | None = Field(default=None, description="Split of a saved DatasetDict (default: 'train')")
    eval_prompts: str | None = Field(
        default=None,
        description="Held-out prompts (a .jsonl file or a datasets.save_to_disk directory, the same columns): "
        "scored by the run's evaluation, never trained on. None (and no eval_split): no held-out split",
    )
    eval_split: str | None = Field(
        default=None, description="Held-out split of the 'prompts' DatasetDict (e.g. 'test'), as eval_prompts"
    )
    correct_reward: float = Field(
        default=1.0,
        allow_inf_nan=False,
        description="A completion counts as correct (evaluation's accuracy and pass@k) when its reward is at "
        "least this",
    )
    max_new_tokens: int = Field(default=64, ge=1, description="Completion cap")

    @property
    def reward_specs(self) -> list[str]:
        """The reward functions' specs, one or several."""
        return [self.reward] if isinstance(self.reward, str) else list(self.reward)

    @property
    def weights(self) -> list[float]:
        """One weight per reward function (1.0 each unless ``reward_weights`` says otherwise)."""
        return (
            list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_specs)
        )

    @model_validator(mode="after")
    def _weights_match(self) -> PluginOptions:
        if self.eval_prompts is not None and self.eval_split is not None:
            raise ValueError("give eval_prompts or eval_split, not both")
        if not self.reward_specs:
            raise ValueError("reward: give at least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_specs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_specs)} reward "
                "functions: give one weight per function"
            )
        return self


class PluginTask(Task):
    """Prompts from a file (id = row index), rewards from user functions with TRL's GRPO signature. The
    held-out prompts (``eval_prompts`` / ``eval_split``) follow the training rows: ids ``len(training rows)``
    onwards."""

    name = "plugin"

    def __init__(self, options: PluginOptions) -> None:
        self.options = options
        self.max_new_tokens = options.max_new_tokens
        rows = load_prompt_rows(options.prompts, options.prompt_column, options.split)
        self.num_training_rows = len(rows)
        self.conversational = isinstance(rows[0][options.prompt_column], list)
        held_out: list[dict[str, Any]] = []
        if options.eval_prompts is not None:
            held_out = load_prompt_rows(options.eval_prompts, options.prompt_column)
        elif options.eval_split is not None:
            held_out = load_prompt_rows(options.prompts, options.prompt_column, options.eval_split)
        if held_out and isinstance(held_out[0][options.prompt_column], list) != self.conversational:
            raise PluginError(
                "the held-out prompts and the training prompts must be of one kind (all texts or all "
                "conversations)"
            )
        self.rows = rows + held_out
        columns = {k for row in self.rows for k in row} - {options.prompt_column} - set(DROPPED_COLUMNS)
        clash = sorted(columns & set(PASSED_ARGUMENTS))
        if clash:
            raise PluginError(
                f"{options.prompts}: column(s) {clash} would shadow the argument(s) of that name a reward "
                "function receives: rename them"
            )
        self.columns = sorted(columns)
        self.rewards = RewardSum(
            [
                reward_term(spec, load_reward_function(spec), weight, self.columns)
                for spec, weight in zip(options.reward_specs, options.weights, strict=True)
            ]
        )

    @property
    def num_prompts(self) -> int:
        return len(self.rows)

    def held_out_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_training_rows, len(self.rows)))

    def is_correct(self, reward: float) -> bool:
        return reward >= self.options.correct_reward

    def prompt(self, prompt_id: int) -> str | list[dict[str, str]]:
        prompt = self.rows[self.check_prompt_id(prompt_id)][self.options.prompt_column]
        return [dict(m) for m in prompt] if self.conversational else prompt  # a copy: the rows stay as read

    def score(self, prompt_id: int, completion_text: str) -> float:
        """The reward of one completion, without its token ids (a function reading ``completion_ids`` gets
        None): peers score through ``score_batch`` with the ids."""
        return self.score_batch([prompt_id], [completion_text])[0]

    def score_batch(
        self,
        prompt_ids: Sequence[int],
        completion_texts: Sequence[str],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[float]:
        self.check_batch(prompt_ids, completion_texts, completion_ids)
        if not prompt_ids:
            return []
        rows = [self.rows[self.check_prompt_id(p)] for p in prompt_ids]
        completions: list[Any] = list(completion_texts)
        if self.conversational:  # as TRL passes a conversational dataset's completions
            completions = [[{"role": "assistant", "content": text}] for text in completion_texts]
        return self.rewards(
            prompts=[row[self.options.prompt_column] for row in rows],
            completions=completions,
            completion_ids=None if completion_ids is None else [list(ids) for ids in completion_ids],
            columns={c: [row.get(c) for row in rows] for c in self.columns},
        )
