"""The ``Task`` interface: deterministic prompts from integer ids and a reward verifier.

Owned here: ``Task`` (the ABC every task implements), ``TaskOptions`` (base of each task's pydantic options)
and ``TaskError``. Called by the inference peer (prompt text, claimed rewards), the trainer (rebuilds the
prompt from its id and re-scores every completion: it trusts nothing it can recompute) and the registry.
Must not import torch, transformers or hivemind: the trainer validates with tasks and the CLI stays instant.
Scoring must never raise on an odd completion text: untrusted text scores low, it does not crash a peer.
A reward is any finite float within ``rollout.MAX_ABS_REWARD`` (1e6, the wire bound of
``rollout.Completion``): the built-in tasks score in [0, 1], a plug-in task's weighted sum of user functions
may be negative or above 1.

Held-out split: every task sets aside prompt ids for evaluation only (``held_out_ids``). No sampler draws
them (``sample_prompt_ids`` draws the others: inference peers, sync trainers' requests, the co-located
loop) and a trainer's ingest refuses a group on one (``held_out``, ``guard.rollout_checks``); the publishing trainer
and the co-located loop score them (``train.evaluation``). The default rule: a task of ``n`` prompts holds
out ``n // HELD_OUT_EVERY`` ids spread evenly over ``0 .. n - 1`` (none when ``n < HELD_OUT_EVERY``); a task
of unbounded ids holds out the top ``UNBOUNDED_HELD_OUT`` ids of ``0 .. 2**31 - 1``. A task may override it
(``count`` keeps every repeat count and letter in training, a plug-in task reads an eval file or split).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

#: A task of ``n`` prompts holds out one id in this many (``Task.held_out_ids``'s default rule).
HELD_OUT_EVERY = 5
#: A task of unbounded ids holds out this many ids, the top of ``0 .. 2**31 - 1``.
UNBOUNDED_HELD_OUT = 256
#: Ids are ints in ``0 .. ID_SPACE - 1`` when a task's ids are unbounded.
ID_SPACE = 2**31


class TaskError(ValueError):
    """A task was configured or used wrongly (unknown name, bad option, prompt id out of range...)."""


class TaskOptions(BaseModel):
    """Base of each task's options: unknown options are an error that names them."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(ABC):
    """A source of prompts and the verifier that scores completions of them.

    A prompt is identified by an integer ``prompt_id``: ``prompt(prompt_id)`` is a pure function of the id and
    the task's options, so a trainer rebuilds any prompt from the id a rollout carries. A reward is a finite
    float within ``rollout.MAX_ABS_REWARD`` of 0 (any scale: GRPO normalises it per group), and a pure
    function of the prompt id, the completion text and its token ids: the trainer re-scores every completion
    and refuses a claim that differs (``guard.rollout_checks``).
    """

    #: Registry name of the task (a rollout's ``task`` field).
    name: ClassVar[str]

    #: Completion length cap the task needs (EOS included).
    max_new_tokens: int

    #: Whether ``prompt`` returns conversations (lists of ``{"role", "content"}`` messages, rendered with the
    #: model's chat template) instead of texts: only a plug-in task's conversational prompts do.
    conversational: bool = False

    @property
    @abstractmethod
    def num_prompts(self) -> int | None:
        """Number of distinct prompts (ids are ``0 .. num_prompts - 1``), or None when ids are unbounded
        (any id in ``0 .. 2**31 - 1`` is valid)."""

    @abstractmethod
    def prompt(self, prompt_id: int) -> str | list[dict[str, str]]:
        """The prompt of ``prompt_id`` (deterministic): a text, or a list of messages when ``conversational``.
        Peers turn it into token ids with ``ml.tokenizer.encode_prompts`` only."""

    @abstractmethod
    def score(self, prompt_id: int, completion_text: str) -> float:
        """Reward (a finite float, see the class doc) of ``completion_text`` (decoded without special tokens)
        as an answer to ``prompt_id``."""

    def score_batch(
        self,
        prompt_ids: Sequence[int],
        completion_texts: Sequence[str],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[float]:
        """Rewards of several completions (a task may batch its verifier; default: one by one).

        ``completion_ids`` are the completions' token ids as sampled (EOS included if sampled), one list per
        text, for a verifier that scores tokens (a TRL reward function's ``completion_ids``); the built-in
        tasks ignore them. The inference peer (claimed reward) and the trainer (re-score) both pass them.
        """
        self.check_batch(prompt_ids, completion_texts, completion_ids)
        return [self.score(p, c) for p, c in zip(prompt_ids, completion_texts, strict=True)]

    @staticmethod
    def check_batch(
        prompt_ids: Sequence[int],
        completion_texts: Sequence[str],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """``TaskError`` unless ``score_batch``'s arguments hold one entry per completion."""
        if len(prompt_ids) != len(completion_texts):
            raise TaskError(f"{len(prompt_ids)} prompt ids for {len(completion_texts)} completions")
        if completion_ids is not None and len(completion_ids) != len(completion_texts):
            raise TaskError(f"{len(completion_ids)} token id lists for {len(completion_texts)} completions")

    def check_prompt_id(self, prompt_id: int) -> int:
        """``prompt_id`` if it is valid for this task, else ``TaskError`` (ids arrive from other peers).
        A held-out id is valid here (evaluation scores it): ``is_held_out`` tells training ids apart."""
        if isinstance(prompt_id, bool) or not isinstance(prompt_id, int):
            raise TaskError(f"prompt id must be an int, got {type(prompt_id).__name__}")
        limit = self.num_prompts if self.num_prompts is not None else ID_SPACE
        if not 0 <= prompt_id < limit:
            raise TaskError(f"prompt id {prompt_id} out of range [0, {limit}) for task {self.name!r}")
        return prompt_id

    def held_out_ids(self) -> tuple[int, ...]:
        """The held-out split, ascending: ids that are scored by evaluation and never trained on (the module
        docstring's default rule; a task may override it). Must be a pure function of the options and leave
        at least one id to train on."""
        n = self.num_prompts
        if n is None:
            return tuple(range(ID_SPACE - UNBOUNDED_HELD_OUT, ID_SPACE))
        count = n // HELD_OUT_EVERY
        return tuple(sorted({(2 * i + 1) * n // (2 * count) for i in range(count)}))

    @cached_property
    def _held_out(self) -> frozenset[int]:
        return frozenset(self.held_out_ids())

    @cached_property
    def _training_ids(self) -> tuple[int, ...] | None:
        """The ids samplers draw from (finite tasks), or None when ids are unbounded."""
        n = self.num_prompts
        if n is None:
            return None
        ids = tuple(i for i in range(n) if i not in self._held_out)
        if not ids:
            raise TaskError(f"task {self.name!r} holds out all of its {n} prompts: nothing to train on")
        return ids

    def is_held_out(self, prompt_id: int) -> bool:
        """Whether ``prompt_id`` belongs to the held-out split (evaluation only: never sampled for training)."""
        return prompt_id in self._held_out

    def is_correct(self, reward: float) -> bool:
        """Whether a completion of this reward is an exact answer (evaluation's accuracy and pass@k): a reward
        of 1 for the built-in tasks, whose rewards lie in [0, 1] with 1 only for an exact answer."""
        return reward >= 1.0 - 1e-9

    def sample_prompt_ids(self, rng: random.Random, k: int) -> list[int]:
        """``k`` training prompt ids drawn with ``rng`` (never a held-out one): distinct when the task has at
        least ``k`` training prompts."""
        if k < 0:
            raise TaskError(f"k must be >= 0, got {k}")
        ids = self._training_ids
        if ids is None:
            out = []
            while len(out) < k:
                prompt_id = rng.randrange(ID_SPACE)
                if prompt_id not in self._held_out:  # a redraw once in ~8 million draws by default
                    out.append(prompt_id)
            return out
        if k <= len(ids):
            return rng.sample(ids, k)
        return [rng.choice(ids) for _ in range(k)]

    def describe(self) -> str:
        """One line for logs."""
        return (
            f"{self.name} (prompts: {self.num_prompts or 'unbounded'}, max_new_tokens: {self.max_new_tokens})"
        )
