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
