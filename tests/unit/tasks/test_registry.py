from __future__ import annotations

import random
import subprocess
import sys

import pytest

from echo_p2p.tasks.base import Task, TaskError
from echo_p2p.tasks.registry import BUILTIN_TASKS, TASK_NAMES, build_task


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_every_builtin_builds_with_defaults(name):
    task = build_task(name)
    assert isinstance(task, Task) and task.name == name and task.max_new_tokens >= 1
    ids = task.sample_prompt_ids(random.Random(0), 8)
    assert ids == task.sample_prompt_ids(random.Random(0), 8)
    assert all(task.check_prompt_id(i) == i for i in ids)
    if task.num_prompts is not None and task.num_prompts >= 8:
        assert len(set(ids)) == 8
    for i in ids:
        assert isinstance(task.prompt(i), str) and task.prompt(i)
        assert 0.0 <= task.score(i, "garbage \x00 ☃ 123 RRUL") <= 1.0
    assert "plugin" in TASK_NAMES and "plugin" not in BUILTIN_TASKS


def test_unknown_task_and_bad_options_name_the_problem():
    with pytest.raises(TaskError, match="unknown task 'chess'.*count"):
        build_task("chess")
    with pytest.raises(TaskError, match="max_n"):
        build_task("count", {"max_n": 0})
    with pytest.raises(TaskError, match="colour"):
        build_task("sokoban", {"colour": "red"})
    with pytest.raises(TaskError, match="level"):
        build_task("arithmetic", {"level": 9})


def test_sampling_more_ids_than_prompts_repeats():
    task = build_task("letter")
    assert len(task.sample_prompt_ids(random.Random(1), 100)) == 100


def test_importing_tasks_does_not_import_torch():
    code = "import sys, echo_p2p.tasks.registry as t; t.build_task('sokoban').prompt(0); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
