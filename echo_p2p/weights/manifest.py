"""Policy-version manifests and verified chunk storage: the wire side of the weight encoding.

Owned here: the typed errors of the weights package, the `Manifest` schema (one policy version: its
parameters, encoding, chunk sizes and sha256 digests, publisher, signature), its single msgpack serializer,
its canonical signing payload, the byte layout of each parameter's payload (so a manifest can be checked
for self-consistency before any chunk is fetched), and `ChunkStore`, which holds the chunks of one version
and admits a chunk only if its size and digest match the manifest.
Called by the codec (`echo_p2p.weights.codec`), which builds and consumes manifests, and by the networking
layer, which publishes manifests on the DHT, streams chunks and serves them from a `ChunkStore`.
Must not import torch or hivemind: the networking layer imports this module on its own. Signing and
verification take plain callables, so the key type (hivemind's RSA keys) stays outside.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

Encoding = Literal["fp32", "bf16", "fp16", "int8", "int8-delta", "bf16-patch", "fp16-patch"]
#: Lossless patches of a 16-bit serving dtype (`echo_p2p.weights.patch`): compressed, so of no fixed size.
PATCH_ENCODINGS = ("bf16-patch", "fp16-patch")
#: Encodings of a version that applies to the weights of its ``base_version`` (the others are snapshots).
DELTA_ENCODINGS = ("int8-delta", *PATCH_ENCODINGS)

#: Largest chunk accepted from anyone (bytes).
MAX_CHUNK_SIZE = 64 * 1024 * 1024
#: Default chunk size (bytes).
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
#: Largest version payload accepted (bytes): 1 TiB, a bound against absurd manifests.
MAX_TOTAL_BYTES = 1 << 40
#: Block sizes bitsandbytes' blockwise 8-bit quantization supports.
ALLOWED_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
#: Floating dtypes: encoded per the manifest's encoding. Value: bytes per element as held by the publisher.
FLOAT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Other dtypes (integer and bool buffers): always sent raw, full value, in every encoding.
RAW_DTYPES = {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
ALLOWED_DTYPES = {**FLOAT_DTYPES, **RAW_DTYPES}

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_SIGNING_DOMAIN = b"echo_p2p/weights/manifest/v1\x00"


class WeightsError(ValueError):
    """Base class of every error the weights package raises on bad data or misuse."""


class ChunkError(WeightsError):
    """A chunk was rejected; it was not stored."""


class ChunkIndexError(ChunkError):
    """The chunk index is not in the manifest."""


class ChunkSizeError(ChunkError):
    """The chunk has another size than the manifest says (e.g. truncated)."""


class ChunkDigestError(ChunkError):
    """The chunk's sha256 differs from the manifest's digest (corrupted or forged)."""


class IncompleteVersionError(WeightsError):
    """A version was applied before all of its chunks were present."""


class BaseVersionError(WeightsError):
    """A delta was applied to weights that are not its base (wrong version, stream, or none at all)."""


class ParamMismatchError(WeightsError):
    """Parameter names, shapes or dtypes differ from what the manifest or model expects."""


class NonFiniteError(WeightsError):
    """A publisher tried to encode weights containing NaN or inf."""


class ParamInfo(BaseModel):
    """One tensor of the policy, in publication order."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=512, description="State-dict name of the tensor")
    shape: list[int] = Field(max_length=16, description="Tensor shape; every dimension >= 0")
    dtype: str = Field(
        description="Dtype the publisher holds the tensor in (torch name, no 'torch.'), from ALLOWED_DTYPES"
    )

    @model_validator(mode="after")
    def _check(self) -> ParamInfo:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape} of {self.name!r}")
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} of {self.name!r} is not allowed")
        return self

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


class ChunkInfo(BaseModel):
    """One chunk of a version's payload byte stream."""

    model_config = ConfigDict(extra="ignore", strict=True)

    index: int = Field(ge=0, description="Position of the chunk in the payload stream, 0..n-1")
    size: int = Field(gt=0, le=MAX_CHUNK_SIZE, description="Chunk length in bytes")
    sha256: str = Field(description="Lower-case hex sha256 digest of the chunk's bytes (64 characters)")

    @model_validator(mode="after")
    def _check(self) -> ChunkInfo:
        if not _SHA256_HEX.match(self.sha256):
            raise ValueError(f"chunk {self.index}: sha256 must be 64 lower-case hex characters")
        return self


def payload_nbytes(param: ParamInfo, encoding: str, blocksize: int) -> int:
    """Bytes that `param` takes in the payload stream of a version with this encoding.

    Layout per parameter (little-endian, parameters back to back in manifest order, no padding):
    non-float dtypes: raw bytes of the value in its own dtype, in every encoding (deltas replace them);
    ``fp32``: float32 values; ``bf16`` / ``fp16``: bfloat16 / float16 values; ``int8`` / ``int8-delta``: ``ceil(numel /
    blocksize)`` float32 absmax values, then ``numel`` uint8 codes of bitsandbytes' signed dynamic map.
    """
    n = param.numel
    if not param.is_float:
        return raw_nbytes(param)
    if encoding in PATCH_ENCODINGS:
        raise WeightsError(f"a {encoding} has no fixed size: see patch_raw_bound")
    if encoding == "fp32":
        return 4 * n
    if encoding in ("bf16", "fp16"):
        return 2 * n
    return 4 * (-(-n // blocksize)) + n


def raw_nbytes(param: ParamInfo) -> int:
    """Bytes of a non-float parameter's value, sent raw in every encoding."""
    return param.numel * RAW_DTYPES[param.dtype]


def patch_raw_bound(params: Iterable[ParamInfo]) -> int:
    """Largest decompressed patch payload (``bf16-patch`` / ``fp16-patch``) (layout in `echo_p2p.weights.patch`): the raw non-float
    values, and per float tensor a mode byte plus the larger of its dense form (2 bytes a value) and its
    sparse form (an 8-byte count, then 6 bytes a value)."""
    return sum(9 + 6 * p.numel if p.is_float else raw_nbytes(p) for p in params)


def patch_payload_bound(params: Iterable[ParamInfo]) -> int:
    """Largest compressed patch payload: zstandard's worst case for `patch_raw_bound` bytes."""
    raw = patch_raw_bound(params)
    return raw + (raw >> 8) + (1 << 17)


class Manifest(BaseModel):
    """One policy version as a publisher announces it: what the chunks hold and how to check them.

    A full snapshot has ``base_version=None`` (encodings fp32, bf16, int8); a delta has encoding
    ``int8-delta``, ``bf16-patch`` or ``fp16-patch`` and applies only to the exact weights of ``base_version`` from the same
    ``stream_id``.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    protocol: Literal[1] = Field(default=1, description="Wire protocol version of the manifest")
    run_id: str = Field(min_length=1, max_length=256, description="Run this policy belongs to")
    version: int = Field(ge=0, description="Policy version (the trainers' optimizer epoch)")
    base_version: int | None = Field(
        default=None, description="Version a delta applies to; None for a full snapshot (keyframe)"
    )
    stream_id: str = Field(
        min_length=1,
        max_length=64,
        description="Id of the publisher's encoder instance; a delta applies only to weights of this stream",
    )
    encoding: Encoding = Field(description="Payload encoding of floating-point tensors")
    blocksize: int = Field(default=4096, description="Elements per absmax block of the 8-bit encodings")
    chunk_size: int = Field(
        gt=0,
        le=MAX_CHUNK_SIZE,
        description="Nominal chunk size: every chunk but the last has exactly this size",
    )
    params: list[ParamInfo] = Field(description="Tensors in payload order")
    chunks: list[ChunkInfo] = Field(description="Chunks in payload order")
    total_bytes: int = Field(ge=0, le=MAX_TOTAL_BYTES, description="Payload length: sum of the chunk sizes")
    publisher: str = Field(min_length=1, max_length=256, description="Peer id (base58) of the publisher")
    publisher_key: bytes = Field(
        default=b"", max_length=4096, description="Publisher's public key, opaque here; checked by the caller"
    )
    created_at: float = Field(description="Publisher's wall-clock time when the version was encoded")
    signature: bytes = Field(
        default=b"", max_length=4096, description="Signature of signing_payload() by the publisher's key"
    )

    # Fields of a newer protocol that this code does not know: kept so that they stay covered by the
    # signature and survive a relay (to_bytes).
    _unknown: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        if self.base_version is not None:
            if not 0 <= self.base_version < self.version:
                raise ValueError(f"base_version {self.base_version} must be in [0, version={self.version})")
            if self.encoding not in DELTA_ENCODINGS:
                raise ValueError(f"encoding {self.encoding} is a full snapshot but base_version is set")
        elif self.encoding in DELTA_ENCODINGS:
            raise ValueError(f"an {self.encoding} manifest needs a base_version")
        if self.blocksize not in ALLOWED_BLOCKSIZES:
            raise ValueError(f"blocksize {self.blocksize} not in {ALLOWED_BLOCKSIZES}")
        if len({p.name for p in self.params}) != len(self.params):
            raise ValueError("duplicate parameter names")
        for i, chunk in enumerate(self.chunks):
            if chunk.index != i:
                raise ValueError(f"chunk {i} has index {chunk.index}: chunks must be listed 0..n-1 in order")
            if chunk.size > self.chunk_size or (i < len(self.chunks) - 1 and chunk.size != self.chunk_size):
                raise ValueError(f"chunk {i} has size {chunk.size}; expected chunk_size {self.chunk_size}")
        if sum(c.size for c in self.chunks) != self.total_bytes:
            raise ValueError("total_bytes differs from the sum of the chunk sizes")
        if self.encoding in PATCH_ENCODINGS:  # compressed: only bounded
            if self.total_bytes > patch_payload_bound(self.params):
                raise ValueError(f"a patch of these params cannot take {self.total_bytes} bytes")
        else:
            expected = sum(payload_nbytes(p, self.encoding, self.blocksize) for p in self.params)
            if expected != self.total_bytes:
                raise ValueError(
                    f"params need {expected} payload bytes but total_bytes is {self.total_bytes}"
                )
        if not math.isfinite(self.created_at):
            raise ValueError("created_at must be finite")
        return self

    @property
    def is_keyframe(self) -> bool:
        """True for a full snapshot (no base version)."""
        return self.base_version is None

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def _wire_dict(self) -> dict[str, Any]:
        return {**self._unknown, **self.model_dump(mode="python")}

    def signing_payload(self) -> bytes:
        """Canonical bytes of every field but the signature (unknown fields of newer peers included)."""
        body = self._wire_dict()
        body.pop("signature", None)
        return _SIGNING_DOMAIN + msgpack.packb(_canonical(body), use_bin_type=True)

    def sign(self, signer: Callable[[bytes], bytes]) -> Manifest:
        """Set ``signature = signer(signing_payload())``; returns self."""
        self.signature = bytes(signer(self.signing_payload()))
        return self

    def verify(self, verifier: Callable[[bytes, bytes], bool]) -> bool:
        """``verifier(payload, signature)``; False when unsigned or when the verifier raises."""
        if not self.signature:
            return False
        try:
            return bool(verifier(self.signing_payload(), self.signature))
        except Exception:  # a verifier choking on garbage is a failed verification
            return False

    def to_bytes(self) -> bytes:
        return msgpack.packb(_canonical(self._wire_dict()), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse untrusted bytes; raises ``ValueError`` (pydantic's ``ValidationError`` too) on bad input."""
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"not a msgpack record: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError("manifest must be a map")
        try:
            manifest = cls.model_validate(obj)
        except ValueError:
            raise
        except Exception as exc:  # e.g. RecursionError or TypeError on pathological input
            raise ValueError(f"malformed manifest: {exc!r}") from exc
        manifest._unknown = {k: v for k, v in obj.items() if k not in cls.model_fields}
        return manifest


def _canonical(obj: Any) -> Any:
    """Maps with sorted keys, recursively, so that msgpack output is deterministic."""
    if isinstance(obj, dict):
        return {k: _canonical(obj[k]) for k in sorted(obj, key=str)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class ChunkStore:
    """The chunks of one version, each admitted only when its size and sha256 match the manifest.

    A receiver fills it chunk by chunk (any order, from any provider); a publisher or a receiver that
    holds every chunk serves them with `get`.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._chunks: dict[int, bytes] = {}

    @classmethod
    def complete(cls, manifest: Manifest, chunks: Iterable[bytes]) -> ChunkStore:
        """A full store from chunks the caller made itself (sizes checked, digests trusted)."""
        store = cls(manifest)
        for index, data in enumerate(chunks):
            store._check_index_and_size(index, data)
            store._chunks[index] = bytes(data)
        if not store.is_complete():
            raise ChunkError(f"{len(store._chunks)} chunks given, manifest lists {manifest.num_chunks}")
        return store

    def _check_index_and_size(self, index: int, data: bytes | bytearray | memoryview) -> None:
        if not 0 <= index < self.manifest.num_chunks:
            raise ChunkIndexError(f"chunk index {index} not in [0, {self.manifest.num_chunks})")
        expected = self.manifest.chunks[index].size
        if len(data) != expected:
            raise ChunkSizeError(f"chunk {index} has {len(data)} bytes, manifest says {expected}")

    def put(self, index: int, data: bytes | bytearray | memoryview) -> bool:
        """Verify and store chunk `index`; True if newly stored, False if it was already present.

        Raises `ChunkIndexError`, `ChunkSizeError` or `ChunkDigestError` without storing anything.
        """
        self._check_index_and_size(index, data)
        if index in self._chunks:
            return False
        if sha256_hex(data) != self.manifest.chunks[index].sha256:
            raise ChunkDigestError(f"chunk {index}: sha256 mismatch")
        self._chunks[index] = bytes(data)
        return True

    def get(self, index: int) -> bytes:
        """The verified bytes of chunk `index`; `KeyError` if not held."""
        return self._chunks[index]

    def has(self, index: int) -> bool:
        return index in self._chunks

    def missing(self) -> list[int]:
        return [i for i in range(self.manifest.num_chunks) if i not in self._chunks]

    def is_complete(self) -> bool:
        return len(self._chunks) == self.manifest.num_chunks

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(len(c) for c in self._chunks.values())

    def __len__(self) -> int:
        return len(self._chunks)
