"""Plug-in rewards as TRL users write them: several functions with weights summed like TRL's ``nansum``,
None skipped, any finite scale kept end to end (sampler claim, trainer re-score, advantages), the keyword
arguments TRL passes (``completion_ids``: the rollout's token ids), the relative re-score tolerance, and the
wire bound on a claimed reward."""

from __future__ import annotations

import json
import logging
import math

import msgpack
import pytest

from echo_p2p.cli import task_option
from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator, reward_matches
from echo_p2p.ml.tokenizer import build_char_tokenizer, decode_completion, encode_prompts
from echo_p2p.rollout import MAX_ABS_REWARD, Completion, RolloutGroup
from echo_p2p.tasks.base import TaskError
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.grpo import group_advantages
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.transport.rollouts.refusals import Reason, Rejection
from tests.unit.tasks import reward_plugin

MODULE = "tests.unit.tasks.reward_plugin"
G = 4
VERSION = 3


def plugin(prompts_file, reward, weights=None):
    options = {"reward": reward, "prompts": str(prompts_file)}
    if weights is not None:
        options["reward_weights"] = weights
    return build_task("plugin", options)


@pytest.fixture(autouse=True)
def _fresh_calls():
    reward_plugin.CALLS.clear()
    yield
    reward_plugin.CALLS.clear()


# ---- the weighted sum -------------------------------------------------------------------------------------
def test_the_reward_is_the_weighted_sum_of_the_functions(prompts_file):
    # exact_answer: 1/0; length_penalty: 2 - len; weights 3 and 0.5, the second named by file path
    task = plugin(
        prompts_file,
        [f"{MODULE}:exact_answer", f"{reward_plugin.__file__}:length_penalty"],
        [3.0, 0.5],
    )
    got = task.score_batch([0, 0, 1], ["4", "44", "8"])
    assert got == pytest.approx([3 * 1 + 0.5 * 1, 3 * 0 + 0.5 * 0, 3 * 1 + 0.5 * 1])
    # default weights: all 1.0
    task = plugin(prompts_file, [f"{MODULE}:exact_answer", f"{MODULE}:length_penalty"])
    assert task.score_batch([0, 1], ["", "8"]) == pytest.approx([0 + 2, 1 + 1])
    # a single string still works (existing configs), as does a list of one
    assert plugin(prompts_file, f"{MODULE}:exact_answer").score(0, "4") == 1.0
    assert plugin(prompts_file, [f"{MODULE}:exact_answer"], [2.0]).score(0, "4") == 2.0


def test_weights_are_checked(prompts_file):
    with pytest.raises(TaskError, match="1 weights for 2 reward functions"):
        plugin(prompts_file, [f"{MODULE}:exact_answer", f"{MODULE}:length_penalty"], [1.0])
    with pytest.raises(TaskError, match="finite"):
        plugin(prompts_file, [f"{MODULE}:exact_answer"], [math.inf])
    with pytest.raises(TaskError, match="at least one"):
        plugin(prompts_file, [])


def test_a_function_returning_none_is_left_out_of_that_completions_sum(prompts_file):
    # none_unless_answered: None for a non-number, +1 right, -1 wrong; record_kwargs: 0.5 for every completion
    task = plugin(prompts_file, [f"{MODULE}:none_unless_answered", f"{MODULE}:record_kwargs"], [2.0, 1.0])
    assert task.score_batch([0, 0, 0], ["4", "5", "four"]) == pytest.approx([2 + 0.5, -2 + 0.5, 0.5])


def test_a_completion_every_function_skips_scores_zero_and_is_logged_once(prompts_file, caplog):
    task = plugin(prompts_file, [f"{MODULE}:none_unless_answered", f"{MODULE}:always_none"])
    with caplog.at_level(logging.DEBUG, logger="echo_p2p.tasks.plugin_rewards"):
        assert task.score_batch([0, 0], ["four", "4"]) == [0.0, 1.0]
        assert task.score_batch([1], ["eight"]) == [0.0]
    assert task.rewards.problems[("*", "all_none")] == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "every reward function gave None" in warnings[0].getMessage()


# ---- no clipping; garbage; failures -----------------------------------------------------------------------
def test_bad_values_score_zero_for_their_term_and_beyond_the_wire_bound_are_clipped(prompts_file, caplog):
    task = plugin(prompts_file, [f"{MODULE}:garbage_values", f"{MODULE}:record_kwargs"])
    with caplog.at_level(logging.WARNING, logger="echo_p2p.tasks.plugin_rewards"):
        got = task.score_batch([0] * 8, ["x"] * 8)
    # NaN, inf, -inf, "0.5", object(): that term is None, the other still counts 0.5
    assert got[:5] == [0.5] * 5
    assert got[5:] == [MAX_ABS_REWARD, -MAX_ABS_REWARD + 0.5, 0.25 + 0.5]
    assert all(math.isfinite(r) for r in got)
    problems = task.rewards.problems
    spec = f"{MODULE}:garbage_values"
    assert (
        problems[(spec, "non_finite")],
        problems[(spec, "not_a_number")],
        problems[(spec, "too_large")],
    ) == (
        3,
        2,
        2,
    )
    assert problems[("*", "sum_too_large")] == 1  # 1e6 + 0.5
    assert len([r for r in caplog.records if spec in r.getMessage()]) == 3  # once per kind


def test_a_function_that_raises_counts_zero_for_the_batch_without_crashing(prompts_file, caplog):
    task = plugin(
        prompts_file,
        [f"{MODULE}:exact_answer", f"{MODULE}:broken", f"{MODULE}:wrong_length"],
        [1.0, 5.0, 7.0],
    )
    with caplog.at_level(logging.DEBUG, logger="echo_p2p.tasks.plugin_rewards"):
        assert task.score_batch([0, 1], ["4", "9"]) == [1.0, 0.0]
        assert task.score_batch([0, 1], ["4", "8"]) == [1.0, 1.0]
    assert task.rewards.problems[(f"{MODULE}:broken", "raised")] == 2
    assert task.rewards.problems[(f"{MODULE}:wrong_length", "raised")] == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 2 and warnings[0].exc_info is not None
    )  # first failure of each: with its traceback


# ---- what a function receives -----------------------------------------------------------------------------
def test_a_kwargs_function_receives_what_trl_passes(prompts_file):
    task = plugin(prompts_file, f"{MODULE}:record_kwargs")
    task.score_batch([1, 0], ["8", "4"], completion_ids=[[5, 6], [7]])
    (call,) = reward_plugin.CALLS
    assert set(call) == {
        "prompts",
        "completions",
        "completion_ids",
        "trainer_state",
        "log_extra",
        "log_metric",
        "answer",
        "source",
    }
    assert call["prompts"] == ["3+5=", "2+2="]
    assert call["completions"] == ["8", "4"]
    assert call["completion_ids"] == [[5, 6], [7]]
    assert call["answer"] == [8, 4] and call["source"] == ["x", None]
    assert call["trainer_state"] is None  # no Hugging Face TrainerState here
    call["log_metric"]("accuracy", 1.0)  # accepted, discarded
    call["log_extra"]("column", ["a", "b"])
    task.score(0, "4")  # one completion, no token ids: completion_ids is None
    assert reward_plugin.CALLS[-1]["completion_ids"] is None


def test_a_function_cannot_change_what_the_next_one_sees(prompts_file):
    task = plugin(prompts_file, [f"{MODULE}:mutates_inputs", f"{MODULE}:record_kwargs"])
    ids = [[5, 6], [7]]
    task.score_batch([0, 1], ["4", "8"], completion_ids=ids)
    (call,) = reward_plugin.CALLS
    assert call["completions"] == ["4", "8"] and call["completion_ids"] == [[5, 6], [7]]
    assert call["answer"] == [4, 8] and task.rows[0]["answer"] == 4
    assert ids == [[5, 6], [7]]


def test_reserved_and_dropped_columns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion_ids": [1], "completion": "c", "answer": 1}) + "\n")
    task = plugin(path, f"{MODULE}:record_kwargs")
    assert task.columns == ["answer"]  # TRL drops `completion` and `completion_ids` columns too
    path.write_text(json.dumps({"prompt": "p", "trainer_state": 1}) + "\n")
    with pytest.raises(TaskError, match=r"\['trainer_state'\] would shadow"):
        plugin(path, f"{MODULE}:record_kwargs")


def test_a_list_of_functions_from_the_command_line():
    assert task_option("reward=[mod:a, path/to/file.py:b]") == ("reward", ["mod:a", "path/to/file.py:b"])
    assert task_option("reward_weights=[1, 0.5]") == ("reward_weights", [1, 0.5])


# ---- end to end: sampler claim -> wire -> trainer re-score -> advantages ----------------------------------
@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def sampled_group(tok, task, texts, prompt_id=0, claims=None) -> RolloutGroup:
    """What an inference peer sends: completion = text + EOS, rewards scored as ``InferencePeer._sample``
    scores them (text decoded without special tokens, and the token ids); ``claims`` overrides them."""
    prompt = encode_prompts(tok, [task.prompt(prompt_id)], use_chat_template=False)[0]
    ids = [encode_prompts(tok, [t], use_chat_template=False)[0] + [tok.eos_token_id] for t in texts]
    decoded = [decode_completion(tok, x) for x in ids]
    rewards = task.score_batch([prompt_id] * len(ids), decoded, completion_ids=ids)
    if claims is not None:
        rewards = claims
    completions = [
        Completion(token_ids=x, logprobs=[-0.5] * len(x), claimed_reward=r)
        for x, r in zip(ids, rewards, strict=True)
    ]
    group = RolloutGroup(
        task="plugin",
        prompt_id=prompt_id,
        prompt_token_ids=prompt,
        completions=completions,
        policy_version=VERSION,
    )
    return RolloutGroup.from_bytes(group.to_bytes())  # through the wire format


def validator_for(tok, task, tolerance=1e-3) -> IngestValidator:
    config = IngestConfig(vocab_size=len(tok), group_size=G, max_staleness=2, reward_tolerance=tolerance)
    return IngestValidator({"plugin": task}, tok, config)


def test_rewards_below_zero_and_above_one_go_through_ingest_unchanged(tok, prompts_file):
    task = plugin(prompts_file, f"{MODULE}:scaled")
    group = sampled_group(tok, task, ["a", "b", "a", "b"])
    assert [c.claimed_reward for c in group.completions] == [-1.0, 2.5, -1.0, 2.5]
    scored = validator_for(tok, task).validate(group, VERSION)
    assert isinstance(scored, ScoredGroup)
    assert scored.rewards == (-1.0, 2.5, -1.0, 2.5)  # re-scored equal, not clipped
    # mean 0.75, std 1.75: advantages -1 / +1 (the per-group normalisation does the scaling)
    assert group_advantages(scored.rewards) == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages(scored.rewards, scale_rewards=False) == pytest.approx([-1.75, 1.75, -1.75, 1.75])


def test_completion_ids_are_the_rollouts_token_ids_on_both_sides(tok, prompts_file):
    task = plugin(prompts_file, [f"{MODULE}:token_count", f"{MODULE}:exact_answer"])
    group = sampled_group(tok, task, ["4", "44", "x", "4444"])
    sampler_ids = reward_plugin.CALLS[-1]["completion_ids"]
    assert sampler_ids == [c.token_ids for c in group.completions]
    assert [c.claimed_reward for c in group.completions] == [
        2 + 1,
        3,
        2,
        5,
    ]  # tokens incl. EOS, + right answer
    reward_plugin.CALLS.clear()
    scored = validator_for(tok, task).validate(group, VERSION)
    assert isinstance(scored, ScoredGroup) and scored.rewards == (3.0, 3.0, 2.0, 5.0)
    assert reward_plugin.CALLS[-1]["completion_ids"] == [c.token_ids for c in group.completions]


def test_the_re_score_tolerance_is_relative_to_the_rewards_size(tok, prompts_file):
    task = plugin(prompts_file, f"{MODULE}:scaled")
    texts = ["k", "k", "a", "x"]  # 1000, 1000, -1, 0
    validator = validator_for(tok, task, tolerance=1e-3)
    ok = sampled_group(tok, task, texts, claims=[1000.5, 999.0, -1.0 + 9e-4, -9e-4])
    assert isinstance(validator.validate(ok, VERSION), ScoredGroup)
    forged = sampled_group(tok, task, texts, claims=[1002.0, 1000.0, -1.0, 0.0])
    result = validator.validate(forged, VERSION)
    assert isinstance(result, Rejection) and result.reason is Reason.FORGED_REWARD
    assert "completion 0 claims 1002" in result.detail
    # near 0 the tolerance stays absolute: 0.0015 for a re-score of 0 is forged
    small = sampled_group(tok, task, texts, claims=[1000.0, 1000.0, -1.0, 0.0015])
    assert validator.validate(small, VERSION).reason is Reason.FORGED_REWARD
    assert reward_matches(1000.0, 1000.5, 1e-3) and not reward_matches(1000.0, 1002.0, 1e-3)
    assert reward_matches(-1000.0, -1000.9, 1e-3) and not reward_matches(0.0, 1000.0, 1e-3)
    assert reward_matches(2.0, 2.0, 0.0) and not reward_matches(2.0, 2.0 + 1e-12, 0.0)


@pytest.mark.parametrize("claim", [1e300, -1e300, MAX_ABS_REWARD * 1.5, math.nan, math.inf, -math.inf])
def test_a_claimed_reward_beyond_the_wire_bound_is_refused(tok, prompts_file, claim):
    task = plugin(prompts_file, f"{MODULE}:scaled")
    group = sampled_group(tok, task, ["a", "b", "a", "b"])
    record = group.model_dump(mode="python")
    record["completions"][2]["claimed_reward"] = claim
    with pytest.raises(ValueError, match=r"completions\.2\.claimed_reward: Input should be"):
        RolloutGroup.from_bytes(msgpack.packb(record, use_bin_type=True))
    # a group built in this process skips the parser: the validator refuses it too, with a reason
    group.completions[2].claimed_reward = claim
    result = validator_for(tok, task).validate(group, VERSION)
    assert isinstance(result, Rejection)
    assert result.reason is (Reason.NON_FINITE if not math.isfinite(claim) else Reason.MALFORMED)
    assert "completion 2" in result.detail
    # at the bound itself: a well-formed claim, judged by the re-score
    group.completions[2].claimed_reward = MAX_ABS_REWARD
    assert validator_for(tok, task).validate(group, VERSION).reason is Reason.FORGED_REWARD
