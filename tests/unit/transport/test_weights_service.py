"""The weights servicer's answers and limits, and the client's frame reader — called directly, no network."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.p2pd_pb2 import RPCError

from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.service import (
    ServedVersion,
    ServiceLimits,
    WeightLibrary,
    WeightsServicer,
    bitmap_indices,
)
from echo_p2p.transport.weights.stream import ChunkStream, RemoteError, StreamViolation
from echo_p2p.weights.codec import WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import ChunkStore

ALICE = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
BOB = PeerID.from_base58("QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z")


def ctx(peer: PeerID = ALICE) -> P2PContext:
    return P2PContext(handle_name="test", local_id=BOB, remote_id=peer)


@pytest.fixture
def served() -> ServedVersion:
    encoder = WeightEncoder(EncodingConfig(encoding="fp32", chunk_size=1000), run_id="r", publisher="QmP")
    (version,) = encoder.encode([("w", torch.arange(1000, dtype=torch.float32))], 0)  # 4 chunks
    return ServedVersion.of(version.manifest, version.store)


def servicer_with(*entries: ServedVersion, **limits) -> WeightsServicer:
    library = WeightLibrary()
    for entry in entries:
        library.add(entry)
    return WeightsServicer(library, ServiceLimits(**limits))


def request(entry: ServedVersion, indices, **kw) -> weights_pb2.ChunksRequest:
    m = entry.manifest
    return weights_pb2.ChunksRequest(
        stream_id=m.stream_id, version=m.version, digest=bytes.fromhex(entry.digest), indices=indices, **kw
    )


async def collect(servicer: WeightsServicer, req, peer: PeerID = ALICE) -> list[weights_pb2.ChunkPart]:
    return [part async for part in servicer.rpc_get_chunks(req, ctx(peer))]


async def test_chunks_stream_in_parts_below_the_part_size_and_are_counted(served):
    servicer = servicer_with(served, part_size=300)
    parts = await collect(servicer, request(served, [2, 0]))
    assert [(p.index, p.offset, len(p.data)) for p in parts] == [
        (2, 0, 300), (2, 300, 300), (2, 600, 300), (2, 900, 100),
        (0, 0, 300), (0, 300, 300), (0, 600, 300), (0, 900, 100),
    ]  # fmt: skip
    assert all(p.chunk_size == 1000 for p in parts)
    assert b"".join(p.data for p in parts[:4]) == served.store.get(2)
    assert servicer.stats.bytes_served == 2000 and servicer.stats.chunks_served == 2
    assert servicer.stats.bytes_by_peer[ALICE.to_base58()] == 2000


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(version=1), "not_held"),
        (dict(stream_id="other"), "not_held"),
        (dict(digest=b"\0" * 32), "not_held"),
        (dict(digest=b"short"), "bad_request"),
        (dict(indices=[4]), "bad_request"),
        (dict(indices=[1, 1]), "bad_request"),
        (dict(indices=[0, 1, 2]), "too_many_chunks"),
    ],
)
async def test_bad_requests_get_one_error_part_and_a_counter(served, change, reason):
    servicer = servicer_with(served, max_chunks_per_request=2)
    req = request(served, change.pop("indices", [0]))
    for field, value in change.items():
        setattr(req, field, value)
    parts = await collect(servicer, req)
    assert [p.error for p in parts] == [reason]
    assert servicer.stats.refused[reason] == 1 and servicer.stats.bytes_served == 0


async def test_request_byte_limit(served):
    servicer = servicer_with(served, max_request_bytes=1500)
    assert [p.error for p in await collect(servicer, request(served, [0, 1]))] == ["too_many_bytes"]


async def test_a_peer_over_its_stream_limit_is_told_busy(served):
    servicer = servicer_with(served, max_streams_per_peer=1)
    first = servicer.rpc_get_chunks(request(served, [0]), ctx(ALICE))
    await first.__anext__()  # ALICE's first stream is open
    assert [p.error for p in await collect(servicer, request(served, [1]), ALICE)] == ["busy"]
    assert [p.index for p in await collect(servicer, request(served, [1]), BOB)] == [1]  # others are served
    await first.aclose()
    assert [p.index for p in await collect(servicer, request(served, [1]), ALICE)] == [1]


async def test_pick_hands_different_chunks_to_different_receivers(served):
    servicer = servicer_with(served)
    got = []
    for peer in (ALICE, BOB, ALICE, BOB):
        parts = await collect(servicer, request(served, [0, 1, 2, 3], pick=1), peer)
        got += [p.index for p in parts]
    assert sorted(got) == [0, 1, 2, 3]  # every chunk once before any is handed out twice


async def test_pick_skips_chunks_handed_out_recently_then_ends_the_stream(served):
    servicer = servicer_with(served)
    first = await collect(servicer, request(served, [0, 1, 2, 3], pick=3, fresh_for=60))
    assert len({p.index for p in first}) == 3
    second = await collect(servicer, request(served, [0, 1, 2, 3], pick=3, fresh_for=60), BOB)
    assert {p.index for p in second} == {0, 1, 2, 3} - {p.index for p in first}
    assert await collect(servicer, request(served, [0, 1, 2, 3], pick=3, fresh_for=60)) == []
    assert len(await collect(servicer, request(served, [0, 1, 2, 3], pick=2))) == 2  # no window: served again


CAROL = PeerID.from_base58("QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ")


async def test_a_pick_that_skips_fresh_chunks_names_who_got_them_when_asked(served):
    servicer = servicer_with(served)
    assert len(await collect(servicer, request(served, [0, 1], pick=2, fresh_for=60), ALICE)) == 2
    assert len(await collect(servicer, request(served, [2], pick=1, fresh_for=60), BOB)) == 1
    fresh = request(served, [0, 1, 2], pick=3, fresh_for=60)
    assert await collect(servicer, fresh, CAROL) == []  # a receiver that did not ask (an older one): no part
    fresh.want_holders = True
    (part,) = await collect(servicer, fresh, CAROL)  # the holders part alone, newest recipient first
    assert [PeerID(h) for h in part.holders] == [BOB, ALICE]
    assert not part.data and not part.missing and not part.error
    assert servicer.stats.holders_named == 1
    (part,) = await collect(servicer, fresh, ALICE)  # never the requester itself
    assert [PeerID(h) for h in part.holders] == [BOB]
    only_bob = request(served, [2], pick=1, fresh_for=60, want_holders=True)
    assert await collect(servicer, only_bob, BOB) == []  # it got them itself: nobody else to name
    (part,) = await collect(servicer, request(served, [0], pick=1, fresh_for=60, want_holders=True), BOB)
    assert [PeerID(h) for h in part.holders] == [ALICE]  # only who got the candidates asked about
    old = await collect(servicer, request(served, [0, 1, 2], pick=3, fresh_for=1e-6, want_holders=True), BOB)
    assert sorted(p.index for p in old if not p.holders) == [0, 1, 2] and not any(p.holders for p in old)


async def test_a_partial_store_serves_what_it_has_and_says_what_is_missing(served):
    partial = ChunkStore(served.manifest)
    partial.put(1, served.store.get(1))
    entry = ServedVersion.of(served.manifest, partial)
    entry.fetching.add(3)
    servicer = servicer_with(entry)
    parts = await collect(servicer, request(entry, [0, 1]))
    assert [(p.index, p.missing, len(p.data)) for p in parts] == [(0, True, 0), (1, False, 1000)]
    have = await servicer.rpc_have(weights_pb2.HaveRequest(digest=bytes.fromhex(entry.digest)), ctx())
    assert have.held and not have.complete and have.num_chunks == 4
    assert bitmap_indices(have.bitmap, 4) == {1} and bitmap_indices(have.fetching, 4) == {3}
    unknown = await servicer.rpc_have(weights_pb2.HaveRequest(digest=b"\1" * 32), ctx())
    assert not unknown.held


async def test_manifests_by_digest_or_stream_within_the_size_cap(served):
    encoder = WeightEncoder(EncodingConfig(encoding="fp32", chunk_size=1000), run_id="r", publisher="QmP")
    (other,) = encoder.encode([("w", torch.zeros(10))], 5)
    other_entry = ServedVersion.of(other.manifest, other.store)
    servicer = servicer_with(served, other_entry)
    by_digest = await servicer.rpc_get_manifests(
        weights_pb2.ManifestsRequest(digests=[bytes.fromhex(served.digest), b"\0" * 32]), ctx()
    )
    assert list(by_digest.manifests) == [served.raw] and not by_digest.truncated
    by_stream = await servicer.rpc_get_manifests(
        weights_pb2.ManifestsRequest(stream_id=other.manifest.stream_id), ctx()
    )
    assert list(by_stream.manifests) == [other_entry.raw]
    capped = servicer_with(served, other_entry, max_manifests_response_bytes=len(served.raw) + 1)
    everything = await capped.rpc_get_manifests(weights_pb2.ManifestsRequest(), ctx())
    assert len(everything.manifests) == 1 and everything.truncated
    too_many = servicer_with(served, max_digests_per_request=1)
    refused = await too_many.rpc_get_manifests(weights_pb2.ManifestsRequest(digests=[b"\0" * 32] * 2), ctx())
    assert refused.error == "too_many_digests"


# ---- the client's frame reader --------------------------------------------------------------------------
def frame(marker: bytes, body: bytes, length: int | None = None) -> bytes:
    return marker + (len(body) if length is None else length).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


class _Writer:
    def close(self) -> None:
        pass


def reader_of(data: bytes) -> ChunkStream:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return ChunkStream(reader, _Writer(), max_frame=1000)


async def test_frame_reader_reads_parts_until_a_clean_end():
    part = weights_pb2.ChunkPart(index=3, offset=0, chunk_size=5, data=b"hello")
    stream = reader_of(frame(P2P.MESSAGE_MARKER, part.SerializeToString()))
    assert (await stream.next(1)).data == b"hello"
    assert await stream.next(1) is None


async def test_frame_reader_refuses_an_oversized_frame_before_reading_it():
    stream = reader_of(frame(P2P.MESSAGE_MARKER, b"", length=1 << 40))
    with pytest.raises(StreamViolation) as info:
        await stream.next(1)
    assert info.value.reason == "oversized"


async def test_frame_reader_reports_truncation_errors_and_garbage():
    with pytest.raises(asyncio.IncompleteReadError):
        await reader_of(frame(P2P.MESSAGE_MARKER, b"x" * 10, length=100)).next(1)
    with pytest.raises(RemoteError, match="boom"):
        await reader_of(frame(P2P.ERROR_MARKER, RPCError(message="boom").SerializeToString())).next(1)
    with pytest.raises(StreamViolation) as info:
        await reader_of(frame(b"\x07", b"")).next(1)
    assert info.value.reason == "malformed_part"
    with pytest.raises(StreamViolation):
        await reader_of(frame(P2P.MESSAGE_MARKER, b"\xff\xff\xff")).next(1)


async def test_frame_reader_times_out_on_a_silent_provider():
    stream = ChunkStream(asyncio.StreamReader(), _Writer(), max_frame=1000)
    with pytest.raises(asyncio.TimeoutError):
        await stream.next(0.05)


async def test_upload_rate_limit_spaces_the_parts(served):
    servicer = servicer_with(served, part_size=1000, upload_rate_limit=20000)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await collect(servicer, request(served, [0, 1, 2, 3]))
    assert loop.time() - t0 >= 0.14  # 4000 bytes at 20 kB/s: the first part leaves at once


async def test_a_pick_interrupted_mid_chunk_is_not_counted_as_handed_out(served):
    servicer = servicer_with(served, part_size=300)
    stream = servicer.rpc_get_chunks(request(served, [0, 1, 2, 3], pick=1, fresh_for=60), ctx())
    first = await stream.__anext__()
    await stream.aclose()  # the receiver went away after 300 of 1000 bytes
    again = await collect(servicer, request(served, [first.index], pick=1, fresh_for=60), BOB)
    assert {p.index for p in again} == {first.index}  # nobody got it: it may be handed out again at once
