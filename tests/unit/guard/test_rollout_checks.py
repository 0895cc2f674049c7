"""IngestValidator: every rejection reason on hand-made groups of the real ``count`` task and char tokenizer,
and the accepted path with rewards re-scored by the task's verifier (the claimed reward is never trusted)."""

from __future__ import annotations

import math

import pytest

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
from echo_p2p.ml.tokenizer import build_char_tokenizer, decode_completion, encode_prompts
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.transport.rollouts.refusals import Reason, Rejection

G = 4
VERSION = 5


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def task():
    return build_task("count")


@pytest.fixture
def validator(tok, task) -> IngestValidator:
    config = IngestConfig(vocab_size=len(tok), group_size=G, max_staleness=2, max_prompt_tokens=16)
    return IngestValidator({"count": task}, tok, config)


def make_group(
    tok, task, prompt_id: int = 7, texts=("cc", "c", "ccc", "dd"), version: int = VERSION
) -> RolloutGroup:
    """An honest group: prompt tokenized as the peers do, completion = text + EOS, true claimed rewards."""
    prompt = encode_prompts(tok, [task.prompt(prompt_id)], use_chat_template=False)[0]
    completions = []
    for text in texts:
        ids = encode_prompts(tok, [text], use_chat_template=False)[0] + [tok.eos_token_id]
        completions.append(
            Completion(
                token_ids=ids,
                logprobs=[-0.5] * len(ids),
                claimed_reward=task.score(prompt_id, decode_completion(tok, ids)),
            )
        )
    return RolloutGroup(
        task="count",
        prompt_id=prompt_id,
        prompt_token_ids=prompt,
        completions=completions,
        policy_version=version,
    )


def reason_of(result) -> Reason:
    assert isinstance(result, Rejection), f"expected a rejection, got {result!r}"
    return result.reason


def test_honest_group_is_accepted_with_rewards_recomputed_by_the_verifier(validator, tok, task):
    group = make_group(tok, task)  # prompt 7 = "2c=": target "cc"
    scored = validator.validate(group, current_version=VERSION)
    assert isinstance(scored, ScoredGroup)
    assert scored.rewards == pytest.approx((1.0, 0.5, 2 / 3, 0.0))
    assert scored.group is group
    # one version stale is within max_staleness=2
    assert isinstance(validator.validate(make_group(tok, task, version=VERSION - 2), VERSION), ScoredGroup)


def test_claimed_reward_far_from_the_rescore_is_forged(validator, tok, task):
    group = make_group(tok, task)
    group.completions[3].claimed_reward = 1.0  # "dd" for "2c=" scores 0
    result = validator.validate(group, VERSION)
    assert reason_of(result) is Reason.FORGED_REWARD
    assert "completion 3" in result.detail
    # within the tolerance: accepted, and the trainer's reward is the verifier's, not the claim
    honest = make_group(tok, task)
    honest.completions[0].claimed_reward = 1.0 - 5e-4
    assert validator.validate(honest, VERSION).rewards[0] == 1.0


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda g, tok: setattr(g, "task", "sokoban"), Reason.UNKNOWN_TASK),
        (lambda g, tok: setattr(g, "prompt_id", 30), Reason.BAD_PROMPT_ID),
        (lambda g, tok: setattr(g, "prompt_id", -1), Reason.BAD_PROMPT_ID),
        (lambda g, tok: setattr(g, "prompt_id", 12), Reason.HELD_OUT),  # "3c=": evaluation only
        (lambda g, tok: setattr(g, "prompt_id", 8), Reason.PROMPT_MISMATCH),  # tokens are of prompt 7
        (lambda g, tok: g.prompt_token_ids.__setitem__(0, g.prompt_token_ids[0] + 1), Reason.PROMPT_MISMATCH),
        (lambda g, tok: g.completions.pop(), Reason.WRONG_GROUP_SIZE),
        (lambda g, tok: g.completions.append(g.completions[0]), Reason.WRONG_GROUP_SIZE),
        (lambda g, tok: g.completions[1].token_ids.__setitem__(0, len(tok)), Reason.TOKEN_OUT_OF_RANGE),
        (lambda g, tok: g.completions[1].token_ids.__setitem__(0, -3), Reason.TOKEN_OUT_OF_RANGE),
        (lambda g, tok: g.prompt_token_ids.__setitem__(0, 10**9), Reason.TOKEN_OUT_OF_RANGE),
        (lambda g, tok: setattr(g, "prompt_token_ids", g.prompt_token_ids * 10), Reason.TOO_LONG),
        (
            lambda g, tok: setattr(g.completions[2], "token_ids", [5] * 13),
            Reason.TOO_LONG,
        ),  # count caps at 12
        (lambda g, tok: g.completions[0].logprobs.pop(), Reason.LOGPROB_MISMATCH),
        (lambda g, tok: g.completions[0].logprobs.__setitem__(0, math.nan), Reason.NON_FINITE),
        (lambda g, tok: g.completions[0].logprobs.__setitem__(0, -math.inf), Reason.NON_FINITE),
        (lambda g, tok: setattr(g.completions[0], "claimed_reward", math.inf), Reason.NON_FINITE),
        (lambda g, tok: g.completions[0].logprobs.__setitem__(0, 0.7), Reason.BAD_LOGPROB),
        (lambda g, tok: g.completions[0].logprobs.__setitem__(0, -1e30), Reason.BAD_LOGPROB),
        (
            lambda g, tok: g.completions[0].logprobs.__setitem__(0, math.log(1e-9 / len(tok)) - 0.1),
            Reason.BAD_LOGPROB,
        ),
        (lambda g, tok: setattr(g, "policy_version", VERSION + 1), Reason.FUTURE_VERSION),
        (lambda g, tok: setattr(g, "policy_version", VERSION - 3), Reason.TOO_STALE),
        (lambda g, tok: setattr(g, "policy_version", -1), Reason.MALFORMED),
        (lambda g, tok: setattr(g.completions[0], "token_ids", []), Reason.MALFORMED),
        (lambda g, tok: setattr(g, "rollout_id", ""), Reason.MALFORMED),
        (lambda g, tok: setattr(g, "rollout_id", "x" * 65), Reason.MALFORMED),
        (lambda g, tok: setattr(g, "protocol", PROTOCOL_VERSION + 1), Reason.OTHER_PROTOCOL),
    ],
    ids=lambda v: v.value if isinstance(v, Reason) else "",
)
def test_each_bad_group_is_rejected_with_its_reason(validator, tok, task, mutate, reason):
    group = make_group(tok, task)
    mutate(group, tok)
    result = validator.validate(group, VERSION)
    assert reason_of(result) is reason
    assert result.detail  # a reason the sender can read


def test_logprob_floor_is_the_tokens_an_honest_sampler_draws_once_in_1e9(validator, tok, task):
    floor = math.log(1e-9 / len(tok))
    assert validator.min_logprob == pytest.approx(floor)
    group = make_group(tok, task)
    group.completions[0].logprobs[0] = floor + 0.01
    assert isinstance(validator.validate(group, VERSION), ScoredGroup)


def test_non_group_input_is_malformed_and_never_raises(validator):
    for junk in (None, b"\x00", {"task": "count"}, 42):
        assert reason_of(validator.validate(junk, VERSION)) is Reason.MALFORMED


def test_a_verifier_that_raises_is_an_internal_error_not_a_crash(tok, task):
    class Broken(type(task)):
        def score(self, prompt_id, completion_text):
            raise RuntimeError("boom")

    config = IngestConfig(vocab_size=len(tok), group_size=G)
    validator = IngestValidator({"count": Broken(task.options)}, tok, config)
    assert reason_of(validator.validate(make_group(tok, task), VERSION)) is Reason.INTERNAL_ERROR


def test_allowed_tasks_and_completion_cap_come_from_the_config(tok, task):
    config = IngestConfig(vocab_size=len(tok), group_size=G, tasks=["letter"], max_completion_tokens=2)
    validator = IngestValidator({"count": task, "letter": build_task("letter")}, tok, config)
    assert reason_of(validator.validate(make_group(tok, task), VERSION)) is Reason.UNKNOWN_TASK
    config = IngestConfig(vocab_size=len(tok), group_size=G, max_completion_tokens=2)
    validator = IngestValidator({"count": task}, tok, config)
    assert reason_of(validator.validate(make_group(tok, task), VERSION)) is Reason.TOO_LONG  # "ccc"+EOS = 4


def test_sync_mode_accepts_only_the_current_version(tok, task):
    config = IngestConfig(vocab_size=len(tok), group_size=G, max_staleness=0)
    validator = IngestValidator({"count": task}, tok, config)
    assert isinstance(validator.validate(make_group(tok, task, version=3), 3), ScoredGroup)
    assert reason_of(validator.validate(make_group(tok, task, version=2), 3)) is Reason.TOO_STALE


def test_rebuilt_prompts_are_cached(validator, tok, task):
    group = make_group(tok, task)
    validator.validate(group, VERSION)
    assert validator.prompt_token_ids("count", 7) == tuple(group.prompt_token_ids)
    assert ("count", 7) in validator._prompts


def test_a_group_sampled_with_other_settings_than_the_runs_is_refused(tok, task):
    """The trainer's log-probs use the run's temperature, top-p and top-k: a group sampled otherwise (or one
    that does not say) would get ratios that mean nothing, and a precision the run excludes is refused."""
    from echo_p2p.rollout import Sampling

    run = Sampling(temperature=0.8, top_p=0.9, top_k=20)
    config = IngestConfig(vocab_size=len(tok), group_size=G, sampling=run, precisions=["float32", "8bit"])
    validator = IngestValidator({"count": task}, tok, config)

    def with_sampling(sampling):
        group = make_group(tok, task)
        group.sampling = sampling
        return validator.validate(group, current_version=VERSION)

    assert isinstance(
        with_sampling(run.model_copy(update={"engine": "vllm", "precision": "8bit"})), ScoredGroup
    )
    assert isinstance(with_sampling(run.model_copy(update={"precision": "float32"})), ScoredGroup)
    for sampling in (
        None,
        run.model_copy(update={"temperature": 1.0, "precision": "float32"}),
        run.model_copy(update={"top_p": 1.0, "precision": "float32"}),
        run.model_copy(update={"top_k": 0, "precision": "float32"}),
        run.model_copy(update={"precision": "4bit"}),
    ):
        result = with_sampling(sampling)
        assert reason_of(result) == Reason.SAMPLING_MISMATCH, sampling
    # the settings travel on the wire and survive a round trip
    group = make_group(tok, task)
    group.sampling = run.model_copy(update={"engine": "transformers", "precision": "8bit"})
    assert RolloutGroup.from_bytes(group.to_bytes()).sampling == group.sampling


def test_an_honest_group_on_a_held_out_prompt_is_refused(validator, tok, task):
    """A stranger must not train the run on its evaluation prompts, however correct the group."""
    held = task.held_out_ids()[2]
    group = make_group(tok, task, prompt_id=held, texts=(task.target(held),) * G)
    result = validator.validate(group, VERSION)
    assert isinstance(result, Rejection) and result.reason is Reason.HELD_OUT
    assert "held out" in result.detail
