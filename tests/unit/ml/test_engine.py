from __future__ import annotations

import pytest
import torch

from echo_p2p.ml.engine import (
    SamplingParams,
    TransformersEngine,
    TransformersEngineConfig,
    completion_logprobs,
    process_logits,
)
from echo_p2p.ml.models import ModelSpec, build_tiny_policy, full_precision_state_dict, load_policy
from echo_p2p.ml.tokenizer import encode_prompts

TEXTS = ["3a=", "12+34=", "c>", "######\n#_@$.#\nmoves:"]  # different lengths: left padding matters


def _flat(groups):
    return [s for g in groups for s in g]


def _check_logprobs(model, prompts, groups, n, params, tol=1e-4):
    samples = _flat(groups)
    ref = completion_logprobs(
        model, [p for p in prompts for _ in range(n)], [s.token_ids for s in samples], params
    )
    diffs = [
        abs(a - b) for r, s in zip(ref, samples, strict=True) for a, b in zip(r, s.logprobs, strict=True)
    ]
    assert all(len(r) == len(s.logprobs) == len(s.token_ids) for r, s in zip(ref, samples, strict=True))
    assert sum(diffs) / len(diffs) < tol and max(diffs) < 10 * tol
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=16, seed=1),
        SamplingParams(max_new_tokens=16, seed=2, temperature=0.7, top_k=5),
        SamplingParams(max_new_tokens=16, seed=3, temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "temp-topk", "temp-topp"],
)
def test_logprobs_match_a_direct_forward_pass(tiny, params):
    model, tok = tiny
    prompts = encode_prompts(tok, TEXTS)
    groups = TransformersEngine(model, tok).sample(prompts, 4, params)
    assert len(groups) == len(prompts) and all(len(g) == 4 for g in groups)
    _check_logprobs(model, prompts, groups, 4, params)


def test_top_k_and_top_p_restrict_the_sampled_tokens(tiny):
    model, tok = tiny
    logits = model(torch.tensor([encode_prompts(tok, ["3a="])[0]])).logits[0, -1].detach()
    lp = process_logits(logits, SamplingParams(top_k=3))
    assert torch.isfinite(lp).sum() == 3
    assert torch.allclose(lp.exp().sum(), torch.tensor(1.0))
    lp = process_logits(logits, SamplingParams(top_p=1e-6))
    assert torch.isfinite(lp).sum() == 1 and lp.max() == 0  # the top token alone


@pytest.fixture
def eos_biased_model():
    """The tiny model with +2.5 on the EOS logit: completions end at varied lengths."""
    model, tok = build_tiny_policy(seed=0)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 2.5
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    return model, tok


@pytest.mark.parametrize("compact_every", [0, 1, 3])
def test_stops_each_sequence_at_its_eos(eos_biased_model, compact_every):
    model, tok = eos_biased_model
    engine = TransformersEngine(model, tok, TransformersEngineConfig(compact_every=compact_every))
    prompts = encode_prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=12, seed=0)
    groups = engine.sample(prompts, 8, params)
    samples = _flat(groups)
    lengths = {len(s.token_ids) for s in samples}
    assert len(lengths) > 3  # ragged: sequences really stop independently
    for s in samples:
        eos_at = [i for i, t in enumerate(s.token_ids) if t == tok.eos_token_id]
        assert s.finished == bool(eos_at)
        if s.finished:
            assert eos_at == [len(s.token_ids) - 1]  # EOS is the last token, and only there
        else:
            assert len(s.token_ids) == params.max_new_tokens
    _check_logprobs(model, prompts, groups, 8, params)
    assert engine.stats.tokens == sum(len(s.token_ids) for s in samples)


def test_compaction_does_not_change_the_samples(eos_biased_model):
    model, tok = eos_biased_model
    prompts = encode_prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    a = TransformersEngine(model, tok, TransformersEngineConfig(compact_every=0)).sample(prompts, 2, params)
    b = TransformersEngine(model, tok, TransformersEngineConfig(compact_every=1)).sample(prompts, 2, params)
    assert [s.token_ids for s in _flat(a)] == [s.token_ids for s in _flat(b)]


def test_left_padding_does_not_change_a_prompt_s_completion(tiny):
    model, tok = tiny
    engine = TransformersEngine(model, tok)
    prompts = encode_prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    batched = engine.sample(prompts, 1, params)
    for prompt, group in zip(prompts, batched, strict=True):
        alone = engine.sample([prompt], 1, params)[0][0]
        assert alone.token_ids == group[0].token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, group[0].logprobs, strict=True)) < 1e-5


def test_seeded_sampling_is_reproducible_and_samples_differ(tiny):
    model, tok = tiny
    engine = TransformersEngine(model, tok, TransformersEngineConfig(max_batch_size=6))  # chunked too
    prompts = encode_prompts(tok, TEXTS)
    a = engine.sample(prompts, 4, SamplingParams(seed=5, max_new_tokens=8))
    b = engine.sample(prompts, 4, SamplingParams(seed=5, max_new_tokens=8))
    c = engine.sample(prompts, 4, SamplingParams(seed=6, max_new_tokens=8))
    assert a == b and a != c
    assert len({tuple(s.token_ids) for s in a[0]}) > 1  # the n samples of one prompt are not copies


def test_load_weights_swaps_the_policy_in_place(tiny):
    model, tok = build_tiny_policy(seed=0)
    new, _ = build_tiny_policy(seed=1)
    engine = TransformersEngine(model, tok)
    prompts = encode_prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=8, seed=0)
    engine.load_weights(full_precision_state_dict(new))
    groups = engine.sample(prompts, 2, params)
    _check_logprobs(new, prompts, groups, 2, params)


def test_bad_prompts_are_rejected(tiny):
    model, tok = tiny
    engine = TransformersEngine(model, tok)
    with pytest.raises(ValueError, match="empty"):
        engine.sample([[]], 1, SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.sample([[len(tok) + 5]], 1, SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_engine_runs_a_quantised_model(mode):
    model, tok = load_policy(ModelSpec(preset="tiny", quantize=mode))
    prompts = encode_prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=8, seed=0)
    groups = TransformersEngine(model, tok).sample(prompts, 2, params)
    # bnb 8-bit quantises activations per row: batched/cached vs full forward differ slightly
    _check_logprobs(model, prompts, groups, 2, params, tol=5e-3 if mode == "8bit" else 1e-4)


@pytest.mark.parametrize("quantize", [None, "8bit"])
def test_update_weights_scatters_a_patch_in_place_like_a_full_load(quantize):
    """A bf16 patch stream followed by the engine: only the changed values are written, and the model ends
    exactly where a full load of the same version puts it (a quantised layer is re-quantised whole)."""
    from echo_p2p.weights.codec import VersionAssembler, WeightEncoder
    from echo_p2p.weights.config import EncodingConfig
    from echo_p2p.weights.model_io import named_tensors

    trainer, tok = build_tiny_policy(seed=0)
    spec = ModelSpec(preset="tiny", seed=0, quantize=quantize)
    served, _ = load_policy(spec)
    reference, _ = load_policy(spec)
    engine, ref_engine = TransformersEngine(served, tok), TransformersEngine(reference, tok)
    encoder = WeightEncoder(EncodingConfig(encoding="patch"), run_id="r", publisher="p")

    def publish(version):
        (update, *_) = encoder.encode(named_tensors(trainer), version)
        asm = VersionAssembler(update.manifest)
        for i in range(update.manifest.num_chunks):
            asm.add_chunk(i, update.get_chunk(i))
        return asm

    held = publish(0).apply(None)
    engine.load_weights(held.tensors)
    untouched = "model.layers.1.mlp.down_proj.weight"  # not in the patch at all
    with torch.no_grad():
        trainer.get_parameter("model.layers.0.mlp.up_proj.weight").view(-1)[[3, 70, 500]] += 0.05
        trainer.get_parameter("model.norm.weight").add_(0.01)
    held = publish(1).apply(held)
    assert held.changed_since == 0 and untouched not in held.changed
    assert held.changed["model.layers.0.mlp.up_proj.weight"].tolist() == [3, 70, 500]
    up = "model.layers.0.mlp.up_proj.weight"
    if quantize is None:  # a sentinel at an unchanged position of a changed tensor: a scatter keeps it
        with torch.no_grad():
            served.get_parameter(up).view(-1)[4] = 123.0
    engine.update_weights(held.tensors, held.changed)
    ref_engine.load_weights(held.tensors)
    if quantize is None:
        flat = served.get_parameter(up).view(-1)
        assert float(flat[4]) == 123.0
        assert torch.equal(flat[[3, 70, 500]], held.tensors[up].view(-1)[[3, 70, 500]].float())
        with torch.no_grad():
            flat[4] = held.tensors[up].view(-1)[4].float()
    served_state, ref_state = served.state_dict(), reference.state_dict()
    for name, t in ref_state.items():
        assert torch.equal(served_state[name], t), name
    prompts = encode_prompts(tok, TEXTS)
    params = SamplingParams(max_new_tokens=8, seed=0)
    assert engine.sample(prompts, 2, params) == ref_engine.sample(prompts, 2, params)
