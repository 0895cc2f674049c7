"""Weight codec: encodings round trip, error feedback, keyframes, chunking, and rejection of bad input."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from echo_p2p.weights.codec import EncodedVersion, VersionAssembler, WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import (
    BaseVersionError,
    ChunkDigestError,
    ChunkSizeError,
    IncompleteVersionError,
    Manifest,
    NonFiniteError,
    ParamMismatchError,
    WeightsError,
)
from echo_p2p.weights.model_io import PolicyWeights, load_into_model, named_tensors
from echo_p2p.weights.quant import dequantize, dynamic_code, quantize_blockwise


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def encoder(encoding: str = "int8-delta", **kwargs) -> WeightEncoder:
    config = EncodingConfig(encoding=encoding, **kwargs)
    return WeightEncoder(config, run_id="run", publisher="QmTrainer", publisher_key=b"key")


def receive(encoded: EncodedVersion, current: PolicyWeights | None = None, **kwargs) -> PolicyWeights:
    """What a receiver does: parse the manifest from bytes, add every chunk (last first), apply."""
    assembler = VersionAssembler(Manifest.from_bytes(encoded.manifest.to_bytes()))
    for index in reversed(range(encoded.manifest.num_chunks)):
        assembler.add_chunk(index, encoded.get_chunk(index))
    return assembler.apply(current, **kwargs)


def perturb_(
    tensors: list[tuple[str, torch.Tensor]], generator: torch.Generator, scale: float = 1e-4
) -> None:
    with torch.no_grad():
        for _, t in tensors:
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=generator) * scale)


@pytest.mark.parametrize("chunk_size", [4096, 1 << 22])
def test_fp32_round_trip_is_bit_exact_and_loads_into_model(chunk_size):
    model = tiny_model(0)
    (encoded,) = encoder("fp32", chunk_size=chunk_size).encode(named_tensors(model), version=0)
    weights = receive(encoded)
    for name, t in named_tensors(model):
        assert weights.tensors[name].dtype == torch.float32 and torch.equal(weights.tensors[name], t)
    other = tiny_model(1)
    load_into_model(other, weights)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, other(ids).logits)
    assert other.lm_head.weight is other.model.embed_tokens.weight  # the tie survives


def test_bf16_round_trip_is_exact_to_the_cast():
    model = tiny_model(0)
    (encoded,) = encoder("bf16").encode(named_tensors(model), version=0)
    weights = receive(encoded)
    assert encoded.nbytes == sum(t.numel() * 2 for _, t in named_tensors(model))
    for name, t in named_tensors(model):
        assert torch.equal(weights.tensors[name], t.to(torch.bfloat16))


def test_the_code_map_is_bitsandbytes_map_and_decoding_needs_no_bitsandbytes():
    """The int8 code map is built here, value for value bitsandbytes' ``create_dynamic_map(signed=True)``
    (what its quantizer indexes), so a receiver decodes an int8 version without importing bitsandbytes."""
    import subprocess
    import sys

    from bitsandbytes.functional import create_dynamic_map

    assert torch.equal(dynamic_code(), create_dynamic_map(signed=True).to(torch.float32))
    code = (
        "import sys, torch\n"
        "from echo_p2p.weights.quant import add_dequantized_\n"
        "target = torch.zeros(8)\n"
        "add_dequantized_(target, torch.tensor([2.0]), torch.arange(0, 256, 32, dtype=torch.uint8), 8)\n"
        "print(target.tolist(), 'BNB' if 'bitsandbytes' in sys.modules else 'NO-BNB')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("NO-BNB"), out.stdout + out.stderr[-2000:]
    assert out.stdout.split("]")[0] + "]" == str((dynamic_code()[::32] * 2).tolist())


def test_int8_snapshot_error_is_bounded_per_block():
    model = tiny_model(0)
    blocksize = 256
    (encoded,) = encoder("int8", blocksize=blocksize).encode(named_tensors(model), version=0)
    weights = receive(encoded)
    fp32_bytes = sum(t.numel() * 4 for _, t in named_tensors(model))
    assert encoded.nbytes <= 0.27 * fp32_bytes
    # about half the widest gap of the code map (bitsandbytes does not always round to the nearest code)
    half_gap = 0.0075
    assert float(dynamic_code().sort().values.diff().max()) / 2 < half_gap
    for name, t in named_tensors(model):
        flat, got = t.reshape(-1), weights.tensors[name].reshape(-1)
        pad = -flat.numel() % blocksize
        absmax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, blocksize).amax(1)
        bound = absmax.repeat_interleave(blocksize)[: flat.numel()] * half_gap + 1e-12
        assert bool(((got - flat).abs() <= bound).all()), name


def test_dequantization_matches_bitsandbytes_bit_for_bit():
    import bitsandbytes.functional as bnbf

    x = torch.randn(10_001) * 0.05
    for blocksize in (64, 4096):
        codes, state = bnbf.quantize_blockwise(x, blocksize=blocksize)
        absmax, codes2 = quantize_blockwise(x, blocksize)
        assert torch.equal(codes, codes2)
        assert torch.equal(dequantize(absmax, codes2, blocksize), bnbf.dequantize_blockwise(codes, state))


def _track(error_feedback: bool, versions: int = 100) -> list[float]:
    """Max abs error between the trainer's weights and a follower's, over `versions` small updates."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=gen) * 0.02
    drift = torch.randn(64, 512, generator=gen).sign()  # updates share a direction, as optimizer steps do
    enc = encoder(keyframe_interval=1000, error_feedback=error_feedback)
    current, errors = None, []
    for version in range(versions + 1):
        if version:
            w = w + 1e-4 * (drift + 0.5 * torch.randn(w.shape, generator=gen))
        (encoded,) = enc.encode([("w", w)], version)
        current = receive(encoded, current)
        errors.append((current.tensors["w"] - w).abs().max().item())
    return errors


def test_error_feedback_keeps_error_bounded_and_without_it_the_error_grows():
    with_ef, without_ef = _track(True), _track(False)
    step_bound = 1e-4 * 4 * 0.0075  # |delta| <~ 4e-4 per element, half the widest code gap
    assert max(with_ef) <= step_bound
    assert max(with_ef[50:]) <= 1.5 * max(with_ef[1:11])  # no growth over time
    assert without_ef[100] > 3 * without_ef[10] > 0  # grows with the number of versions
    assert without_ef[100] > 10 * max(with_ef)


def test_newcomer_from_keyframe_matches_follower_bit_for_bit():
    model = tiny_model(0)
    tensors = named_tensors(model)
    enc = encoder(keyframe_interval=5, chunk_size=10_000)
    gen = torch.Generator().manual_seed(1)
    published: dict[int, list[EncodedVersion]] = {}
    follower = None
    for version in range(13):
        if version:
            perturb_(tensors, gen)
        published[version] = enc.encode(tensors, version)
        delta = next((e for e in published[version] if not e.is_keyframe), None)
        follower = receive(delta if delta else published[version][0], follower)
    kinds = {v: [(e.manifest.encoding, e.manifest.base_version) for e in out] for v, out in published.items()}
    assert kinds[0] == [("fp32", None)]
    assert kinds[1] == [("int8-delta", 0)]
    assert kinds[5] == [("int8-delta", 4), ("fp32", None)]
    assert kinds[10] == [("int8-delta", 9), ("fp32", None)]
    assert all(len(kinds[v]) == 1 for v in (6, 9, 11, 12))

    keyframe = next(e for e in published[10] if e.is_keyframe)
    newcomer = receive(keyframe)
    for version in (11, 12):
        newcomer = receive(published[version][0], newcomer)
    assert newcomer.version == follower.version == 12 and newcomer.stream_id == follower.stream_id
    for name, t in follower.tensors.items():
        assert torch.equal(newcomer.tensors[name], t), name
    for name, t in tensors:  # and both are close to the trainer's true weights
        assert (follower.tensors[name] - t).abs().max() < 1e-5


def test_parameter_spanning_many_chunks_and_inplace_apply():
    gen = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(300, generator=gen)), ("b", torch.randn(5, 7, generator=gen))]
    tensors.append(("steps", torch.arange(3)))  # a non-float buffer travels raw
    enc = encoder(chunk_size=37, blocksize=64)
    (key,) = enc.encode(tensors, 0)
    assert key.manifest.num_chunks == -(-key.nbytes // 37) and key.manifest.chunks[-1].size <= 37
    current = receive(key)
    perturb_(tensors, gen, scale=1e-3)
    tensors[2] = ("steps", torch.arange(3) + 10)
    (delta,) = enc.encode(tensors, 1)
    assert delta.manifest.num_chunks > 5
    staged = receive(delta, current)
    assert current.version == 0  # untouched by a non-inplace apply
    inplace = receive(delta, current, inplace=True)
    assert inplace.tensors["a"] is current.tensors["a"]
    for name, _ in tensors:
        assert torch.equal(staged.tensors[name], inplace.tensors[name])
    assert torch.equal(staged.tensors["steps"], torch.arange(3) + 10)
    assert (staged.tensors["a"] - tensors[0][1]).abs().max() < 1e-4


def test_corrupt_wrong_size_and_truncated_chunks_are_rejected_and_not_stored():
    model = tiny_model(0)
    (encoded,) = encoder("int8", chunk_size=5000).encode(named_tensors(model), 0)
    assembler = VersionAssembler(encoded.manifest)
    good = encoded.get_chunk(1)
    bad = bytearray(good)
    bad[100] ^= 0xFF
    rejected = [(bytes(bad), ChunkDigestError), (good[:-10], ChunkSizeError), (good + b"x", ChunkSizeError)]
    for data, error in rejected:
        with pytest.raises(error):
            assembler.add_chunk(1, data)
        assert 1 in assembler.missing()
    with pytest.raises(ChunkDigestError):
        assembler.add_chunk(0, good)  # a valid chunk under the wrong index
    with pytest.raises(IncompleteVersionError):
        assembler.apply()
    for index in assembler.missing():
        assembler.add_chunk(index, encoded.get_chunk(index))
    assert assembler.is_complete() and assembler.apply().version == 0


def test_delta_needs_its_exact_base():
    gen = torch.Generator().manual_seed(0)
    tensors = [("w", torch.randn(100, generator=gen))]
    enc = encoder()
    v0 = receive(enc.encode(tensors, 0)[0])
    perturb_(tensors, gen)
    (d1,) = enc.encode(tensors, 1)
    perturb_(tensors, gen)
    (d2,) = enc.encode(tensors, 2)
    with pytest.raises(BaseVersionError):
        receive(d1)  # no base at all
    with pytest.raises(BaseVersionError):
        receive(d2, v0)  # skipped version 1
    with pytest.raises(BaseVersionError):
        receive(d1, PolicyWeights(version=0, stream_id="another", tensors=v0.tensors))
    with pytest.raises(ParamMismatchError):
        receive(d1, PolicyWeights(version=0, stream_id=v0.stream_id, tensors={"w": torch.zeros(99)}))
    with pytest.raises(ParamMismatchError):
        receive(d1, PolicyWeights(version=0, stream_id=v0.stream_id, tensors={"w": v0.tensors["w"].double()}))
    assert receive(d2, receive(d1, v0)).version == 2


def test_encoder_rejects_bad_input_and_restarts_the_stream_cleanly():
    tensors = [("w", torch.randn(100))]
    enc = encoder()
    enc.encode(tensors, 0)
    stream = enc.stream_id
    with pytest.raises(WeightsError):
        enc.encode(tensors, 0)  # versions must increase
    with pytest.raises(ParamMismatchError):
        enc.encode([("w", torch.randn(101))], 1)
    with pytest.raises(NonFiniteError):
        enc.encode([("w", torch.full((100,), float("nan")))], 1)
    assert enc.stream_id == stream  # rejected before the shadow was touched
    assert [e.manifest.base_version for e in enc.encode(tensors, 1)] == [0]
    with pytest.raises(ParamMismatchError):
        enc.encode([("w", torch.randn(100, dtype=torch.float64))], 2)


def test_named_tensors_lists_tied_embeddings_once():
    model = tiny_model(0)
    names = [name for name, _ in named_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(model.state_dict()) - 1
    with pytest.raises(ParamMismatchError):
        load_into_model(model, {name: t for name, t in named_tensors(model)[1:]})
