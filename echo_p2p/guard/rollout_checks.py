"""Rollout checks: validation of untrusted rollout groups before they reach a trainer's replay buffer.

Owned here: ``IngestConfig`` (the limits a trainer enforces) and ``IngestValidator``, which checks schema,
sizes, token ranges, log-probs, versions and the prompt (rebuilt from its id), then re-scores every
completion with the task's own verifier: the claimed reward is never trusted, it is only compared with the
re-score to catch forgers (``reward_matches``). Called by the trainer peer, through the rollout transport
(``echo_p2p.transport.rollouts.ingest`` async, ``rollouts.pull`` sync). Must not import hivemind or torch,
and must never raise on bad input: every problem is a ``Rejection`` (the refusal codes are the wire's:
``transport.rollouts.refusals``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.ml.tokenizer import check_chat_template, decode_completion, encode_prompts
from echo_p2p.rollout import MAX_ABS_REWARD, MAX_ROLLOUT_ID_LEN, RolloutGroup, Sampling
from echo_p2p.tasks.base import Task, TaskError
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.transport.rollouts.refusals import Reason, Rejection

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: A behaviour log-prob above this is impossible (log p <= 0) beyond float rounding.
MAX_LOGPROB = 1e-3


class IngestConfig(BaseModel):
    """The limits a trainer enforces on every rollout group it receives (pushed or pulled)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(
        ge=1, description="Token ids must lie in [0, vocab_size) (the model's vocabulary)"
    )
    group_size: int = Field(default=16, ge=1, le=4096, description="G: exact number of completions per group")
    max_prompt_tokens: int = Field(default=1024, ge=1, description="Longest prompt (tokens) accepted")
    max_completion_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Longest completion (tokens, EOS included); None: each task's own max_new_tokens",
    )
    max_staleness: int = Field(
        default=4, ge=0, description="Refuse groups older than current_version - max_staleness (0: sync mode)"
    )
    logprob_floor_mass: float = Field(
        default=1e-9,
        gt=0,
        lt=1,
        description="Behaviour log-probs below log(logprob_floor_mass / vocab_size) are refused (bad_logprob): "
        "the tokens that a distribution over the vocabulary gives less than that probability weigh at most "
        "``logprob_floor_mass`` together, so an honest sampler reports one below the floor at most once in "
        "1e9 tokens, whatever its temperature, top-p or quantisation (-31.5 for a 49k vocabulary).",
    )
    reward_tolerance: float = Field(
        default=1e-3,
        ge=0,
        allow_inf_nan=False,
        description="Relative tolerance of the re-score: a claimed reward is accepted when "
        "|claimed - re-scored| <= reward_tolerance * max(1, |re-scored|), else forged_reward (absolute for "
        "rewards within [-1, 1], relative to the reward's size above: rewards may have any scale)",
    )
    tasks: list[str] | None = Field(
        default=None, description="Task names accepted; None: every task the validator was given"
    )
    use_chat_template: bool | None = Field(
        default=None,
        description="How prompts are encoded (must match the inference peers); None: the tokenizer's default",
    )
    prompt_cache_size: int = Field(
        default=4096, ge=0, description="Rebuilt prompts kept in memory (tokenizing is the costly part)"
    )
    sampling: Sampling | None = Field(
        default=None,
        description="The run's sampling distribution: a group must say it was sampled with exactly this "
        "temperature, top_p and top_k (the trainer's log-probs use them); None: not checked",
    )
    precisions: list[str] | None = Field(
        default=None, description="Sampler weight precisions accepted (with ``sampling``); None: any"
    )
    require_seed: bool = Field(
        default=False,
        description="Refuse a group that does not carry the seed of its draws (``RolloutGroup.sampling_seed``; "
        "``RunSettings.seeded_sampling``) as sampling_mismatch",
    )


def reward_matches(claimed: float, rescored: float, tolerance: float) -> bool:
    """True when a sampler's ``claimed`` reward agrees with the trainer's ``rescored`` one:
    ``|claimed - rescored| <= tolerance * max(1, |rescored|)``. The bound is relative to the re-score (the
    trusted value, so a forger cannot widen it with a huge claim) and never tighter than ``tolerance`` in
    absolute terms, so rewards near 0 are compared as before. Both peers run the same verifier on the same
    text and token ids and the float travels exactly, so an honest claim is equal, bar a verifier that is not
    deterministic."""
    return abs(claimed - rescored) <= tolerance * max(1.0, abs(rescored))


class IngestValidator:
    """Checks rollout groups against one trainer's tasks, tokenizer and limits; see the module doc.

    ``validate`` is thread-safe in the sense that it holds no lock-free shared mutable state other than the
    prompt cache (an ``OrderedDict`` touched under the GIL); call it from one thread per tokenizer when the
    tokenizer itself is not thread-safe.
    """

    def __init__(
        self, tasks: Mapping[str, Task], tokenizer: PreTrainedTokenizerBase, config: IngestConfig
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        allowed = set(config.tasks) if config.tasks is not None else set(tasks)
        self.tasks: dict[str, Task] = {name: task for name, task in tasks.items() if name in allowed}
        for task in self.tasks.values():  # a conversational task needs the chat template (ValueError)
            check_chat_template(tokenizer, task.conversational, config.use_chat_template)
        self._prompts: OrderedDict[tuple[str, int], tuple[int, ...]] = OrderedDict()
        self.min_logprob = math.log(config.logprob_floor_mass / config.vocab_size)

    # ---- public -----------------------------------------------------------------------------------------
    def validate(self, group: Any, current_version: int) -> ScoredGroup | Rejection:
        """The group with re-scored rewards, or why it is refused. Never raises."""
        try:
            return self._validate(group, current_version)
        except Exception as exc:  # a bug or a task verifier that raised: refuse, log, keep serving
            logger.exception("validating a rollout group failed")
            return Rejection(Reason.INTERNAL_ERROR, f"{type(exc).__name__}")

    def prompt_token_ids(self, task_name: str, prompt_id: int) -> tuple[int, ...]:
        """The prompt of ``prompt_id`` tokenized as the inference peers must have done it (cached): the task's
        text or conversation through ``encode_prompts``, the function the samplers use."""
        key = (task_name, prompt_id)
        cached = self._prompts.get(key)
        if cached is not None:
            self._prompts.move_to_end(key)
            return cached
        text = self.tasks[task_name].prompt(prompt_id)
        ids = tuple(encode_prompts(self.tokenizer, [text], self.config.use_chat_template)[0])
        if self.config.prompt_cache_size:
            self._prompts[key] = ids
            while len(self._prompts) > self.config.prompt_cache_size:
                self._prompts.popitem(last=False)
        return ids

    # ---- checks, cheapest first -------------------------------------------------------------------------
    def _validate(self, group: Any, current_version: int) -> ScoredGroup | Rejection:
        if not isinstance(group, RolloutGroup):
            return Rejection(Reason.MALFORMED, f"not a RolloutGroup ({type(group).__name__})")
        if group.protocol != PROTOCOL_VERSION:
            return Rejection(Reason.OTHER_PROTOCOL, f"protocol {group.protocol}, expected {PROTOCOL_VERSION}")
        if not group.rollout_id or len(group.rollout_id) > MAX_ROLLOUT_ID_LEN:
            return Rejection(Reason.MALFORMED, "rollout_id empty or too long")
        if group.policy_version < 0:
            return Rejection(Reason.MALFORMED, f"negative policy_version {group.policy_version}")
        task = self.tasks.get(group.task)
        if task is None:
            return Rejection(Reason.UNKNOWN_TASK, f"task {group.task[:64]!r} is not trained here")
        try:
            task.check_prompt_id(group.prompt_id)
        except TaskError as exc:
            return Rejection(Reason.BAD_PROMPT_ID, str(exc))
        if task.is_held_out(group.prompt_id):
            return Rejection(Reason.HELD_OUT, f"prompt {group.prompt_id} is held out for evaluation")
        if len(group.completions) != self.config.group_size:
            return Rejection(
                Reason.WRONG_GROUP_SIZE,
                f"{len(group.completions)} completions, expected {self.config.group_size}",
            )
        if (rejection := self._check_shapes(group, task)) is not None:
            return rejection
        if group.policy_version > current_version:
            return Rejection(
                Reason.FUTURE_VERSION, f"version {group.policy_version} > current {current_version}"
            )
        if current_version - group.policy_version > self.config.max_staleness:
            return Rejection(
                Reason.TOO_STALE,
                f"version {group.policy_version} is {current_version - group.policy_version} behind "
                f"(max {self.config.max_staleness})",
            )
        if (rejection := self._check_sampling(group.sampling)) is not None:
            return rejection
        if self.config.require_seed and not group.sampling_seed:
            return Rejection(
                Reason.SAMPLING_MISMATCH,
                "not drawn from a seed: the run checks seeded draws (sample with the transformers engine)",
            )
        if tuple(group.prompt_token_ids) != self.prompt_token_ids(group.task, group.prompt_id):
            return Rejection(Reason.PROMPT_MISMATCH, f"prompt tokens differ from prompt {group.prompt_id}")
        return self._rescore(group, task)

    def _check_sampling(self, sampling: Sampling | None) -> Rejection | None:
        run = self.config.sampling
        if run is None:
            return None
        if sampling is None:
            return Rejection(Reason.SAMPLING_MISMATCH, "the group does not say how it was sampled")
        for name in ("temperature", "top_p", "top_k"):
            if getattr(sampling, name) != getattr(run, name):
                return Rejection(
                    Reason.SAMPLING_MISMATCH,
                    f"{name} {getattr(sampling, name)!r}, the run samples at {getattr(run, name)!r}",
                )
        if self.config.precisions is not None and sampling.precision not in self.config.precisions:
            return Rejection(
                Reason.SAMPLING_MISMATCH,
                f"precision {sampling.precision[:32]!r} is not one the run allows ({', '.join(self.config.precisions)})",
            )
        return None

    def _check_shapes(self, group: RolloutGroup, task: Task) -> Rejection | None:
        vocab = self.config.vocab_size
        max_completion = self.config.max_completion_tokens or task.max_new_tokens
        prompt = group.prompt_token_ids
        if not prompt:
            return Rejection(Reason.MALFORMED, "empty prompt")
        if len(prompt) > self.config.max_prompt_tokens:
            return Rejection(
                Reason.TOO_LONG, f"prompt of {len(prompt)} tokens > {self.config.max_prompt_tokens}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            return Rejection(Reason.TOKEN_OUT_OF_RANGE, f"prompt token outside [0, {vocab})")
        for i, completion in enumerate(group.completions):
            ids = completion.token_ids
            if not ids:
                return Rejection(Reason.MALFORMED, f"completion {i} is empty")
            if len(ids) > max_completion:
                return Rejection(Reason.TOO_LONG, f"completion {i} has {len(ids)} tokens > {max_completion}")
            if min(ids) < 0 or max(ids) >= vocab:
                return Rejection(
                    Reason.TOKEN_OUT_OF_RANGE, f"completion {i} has a token outside [0, {vocab})"
                )
            if len(completion.logprobs) != len(ids):
                return Rejection(
                    Reason.LOGPROB_MISMATCH,
                    f"completion {i}: {len(completion.logprobs)} log-probs, {len(ids)} tokens",
                )
            if not all(math.isfinite(lp) for lp in completion.logprobs):
                return Rejection(Reason.NON_FINITE, f"completion {i} has a non-finite log-prob")
            if max(completion.logprobs) > MAX_LOGPROB:
                return Rejection(Reason.BAD_LOGPROB, f"completion {i} has a positive log-prob")
            if min(completion.logprobs) < self.min_logprob:
                return Rejection(
                    Reason.BAD_LOGPROB,
                    f"completion {i} has a log-prob below the floor {self.min_logprob:.1f}",
                )
            if not math.isfinite(completion.claimed_reward):
                return Rejection(Reason.NON_FINITE, f"completion {i} has a non-finite claimed reward")
            if abs(completion.claimed_reward) > MAX_ABS_REWARD:
                return Rejection(
                    Reason.MALFORMED,
                    f"completion {i} claims a reward of {completion.claimed_reward:.4g}, "
                    f"beyond ±{MAX_ABS_REWARD:g}",
                )
        return None

    def _rescore(self, group: RolloutGroup, task: Task) -> ScoredGroup | Rejection:
        texts = [decode_completion(self.tokenizer, c.token_ids) for c in group.completions]
        rewards = task.score_batch(
            [group.prompt_id] * len(texts), texts, completion_ids=[c.token_ids for c in group.completions]
        )
        if len(rewards) != len(texts) or not all(
            math.isfinite(r) and abs(r) <= MAX_ABS_REWARD for r in rewards
        ):
            logger.error("task %s returned bad rewards %r", task.name, rewards[:4])
            return Rejection(Reason.INTERNAL_ERROR, "the task's verifier returned bad rewards")
        for i, (completion, reward) in enumerate(zip(group.completions, rewards, strict=True)):
            if not reward_matches(completion.claimed_reward, reward, self.config.reward_tolerance):
                return Rejection(
                    Reason.FORGED_REWARD,
                    f"completion {i} claims {completion.claimed_reward:.4g}, verifier says {reward:.4g}",
                )
        return ScoredGroup(group, rewards)
