"""Lossless patches at serving precision: the 16-bit values that changed between two versions of the policy.

Owned here: the byte format of a ``bf16-patch`` / ``fp16-patch`` payload, building one from the 16-bit state
receivers hold and the trainer's new weights cast to it (`diff16`, `encode_patch`), parsing it back from bytes with every count and
position checked before anything is touched (`decode_patch`), and applying it in place (`apply_patch_`).
Called only by `echo_p2p.weights.codec`. Pure ML on CPU tensors and numpy; must not import hivemind.

Why it is small: during RL fine-tuning at RL learning rates almost every weight moves by less than half a
bf16 step per update, so its bf16 cast does not change (PULSE, arXiv 2602.03839; `docs/scaling.md` has
our own figures). A patch lists only the positions whose bf16 bits changed and by how much, so a receiver
that applies it holds exactly ``trainer_weights.to(bfloat16)`` (or float16): no error feedback, nothing
lost.

Payload = one zstandard frame of the concatenated parameter sections, in manifest order:
- a non-float parameter: its raw bytes (full value, as in every other encoding);
- a float parameter: one mode byte, then
  - ``0`` unchanged: nothing;
  - ``1`` sparse: ``count`` as uint64, then ``count`` uint32 gaps (position minus previous position minus
    one; the first gap is the first position), then ``count`` uint16 steps;
  - ``2`` dense: ``numel`` uint16 steps;
  where a step is ``new_bits - old_bits`` modulo 2**16 of the 16-bit patterns (an RL update moves a
  weight by one or two bf16 steps, so steps are tiny integers), and every uint16/uint32 array is
  byte-shuffled (all lowest bytes, then the next, ...) so that the mostly-zero high bytes compress away.
All integers little-endian. A tensor is sparse when under ``SPARSE_MAX_DENSITY`` of its values changed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from echo_p2p.weights.manifest import (
    ParamInfo,
    WeightsError,
    patch_payload_bound,
    patch_raw_bound,
    raw_nbytes,
)

MODE_SAME, MODE_SPARSE, MODE_DENSE = 0, 1, 2
#: Above this share of changed values a tensor is sent dense (6 bytes per change before compression
#: against 2 per value).
SPARSE_MAX_DENSITY = 1 / 3
#: zstandard level. On a SmolLM2 patch (0.53 M changed values) levels 1 / 3 / 9 / 19 gave 0.748 / 0.740 /
#: 0.718 / 0.670 MiB in 0.013 / 0.016 / 0.065 / 0.76 s; compression is ~5% of the encode (docs/scaling.md).
ZSTD_LEVEL = 3
#: Tensors at or above this many values cannot be patched sparsely (gaps are uint32).
MAX_SPARSE_NUMEL = 1 << 32


class PatchError(WeightsError):
    """A patch payload is malformed (wrong counts, positions out of range, trailing bytes, bad frame)."""


@dataclass
class TensorPatch:
    """The change of one float tensor: ``positions`` (int64, strictly increasing; None = every value) and
    the uint16 ``steps`` to add to the old 16-bit patterns there, one per position."""

    positions: np.ndarray | None
    steps: np.ndarray

    @property
    def count(self) -> int:
        return int(self.steps.size)


def bits16(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a contiguous CPU bf16 / fp16 tensor as a flat uint16 numpy view (shares memory)."""
    if t.dtype not in (torch.bfloat16, torch.float16) or not t.is_contiguous():
        raise WeightsError(f"expected a contiguous 16-bit float tensor, got {t.dtype}")
    return t.view(-1).view(torch.int16).numpy().view(np.uint16)


def diff16(old: torch.Tensor, new: torch.Tensor) -> TensorPatch | None:
    """The patch that turns 16-bit tensor `old` into `new` (same shape and dtype); None if equal."""
    a, b = bits16(old), bits16(new)
    positions = np.flatnonzero(a != b)
    if positions.size == 0:
        return None
    if positions.size > SPARSE_MAX_DENSITY * a.size or a.size >= MAX_SPARSE_NUMEL:
        return TensorPatch(None, b - a)  # uint16 arithmetic wraps: the step modulo 2**16
    return TensorPatch(positions, b[positions] - a[positions])


def _shuffle(a: np.ndarray) -> bytes:
    """Byte planes of a little-endian integer array: every element's byte 0, then byte 1, ..."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.dtype.itemsize).T).tobytes()


def _unshuffle(buf: memoryview, count: int, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(buf, dtype=np.uint8, count=count * dtype.itemsize).reshape(dtype.itemsize, count)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1)


def encode_patch(
    params: list[ParamInfo], patches: dict[str, TensorPatch | None], raw: dict[str, bytes | memoryview]
) -> bytes:
    """The compressed payload of a patch: `patches` for float params, `raw` bytes for the others."""
    import zstandard

    parts: list[bytes | memoryview] = []
    for info in params:
        if not info.is_float:
            parts.append(raw[info.name])
            continue
        patch = patches.get(info.name)
        if patch is None:
            parts.append(bytes([MODE_SAME]))
        elif patch.positions is None:
            if patch.count != info.numel:
                raise PatchError(f"{info.name}: a dense patch needs {info.numel} steps, got {patch.count}")
            parts += [bytes([MODE_DENSE]), _shuffle(patch.steps.astype(np.uint16, copy=False))]
        else:
            gaps = np.diff(patch.positions, prepend=-1) - 1
            parts += [
                bytes([MODE_SPARSE]),
                struct.pack("<Q", patch.count),
                _shuffle(gaps.astype(np.uint32)),
                _shuffle(patch.steps.astype(np.uint16, copy=False)),
            ]
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(parts))


def decode_patch(
    payload: bytes, params: list[ParamInfo]
) -> tuple[dict[str, TensorPatch | None], dict[str, memoryview]]:
    """Parse a compressed patch payload; every size, mode and position is checked before returning.

    Returns (float patches by name, raw bytes of the non-float params). Raises `PatchError`.
    """
    import zstandard

    bound = patch_raw_bound(params)
    if len(payload) > patch_payload_bound(params):
        raise PatchError(f"patch of {len(payload)} bytes is larger than any patch of these parameters")
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise PatchError(f"not a zstandard frame: {exc}") from None
    if size < 0 or size > bound:  # -1: size unknown (we always write it)
        raise PatchError(f"patch declares {size} bytes, at most {bound} possible")
    try:
        data = memoryview(zstandard.ZstdDecompressor().decompress(payload, max_output_size=bound))
    except zstandard.ZstdError as exc:
        raise PatchError(f"corrupt patch: {exc}") from None
    if len(data) != size:
        raise PatchError(f"patch holds {len(data)} bytes, its frame says {size}")
    pos = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise PatchError(f"patch truncated in {what}")
        out = data[pos : pos + n]
        pos += n
        return out

    patches: dict[str, TensorPatch | None] = {}
    raws: dict[str, memoryview] = {}
    for info in params:
        if not info.is_float:
            raws[info.name] = take(raw_nbytes(info), info.name)
            continue
        mode = take(1, info.name)[0]
        n = info.numel
        if mode == MODE_SAME:
            patches[info.name] = None
        elif mode == MODE_DENSE:
            patches[info.name] = TensorPatch(None, _unshuffle(take(2 * n, info.name), n, np.dtype(np.uint16)))
        elif mode == MODE_SPARSE:
            (count,) = struct.unpack("<Q", take(8, info.name))
            if not 0 < count <= n or n >= MAX_SPARSE_NUMEL:
                raise PatchError(f"{info.name}: {count} changed positions in a tensor of {n} values")
            gaps = _unshuffle(take(4 * count, info.name), count, np.dtype(np.uint32))
            positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
            if positions[-1] >= n:
                raise PatchError(f"{info.name}: position {int(positions[-1])} out of range [0, {n})")
            steps = _unshuffle(take(2 * count, info.name), count, np.dtype(np.uint16))
            patches[info.name] = TensorPatch(positions, steps)
        else:
            raise PatchError(f"{info.name}: unknown patch mode {mode}")
    if pos != len(data):
        raise PatchError(f"{len(data) - pos} trailing bytes after the last parameter")
    return patches, raws


def apply_patch_(target: torch.Tensor, patch: TensorPatch) -> None:
    """Add the patch's steps to the bit patterns of `target` (contiguous CPU bf16 / fp16), in place."""
    bits = bits16(target)
    if patch.positions is None:
        if patch.count != bits.size:
            raise PatchError(f"dense patch of {patch.count} steps for a tensor of {bits.size} values")
        bits += patch.steps
    else:
        bits[patch.positions] += patch.steps
