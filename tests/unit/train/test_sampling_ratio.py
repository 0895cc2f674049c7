"""The importance ratio of on-policy rollouts is 1 whatever the sampling filter, when the trainer computes
its log-probs under the same settings (the real tiny preset, the real transformers engine, the Learner)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from echo_p2p.ml.engine import SamplingParams, TransformersEngine
from echo_p2p.ml.models import ModelSpec, load_policy
from echo_p2p.ml.tokenizer import encode_prompts
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup

TEXTS = ["3a=", "12+34=", "c>", "7b7b="]


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return load_policy(ModelSpec(preset="tiny", seed=0))


def on_policy_groups(model, tok, params: SamplingParams) -> list[ScoredGroup]:
    prompts = encode_prompts(tok, TEXTS)
    samples = TransformersEngine(model, tok).sample(prompts, 8, params)
    groups = []
    for prompt_id, (prompt, outs) in enumerate(zip(prompts, samples, strict=True)):
        completions = [
            Completion(token_ids=s.token_ids, logprobs=s.logprobs, claimed_reward=0.0) for s in outs
        ]
        group = RolloutGroup(
            task="t", prompt_id=prompt_id, prompt_token_ids=prompt, completions=completions, policy_version=0
        )
        groups.append(ScoredGroup(group, [float(i % 2) for i in range(len(outs))]))
    return groups


@pytest.mark.parametrize(
    "settings", [{"top_p": 0.7}, {"top_k": 20}, {"top_k": 20, "top_p": 0.7, "temperature": 0.8}]
)
def test_on_policy_ratio_is_one_under_top_p_and_top_k(policy, settings):
    model, tok = policy
    params = SamplingParams(max_new_tokens=24, seed=5, **settings)
    groups = on_policy_groups(model, tok, params)
    config = GRPOConfig(micro_batch_size=64)
    derived = DerivedSettings(pad_token_id=tok.pad_token_id or 0, **settings)
    stats = Learner(model, config, derived=derived).compute_gradients(groups)
    model.zero_grad(set_to_none=True)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=0.01), stats
    assert stats["clip_frac"] == 0.0 and stats["behaviour_outside_clip_frac"] == 0.0, stats
    # the trainer's full softmax against the same rollouts: what happened before settings travelled
    unfiltered = dataclasses.replace(derived, top_k=0, top_p=1.0)
    stats = Learner(model, config, derived=unfiltered).compute_gradients(groups)
    model.zero_grad(set_to_none=True)
    assert abs(stats["ratio_mean"] - 1.0) > 0.05 and stats["behaviour_outside_clip_frac"] > 0.05, stats
