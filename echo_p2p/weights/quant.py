"""Blockwise 8-bit quantization, per-tensor payload encoding/decoding, and the chunked payload stream.

Owned here: the byte layout of one tensor in a version's payload (see `manifest.payload_nbytes`), the
cutting of the payload stream into chunks (`Chunker`) and reading it back across chunks (`PayloadReader`), the
bitsandbytes blockwise 8-bit quantizer, and the one dequantization formula (``code[q] * absmax``) that both
the publisher's shadow and every receiver use, so that both sides reconstruct bit-identical weights.
Called only by `echo_p2p.weights.codec`. Works on CPU tensors; must not import hivemind. bitsandbytes is
imported lazily, by the publisher's first quantization only: decoding needs only the map (`dynamic_code`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import numpy as np
import torch

from echo_p2p.weights.manifest import ChunkStore, ParamInfo, ParamMismatchError, WeightsError

#: Elements dequantized per step (bounds the int64 index and fp32 scale temporaries to a few MiB).
_SLICE_ELEMS = 1 << 20

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
#: 16-bit dtypes receivers can serve exactly (snapshot encodings and patch streams), by encoding prefix.
SERVING_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_byteorder() -> None:
    if sys.byteorder != "little":
        raise WeightsError("the weight payload format is little-endian; this host is big-endian")


@functools.lru_cache(maxsize=1)
def dynamic_code() -> torch.Tensor:
    """The signed dynamic 8-bit map (256 float32 values, ascending) that int8 codes index; it is part of the
    wire format, not sent on it. Dettmers, "8-Bit Approximations for Parallelism in Deep Learning"
    (arXiv 1511.04561): for each exponent e = 10^-6 .. 10^0, 2^i evenly spaced fractions of it, both signs,
    then 0 and 1. It is bitsandbytes' ``create_dynamic_map(signed=True)``, value for value (a unit test
    compares them, and `quantize_blockwise` checks the map bitsandbytes quantises with): built here so that a
    receiver decodes without importing bitsandbytes (~1 CPU-s at a peer's start)."""
    values: list[float] = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist() + (-(10 ** (i - 6)) * means).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


def round_to_serving_grid_(params: Iterator[torch.Tensor], dtype: str) -> int:
    """Round float tensors in place to the values of a serving dtype ('bf16' / 'fp16'), keeping their own
    dtype; returns how many values moved. Run on a trainer's fresh weights (``start_on_serving_grid``)."""
    moved = 0
    with torch.no_grad():
        for p in params:
            if not p.is_floating_point() or p.dtype == SERVING_DTYPES[dtype]:
                continue
            rounded = p.to(SERVING_DTYPES[dtype]).to(p.dtype)
            moved += int((rounded != p).sum())
            p.copy_(rounded)
    return moved


def decoded_dtype(info: ParamInfo, encoding: str) -> torch.dtype:
    """Dtype of a decoded tensor: bf16 / fp16 for the bf16 / fp16 encodings, float32 for the others (an
    int8-delta of an auto stream applies to a 16-bit state: see ``VersionAssembler``)."""
    if not info.is_float:
        return TORCH_DTYPES[info.dtype]
    return SERVING_DTYPES.get(encoding.removesuffix("-patch"), torch.float32)


def quantize_blockwise(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat contiguous float32 CPU tensor -> (absmax float32 [ceil(n / blocksize)], codes uint8 [n])."""
    import bitsandbytes.functional as bnbf

    codes, state = bnbf.quantize_blockwise(x, blocksize=blocksize)
    code = dynamic_code()
    if state.code.shape != code.shape or not torch.equal(state.code.to("cpu", torch.float32), code):
        raise WeightsError("bitsandbytes used a non-standard code map; receivers could not decode it")
    return state.absmax.to("cpu", torch.float32).contiguous(), codes.to("cpu").contiguous()


def add_dequantized_(target: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor, blocksize: int) -> None:
    """``target += code[codes] * absmax`` (per block), in place, slice by slice.

    Publisher (shadow) and receivers call exactly this, so that their float32 results are bit-identical.
    """
    code = dynamic_code()
    n = codes.numel()
    step = max(1, _SLICE_ELEMS // blocksize) * blocksize
    for start in range(0, n, step):
        stop = min(start + step, n)
        values = code[codes[start:stop].long()]
        blocks = absmax[start // blocksize : -(-stop // blocksize)]
        scale = blocks.repeat_interleave(blocksize)[: stop - start]
        target[start:stop].add_(values.mul_(scale))


def add_dequantized_state_(
    target: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor, blocksize: int
) -> None:
    """`add_dequantized_` on a flat float32 or 16-bit state; a 16-bit state is added to in float32 and
    rounded back (round-to-nearest-even), identically on the publisher's shadow and every receiver."""
    if target.dtype == torch.float32:
        add_dequantized_(target, absmax, codes, blocksize)
        return
    wide = target.float()
    add_dequantized_(wide, absmax, codes, blocksize)
    target.copy_(wide)


def dequantize(absmax: torch.Tensor, codes: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``code[codes] * absmax`` as a new flat float32 tensor (bit-identical to bitsandbytes' CPU kernel)."""
    out = torch.zeros(codes.numel(), dtype=torch.float32)
    add_dequantized_(out, absmax, codes, blocksize)
    return out


def as_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor (a view when it is contiguous, no copy)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def encode_float(x: torch.Tensor, encoding: str, blocksize: int) -> Iterator[memoryview]:
    """Payload pieces of one float tensor for a full-snapshot encoding (fp32, bf16, int8)."""
    if encoding == "fp32":
        yield as_bytes(x.to("cpu", torch.float32))
    elif encoding in SERVING_DTYPES:
        yield as_bytes(x.to("cpu", SERVING_DTYPES[encoding]))
    elif encoding in ("int8", "int8-delta"):
        if x.numel() == 0:
            return
        absmax, codes = quantize_blockwise(x.to("cpu", torch.float32).reshape(-1).contiguous(), blocksize)
        yield as_bytes(absmax)
        yield as_bytes(codes)
    else:
        raise WeightsError(f"unknown encoding {encoding!r}")


def from_payload(buf: bytearray, dtype: torch.dtype, count: int) -> torch.Tensor:
    """A flat tensor over `buf` (no copy; the tensor keeps `buf` alive)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.bfloat16:  # numpy has no bfloat16: go through int16
        return torch.frombuffer(buf, dtype=torch.int16, count=count).view(torch.bfloat16)
    return torch.frombuffer(buf, dtype=dtype, count=count)


def split_int8(buf: bytearray, numel: int, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Payload bytes of one 8-bit tensor -> (absmax float32, codes uint8), both views of `buf`."""
    nblocks = -(-numel // blocksize)
    arr = np.frombuffer(buf, dtype=np.uint8)
    absmax = torch.from_numpy(arr[: 4 * nblocks].view(np.float32))
    codes = torch.from_numpy(arr[4 * nblocks :])
    return absmax, codes


def check_tensor(name: str, t: torch.Tensor, shape: list[int], dtype: torch.dtype) -> None:
    if list(t.shape) != shape or t.dtype != dtype:
        raise ParamMismatchError(
            f"{name}: expected shape {shape} dtype {dtype}, got shape {list(t.shape)} dtype {t.dtype}"
        )


class Chunker:
    """Cuts a stream of byte pieces into chunks of `size` bytes and digests each chunk."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = bytearray()
        self.chunks: list[bytes] = []

    def write(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if not self.buf and n - pos >= self.size:  # a whole chunk straight from the piece: one copy
                self.chunks.append(bytes(data[pos : pos + self.size]))
                pos += self.size
                continue
            take = min(n - pos, self.size - len(self.buf))
            self.buf += data[pos : pos + take]
            pos += take
            if len(self.buf) == self.size:
                self.chunks.append(bytes(self.buf))
                self.buf = bytearray()

    def finish(self) -> list[bytes]:
        if self.buf:
            self.chunks.append(bytes(self.buf))
            self.buf = bytearray()
        return self.chunks


class PayloadReader:
    """Reads a version's payload stream from its chunks, in order, without joining them."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.index = 0
        self.offset = 0

    def read(self, n: int) -> bytearray:
        out = bytearray(n)
        pos = 0
        while pos < n:
            chunk = self.store.get(self.index)
            take = min(n - pos, len(chunk) - self.offset)
            out[pos : pos + take] = memoryview(chunk)[self.offset : self.offset + take]
            pos += take
            self.offset += take
            if self.offset == len(chunk):
                self.index, self.offset = self.index + 1, 0
        return out
