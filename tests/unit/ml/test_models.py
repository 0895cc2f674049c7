from __future__ import annotations

import time

import pytest
import torch

from echo_p2p.ml.engine import SamplingParams, TransformersEngine, completion_logprobs
from echo_p2p.ml.models import (
    ModelNotFoundError,
    ModelSpec,
    build_tiny_policy,
    full_precision_state_dict,
    is_quantized,
    load_policy,
    load_weights_,
    quantize_linear_layers_,
)
from echo_p2p.ml.tokenizer import encode_prompts


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_init_is_deterministic_from_the_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, _ = build_tiny_policy(seed=7)
    assert torch.equal(torch.rand(3), before)  # global RNG untouched
    b, _ = build_tiny_policy(seed=7)
    c, _ = build_tiny_policy(seed=8)
    assert _same_weights(a, b)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.tie_word_embeddings and a.lm_head.weight is a.model.embed_tokens.weight
    assert (a.config.hidden_size, a.config.num_hidden_layers, a.config.head_dim) == (64, 2, 16)
    assert sum(p.numel() for p in a.parameters()) < 150_000


def test_save_and_load_round_trip_through_from_pretrained(tiny, tiny_dir):
    model, tok = tiny
    loaded, loaded_tok = load_policy(ModelSpec(path=str(tiny_dir)))
    assert _same_weights(model, loaded)
    assert loaded_tok("5c=")["input_ids"] == tok("5c=")["input_ids"]
    assert loaded_tok.padding_side == "left" and loaded_tok.pad_token_id == tok.pad_token_id
    x = torch.tensor([tok("4d=dd")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


def test_missing_model_is_a_clear_error_and_nothing_is_downloaded(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not on this machine"):
        load_policy(ModelSpec(path=str(tmp_path / "nope")))
    with pytest.raises(ModelNotFoundError, match="not on this machine"):
        load_policy(ModelSpec(path="some-org/some-model-not-in-cache"))
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        load_policy(ModelSpec(gguf_file=str(tmp_path / "x.gguf")))


def test_model_spec_needs_exactly_one_source():
    with pytest.raises(ValueError, match="no model given"):
        ModelSpec()
    with pytest.raises(ValueError, match="not both"):
        ModelSpec(preset="tiny", path="/x")
    with pytest.raises(ValueError):
        ModelSpec(preset="tiny", quantize="3bit")


def _logprob_gap(reference, other, tok) -> tuple[float, float]:
    """Mean / max |log-prob difference| of `other` vs `reference` on completions sampled from `reference`."""
    prompts = encode_prompts(tok, [f"{n}{c}=" for n in range(1, 7) for c in "abcde"])
    groups = TransformersEngine(reference, tok).sample(prompts, 2, SamplingParams(max_new_tokens=12, seed=0))
    p = [pr for pr in prompts for _ in range(2)]
    comps = [s.token_ids for g in groups for s in g]
    params = SamplingParams()
    ref = completion_logprobs(reference, p, comps, params)
    got = completion_logprobs(other, p, comps, params)
    diffs = torch.tensor(
        [abs(a - b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True)]
    )
    return diffs.mean().item(), diffs.max().item()


@pytest.mark.parametrize(("mode", "bound"), [("8bit", 0.05), ("4bit", 0.3)])
@pytest.mark.parametrize("source", ["preset", "path"])
def test_quantised_loading_on_cpu(tiny, tiny_dir, mode, bound, source):
    import bitsandbytes as bnb

    spec = (
        ModelSpec(preset="tiny", seed=0, quantize=mode)
        if source == "preset"
        else ModelSpec(path=str(tiny_dir), quantize=mode)
    )
    qmodel, tok = load_policy(spec)
    layer_type = bnb.nn.Linear8bitLt if mode == "8bit" else bnb.nn.Linear4bit
    assert isinstance(qmodel.model.layers[0].self_attn.q_proj, layer_type)
    assert isinstance(qmodel.model.layers[1].mlp.down_proj, layer_type)
    assert type(qmodel.lm_head) is torch.nn.Linear  # embeddings / lm_head stay full precision
    assert is_quantized(qmodel) and not is_quantized(tiny[0])
    mean, worst = _logprob_gap(tiny[0], qmodel, tok)
    print(f"{mode} ({source}) log-prob gap vs fp32: mean {mean:.2e}, max {worst:.2e}")
    assert 0 < mean < bound


@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_new_full_precision_weights_are_requantised(tiny, mode):
    new_model, tok = build_tiny_policy(seed=1)
    qmodel, _ = load_policy(ModelSpec(preset="tiny", seed=0, quantize=mode))
    before, _ = _logprob_gap(new_model, qmodel, tok)
    load_weights_(qmodel, full_precision_state_dict(new_model))
    after, _ = _logprob_gap(new_model, qmodel, tok)
    direct, _ = _logprob_gap(new_model, load_policy(ModelSpec(preset="tiny", seed=1, quantize=mode))[0], tok)
    assert after < before / 5
    assert after == pytest.approx(direct, rel=1e-3, abs=1e-6)  # same as quantising the new weights directly


def test_load_weights_into_full_precision_model_and_its_checks(tiny):
    model, _ = build_tiny_policy(seed=0)
    new, _ = build_tiny_policy(seed=1)
    weights = full_precision_state_dict(new)
    load_weights_(model, weights)
    assert _same_weights(model, new)
    # only one name of the tied embedding is enough
    weights.pop("lm_head.weight", None)
    load_weights_(model, weights)

    target, _ = build_tiny_policy(seed=0)
    snapshot = full_precision_state_dict(target)
    with pytest.raises(KeyError, match="unknown"):
        load_weights_(target, {**weights, "model.extra.weight": torch.zeros(1)})
    partial = dict(weights)
    partial.pop("model.norm.weight")
    with pytest.raises(KeyError, match="missing"):
        load_weights_(target, partial)
    bad = dict(weights)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        load_weights_(target, bad)
    assert _same_weights(target, build_tiny_policy(seed=0)[0])  # nothing was modified
    assert snapshot.keys() == full_precision_state_dict(target).keys()


def test_a_full_precision_peer_never_imports_bitsandbytes():
    """Importing bitsandbytes costs ~1 CPU-s; a peer without quantised layers (every trainer, most inference
    peers) loads and swaps weights without it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from echo_p2p.ml.models import build_tiny_policy, full_precision_state_dict, load_weights_\n"
        "model, _ = build_tiny_policy(seed=0)\n"
        "load_weights_(model, full_precision_state_dict(build_tiny_policy(seed=1)[0]))\n"
        "print('BNB' if 'bitsandbytes' in sys.modules else 'NO-BNB')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "NO-BNB", out.stdout + out.stderr[-2000:]


@pytest.mark.slow
def test_smollm2_preset_loads_and_answers():
    pytest.importorskip("gguf")
    start = time.perf_counter()
    model, tok = load_policy(ModelSpec(preset="smollm2"))
    print(f"SmolLM2 load: {time.perf_counter() - start:.1f} s")
    assert sum(p.numel() for p in model.parameters()) > 100e6
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    engine = TransformersEngine(model, tok)
    prompts = encode_prompts(tok, ["What is 2+3? Answer with a number.", "What is the capital of France?"])
    out = engine.sample(prompts, 1, SamplingParams(temperature=0, max_new_tokens=16))
    answers = [tok.decode(g[0].token_ids, skip_special_tokens=True) for g in out]
    print("SmolLM2 answers:", answers)
    assert "5" in answers[0]
    assert "Paris" in answers[1]
    assert out[0][0].finished and out[0][0].token_ids[-1] in engine.eos_token_ids

    # GGUF + --quantize: transformers refuses a quantization_config with a GGUF file, so load_policy
    # quantises the loaded model itself with quantize_linear_layers_; exercise that on the real model.
    completions = [g[0].token_ids for g in out]
    reference = completion_logprobs(model, prompts, completions, SamplingParams())
    quantize_linear_layers_(model, "8bit")
    quantised = completion_logprobs(model, prompts, completions, SamplingParams())
    gaps = [abs(a - b) for r, q in zip(reference, quantised, strict=True) for a, b in zip(r, q, strict=True)]
    print(
        f"SmolLM2 8-bit log-prob gap on greedy answers: mean {sum(gaps) / len(gaps):.3f}, max {max(gaps):.3f}"
    )
    assert sum(gaps) / len(gaps) < 0.2
    out8 = engine.sample(prompts, 1, SamplingParams(temperature=0, max_new_tokens=16))
    assert "5" in tok.decode(out8[0][0].token_ids, skip_special_tokens=True)


def _tiny_gguf(path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(4, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_within_a_gguf_load_each_file_is_parsed_once_and_the_name_map_built_once(tmp_path):
    """transformers reads a GGUF file's header for the config, the tokenizer and the weights, and builds the
    tensor-name map per module: within ``_gguf_parsed_once`` (``load_policy``'s GGUF loads) both are made
    once, and gguf is itself again afterwards."""
    gguf = pytest.importorskip("gguf")
    from echo_p2p.ml.models import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    reader_type, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and isinstance(first, reader_type)
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_type, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
