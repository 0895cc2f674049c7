"""Held-out splits: what each task sets aside, that no sampler draws it, and the plug-in task's eval file."""

from __future__ import annotations

import json
import random

import pytest

from echo_p2p.tasks.base import ID_SPACE, UNBOUNDED_HELD_OUT, TaskError
from echo_p2p.tasks.registry import BUILTIN_TASKS, build_task


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_every_builtin_task_holds_out_valid_ids_that_are_never_sampled(name):
    task = build_task(name)
    held = task.held_out_ids()
    assert held and list(held) == sorted(set(held)) and all(task.check_prompt_id(i) == i for i in held)
    assert held == build_task(name).held_out_ids()  # a pure function of the options: every peer agrees
    rng = random.Random(0)
    drawn = [i for _ in range(300) for i in task.sample_prompt_ids(rng, 16)]
    assert not any(task.is_held_out(i) for i in drawn)
    if task.num_prompts is not None:  # every training id is still drawn
        assert set(drawn) == set(range(task.num_prompts)) - set(held)


def test_count_holds_out_one_pair_per_repeat_count_and_keeps_every_n_and_letter_in_training():
    task = build_task("count")
    assert [task.prompt(i) for i in task.held_out_ids()] == ["1a=", "2b=", "3c=", "4d=", "5e=", "6a="]
    training = [task.prompt(i) for i in range(task.num_prompts) if not task.is_held_out(i)]
    assert len(training) == 24
    assert {p[0] for p in training} == set("123456") and {p[1] for p in training} == set("abcde")
    one_letter = build_task("count", {"letters": "a", "max_n": 4})
    assert [one_letter.prompt(i) for i in one_letter.held_out_ids()] == ["2a="]


def test_letter_and_arithmetic_splits():
    letter = build_task("letter")
    assert [letter.prompt(i) for i in letter.held_out_ids()] == ["c>", "h>", "m>", "r>", "w>"]
    level1 = build_task("arithmetic")
    held = [level1.problem(i)[0] for i in level1.held_out_ids()]
    assert len(held) == 20
    training = [level1.problem(i)[0] for i in range(100) if not level1.is_held_out(i)]
    for digit in "0123456789":  # every first and every second operand is trained on (eight partners)
        assert sum(p[0] == digit for p in training) == 8 and sum(p[2] == digit for p in training) == 8
    level2 = build_task("arithmetic", {"level": 2})
    assert level2.held_out_ids() == tuple(range(ID_SPACE - UNBOUNDED_HELD_OUT, ID_SPACE))
    assert level2.is_held_out(ID_SPACE - 1) and not level2.is_held_out(5)
    pool = build_task("arithmetic", {"level": 2, "num_prompts": 10})
    assert pool.held_out_ids() == (2, 7)  # one id in five of a pool, spread evenly


def test_a_task_that_would_hold_out_everything_is_refused():
    class Greedy(type(build_task("letter"))):
        def held_out_ids(self):
            return tuple(range(25))

    with pytest.raises(TaskError, match="nothing to train on"):
        Greedy().sample_prompt_ids(random.Random(0), 1)


def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(
        "def exact(prompts, completions, answer, **kw):\n"
        "    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]\n"
    )
    return f"{path}:exact"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plugin_eval_prompts_follow_the_training_rows_and_are_held_out(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(4)])
    held = write_jsonl(
        tmp_path / "eval.jsonl", [{"prompt": "q0", "answer": "x"}, {"prompt": "q1", "answer": "y"}]
    )
    options = {"prompts": train, "reward": rewards_file(tmp_path)}
    task = build_task("plugin", {**options, "eval_prompts": held, "correct_reward": 0.5})
    assert task.num_prompts == 6 and task.held_out_ids() == (4, 5)
    assert task.prompt(5) == "q1" and task.score_batch([5], ["y"]) == [1.0]
    assert set(task.sample_prompt_ids(random.Random(0), 100)) == {0, 1, 2, 3}
    assert task.is_correct(0.5) and not task.is_correct(0.49)
    assert build_task("plugin", options).held_out_ids() == ()  # no eval file: no held-out split
    with pytest.raises(TaskError, match="not both"):
        build_task("plugin", {**options, "eval_prompts": held, "eval_split": "test"})
