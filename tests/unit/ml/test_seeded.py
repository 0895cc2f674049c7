"""Seeded sampling (``ml.seeded``): the stream is the one the module doc defines, a draw is an exact sample of
its distribution, and a token is the draw of its uniform exactly when it lies in its interval."""

from __future__ import annotations

import hashlib
import math
import struct

import torch

from echo_p2p.ml.engine import SamplingParams, TransformersEngine
from echo_p2p.ml.seeded import derive_seed, draw, interval_misses, new_seed, uniforms


def test_the_stream_is_blake2b_keyed_with_the_seed_eight_uniforms_per_block():
    seed = new_seed()
    assert len(seed) == 32 and int(seed, 16) >= 0 and new_seed() != seed
    u = uniforms(seed, 3, 20)
    block1 = hashlib.blake2b(b"3:1", key=bytes.fromhex(seed), digest_size=64).digest()
    assert u[8:16] == [(w >> 11) * 2.0**-53 for w in struct.unpack("<8Q", block1)]
    assert uniforms(seed, 3, 5) == u[:5] and all(0.0 <= x < 1.0 for x in u)
    assert uniforms(seed, 4, 20) != u and uniforms(new_seed(), 3, 20) != u
    assert derive_seed(7, 0) == derive_seed(7, 0) != derive_seed(7, 1) != derive_seed(8, 1)


def test_a_draw_is_a_sample_of_its_distribution_and_a_filtered_token_is_never_drawn():
    probs = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.3])
    n = 20_000
    u = torch.tensor(uniforms(new_seed(), 0, n), dtype=torch.float64)
    tokens = draw(probs.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0
    for p, c in zip(probs.tolist(), counts.tolist(), strict=True):
        assert abs(c - n * p) <= 4 * math.sqrt(n * p * (1 - p)) + 1e-9, (p, c)
    # unnormalised weights (a sampler's float32 softmax) draw the same tokens
    assert torch.equal(draw((probs * 0.999).expand(n, -1), u), tokens)


def test_a_token_misses_its_uniform_unless_it_is_its_draw():
    logits = torch.randn(2_000, 50) * 2
    logp = torch.log_softmax(logits, dim=-1)
    u = torch.tensor(uniforms(new_seed(), 0, 2_000), dtype=torch.float64)
    drawn = draw(logp.exp(), u)
    assert not bool(interval_misses(logp, drawn, u, 0.0).any())
    # any other token misses unless the slack covers the gap
    other = (drawn + 1 + torch.randint(0, 49, drawn.shape)) % 50
    p_other = logp.exp().gather(1, other[:, None]).squeeze(1)
    missed = interval_misses(logp, other, u, 0.01)
    assert float(missed.double().mean()) > 1 - float(p_other.mean()) - 0.05
    assert not bool(missed[other == drawn].any())
    # a slightly different distribution (a sampler in another precision) still passes within the slack
    near = torch.log_softmax(logits + 0.002 * torch.randn_like(logits), dim=-1)
    assert not bool(interval_misses(near, drawn, u, 0.01).any())


def test_the_engine_draws_each_prompts_completions_from_a_seed_a_replay_confirms(tiny):
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)
    prompts = [tokenizer("3b=")["input_ids"], tokenizer("12a=")["input_ids"]]
    groups = engine.sample(prompts, 4, params)
    again = engine.sample(prompts, 4, params)
    assert [[s.token_ids for s in g] for g in groups] == [[s.token_ids for s in g] for g in again]
    assert groups[0][0].seed == derive_seed(11, 0) and groups[1][3].seed == derive_seed(11, 1)
    assert engine.sample(prompts, 2, params.model_copy(update={"temperature": 0.0}))[0][0].seed == ""
    for prompt, group in zip(prompts, groups, strict=True):
        for k, sample in enumerate(group):
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            u = torch.tensor(uniforms(sample.seed, k, len(sample.token_ids)), dtype=torch.float64)
            assert not bool(interval_misses(logp, torch.tensor(sample.token_ids), u, 0.0).any())
            # its own log-probs are those of the distribution it was drawn from
            got = logp.gather(1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
            assert torch.allclose(got, torch.tensor(sample.logprobs), atol=1e-4)
