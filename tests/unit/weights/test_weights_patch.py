"""Lossless patch streams: receivers bit-identical to the trainer's cast, the per-version choice, bad patches.

The reference for exactness is independent of the codec: ``tensor.to(bfloat16)`` (or float16) of the
trainer's float32 weights, compared with ``torch.equal`` (bit patterns, so -0.0 and NaN payloads count).
"""

import struct

import numpy as np
import pytest
import torch
import zstandard

from echo_p2p.weights.codec import EncodedVersion, VersionAssembler, WeightEncoder, merge_changes
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import (
    ChunkDigestError,
    ChunkSizeError,
    Manifest,
    NonFiniteError,
    patch_payload_bound,
)
from echo_p2p.weights.model_io import PolicyWeights
from echo_p2p.weights.patch import (
    MODE_DENSE,
    MODE_SPARSE,
    PatchError,
    TensorPatch,
    apply_patch_,
    decode_patch,
    diff16,
    encode_patch,
)

SHAPES = {"embed": (97, 33), "mlp": (4099,), "norm": (33,)}


def make_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {name: torch.randn(shape, generator=g) * 0.05 for name, shape in SHAPES.items()}
    w["norm"] += 1.0
    w["steps"] = torch.tensor([0, 7], dtype=torch.int64)  # a non-float buffer: sent raw every version
    return w


def rl_step_(w: dict[str, torch.Tensor], g: torch.Generator, lr: float) -> None:
    """An Adam-like update: every float value moves by about `lr` (sign of a random gradient)."""
    for t in w.values():
        if t.is_floating_point():
            t.add_(torch.randn(t.shape, generator=g).sign() * lr)
    w["steps"][0] += 1


def encoder(encoding: str = "patch", **kwargs) -> WeightEncoder:
    config = EncodingConfig(encoding=encoding, chunk_size=4096, **kwargs)
    return WeightEncoder(config, run_id="run", publisher="QmTrainer")


def receive(encoded: EncodedVersion, current: PolicyWeights | None, **kwargs) -> PolicyWeights:
    assembler = VersionAssembler(Manifest.from_bytes(encoded.manifest.to_bytes()))
    for index in range(encoded.manifest.num_chunks):
        assembler.add_chunk(index, encoded.get_chunk(index))
    return assembler.apply(current, **kwargs)


def assert_exact(held: PolicyWeights, w: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for name, t in w.items():
        expected = t.to(dtype) if t.is_floating_point() else t
        assert held.tensors[name].dtype == expected.dtype, name
        assert torch.equal(held.tensors[name], expected), name


@pytest.mark.parametrize("serving", ["bf16", "fp16"])
def test_follower_of_200_patches_and_newcomers_from_keyframes_are_bit_identical(serving):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[serving]
    w, g = make_weights(), torch.Generator().manual_seed(1)
    enc = encoder("patch", serving_dtype=serving, keyframe_interval=50)
    follower: PolicyWeights | None = None
    newcomers: dict[int, PolicyWeights] = {}
    for version in range(201):
        if version:
            rl_step_(w, g, lr=1e-4 if version % 7 else 3e-3)  # mostly sparse, now and then dense
        out = enc.encode(w.items(), version)
        update = out[0]
        follower = receive(update, None if update.is_keyframe else follower, inplace=version % 2 == 0)
        assert follower.version == version
        assert_exact(follower, w, dtype)
        for nc_start, held in list(newcomers.items()):
            newcomers[nc_start] = receive(update, held)
            assert_exact(newcomers[nc_start], w, dtype)
        keyframe = next((e for e in out if e.is_keyframe), None)
        if keyframe is not None and version in (50, 150):  # a newcomer starts from this keyframe
            newcomers[version] = receive(keyframe, None)
            assert_exact(newcomers[version], w, dtype)
    kinds = {e.manifest.encoding for e in enc_history(serving)}
    assert f"{serving}-patch" in kinds and serving in kinds
    assert set(newcomers) == {50, 150}


def enc_history(serving: str) -> list[EncodedVersion]:
    """A short stream with a sparse and a dense version, for the encodings it uses."""
    w, g = make_weights(), torch.Generator().manual_seed(2)
    enc = encoder("patch", serving_dtype=serving, keyframe_interval=3)
    out = []
    for version, lr in enumerate([0.0, 1e-4, 3e-3, 1e-4]):
        rl_step_(w, g, lr)
        out += enc.encode(w.items(), version)
    return out


def test_a_patch_lists_only_the_values_whose_bits_changed():
    w = make_weights()
    enc = encoder("patch")
    enc.encode(w.items(), 0)
    out = enc.encode(w.items(), 1)  # nothing changed: a patch of a few bytes
    assert out[0].manifest.encoding == "bf16-patch" and out[0].nbytes < 100
    assert enc.last_stats["changed"] == 0
    w["mlp"][[5, 17, 4000]] += 0.01
    out = enc.encode(w.items(), 2)
    assert out[0].manifest.encoding == "bf16-patch" and out[0].nbytes < 200
    assert enc.last_stats["changed"] == 3 and enc.last_stats["kind"] == "patch"


def params() -> list:
    return encoder("bf16").encode(make_weights().items(), 0)[0].manifest.params


def test_changed_positions_are_reported_for_in_place_engine_updates():
    w = make_weights()
    enc = encoder("patch")
    held = receive(enc.encode(w.items(), 0)[0], None)
    w["mlp"][[3, 99]] += 0.01
    w["embed"] += 0.01  # every value: sent dense
    new = receive(enc.encode(w.items(), 1)[0], held)
    assert new.changed_since == 0
    assert set(new.changed) == {"mlp", "embed", "steps"}  # "norm" did not change
    assert new.changed["mlp"].tolist() == [3, 99]
    assert new.changed["embed"] is None and new.changed["steps"] is None
    assert held.changed is None  # a keyframe: everything is new


def test_auto_chooses_per_version_by_size():
    w, g = make_weights(), torch.Generator().manual_seed(3)
    enc = encoder("auto", keyframe_interval=1000)
    held = receive(enc.encode(w.items(), 0)[0], None)
    rl_step_(w, g, 1e-5)  # a few bf16 values move: the patch is far smaller than an int8 delta
    out = enc.encode(w.items(), 1)
    assert out[0].manifest.encoding == "bf16-patch"
    assert enc.last_stats["patch_bytes"] < 0.2 * enc.last_stats["int8-delta_bytes"]
    held = receive(out[0], held)
    assert_exact(held, w, torch.bfloat16)
    for t in (w["embed"], w["mlp"], w["norm"]):  # new random values: nothing compresses, int8 is smallest
        t.copy_(torch.randn(t.shape, generator=g))
    out = enc.encode(w.items(), 2)
    assert out[0].manifest.encoding == "int8-delta" and out[0].manifest.base_version == 1
    assert enc.last_stats["int8-delta_bytes"] < enc.last_stats["patch_bytes"]
    held = receive(out[0], held)
    shadow = {n: t.clone() for n, t in enc._shadow.items()}  # the publisher's view of the receivers
    for name in shadow:  # the int8 delta on a bf16 state is applied identically on both sides
        assert torch.equal(held.tensors[name], shadow[name]), name
    assert held.tensors["mlp"].dtype == torch.bfloat16
    rl_step_(w, g, 1e-4)  # the next patch makes receivers exact again
    out = enc.encode(w.items(), 3)
    assert out[0].manifest.encoding == "bf16-patch"
    assert_exact(receive(out[0], held), w, torch.bfloat16)


def test_patch_stream_sends_a_keyframe_alone_when_the_patch_would_be_larger():
    w, g = make_weights(), torch.Generator().manual_seed(4)
    enc = encoder("patch", keyframe_interval=1000)
    held = receive(enc.encode(w.items(), 0)[0], None)
    for t in (w["embed"], w["mlp"], w["norm"]):  # random finite bf16 bit patterns: incompressible steps
        bits = torch.randint(0, 1 << 16, t.shape, generator=g, dtype=torch.int32)
        bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # no inf / NaN
        t.copy_(bits.to(torch.int16).view(torch.bfloat16).float())
    out = enc.encode(w.items(), 1)
    assert [(e.manifest.encoding, e.manifest.base_version) for e in out] == [("bf16", None)]
    assert enc.last_stats["kind"] == "keyframe" and enc.last_stats["patch_bytes"] >= out[0].nbytes
    held = receive(out[0], None)
    assert_exact(held, w, torch.bfloat16)
    rl_step_(w, g, 1e-4)
    out = enc.encode(w.items(), 2)  # and the stream goes on with patches from that keyframe
    assert out[0].manifest.encoding == "bf16-patch" and out[0].manifest.base_version == 1
    assert_exact(receive(out[0], held), w, torch.bfloat16)


def test_fp16_serving_refuses_values_beyond_its_range():
    w = make_weights()
    w["mlp"][0] = 70000.0  # finite in fp32, inf in fp16
    with pytest.raises(NonFiniteError, match="range of fp16"):
        encoder("patch", serving_dtype="fp16").encode(w.items(), 0)
    encoder("patch", serving_dtype="bf16").encode(w.items(), 0)  # bf16 has fp32's range


# ------------------------------------------------------------------------------------- corrupt patches


def _stream() -> tuple[PolicyWeights, EncodedVersion, dict[str, torch.Tensor]]:
    w, g = make_weights(), torch.Generator().manual_seed(5)
    enc = encoder("patch", keyframe_interval=1000)
    held = receive(enc.encode(w.items(), 0)[0], None)
    rl_step_(w, g, 1e-3)
    return held, enc.encode(w.items(), 1)[0], w


def test_corrupt_or_truncated_chunks_are_refused_by_digest_and_nothing_is_applied():
    held, update, _ = _stream()
    before = {n: t.clone() for n, t in held.tensors.items()}
    assert update.manifest.num_chunks >= 2
    asm = VersionAssembler(update.manifest)
    chunk = bytearray(update.get_chunk(0))
    chunk[10] ^= 0xFF
    with pytest.raises(ChunkDigestError):
        asm.add_chunk(0, bytes(chunk))
    with pytest.raises(ChunkSizeError):
        asm.add_chunk(0, update.get_chunk(0)[:-1])
    assert asm.missing() == list(range(update.manifest.num_chunks))
    for n, t in held.tensors.items():
        assert torch.equal(t, before[n])


def test_a_malformed_patch_from_a_trusted_publisher_changes_nothing():
    """Defence in depth: a patch that passes the digests (its publisher signed garbage) is parsed whole and
    refused before any tensor is touched, even when applied in place."""
    held, update, _ = _stream()
    manifest = update.manifest
    good = b"".join(update.get_chunk(i) for i in range(manifest.num_chunks))
    raw = zstandard.ZstdDecompressor().decompress(good)
    cctx = zstandard.ZstdCompressor()
    bad_payloads = {
        "not zstd": b"garbage" * 10,
        "trailing": cctx.compress(raw + b"\x00"),
        "truncated": cctx.compress(raw[:-1]),
        "unknown mode": cctx.compress(b"\x07" + raw[1:]),
    }
    before = {n: t.clone() for n, t in held.tensors.items()}
    for what, payload in bad_payloads.items():
        forged = manifest.model_copy(update={"chunks": [], "total_bytes": 0})
        forged = Manifest.model_validate(
            {
                **forged.model_dump(),
                "chunks": [{"index": 0, "size": len(payload), "sha256": _sha(payload)}],
                "chunk_size": max(len(payload), 1),
                "total_bytes": len(payload),
            }
        )
        asm = VersionAssembler(forged)
        asm.add_chunk(0, payload)
        with pytest.raises(PatchError):
            asm.apply(held, inplace=True)
        for n, t in held.tensors.items():
            assert torch.equal(t, before[n]), (what, n)


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_decode_refuses_out_of_range_positions_and_counts():
    infos = params()
    mlp = next(i for i in infos if i.name == "mlp")
    n = mlp.numel

    def payload(mlp_section: bytes) -> bytes:
        parts = []
        for info in infos:
            if not info.is_float:
                parts.append(bytes(8 * info.numel))
            elif info.name == "mlp":
                parts.append(mlp_section)
            else:
                parts.append(b"\x00")
        return zstandard.ZstdCompressor().compress(b"".join(parts))

    def sparse(gaps: list[int], steps: list[int], count: int | None = None) -> bytes:
        g = np.array(gaps, dtype=np.uint32).view(np.uint8).reshape(-1, 4).T.tobytes()
        s = np.array(steps, dtype=np.uint16).view(np.uint8).reshape(-1, 2).T.tobytes()
        return bytes([MODE_SPARSE]) + struct.pack("<Q", len(gaps) if count is None else count) + g + s

    patches, _ = decode_patch(payload(sparse([2, 0], [1, 65535])), infos)  # positions 2 and 3
    assert patches["mlp"].positions.tolist() == [2, 3] and patches["mlp"].steps.tolist() == [1, 65535]
    with pytest.raises(PatchError, match="out of range"):
        decode_patch(payload(sparse([n - 1, 0], [1, 1])), infos)
    with pytest.raises(PatchError, match="changed positions"):
        decode_patch(payload(sparse([0], [1], count=n + 1)), infos)
    with pytest.raises(PatchError):  # claims 3 changes, holds 2: the sections after it no longer line up
        decode_patch(payload(sparse([0, 0], [1, 1], count=3)), infos)
    with pytest.raises(PatchError, match="truncated"):
        decode_patch(payload(bytes([MODE_DENSE]) + bytes(2 * n - 2)), infos)
    with pytest.raises(PatchError, match="larger than any patch"):
        decode_patch(b"\x00" * (patch_payload_bound(infos) + 1), infos)


def test_steps_wrap_modulo_2_16_and_apply_in_place():
    old = torch.tensor([1.0, -2.0, 0.0] + [3.5] * 7, dtype=torch.bfloat16)
    new = torch.tensor([1.0078125, -2.015625, -0.0] + [3.5] * 7, dtype=torch.bfloat16)
    patch = diff16(old, new)  # +1 step, +1 step on a negative value, 0x0000 -> 0x8000
    assert patch is not None and patch.positions.tolist() == [0, 1, 2]
    assert patch.steps.tolist() == [1, 1, 0x8000]
    target = old.clone()
    apply_patch_(target, patch)
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))  # -0.0 kept bit for bit
    assert diff16(new, new.clone()) is None
    dense = TensorPatch(None, np.ones(3, dtype=np.uint16))
    with pytest.raises(PatchError):
        apply_patch_(old.clone(), dense)
    with pytest.raises(PatchError):
        encode_patch(params(), {"mlp": dense}, {"steps": b"\x00" * 16})


def test_changes_of_a_chain_merge_into_one_update():
    a = {"x": torch.tensor([1, 5]), "y": None}
    b = {"x": torch.tensor([2, 5]), "z": torch.tensor([0])}
    merged = merge_changes(a, b)
    assert merged["x"].tolist() == [1, 2, 5] and merged["y"] is None and merged["z"].tolist() == [0]
    assert merge_changes(a, None) is None and merge_changes(None, b) is None
    assert merge_changes({}, b) == b


def test_weights_on_rounding_midpoints_turn_a_tiny_step_into_half_a_unit_unless_started_on_the_grid():
    """A checkpoint stored finer than bf16 (here: fp16-exact values) has values exactly halfway between two
    bf16 numbers. One AdamW step at lr 1e-6 moves every weight by ~1e-6, yet the receivers' bf16 cast of
    each tie jumps by half a bf16 unit (~100x the step) in the direction of the step. Rounding the fresh
    weights to the grid first (``round_to_serving_grid_``) leaves the cast where it was."""
    from echo_p2p.weights.quant import round_to_serving_grid_

    base = torch.linspace(0.25, 0.5, 4097)[:-1].to(torch.float16).float()  # fp16 values, 1/8 of them ties
    ties = (base.view(torch.int32) & 0xFFFF) == 0x8000
    assert ties.float().mean() > 0.1

    def cast_moves(start_on_grid: bool) -> torch.Tensor:
        w = torch.nn.Parameter(base.clone())
        if start_on_grid:
            assert round_to_serving_grid_([w], "bf16") > 0
        start, before = w.detach().clone(), w.detach().to(torch.bfloat16).float()
        opt = torch.optim.AdamW([w], lr=1e-6)
        w.grad = torch.ones_like(w)  # every weight steps down by ~1e-6
        opt.step()
        assert (w.detach() - start).abs().max() < 2e-6  # the trainer's own weights barely moved
        return w.detach().to(torch.bfloat16).float() - before

    moves = cast_moves(start_on_grid=False)
    assert (moves[ties] < -5e-4).float().mean() > 0.4  # ties broke downwards by half a unit (~1e-3 here)
    assert (moves != 0).float().mean() > 0.05
    assert torch.count_nonzero(cast_moves(start_on_grid=True)) == 0
