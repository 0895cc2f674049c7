"""Weight codec: turns policy versions into manifests + chunks (publisher) and back into weights (receiver).

Owned here: `WeightEncoder` (configured by `config.EncodingConfig`), which keeps the error-feedback shadow
of an int8-delta stream and decides keyframes; `VersionAssembler`, which collects verified chunks of one
version and applies it, streaming chunk by chunk, only when every chunk is present. `PolicyWeights` and the model helpers
`named_tensors` / `load_into_model` live in `model_io`.
Called by trainer peers (encode after each optimizer epoch) and inference peers (assemble, apply, load),
with the networking layer moving manifests and chunks in between.
Pure ML: must not import hivemind or do any networking. Does not sign manifests (the caller signs with
`Manifest.sign`) and does not check who published one (the caller verifies the signature and trust first).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import (
    PATCH_ENCODINGS,
    BaseVersionError,
    ChunkInfo,
    ChunkStore,
    IncompleteVersionError,
    Manifest,
    NonFiniteError,
    ParamInfo,
    ParamMismatchError,
    WeightsError,
    payload_nbytes,
    sha256_hex,
)
from echo_p2p.weights.model_io import PolicyWeights
from echo_p2p.weights.patch import apply_patch_, decode_patch, diff16, encode_patch
from echo_p2p.weights.quant import (
    DTYPE_NAMES,
    SERVING_DTYPES,
    Chunker,
    PayloadReader,
    add_dequantized_state_,
    as_bytes,
    check_byteorder,
    check_tensor,
    decoded_dtype,
    dequantize,
    encode_float,
    from_payload,
    quantize_blockwise,
    split_int8,
)


@dataclass
class EncodedVersion:
    """One manifest (unsigned when the encoder returns it) and all of its chunks, ready to serve."""

    manifest: Manifest
    store: ChunkStore

    def get_chunk(self, index: int) -> bytes:
        return self.store.get(index)

    @property
    def is_keyframe(self) -> bool:
        return self.manifest.is_keyframe

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes


class WeightEncoder:
    """Publisher side: encodes successive policy versions of one trainer into manifests and chunks.

    fp32 / bf16 / int8: every version is one full snapshot. int8-delta: the encoder keeps a float32
    "shadow", the exact weights a receiver following the stream holds. Each version V is published as
    ``quantize(new - shadow)`` with ``base_version`` = the previous published version, and the shadow is
    advanced by the dequantized delta (error feedback), so quantization error never accumulates. When V
    crosses a multiple of ``keyframe_interval`` it also publishes the shadow itself as an exact fp32 snapshot
    (``base_version=None``): a newcomer starting there and following the deltas ends bit-identical to a
    peer that followed every delta. The first version an encoder publishes is a keyframe only. Every
    encoder instance is its own stream (`stream_id`); after an error the stream restarts with a keyframe.

    patch and auto: the shadow is in the serving dtype (bf16 or fp16), the weights receivers serve. Each
    version is a lossless ``bf16-patch`` / ``fp16-patch`` (the values whose bits changed;
    `echo_p2p.weights.patch`) after which the shadow is exactly ``new.to(serving dtype)``, or a keyframe
    alone when the patch would not be smaller. auto also considers an ``int8-delta`` against the 16-bit
    shadow (error feedback as above, rounded on both sides) and sends whichever of patch, int8 delta and
    keyframe is smallest for that version; the next patch then restores exactness. Keyframes (every
    ``keyframe_interval``) are ``bf16`` / ``fp16`` snapshots of the shadow.
    ``last_stats`` describes the latest version: what was chosen and what each option would have cost.
    """

    def __init__(
        self, config: EncodingConfig, *, run_id: str, publisher: str, publisher_key: bytes = b""
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.publisher = publisher
        self.publisher_key = publisher_key
        self._reset_stream()

    def _reset_stream(self) -> None:
        self.stream_id = uuid.uuid4().hex[:16]
        self._shadow: dict[str, torch.Tensor] | None = None
        self._infos: list[ParamInfo] | None = None
        self._last_keyframe: int | None = None
        self.last_version: int | None = None
        self.last_stats: dict[str, float | str] = {}

    def reset(self) -> None:
        """Forget the shadow and start a new stream: the next version is a keyframe only."""
        self._reset_stream()

    def encode(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        created_at: float | None = None,
    ) -> list[EncodedVersion]:
        """Encode version `version` of the weights; returns [delta] or [delta, keyframe] or [snapshot].

        `named_tensors` (e.g. `named_tensors(model)`) is read once and must not change during the call.
        Versions must increase. Raises `NonFiniteError` on NaN/inf and `ParamMismatchError` when the
        tensors differ in names, shapes or dtypes from the stream's previous version.
        """
        check_byteorder()
        items = [(name, t.detach()) for name, t in named_tensors]
        infos = [_param_info(name, t) for name, t in items]
        if self.last_version is not None and version <= self.last_version:
            raise WeightsError(
                f"version {version} is not after the last published version {self.last_version}"
            )
        for name, t in items:
            if t.is_floating_point() and not _all_finite(t):
                raise NonFiniteError(f"{name} has NaN or inf values")
        created = time.time() if created_at is None else float(created_at)
        cfg = self.config
        if cfg.encoding in ("fp32", "bf16", "int8"):
            pieces = (p for _, t in items for p in _snapshot_pieces(t, cfg.encoding, cfg.blocksize))
            out = [self._build(infos, version, None, cfg.encoding, pieces, created)]
            self.last_version = version
            return out
        if self._infos is not None and infos != self._infos:
            raise ParamMismatchError("tensor names, shapes or dtypes changed within a stream")
        if cfg.encoding in ("patch", "auto"):
            try:
                out = self._encode_patch_stream(items, infos, version, created)
            except BaseException:
                self._reset_stream()
                raise
            self._infos = infos
            self.last_version = version
            return out
        try:
            out = []
            if self._shadow is None:
                self._shadow = {name: _state_copy(t, torch.float32) for name, t in items}
                keyframe = True
            else:
                pieces = self._delta_pieces(items)
                out.append(self._build(infos, version, self.last_version, "int8-delta", pieces, created))
                assert self._last_keyframe is not None
                keyframe = version // cfg.keyframe_interval > self._last_keyframe // cfg.keyframe_interval
            if keyframe:
                pieces = (
                    p for t in self._shadow.values() for p in _snapshot_pieces(t, "fp32", cfg.blocksize)
                )
                out.append(self._build(infos, version, None, "fp32", pieces, created))
                self._last_keyframe = version
        except BaseException:
            self._reset_stream()  # the shadow may be half-advanced: receivers can no longer match it
            raise
        self._infos = infos
        self.last_version = version
        return out

    def _encode_patch_stream(
        self, items: list[tuple[str, torch.Tensor]], infos: list[ParamInfo], version: int, created: float
    ) -> list[EncodedVersion]:
        """A patch / auto version: [update] or [update, keyframe] or [keyframe]; see the class doc."""
        cfg = self.config
        t0 = time.perf_counter()
        serving = cfg.serving_dtype
        new = {name: _state_copy(t, SERVING_DTYPES[serving]) for name, t in items}
        for name, t in new.items():  # finite in fp32 but past fp16's range
            if t.is_floating_point() and not _all_finite(t):
                raise NonFiniteError(f"{name} has values beyond the range of {serving}")
        kinds = {"keyframe": sum(payload_nbytes(i, serving, cfg.blocksize) for i in infos)}
        out: list[EncodedVersion] = []
        stats: dict[str, float | str] = {"numel": float(sum(i.numel for i in infos if i.is_float))}
        keyframe = self._shadow is None
        if self._shadow is not None:
            shadow = self._shadow
            patches = {i.name: diff16(shadow[i.name], new[i.name]) for i in infos if i.is_float}
            raw = {i.name: as_bytes(new[i.name]) for i in infos if not i.is_float}
            patch = encode_patch(infos, patches, raw)
            kinds["patch"] = len(patch)
            stats["changed"] = float(sum(p.count for p in patches.values() if p is not None))
            if cfg.encoding == "auto":
                kinds["int8-delta"] = sum(payload_nbytes(i, "int8-delta", cfg.blocksize) for i in infos)
            choice = min(kinds, key=lambda k: (kinds[k], k != "patch"))
            stats["kind"] = choice
            if choice == "patch":
                memo = [memoryview(patch)]
                out.append(self._build(infos, version, self.last_version, f"{serving}-patch", memo, created))
                self._shadow = new
            elif choice == "int8-delta":
                pieces = self._delta_pieces(items)
                out.append(self._build(infos, version, self.last_version, "int8-delta", pieces, created))
            else:
                keyframe = True
            if not keyframe:
                assert self._last_keyframe is not None
                keyframe = version // cfg.keyframe_interval > self._last_keyframe // cfg.keyframe_interval
        else:
            stats["kind"] = "keyframe"
        if keyframe:
            if stats["kind"] == "keyframe":
                self._shadow = new
            pieces = (p for t in self._shadow.values() for p in _snapshot_pieces(t, serving, cfg.blocksize))
            out.append(self._build(infos, version, None, serving, pieces, created))
            self._last_keyframe = version
        stats.update({f"{k}_bytes": float(v) for k, v in kinds.items()}, encode_s=time.perf_counter() - t0)
        self.last_stats = stats
        return out

    def _delta_pieces(self, items: list[tuple[str, torch.Tensor]]) -> Iterator[memoryview]:
        """Payload of a delta version; advances the shadow param by param as the pieces are consumed."""
        assert self._shadow is not None
        blocksize = self.config.blocksize
        for name, t in items:
            ref = self._shadow[name].view(-1)
            if not t.is_floating_point():  # raw, full value
                ref.copy_(t.reshape(-1))
                yield as_bytes(ref)
                continue
            if t.numel() == 0:
                continue
            new = t.to("cpu", torch.float32).reshape(-1)
            absmax, codes = quantize_blockwise(new - ref.float(), blocksize)
            yield as_bytes(absmax)
            yield as_bytes(codes)
            if self.config.error_feedback:
                add_dequantized_state_(ref, absmax, codes, blocksize)
            else:
                ref.copy_(new)

    def _build(
        self,
        infos: list[ParamInfo],
        version: int,
        base_version: int | None,
        encoding: str,
        pieces: Iterable[memoryview],
        created_at: float,
    ) -> EncodedVersion:
        chunker = Chunker(self.config.chunk_size)
        for piece in pieces:
            chunker.write(piece)
        chunks = chunker.finish()
        manifest = Manifest(
            run_id=self.run_id,
            version=version,
            base_version=base_version,
            stream_id=self.stream_id,
            encoding=encoding,
            blocksize=self.config.blocksize,
            chunk_size=self.config.chunk_size,
            params=infos,
            chunks=[ChunkInfo(index=i, size=len(c), sha256=sha256_hex(c)) for i, c in enumerate(chunks)],
            total_bytes=sum(len(c) for c in chunks),
            publisher=self.publisher,
            publisher_key=self.publisher_key,
            created_at=created_at,
        )
        return EncodedVersion(manifest=manifest, store=ChunkStore.complete(manifest, chunks))


class VersionAssembler:
    """Receiver side: the chunks of one version, verified on arrival, applied once all are present.

    Create it only for a manifest whose signature and publisher the caller has already checked.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.store = ChunkStore(manifest)

    def add_chunk(self, index: int, data: bytes | bytearray | memoryview) -> bool:
        """Verify and keep chunk `index` (True if new). Raises a `ChunkError` subclass and keeps nothing."""
        return self.store.put(index, data)

    def missing(self) -> list[int]:
        return self.store.missing()

    def is_complete(self) -> bool:
        return self.store.is_complete()

    def apply(self, current: PolicyWeights | None = None, *, inplace: bool = False) -> PolicyWeights:
        """Decode the version, streaming through the chunks in order, and return its weights.

        A delta needs `current` at ``manifest.base_version`` of the same stream (`BaseVersionError`
        otherwise). Names, shapes and dtypes of `current` are checked before anything is decoded
        (`ParamMismatchError`). With ``inplace=False`` (default) `current` is left untouched and new
        tensors are returned (one staging copy); with ``inplace=True`` `current`'s tensors are updated and
        reused (no second copy; the caller must make sure nobody reads them meanwhile).
        """
        m = self.manifest
        if not self.is_complete():
            raise IncompleteVersionError(f"version {m.version}: {len(self.missing())} chunks missing")
        check_byteorder()
        is_delta = m.base_version is not None
        if is_delta:
            if current is None:
                raise BaseVersionError(
                    f"version {m.version} is a delta: it needs the weights of {m.base_version}"
                )
            if current.stream_id != m.stream_id or current.version != m.base_version:
                raise BaseVersionError(
                    f"delta {m.version} applies to version {m.base_version} of stream {m.stream_id}, "
                    f"not to version {current.version} of stream {current.stream_id}"
                )
        use_current = current is not None and (is_delta or inplace)
        if use_current:
            assert current is not None
            self._check_current(current, contiguous=inplace)
        if m.encoding in PATCH_ENCODINGS:
            assert current is not None
            return self._apply_patch(current, inplace)
        reader = PayloadReader(self.store)
        out: dict[str, torch.Tensor] = {}
        bs = m.blocksize
        for info in m.params:
            buf = reader.read(payload_nbytes(info, m.encoding, bs))
            dtype, n = decoded_dtype(info, m.encoding), info.numel
            if not info.is_float or m.encoding == "fp32" or m.encoding in SERVING_DTYPES:
                new = from_payload(buf, dtype, n)
            elif is_delta:
                assert current is not None
                base = current.tensors[info.name]
                target = base if inplace else base.detach().clone(memory_format=torch.contiguous_format)
                if n:
                    absmax, codes = split_int8(buf, n, bs)
                    add_dequantized_state_(target.view(-1), absmax, codes, bs)
                out[info.name] = target
                continue
            else:
                new = dequantize(*split_int8(buf, n, bs), bs) if n else torch.empty(0, dtype=dtype)
            new = new.view(info.shape)
            if use_current and inplace:
                assert current is not None
                current.tensors[info.name].copy_(new)
                out[info.name] = current.tensors[info.name]
            else:
                out[info.name] = new
        return PolicyWeights(version=m.version, stream_id=m.stream_id, tensors=out)

    def _apply_patch(self, current: PolicyWeights, inplace: bool) -> PolicyWeights:
        """A patch on `current` (already checked): parsed and validated whole before anything changes."""
        m = self.manifest
        payload = b"".join(self.store.get(i) for i in range(m.num_chunks))
        patches, raws = decode_patch(payload, m.params)
        out: dict[str, torch.Tensor] = {}
        changed: dict[str, torch.Tensor | None] = {}
        for info in m.params:
            base = current.tensors[info.name]
            patch = patches.get(info.name)
            if info.is_float and patch is None:
                out[info.name] = base
                continue
            target = base if inplace else base.detach().clone(memory_format=torch.contiguous_format)
            if info.is_float:
                assert patch is not None
                apply_patch_(target, patch)
                changed[info.name] = None if patch.positions is None else torch.from_numpy(patch.positions)
            else:
                target.view(-1).copy_(from_payload(bytearray(raws[info.name]), target.dtype, info.numel))
                changed[info.name] = None
            out[info.name] = target
        return PolicyWeights(m.version, m.stream_id, out, changed=changed, changed_since=current.version)

    def _check_current(self, current: PolicyWeights, *, contiguous: bool) -> None:
        m = self.manifest
        names = [p.name for p in m.params]
        if set(current.tensors) != set(names):
            missing = sorted(set(names) - set(current.tensors))[:5]
            extra = sorted(set(current.tensors) - set(names))[:5]
            raise ParamMismatchError(
                f"current weights differ from the manifest: missing {missing}, extra {extra}"
            )
        for info in m.params:
            t = current.tensors[info.name]
            dtype = decoded_dtype(info, m.encoding)
            if m.encoding == "int8-delta" and info.is_float and t.dtype in SERVING_DTYPES.values():
                dtype = t.dtype  # the int8 delta of an auto stream: its state is 16-bit
            check_tensor(info.name, t, info.shape, dtype)
            if (contiguous or m.encoding in PATCH_ENCODINGS) and not t.is_contiguous():
                raise ParamMismatchError(f"{info.name}: in-place apply needs contiguous tensors")


def merge_changes(
    first: dict[str, torch.Tensor | None] | None, then: dict[str, torch.Tensor | None] | None
) -> dict[str, torch.Tensor | None] | None:
    """The changes of two successive updates as one (``PolicyWeights.changed`` convention): the union of
    the positions per tensor; None (unknown: everything) if either is None."""
    if first is None or then is None:
        return None
    out = dict(first)
    for name, positions in then.items():
        if name not in out:
            out[name] = positions
        elif out[name] is None or positions is None:
            out[name] = None
        else:
            out[name] = torch.unique(torch.cat([out[name], positions]))  # type: ignore[list-item]
    return out


def _param_info(name: str, t: torch.Tensor) -> ParamInfo:
    if t.dtype not in DTYPE_NAMES:
        raise ParamMismatchError(f"{name}: dtype {t.dtype} cannot be published")
    return ParamInfo(name=name, shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype])


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t`. A float32 sum is finite when every value is (one cheap pass, ~10x faster than
    ``isfinite``); only when it is not (NaN, inf, or an overflow of huge values) is every value checked."""
    return math.isfinite(float(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def _state_copy(t: torch.Tensor, float_dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU copy: `float_dtype` for float tensors (the shadow's precision), own dtype otherwise."""
    dtype = float_dtype if t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=dtype).copy_(t)


def _snapshot_pieces(t: torch.Tensor, encoding: str, blocksize: int) -> Iterator[memoryview]:
    if not t.is_floating_point():
        yield as_bytes(t.to("cpu"))
    else:
        yield from encode_float(t, encoding, blocksize)
