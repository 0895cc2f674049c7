"""A fetch that cannot complete ends fast: a real ``_FetchSession`` against real ``WeightsServicer``s in-process.

The endpoint here is the client side of ``WeightsEndpoint`` without p2pd: its calls go straight to the
servicers' ``rpc_have`` / ``rpc_get_chunks``, so the session, the servicer (``pick``, ``fresh_for``,
``not_held``) and their interplay are the real ones. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import P2PContext, PeerID

from echo_p2p.net.directory import Entry
from echo_p2p.net.records import PolicyRecord, ProviderRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.config import FetcherConfig, FetchError, FetchStats
from echo_p2p.transport.weights.providers import Source
from echo_p2p.transport.weights.service import ServedVersion, ServiceLimits, WeightLibrary, WeightsServicer
from echo_p2p.transport.weights.session import _FetchSession
from echo_p2p.weights import ChunkStore, EncodingConfig, WeightEncoder

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


@pytest.fixture
def verifier():
    pool = concurrent.futures.ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


def publish() -> ServedVersion:
    encoder = WeightEncoder(EncodingConfig(encoding="fp32", chunk_size=400), run_id="r", publisher=PUB)
    (version,) = encoder.encode([("w", torch.arange(1000, dtype=torch.float32))], 0)  # 10 chunks
    return ServedVersion.of(version.manifest, version.store)


def setup(verifier, **config) -> tuple[_FetchSession, WeightsServicer, ServedVersion]:
    served = publish()
    library = WeightLibrary()
    library.add(served)
    publisher = WeightsServicer(library)
    fetcher = SimpleNamespace(
        config=FetcherConfig(**config),
        endpoint=LocalEndpoint({PUB: publisher}),
        directory=SimpleNamespace(providers=lambda: []),
        _banned_until={},
        _stop=threading.Event(),
        _verifier=verifier,
        _ban=lambda peer_id, reason: None,
        stats=FetchStats(),
        on_progress=None,
    )
    record = PolicyRecord(peer_id=PUB, stream_id=served.manifest.stream_id, version=0)
    receiving = ServedVersion.of(served.manifest, ChunkStore(served.manifest), raw=served.raw)
    return _FetchSession(fetcher, record, [receiving]), publisher, served


async def hand_out_everything(publisher: WeightsServicer, served: ServedVersion) -> None:
    """Another receiver takes every chunk from the publisher (pick mode): all of them are 'fresh' now."""
    m = served.manifest
    request = weights_pb2.ChunksRequest(
        stream_id=m.stream_id,
        version=m.version,
        digest=bytes.fromhex(served.digest),
        indices=list(range(m.num_chunks)),
        pick=m.num_chunks,
    )
    context = P2PContext(handle_name="test", local_id=ME, remote_id=OTHER)
    parts = [p async for p in publisher.rpc_get_chunks(request, context)]
    assert {p.index for p in parts} == set(range(m.num_chunks))


async def test_a_version_the_publisher_dropped_fails_at_once_instead_of_hanging(verifier):
    # defaults: stall 3 s, no progress 60 s, fetch 600 s; the publisher stays alive and answers not_held
    session, publisher, served = setup(verifier)
    await hand_out_everything(publisher, served)  # the other receiver skips/moves on: nobody serves them
    publisher.library.remove(served.digest)  # a newer keyframe replaced the chain after our manifests came
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 10)
    assert info.value.reason == "version_dropped"
    assert time.monotonic() - t0 < 5
    assert not session.tasks and not session.entries[served.digest].fetching


async def test_chunks_handed_to_a_receiver_nobody_can_ask_are_fetched_without_the_window(verifier):
    # stall_timeout far away: only dropping the freshness window can make the publisher send them
    session, publisher, served = setup(verifier, stall_timeout=30.0)
    await hand_out_everything(publisher, served)
    t0 = time.monotonic()
    await asyncio.wait_for(session.run(), 5)
    assert session.entries[served.digest].store.is_complete()
    assert session.no_window == {served.digest}
    assert time.monotonic() - t0 < 3


async def test_the_window_stays_while_another_provider_lists_the_version(verifier):
    session, _, served = setup(verifier)
    helper = ProviderRecord(peer_id="QmHelper", stream_id=served.manifest.stream_id, partial=[served.digest])
    session.f.directory.providers = lambda: [Entry(record=helper, expires_at=time.time() + 30)]
    session.empty_picks[served.digest] = time.monotonic()
    await session._refresh_providers()
    assert served.digest not in session.no_window  # the helper got them: ask it (the publisher is spared)
    _, _, _, fresh_for = session._pick_work(session.sources[PUB], session._alive(), stalled=False)
    assert fresh_for == session.cfg.publisher_fresh_window

    session.sources["QmHelper"].forget(served.digest)  # not_held: it moved on, and its record says so
    session.f.directory.providers = lambda: []
    session.empty_picks[served.digest] = time.monotonic()
    await session._refresh_providers()
    assert served.digest in session.no_window
    _, _, _, fresh_for = session._pick_work(session.sources[PUB], session._alive(), stalled=False)
    assert fresh_for == 0.0


def test_a_provider_that_forgot_a_version_no_longer_spares_the_publisher(verifier):
    session, _, served = setup(verifier)
    peer = session.sources["QmPeer"] = Source("QmPeer", [])
    peer.partial.add(served.digest)
    peer.have[served.digest] = set(range(5))
    peer.fetching[served.digest] = set(range(5, 10))
    publisher = session.sources[PUB]
    assert session._pick_work(publisher, session._alive(), stalled=False) is None  # all of it is coming
    peer.forget(served.digest)  # have: held=False (it skipped the version or moved on)
    _, candidates, _, _ = session._pick_work(publisher, session._alive(), stalled=False)
    assert candidates == list(range(10))
    assert session._orphans() == []  # the publisher still serves it


async def test_nobody_left_holding_a_manifest_ends_the_fetch_after_no_provider_timeout(verifier):
    session, _, served = setup(verifier, no_provider_timeout=0.5)
    session.sources[PUB].dropped = True  # e.g. banned meanwhile; no peer lists the version
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 5)
    assert info.value.reason == "no_providers"


async def test_a_fetch_ends_promptly_when_the_fetcher_stops(verifier):
    session, _, _ = setup(verifier)
    session.sources[PUB].busy_until = time.monotonic() + 60  # nothing will arrive for a long while
    asyncio.get_running_loop().call_later(0.3, session.f._stop.set)
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 5)
    assert info.value.reason == "stopped" and time.monotonic() - t0 < 2
