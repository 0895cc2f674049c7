"""Fuzz: the weights transport on both ends. The servicer's RPCs (``rpc_get_manifests``, ``rpc_have``,
``rpc_get_chunks``) called directly with any request; the receiver's chunk-stream reader (``ChunkStream``)
fed any frames; the receiver's manifest check (``ManifestCheck.check``) given any bytes for a manifest.
Every request is answered (or refused with a known error) within its limits, every frame is a part, a
clean end or a named refusal, and only the signed manifest passes; nothing raises anything else or hangs."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hypothesis import event, given
from hypothesis import strategies as st

from echo_p2p.guard.trust import TrustedTrainers
from echo_p2p.net.records import ManifestRef, PolicyRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.fetch.config import FetchStats
from echo_p2p.transport.weights.fetch.manifests import ManifestCheck
from echo_p2p.transport.weights.service import ServedVersion, ServiceLimits, WeightLibrary, WeightsServicer
from echo_p2p.transport.weights.stream import ChunkStream, RemoteError, StreamViolation
from echo_p2p.weights.codec import WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import ChunkStore
from tests.unit.fuzz.fuzzing import FUZZ, broken, context, hostile_bytes, packed, peak_allocated, run

pytestmark = pytest.mark.timeout(120)
LIMITS = ServiceLimits(part_size=256, max_chunks_per_request=8, max_digests_per_request=4)
CHUNK_ERRORS = {"bad_request", "not_held", "too_many_chunks", "too_many_bytes", "busy"}
UINT32 = st.integers(0, 2**32 - 1)


@pytest.fixture(scope="module")
def library(identity):
    import torch

    encoder = WeightEncoder(
        EncodingConfig(encoding="fp32", chunk_size=400),
        run_id="fuzz",
        publisher=identity.peer_id,
        publisher_key=identity.public_key_bytes(),
    )
    (version,) = encoder.encode([("w", torch.arange(1000, dtype=torch.float32))], 0)  # 10 chunks
    version.manifest.sign(identity.private_key.sign)
    complete = ServedVersion.of(version.manifest, version.store)
    library = WeightLibrary()
    library.add(complete)
    (other,) = encoder.encode([("w", torch.ones(1000))], 1)
    partial = ServedVersion.of(other.manifest, ChunkStore(other.manifest))  # being fetched: chunks 0-4 held
    for i in range(5):
        partial.store.put(i, other.store.get(i))
    library.add(partial)
    return library


def digests(library: WeightLibrary):
    held = [bytes.fromhex(e.digest) for e in library.entries()]
    return st.sampled_from(held) | st.binary(max_size=40)


@FUZZ
@given(data=st.data())
def test_manifest_requests_are_answered_within_the_limits(loop, library, data):
    servicer = WeightsServicer(library, LIMITS)
    request = weights_pb2.ManifestsRequest(
        digests=data.draw(st.lists(digests(library), max_size=6)),
        stream_id=data.draw(st.text(max_size=80)),
        min_version=data.draw(st.integers(-(2**63), 2**63 - 1)),
    )
    response = run(loop, servicer.rpc_get_manifests(request, context()))
    if len(request.digests) > LIMITS.max_digests_per_request:
        assert response.error == "too_many_digests" and not response.manifests
        return
    assert not response.error
    raws = {e.raw for e in library.entries()}
    assert all(raw in raws for raw in response.manifests)
    assert sum(len(m) for m in response.manifests) <= LIMITS.max_manifests_response_bytes


@FUZZ
@given(data=st.data())
def test_have_requests_are_answered_for_exactly_the_manifests_held(loop, library, data):
    digest = data.draw(digests(library))
    response = run(
        loop, WeightsServicer(library, LIMITS).rpc_have(weights_pb2.HaveRequest(digest=digest), context())
    )
    entry = library.get(digest.hex()) if len(digest) == 32 else None
    assert response.held == (entry is not None)
    if entry is not None:
        assert response.num_chunks == entry.manifest.num_chunks
        assert len(response.bitmap) == (entry.manifest.num_chunks + 7) // 8


@st.composite
def chunk_requests(draw, library: WeightLibrary) -> weights_pb2.ChunksRequest:
    """A request for one of the held manifests with any of its fields replaced by what a stranger sends."""
    entry = draw(st.sampled_from(library.entries()))
    m = entry.manifest
    fields = dict(
        stream_id=m.stream_id, version=m.version, digest=bytes.fromhex(entry.digest), indices=[0, 1], pick=0
    )
    hostile = dict(
        stream_id=st.text(max_size=80),
        version=st.integers(-(2**63), 2**63 - 1),
        digest=st.binary(max_size=40),
        indices=st.lists(st.integers(0, 9), max_size=10, unique=True)
        | st.lists(st.integers(0, 12) | UINT32, max_size=12),
        pick=st.sampled_from([1, 3, 64]) | UINT32,
        fresh_for=st.floats(allow_nan=True, allow_infinity=True),
    )
    for name, strategy in hostile.items():
        if draw(st.integers(0, 2)) == 0:
            fields[name] = draw(strategy)
    return weights_pb2.ChunksRequest(**fields)


@FUZZ
@given(data=st.data())
def test_chunk_requests_get_their_chunks_or_one_known_error(loop, library, data):
    request = data.draw(chunk_requests(library))
    servicer = WeightsServicer(library, LIMITS)

    async def collect():
        return [p async for p in servicer.rpc_get_chunks(request, context())]

    parts = run(loop, collect())
    event(parts[0].error if parts and parts[0].error else f"{len({p.index for p in parts})} chunks")
    if parts and parts[0].error:
        assert len(parts) == 1 and parts[0].error in CHUNK_ERRORS, parts[0].error
        return
    entry = library.get(bytes(request.digest).hex())
    asked = list(request.indices)
    sizes: dict[int, int] = {}
    for part in parts:
        assert part.index in asked and not part.error
        if part.missing:
            assert not entry.store.has(part.index) and part.index not in sizes
            continue
        assert part.offset == sizes.get(part.index, 0) and 0 < len(part.data) <= LIMITS.part_size
        assert part.chunk_size == entry.manifest.chunks[part.index].size
        sizes[part.index] = part.offset + len(part.data)
    assert all(sizes[i] == entry.manifest.chunks[i].size for i in sizes)  # every chunk begun is whole
    assert len({p.index for p in parts}) <= (request.pick or len(asked))
    assert servicer._streams_total == 0  # the stream slot is given back


# ---- the receiver's side ---------------------------------------------------------------------------------
class _Writer:
    def close(self) -> None:
        pass


frames = st.builds(
    lambda marker, body, length: marker + (len(body) if length is None else length).to_bytes(8, "big") + body,
    st.sampled_from([P2P.MESSAGE_MARKER, P2P.ERROR_MARKER]) | st.binary(min_size=1, max_size=1),
    st.binary(max_size=300)
    | st.builds(
        lambda p: p.SerializeToString(),
        st.builds(
            weights_pb2.ChunkPart,
            index=UINT32,
            offset=st.integers(0, 2**64 - 1),
            data=st.binary(max_size=300),
            missing=st.booleans(),
            error=st.text(max_size=50),
        ),
    ),
    st.none() | st.integers(0, 2**64 - 1),
)


@FUZZ
@given(st.lists(frames, max_size=5), st.binary(max_size=12))
def test_the_chunk_stream_reader_turns_any_frames_into_parts_or_a_named_refusal(loop, frames, tail):
    reader = asyncio.StreamReader(loop=loop)  # not the thread's current loop: there may be none
    reader.feed_data(b"".join(frames) + tail)
    reader.feed_eof()
    stream = ChunkStream(reader, _Writer(), max_frame=LIMITS.part_size + 256)

    async def read_all():
        parts = []
        for _ in range(len(frames) + 2):
            try:
                part = await stream.next(5)
            except (StreamViolation, RemoteError, asyncio.IncompleteReadError) as exc:
                return parts, exc
            if part is None:
                return parts, None
            parts.append(part)
        raise AssertionError("more parts than frames")

    (parts, refusal), peak = peak_allocated(lambda: run(loop, read_all()))
    event(type(refusal).__name__ if refusal is not None else f"{len(parts)} parts")
    assert all(isinstance(p, weights_pb2.ChunkPart) for p in parts)
    if isinstance(refusal, StreamViolation):
        assert refusal.reason in {"oversized", "malformed_part"}
    assert peak < 1 << 20  # a frame claiming 2^64 bytes is refused before anything is read


@pytest.fixture(scope="module")
def manifest_check(identity, library):
    """A ``ManifestCheck`` trusting the publisher of the signed manifest of version 0, and that manifest."""
    entry = next(e for e in library.entries() if e.manifest.version == 0)
    f = ManifestCheck(TrustedTrainers.from_keys([identity.public_key_bytes()]), "fuzz", FetchStats())
    m = entry.manifest
    ref = ManifestRef(
        version=m.version,
        digest=entry.digest,
        encoding=m.encoding,
        total_bytes=m.total_bytes,
        num_chunks=m.num_chunks,
    )
    record = PolicyRecord(peer_id=identity.peer_id, stream_id=m.stream_id, version=0, manifests=[ref])
    return f, entry, ref, record


REFUSALS = {
    "malformed_manifest",
    "wrong_run",
    "bad_publisher_key",
    "publisher_key_mismatch",
    "untrusted_publisher",
    "bad_signature",
    "manifest_record_mismatch",
}


def test_the_signed_manifest_passes_the_check(manifest_check):
    f, entry, ref, record = manifest_check
    assert f.check(entry.raw, ref, record, "QmPeer") is not None


@FUZZ
@given(data=st.data())
def test_any_other_bytes_for_a_manifest_are_refused_with_a_reason(manifest_check, data):
    f, entry, ref, record = manifest_check
    honest = msgpack_dict(entry.raw)
    raw = data.draw(hostile_bytes(entry.raw, extra=st.builds(packed, broken(honest))))
    before = sum(f.stats.rejected.values())
    manifest = f.check(raw, ref, record, "QmPeer")
    event("passed" if manifest is not None else "refused")
    if manifest is not None:  # only the signed manifest (re-encoded the same way) may pass
        assert manifest.to_bytes() == entry.raw
        return
    assert sum(f.stats.rejected.values()) == before + 1
    assert set(f.stats.rejected) <= REFUSALS


def msgpack_dict(raw: bytes) -> dict:
    import msgpack

    return msgpack.unpackb(raw, raw=False)
