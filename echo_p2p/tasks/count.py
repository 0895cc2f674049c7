"""Toy tasks that a tiny model learns from scratch in seconds on CPU: ``count`` and ``letter``.

Owned here: ``CountTask`` (prompt ``"{n}{c}="``, answer ``c`` repeated ``n`` times) and ``LetterTask``
(prompt ``"c>"``, answer the next letter ``"d"``), with their positional-match rewards.
Called through the registry by peers and tests (the local swarm's default task is ``count``).
Must not import torch. Prompts use only characters of the built-in char tokenizer.
"""

from __future__ import annotations

import string

from pydantic import Field, field_validator

from echo_p2p.tasks.base import Task, TaskOptions


def positional_match(target: str, completion: str) -> float:
    """Matching positions / max(len(target), len(completion)): 1.0 only for an exact answer; too long or too
    short answers lose the extra/missing positions."""
    width = max(len(target), len(completion))
    if width == 0:
        return 1.0
    return sum(a == b for a, b in zip(target, completion, strict=False)) / width


class CountOptions(TaskOptions):
    max_n: int = Field(
        default=6, ge=1, le=9, description="Largest repeat count n (prompts use n in 1..max_n)"
    )
    letters: str = Field(
        default="abcde", min_length=1, description="Letters c the prompts use (a-z, distinct)"
    )
    max_new_tokens: int = Field(
        default=12,
        ge=1,
        description="Completion cap. It must leave a run-on answer costly: an answer that never stops is cut "
        "here and scores n / cap. At 7 (max_n + 1) writing 7 letters scored n/7, within 0.14 of stopping "
        "at n = 6, and a policy that had not yet learned the letter lost reward by stopping: EOS fell to "
        "p < 1e-4 within 75 steps and was never sampled again (reward plateau 0.5). At 12 every seed "
        "tried learns to stop (reward 0.97-0.99 after 250 co-located steps).",
    )

    @field_validator("letters")
    @classmethod
    def _letters(cls, value: str) -> str:
        if len(set(value)) != len(value) or not set(value) <= set(string.ascii_lowercase):
            raise ValueError("letters must be distinct lowercase a-z")
        return value


class CountTask(Task):
    """``"3b="`` -> ``"bbb"``. Reward: ``positional_match`` of the completion against the target, so the model
    must get the letter, the count and the stop (EOS) right. Ids enumerate (n, c): ``n = id // len(letters)
    + 1``, ``c = letters[id % len(letters)]``."""

    name = "count"

    def __init__(self, options: CountOptions | None = None) -> None:
        self.options = options or CountOptions()
        self.max_new_tokens = self.options.max_new_tokens

    @property
    def num_prompts(self) -> int:
        return self.options.max_n * len(self.options.letters)

    def _parts(self, prompt_id: int) -> tuple[int, str]:
        self.check_prompt_id(prompt_id)
        k = len(self.options.letters)
        return prompt_id // k + 1, self.options.letters[prompt_id % k]

    def prompt(self, prompt_id: int) -> str:
        n, c = self._parts(prompt_id)
        return f"{n}{c}="

    def target(self, prompt_id: int) -> str:
        n, c = self._parts(prompt_id)
        return c * n

    def score(self, prompt_id: int, completion_text: str) -> float:
        return positional_match(self.target(prompt_id), completion_text)


class LetterOptions(TaskOptions):
    max_new_tokens: int = Field(default=2, ge=1, description="Completion cap (the letter, then EOS)")


class LetterTask(Task):
    """``"c>"`` -> ``"d"`` over a..y (25 prompts, id = letter index). Reward: ``positional_match``."""

    name = "letter"

    def __init__(self, options: LetterOptions | None = None) -> None:
        self.options = options or LetterOptions()
        self.max_new_tokens = self.options.max_new_tokens

    @property
    def num_prompts(self) -> int:
        return 25

    def prompt(self, prompt_id: int) -> str:
        self.check_prompt_id(prompt_id)
        return f"{string.ascii_lowercase[prompt_id]}>"

    def target(self, prompt_id: int) -> str:
        self.check_prompt_id(prompt_id)
        return string.ascii_lowercase[prompt_id + 1]

    def score(self, prompt_id: int, completion_text: str) -> float:
        return positional_match(self.target(prompt_id), completion_text)
