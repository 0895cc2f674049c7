from __future__ import annotations

import pytest

from echo_p2p.tasks.base import TaskError
from echo_p2p.tasks.count import positional_match
from echo_p2p.tasks.registry import build_task


def test_count_prompts_enumerate_n_and_letter():
    task = build_task("count")
    assert task.num_prompts == 30
    prompts = [task.prompt(i) for i in range(30)]
    assert len(set(prompts)) == 30
    assert task.prompt(0) == "1a=" and task.prompt(29) == "6e="
    assert task.target(7) == "cc"  # 7 = 1 * 5 + 2 -> n=2, c


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("ccc", 1.0), ("cc", 2 / 3), ("cccc", 0.75), ("", 0.0), ("ddd", 0.0), ("cdc", 2 / 3), ("ccc\n", 0.75)],
)
def test_count_reward_is_the_positional_match(completion, reward):
    task = build_task("count")
    pid = next(i for i in range(30) if task.prompt(i) == "3c=")
    assert task.score(pid, completion) == pytest.approx(reward)


def test_letter_task():
    task = build_task("letter")
    assert task.num_prompts == 25
    assert task.prompt(2) == "c>"
    assert task.score(2, "d") == 1.0
    assert task.score(2, "e") == 0.0
    assert task.score(2, "dd") == 0.5
    assert task.score(24, "z") == 1.0


def test_prompt_ids_are_checked():
    task = build_task("count")
    for bad in (-1, 30, "3", 2.0, True):
        with pytest.raises(TaskError):
            task.prompt(bad)  # type: ignore[arg-type]


def test_positional_match_edges():
    assert positional_match("", "") == 1.0
    assert positional_match("ab", "") == 0.0
