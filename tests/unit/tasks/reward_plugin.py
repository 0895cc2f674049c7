"""Reward functions with TRL's GRPO signature, loaded by the plug-in tests by import path and by file path."""

from __future__ import annotations


def exact_answer(prompts, completions, answer, **kwargs):
    """1.0 when the completion, stripped, equals the row's ``answer`` column."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def length_penalty(prompts, completions, **kwargs):
    """Out-of-range on purpose: shorter is better, 2.0 for an empty completion (clipped to 1)."""
    return [2.0 - len(c) for c in completions]


def broken(prompts, completions, **kwargs):
    raise RuntimeError("this reward function is broken")


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def no_kwargs(prompts, completions):
    return [0.0 for _ in completions]


NOT_A_FUNCTION = 42


# ---- for the TRL-style reward tests (tests/unit/tasks/test_plugin_rewards.py) ----------------------------
CALLS: list[dict] = []  # what the recording functions received, newest last


def record_kwargs(completions, **kwargs):
    """TRL's usual signature: records every keyword argument it received; 0.5 each."""
    CALLS.append({"completions": list(completions), **kwargs})
    return [0.5 for _ in completions]


def token_count(completion_ids, **kwargs):
    """TRL's documented example: reward the completion's length in tokens (records what it received)."""
    CALLS.append({"completion_ids": completion_ids})
    return [float(len(ids)) for ids in completion_ids]


def none_unless_answered(completions, answer, **kwargs):
    """Applies only to completions that are a number: None for the others (TRL's multi-task convention)."""
    return [
        None if not c.strip().isdigit() else (1.0 if c.strip() == str(a) else -1.0)
        for c, a in zip(completions, answer, strict=True)
    ]


def always_none(completions, **kwargs):
    return [None for _ in completions]


def scaled(completions, **kwargs):
    """Rewards of any scale: 'a' -1, 'b' 2.5, 'k' 1000 (k for kilo), anything else 0."""
    table = {"a": -1.0, "b": 2.5, "k": 1000.0}
    return [table.get(c[:1], 0.0) for c in completions]


def garbage_values(completions, **kwargs):
    """One of each value a reward function should not return, in order: NaN, inf, -inf, a string, an object,
    1e300 (finite but beyond the wire bound), -1e300, then 0.25."""
    values = [float("nan"), float("inf"), float("-inf"), "0.5", object(), 1e300, -1e300, 0.25]
    return values[: len(completions)]


def mutates_inputs(prompts, completions, completion_ids, answer, **kwargs):
    """Edits everything it is given; the next function must not see it."""
    completions[:] = ["edited"] * len(completions)
    for ids in completion_ids or []:
        ids.append(999)
    answer[:] = [None] * len(answer)
    return [0.0 for _ in completions]


def wants_missing_column(prompts, completions, difficulty):
    return [0.0 for _ in completions]


def sees_no_completion(prompts, **other):  # has **other, so it receives completions: this one is fine
    return [0.0 for _ in other["completions"]]


def prompts_only(prompts):
    return [0.0 for _ in prompts]


def positional_only(completions, /, **kwargs):
    return [0.0 for _ in completions]


async def async_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def chat_answer(prompts, completions, answer, **kwargs):
    """A reward written for TRL's conversational format: ``prompts`` are message lists and each completion
    is ``[{"role": "assistant", "content": text}]``; 1.0 when that content, stripped, is the answer."""
    CALLS.append({"prompts": prompts, "completions": completions})
    return [
        1.0 if c[0]["content"].strip() == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def chat_length(completions, **kwargs):
    """The assistant message's length in characters (conversational completions only: a text raises)."""
    return [float(len(c[0]["content"])) for c in completions]
