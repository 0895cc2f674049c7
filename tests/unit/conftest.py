"""Shared fixtures of the unit tests that train (``train/``, ``guard/``): a tiny Qwen3 model and a factory of
scored rollout groups."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.train.scored import ScoredGroup

VOCAB = 16
PAD, EOS = 0, 1


def make_tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=256,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    model.eval()  # no dropout: ratios against behaviour log-probs must be exact
    return model


@pytest.fixture
def tiny_model() -> Callable[..., torch.nn.Module]:
    torch.set_num_threads(1)  # two test workers share two cores
    return make_tiny_model


def make_group(
    prompt: list[int],
    completions: list[list[int]],
    rewards: list[float],
    version: int = 0,
    logprobs: list[list[float]] | None = None,
    rollout_id: str | None = None,
) -> ScoredGroup:
    if logprobs is None:
        logprobs = [[-1.0 - 0.1 * j for j in range(len(c))] for c in completions]
    comps = [
        Completion(token_ids=c, logprobs=lp, claimed_reward=0.0)
        for c, lp in zip(completions, logprobs, strict=True)
    ]
    kwargs = {"rollout_id": rollout_id} if rollout_id is not None else {}
    group = RolloutGroup(
        task="test", prompt_id=0, prompt_token_ids=prompt, completions=comps, policy_version=version, **kwargs
    )
    return ScoredGroup(group, rewards)


@pytest.fixture
def random_groups() -> Callable[..., list[ScoredGroup]]:
    """Groups with prompts and completions of varied lengths and random behaviour log-probs."""

    def factory(num_groups: int = 4, group_size: int = 3, seed: int = 0) -> list[ScoredGroup]:
        rng = random.Random(seed)
        out = []
        for _ in range(num_groups):
            prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 4))]
            comps = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(group_size)]
            lps = [[-rng.uniform(0.5, 4.0) for _ in c] for c in comps]
            rewards = [float(rng.random() < 0.5) + rng.random() * 0.1 for _ in comps]
            out.append(make_group(prompt, comps, rewards, logprobs=lps))
        return out

    return factory


@pytest.fixture
def scored_group() -> Callable[..., ScoredGroup]:
    """``make_group`` as a fixture (test modules do not import conftest by name)."""
    return make_group


#: A bootstrap address nobody listens on: peers built from it are constructed, never started.
UNSTARTED_BOOTSTRAP = "/ip4/127.0.0.1/tcp/31337/p2p/QmNMa1sxAWQsRdGFBa2Kyaxx8bZYuJPPtV4xgKh1Bi8bFp"


def unstarted_peer(cls, metrics_dir=None, *flags: str, **settings):
    """A real peer of class ``cls`` (its role's flags, then ``settings`` over the parsed config's top-level
    fields), constructed as the CLI constructs it but never started: no DHT, no threads. Tests set the
    collaborators a started peer would have built (an intake, a publish schedule, a pusher) instead of
    creating the object with ``__new__``. Without ``metrics_dir`` it writes no metrics."""
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.peer import parse_config

    argv = ["--role", cls.role, "--run-id", "r", "--initial-peers", UNSTARTED_BOOTSTRAP, *flags]
    if cls.role == "inference":  # named, never read: the peer is not started
        argv += ["--trusted-trainers", "trainers-of-an-unstarted-peer"]
    if metrics_dir is not None:
        argv += ["--metrics-dir", str(metrics_dir)]
    config = parse_config(argv, environ={})
    if settings:
        config = config.model_copy(update=settings)
    return cls(config, identity=load_or_create_identity(None))
