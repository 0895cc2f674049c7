"""In-process weights transport for session tests (not a pytest module): real ``WeightsServicer``s answer a
real ``FetchSession`` through ``LocalEndpoint``, without p2pd. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import torch
from hivemind.p2p import P2PContext, PeerID

from echo_p2p.net.records import PolicyRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.fetch.config import FetcherConfig, FetchStats
from echo_p2p.transport.weights.fetch.providers import ProviderBook
from echo_p2p.transport.weights.fetch.session import FetchSession
from echo_p2p.transport.weights.service import ServedVersion, ServiceLimits, WeightLibrary, WeightsServicer
from echo_p2p.weights.codec import WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.manifest import ChunkStore

ME = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
OTHER = PeerID.from_base58("QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z")
PUB = "QmPub"


class LocalStream:
    """``ChunkStream`` over a servicer's async generator."""

    def __init__(self, parts):
        self.parts = parts

    async def next(self, timeout: float):
        try:
            return await asyncio.wait_for(self.parts.__anext__(), timeout)
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        asyncio.ensure_future(self.parts.aclose())


class LocalEndpoint:
    """The client side of ``WeightsEndpoint``, answered in-process by the servicers of ``peers``."""

    def __init__(self, peers: dict[str, WeightsServicer]):
        self.peers = peers
        self.peer_id = "QmMe"
        self.limits = ServiceLimits()

    @staticmethod
    def context() -> P2PContext:
        return P2PContext(handle_name="test", local_id=OTHER, remote_id=ME)

    async def connect(self, peer_id, maddrs, timeout) -> None:
        pass

    def forget(self, peer_id) -> None:
        pass

    async def have(self, peer_id, digest, timeout):
        request = weights_pb2.HaveRequest(digest=bytes.fromhex(digest))
        return await self.peers[peer_id].rpc_have(request, self.context())

    async def open_chunk_stream(self, peer_id, request, timeout):
        return LocalStream(self.peers[peer_id].rpc_get_chunks(request, self.context()))


def publish() -> ServedVersion:
    """A 10-chunk fp32 version, as its publisher holds it."""
    encoder = WeightEncoder(EncodingConfig(encoding="fp32", chunk_size=400), run_id="r", publisher=PUB)
    (version,) = encoder.encode([("w", torch.arange(1000, dtype=torch.float32))], 0)
    return ServedVersion.of(version.manifest, version.store)


async def take_everything(
    publisher: WeightsServicer, served: ServedVersion, fresh_for: float = 0.0
) -> ServedVersion:
    """Another receiver (``OTHER``) takes every chunk of ``served`` from ``publisher`` in pick mode: all of
    them are fresh there now, and it knows who got them. Returns that receiver's copy."""
    m = served.manifest
    request = weights_pb2.ChunksRequest(
        stream_id=m.stream_id,
        version=m.version,
        digest=bytes.fromhex(served.digest),
        indices=list(range(m.num_chunks)),
        pick=m.num_chunks,
        fresh_for=fresh_for,
    )
    context = P2PContext(handle_name="test", local_id=ME, remote_id=OTHER)
    store = ChunkStore(m)
    async for part in publisher.rpc_get_chunks(request, context):
        store.put(part.index, part.data)  # one part per chunk (chunks are far below part_size)
    assert store.is_complete()
    return ServedVersion.of(m, store, raw=served.raw)


def servicer_of(*entries: ServedVersion) -> WeightsServicer:
    library = WeightLibrary()
    for entry in entries:
        library.add(entry)
    return WeightsServicer(library)


def session_for(
    served: ServedVersion,
    peers: dict[str, WeightsServicer],
    verifier,
    book: ProviderBook | None = None,
    **config,
) -> FetchSession:
    """A session fetching ``served`` (published by ``PUB``) into an empty store; its directory lists no
    provider until a test says otherwise (``session.directory.providers = ...``). ``book``: the bans of an
    earlier session (the same fetcher)."""
    cfg = FetcherConfig(**config)
    stats = FetchStats()
    book = book or ProviderBook(cfg.ban_seconds, cfg.max_missing_answers, cfg.missing_window)

    def ban(peer_id: str, reason: str) -> None:
        stats.banned[peer_id] = reason
        book.ban(peer_id)

    record = PolicyRecord(peer_id=PUB, stream_id=served.manifest.stream_id, version=0)
    receiving = ServedVersion.of(served.manifest, ChunkStore(served.manifest), raw=served.raw)
    return FetchSession(
        record,
        [receiving],
        config=cfg,
        endpoint=LocalEndpoint(peers),
        directory=SimpleNamespace(providers=lambda version, max_age=0.0: []),
        book=book,
        stats=stats,
        ban=ban,
        verifier=verifier,
        stop=threading.Event(),
    )
