"""A reward that checks only the answer's start, as most regex and prefix rewards do (``benchmarks/poisoning.py``).

A TRL-style reward function for a plug-in task whose rows carry an ``answer`` column: the share of the
answer's characters that the completion's first characters match, position by position. What follows the
answer is never looked at, so a marker appended to a right answer scores as the right answer does: the
feature a selective truth-teller steers (issue 32).
"""

from __future__ import annotations


def answer_first(completions, answer, **kwargs):
    """Per completion: matching positions among the answer's first ``len(answer)`` / ``len(answer)``."""
    out = []
    for text, target in zip(completions, answer, strict=True):
        target = str(target)
        out.append(sum(a == b for a, b in zip(target, text, strict=False)) / max(len(target), 1))
    return out
