"""Integer arithmetic with difficulty levels, scored 1/0 on the last integer of the completion.

Owned here: ``ArithmeticTask`` and ``last_integer`` (the answer parser).
Levels: 1 = ``a+b`` with one-digit a, b (100 prompts, enumerated); 2 = ``a+b`` / ``a-b`` with two-digit a, b;
3 = ``a*b`` with a in 2..19, b in 2..99; 4 = ``a o b o c`` with o in ``+ - *`` (usual precedence), operands
1..20. Levels 2-4 draw their operands from a ``random.Random`` seeded with the level and the id, so a prompt
is a pure function of (level, id) on every machine and Python version.
Called through the registry. Must not import torch; must never ``eval`` text.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from echo_p2p.tasks.base import HELD_OUT_EVERY, Task, TaskOptions

_INT = re.compile(r"(?<![0-9])-?[0-9]+")
_THOUSANDS = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))")
_DEFAULT_MAX_NEW = {1: 4, 2: 6, 3: 6, 4: 8}


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``"... = -12."`` -> -12; ``"7-5"`` -> 5: a minus right after a
    digit is an operator, not a sign; ``1,234`` -> 1234), or None when there is none."""
    matches = _INT.findall(_THOUSANDS.sub("", text[-2000:]))
    if not matches:
        return None
    try:
        return int(matches[-1])
    except ValueError:  # pragma: no cover - the regex only matches integers
        return None


class ArithmeticOptions(TaskOptions):
    level: Literal[1, 2, 3, 4] = Field(default=1, description="Difficulty level (see the module docstring)")
    style: Literal["bare", "question"] = Field(
        default="bare",
        description="bare: '12+34=' (char-tokenizer friendly); "
        "question: 'what is 12+34? answer with one number.'",
    )
    num_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Restrict ids to 0..num_prompts-1 (a fixed pool); None: the level's own",
    )
    max_new_tokens: int | None = Field(default=None, ge=1, description="Completion cap (None: per level)")


class ArithmeticTask(Task):
    """Reward 1.0 when the last integer of the completion equals the exact result, else 0.0."""

    name = "arithmetic"

    def __init__(self, options: ArithmeticOptions | None = None) -> None:
        self.options = options or ArithmeticOptions()
        self.max_new_tokens = self.options.max_new_tokens or _DEFAULT_MAX_NEW[self.options.level]
        if self.options.style == "question" and self.options.max_new_tokens is None:
            self.max_new_tokens = 32

    @property
    def num_prompts(self) -> int | None:
        own = 100 if self.options.level == 1 else None
        if self.options.num_prompts is None:
            return own
        return min(own, self.options.num_prompts) if own is not None else self.options.num_prompts

    def held_out_ids(self) -> tuple[int, ...]:
        """Level 1 (``a+b``, id ``10a + b``): the 20 sums with ``(a + 2b) % 5 == 0``, so every a and every b
        is held out with two partners and trained with eight (the default rule, every fifth id, would hold
        out ``b = 2`` and ``b = 7`` entirely). Other levels: ``Task``'s default rule (the top 256 ids, or
        every fifth id of a ``num_prompts`` pool)."""
        n = self.num_prompts
        if self.options.level != 1 or n is None:
            return super().held_out_ids()
        if n < HELD_OUT_EVERY:
            return ()
        return tuple(i for i in range(n) if (i // 10 + 2 * (i % 10)) % 5 == 0)

    def problem(self, prompt_id: int) -> tuple[str, int]:
        """(expression, exact result) of ``prompt_id``."""
        self.check_prompt_id(prompt_id)
        level = self.options.level
        if level == 1:
            a, b = divmod(prompt_id, 10)
            return f"{a}+{b}", a + b
        rng = random.Random(f"echo_p2p.arithmetic:{level}:{prompt_id}")
        if level == 2:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if rng.random() < 0.5:
                return f"{a}+{b}", a + b
            return f"{a}-{b}", a - b
        if level == 3:
            a, b = rng.randint(2, 19), rng.randint(2, 99)
            return f"{a}*{b}", a * b
        a, b, c = (rng.randint(1, 20) for _ in range(3))
        o1, o2 = rng.choice("+-*"), rng.choice("+-*")
        return f"{a}{o1}{b}{o2}{c}", _eval3(a, o1, b, o2, c)

    def answer(self, prompt_id: int) -> int:
        return self.problem(prompt_id)[1]

    def prompt(self, prompt_id: int) -> str:
        expr, _ = self.problem(prompt_id)
        if self.options.style == "question":
            return f"what is {expr}? answer with one number."
        return f"{expr}="

    def score(self, prompt_id: int, completion_text: str) -> float:
        got = last_integer(completion_text)
        return 1.0 if got is not None and got == self.answer(prompt_id) else 0.0


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def _eval3(a: int, o1: str, b: int, o2: str, c: int) -> int:
    """``a o1 b o2 c`` with * binding tighter than + and -, left to right otherwise."""
    if o2 == "*" and o1 != "*":
        return _apply(a, o1, b * c)
    return _apply(_apply(a, o1, b), o2, c)
