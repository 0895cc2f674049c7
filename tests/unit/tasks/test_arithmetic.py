from __future__ import annotations

import pytest

from echo_p2p.tasks.arithmetic import last_integer
from echo_p2p.tasks.registry import build_task


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42),
        ("the answer is 7.", 7),
        ("3+4 = 7", 7),
        ("-12", -12),
        ("x = -12.", -12),
        ("7-5", 5),
        ("1,234", 1234),
        ("12 then 13", 13),
        ("no digits", None),
        ("", None),
    ],
)
def test_last_integer(text, value):
    assert last_integer(text) == value


def test_level_1_enumerates_one_digit_sums():
    task = build_task("arithmetic", {"level": 1})
    assert task.num_prompts == 100
    assert task.prompt(37) == "3+7="
    assert task.score(37, "10") == 1.0
    assert task.score(37, "3+7=10") == 1.0
    assert task.score(37, "11") == 0.0
    assert task.score(37, "") == 0.0


@pytest.mark.parametrize("level", [2, 3, 4])
def test_levels_are_deterministic_and_scored_on_the_exact_result(level):
    a = build_task("arithmetic", {"level": level})
    b = build_task("arithmetic", {"level": level})
    assert a.num_prompts is None
    ids = [0, 1, 2, 99, 12345, 2**31 - 1]
    assert [a.prompt(i) for i in ids] == [b.prompt(i) for i in ids]
    assert len({a.prompt(i) for i in range(50)}) > 40
    for i in ids:
        expr, value = a.problem(i)
        assert a.prompt(i) == f"{expr}="
        assert a.score(i, str(value)) == 1.0
        assert a.score(i, f"so {expr} = {value}") == 1.0
        assert a.score(i, str(value + 1)) == 0.0
        # the exact result, recomputed independently of the task's own evaluator
        assert value == _reference_eval(expr)
    ops = "".join(a.problem(i)[0] for i in range(200))
    assert {2: {"+", "-"}, 3: {"*"}, 4: {"+", "-", "*"}}[level] <= set(ops)


def _reference_eval(expr: str) -> int:
    import ast

    return int(eval(compile(ast.parse(expr, mode="eval"), "<expr>", "eval"), {"__builtins__": {}}))


def test_question_style_and_pool():
    task = build_task("arithmetic", {"level": 2, "style": "question", "num_prompts": 10})
    assert task.num_prompts == 10
    assert task.prompt(3).startswith("what is ") and task.prompt(3).endswith("? answer with one number.")
    assert task.max_new_tokens >= 16
