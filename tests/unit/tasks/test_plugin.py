from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from echo_p2p.tasks.base import TaskError
from echo_p2p.tasks.plugin_loader import PluginError, load_reward_function
from echo_p2p.tasks.registry import build_task

HERE = Path(__file__).resolve().parent
MODULE = "tests.unit.tasks.reward_plugin"


@pytest.mark.parametrize("spec", [f"{MODULE}:exact_answer", f"{HERE / 'reward_plugin.py'}:exact_answer"])
def test_plugin_reward_loaded_by_name_with_extra_columns(prompts_file, spec):
    task = build_task("plugin", {"reward": spec, "prompts": str(prompts_file)})
    assert task.num_prompts == 3
    assert task.prompt(1) == "3+5="
    assert task.score(1, "8") == 1.0
    assert task.score(1, " 8 ") == 1.0
    assert task.score(1, "9") == 0.0
    assert task.score_batch([0, 1, 2], ["4", "0", "1"]) == [1.0, 0.0, 1.0]


def test_rewards_keep_their_scale_and_a_broken_function_scores_zero(prompts_file):
    task = build_task("plugin", {"reward": f"{MODULE}:length_penalty", "prompts": str(prompts_file)})
    assert task.score_batch([0, 0, 0], ["", "x", "xyz"]) == [2.0, 1.0, -1.0]  # not clipped to [0, 1]
    for name in ("broken", "wrong_length"):
        task = build_task("plugin", {"reward": f"{MODULE}:{name}", "prompts": str(prompts_file)})
        assert task.score_batch([0, 1], ["4", "8"]) == [0.0, 0.0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "must look like"),
        (f"{MODULE}:", "must look like"),
        ("echo_p2p_no_such_module:fn", "cannot import reward module"),
        (f"{MODULE}:missing", "has no attribute 'missing'"),
        (f"{MODULE}:NOT_A_FUNCTION", "not a function"),
        ("/nonexistent/reward.py:fn", "file not found"),
    ],
)
def test_bad_reward_specs_are_clear_errors(spec, message):
    with pytest.raises(PluginError, match=message):
        load_reward_function(spec)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("wants_missing_column", r"cannot be called as TRL calls a reward function.*'difficulty'"),
        ("prompts_only", "takes neither `completions` nor `completion_ids` nor \\*\\*kwargs"),
        ("positional_only", "cannot be called as TRL calls a reward function"),
        ("async_reward", "is async"),
    ],
)
def test_reward_signature_is_checked_against_the_columns(prompts_file, name, message):
    with pytest.raises(TaskError, match=message):
        build_task("plugin", {"reward": f"{MODULE}:{name}", "prompts": str(prompts_file)})


def test_a_function_without_kwargs_gets_only_the_arguments_it_names(prompts_file):
    # (prompts, completions) only: TRL would also pass completion_ids, trainer_state and the columns and fail
    task = build_task("plugin", {"reward": f"{MODULE}:no_kwargs", "prompts": str(prompts_file)})
    assert task.score_batch([0, 1], ["4", "8"], completion_ids=[[1], [2]]) == [0.0, 0.0]
    task = build_task("plugin", {"reward": f"{MODULE}:sees_no_completion", "prompts": str(prompts_file)})
    assert task.score_batch([0], ["4"]) == [0.0]


def test_bad_prompt_files(tmp_path):
    spec = f"{MODULE}:length_penalty"
    with pytest.raises(PluginError, match="not found"):
        build_task("plugin", {"reward": spec, "prompts": str(tmp_path / "none.jsonl")})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(PluginError, match="bad.jsonl:2"):
        build_task("plugin", {"reward": spec, "prompts": str(bad)})
    no_prompt = tmp_path / "noprompt.jsonl"
    no_prompt.write_text('{"question": "a"}\n')
    with pytest.raises(PluginError, match="no string 'prompt'"):
        build_task("plugin", {"reward": spec, "prompts": str(no_prompt)})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PluginError, match="no prompts"):
        build_task("plugin", {"reward": spec, "prompts": str(empty)})
    with pytest.raises(TaskError, match="reward"):
        build_task("plugin", {"prompts": str(empty)})


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed here")
def test_dataset_directory_without_datasets_package_is_a_clear_error(tmp_path):
    with pytest.raises(PluginError, match="needs the `datasets` package"):
        build_task("plugin", {"reward": f"{MODULE}:length_penalty", "prompts": str(tmp_path)})


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")
def test_dataset_saved_to_disk(tmp_path):  # pragma: no cover - only where datasets is installed
    import datasets

    datasets.Dataset.from_list([{"prompt": "2+2=", "answer": 4}]).save_to_disk(str(tmp_path / "ds"))
    task = build_task("plugin", {"reward": f"{MODULE}:exact_answer", "prompts": str(tmp_path / "ds")})
    assert task.score(0, "4") == 1.0
