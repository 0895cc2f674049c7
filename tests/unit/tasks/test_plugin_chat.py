"""Plug-in tasks with conversational prompts (TRL's ``{"prompt": [{"role": ..., "content": ...}]}``): they
load, reward functions receive them as TRL passes them, malformed rows are refused with the reason, and a
group sampled from one passes the trainer's ingest validation, which rebuilds the prompt's token ids through
the same function as the sampler, with its own tokenizer."""

from __future__ import annotations

import json

import pytest

from echo_p2p.tasks.plugin_loader import PluginError
from echo_p2p.tasks.registry import build_task
from tests.unit.ml.test_tokenizer import CHAR_CHAT_TEMPLATE
from tests.unit.tasks import reward_plugin

MODULE = "tests.unit.tasks.reward_plugin"
ROWS = [
    {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}], "answer": 4},
    {"prompt": [{"role": "user", "content": "3+5="}], "answer": 8},
]


def write_rows(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def chat_task(tmp_path, rows=ROWS):
    return build_task(
        "plugin", {"reward": f"{MODULE}:chat_answer", "prompts": write_rows(tmp_path / "p.jsonl", rows)}
    )


def test_a_conversational_task_loads_and_its_rewards_see_trl_shaped_arguments(tmp_path):
    task = chat_task(tmp_path)
    assert task.conversational and task.num_prompts == 2
    assert task.prompt(0) == ROWS[0]["prompt"]
    task.prompt(0)[0]["content"] = "edited"  # a copy: the task's rows are not changed by a caller
    assert task.prompt(0) == ROWS[0]["prompt"]
    reward_plugin.CALLS.clear()
    assert task.score_batch([1, 1, 0], ["8", " 8\n", "8"]) == [1.0, 1.0, 0.0]
    call = reward_plugin.CALLS[-1]
    assert call["prompts"] == [ROWS[1]["prompt"], ROWS[1]["prompt"], ROWS[0]["prompt"]]
    assert call["completions"][1] == [{"role": "assistant", "content": " 8\n"}]
    text_task = build_task(
        "plugin",
        {
            "reward": f"{MODULE}:exact_answer",
            "prompts": write_rows(tmp_path / "t.jsonl", [{"prompt": "2+2=", "answer": 4}]),
        },
    )
    assert not text_task.conversational and text_task.prompt(0) == "2+2="


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ([{"role": "robot", "content": "3+5="}], "row 1's 'prompt' is refused: message 0 has role 'robot'"),
        (
            [{"role": "user", "content": ["3+5="]}],
            "row 1's 'prompt' is refused: message 0's content is a list",
        ),
        ([{"role": "user", "content": "3" * 70_000}], "row 1's 'prompt' is refused: .* more than 65536"),
        (
            [{"role": "user", "content": "x"}] * 65,
            "row 1's 'prompt' is refused: .* 65 messages, more than 64",
        ),
        ([], "row 1's 'prompt' is refused: the conversation has no message"),
        ([{"role": "assistant", "content": "8"}], "row 1's 'prompt' is refused: .* ends with a user message"),
        ("3+5=", "row 1's 'prompt' is not a conversation and row 0's is"),
    ],
)
def test_malformed_conversations_are_refused_when_the_task_loads(tmp_path, prompt, reason):
    with pytest.raises(PluginError, match=reason):
        chat_task(tmp_path, [ROWS[0], {"prompt": prompt, "answer": 8}])


def test_a_text_task_with_a_conversation_in_a_later_row_is_refused(tmp_path):
    with pytest.raises(PluginError, match="row 1's 'prompt' is not a text and row 0's is"):
        chat_task(tmp_path, [{"prompt": "2+2=", "answer": 4}, ROWS[1]])


@pytest.fixture
def chat_model_dir(tmp_path):
    """The tiny preset saved as a model directory whose tokenizer has a chat template."""
    from echo_p2p.ml.models import build_tiny_policy, save_policy

    model, tokenizer = build_tiny_policy(seed=0)
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    return save_policy(model, tokenizer, tmp_path / "chat-model")


def test_a_group_sampled_from_a_conversational_task_passes_the_trainers_ingest(tmp_path, chat_model_dir):
    """Sampler and trainer each build the task and load the tokenizer from the same files; the sampler
    (the co-located loop's sampling, the inference peer's code) encodes with ``encode_prompts``, the trainer's
    validator rebuilds the ids from the prompt id and re-scores: every group is accepted, with the rewards
    the sampler claimed. A group whose prompt was encoded as bare text is refused as ``prompt_mismatch``."""
    from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer
    from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
    from echo_p2p.ml.models import ModelSpec, load_tokenizer
    from echo_p2p.ml.tokenizer import encode_prompts
    from echo_p2p.transport.rollouts.refusals import Reason, Rejection

    options = {
        "reward": [f"{MODULE}:chat_answer", f"{MODULE}:chat_length"],
        "reward_weights": [1.0, 0.1],
        "prompts": write_rows(tmp_path / "p.jsonl", ROWS),
    }
    spec = ModelSpec(path=str(chat_model_dir))
    sampler = ColocatedTrainer(
        ColocatedConfig(
            model=spec, task="plugin", task_options=options, group_size=4, prompts_per_step=2, steps=1
        )
    )
    groups = [g.group for g in sampler.sample_groups(0, prompt_ids=[0, 1])[0]]
    tokenizer = load_tokenizer(spec)
    assert tokenizer.decode(groups[0].prompt_token_ids) == "s:add\nu:2+2=\na:"
    validator = IngestValidator(
        {"plugin": build_task("plugin", options)},
        tokenizer,
        IngestConfig(vocab_size=len(tokenizer), group_size=4, max_staleness=0),
    )
    for group in groups:
        accepted = validator.validate(group, 0)
        assert not isinstance(accepted, Rejection), accepted
        assert list(accepted.rewards) == [c.claimed_reward for c in group.completions]
        assert any(r > 0 for r in accepted.rewards)  # the functions saw assistant messages on both sides
    bare = groups[1].model_copy(
        update={
            "prompt_token_ids": encode_prompts(tokenizer, ["3+5="], use_chat_template=False)[0],
            "rollout_id": "x",
        }
    )
    refused = validator.validate(bare, 0)
    assert isinstance(refused, Rejection) and refused.reason is Reason.PROMPT_MISMATCH


def test_a_conversational_task_on_a_model_without_chat_template_is_refused_at_start(tmp_path):
    from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer
    from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
    from echo_p2p.ml.tokenizer import build_char_tokenizer

    options = {"reward": f"{MODULE}:chat_answer", "prompts": write_rows(tmp_path / "p.jsonl", ROWS)}
    with pytest.raises(ValueError, match="chat template, and this model's tokenizer has none"):
        ColocatedTrainer(ColocatedConfig(task="plugin", task_options=options, steps=1))  # the tiny preset
    with pytest.raises(ValueError, match="tokenizer has none"):
        IngestValidator(
            {"plugin": build_task("plugin", options)}, build_char_tokenizer(), IngestConfig(vocab_size=80)
        )
