"""A publisher with nothing fresh to hand out names who just got those chunks, and the receiver asks them at
once instead of waiting for their provider records; what such a ``holders`` part may carry is checked like
every other part. Real ``FetchSession``, ``read_stream`` and ``WeightsServicer``s in-process
(``local_weights``); every wait has a deadline."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

from echo_p2p.proto import weights_pb2
from echo_p2p.transport.p2p_loop import P2PLoop
from echo_p2p.transport.weights.fetch.providers import Source
from echo_p2p.transport.weights.fetch.reader import StreamLimits, read_stream
from echo_p2p.transport.weights.fetch.scheduler import ChunkAsk
from echo_p2p.transport.weights.service import MAX_HOLDERS, ServedVersion
from echo_p2p.weights.manifest import ChunkStore
from tests.unit.transport.local_weights import (
    ME,
    OTHER,
    PUB,
    LocalStream,
    publish,
    servicer_of,
    session_for,
    take_everything,
)

HELPER = OTHER.to_base58()
ADDRESS = f"/ip4/127.0.0.1/tcp/31337/p2p/{HELPER}"


async def test_the_receivers_named_by_the_publisher_serve_the_chunks_at_once(verifier):
    served = publish()
    publisher = servicer_of(served)
    helper = servicer_of(await take_everything(publisher, served, fresh_for=30.0))
    # stall 30 s: only the helper, or the publisher without its window (after announce_grace), can deliver
    session = session_for(served, {PUB: publisher, HELPER: helper}, verifier, stall_timeout=30.0)
    session.book.note_addresses(HELPER, [ADDRESS])  # read in an earlier fetch's provider records
    t0 = time.monotonic()
    await asyncio.wait_for(session.run(), 5)
    took = time.monotonic() - t0
    assert session.entries[served.digest].store.is_complete()
    assert session.stats.bytes_by_provider[HELPER] == served.manifest.total_bytes  # all of it from the helper
    assert publisher.stats.bytes_by_peer[ME.to_base58()] == 0 and publisher.stats.holders_named == 1
    assert session.stats.named_providers == 1 and session.sched.sources[HELPER].named
    assert session.sched.no_window == set()  # the window held: nobody had to be asked without it
    assert session.stats.provider_reads == 1  # no forced read: the publisher said who got them
    assert took < session.cfg.announce_grace  # the path without names waits at least that long


async def test_a_named_receiver_that_cannot_be_reached_is_dropped_not_banned(verifier):
    served = publish()
    publisher = servicer_of(served)
    await take_everything(publisher, served, fresh_for=30.0)
    # the helper is unreachable; provider reads come faster than the defaults (1 s, 1.5 s), the rules alike
    session = session_for(
        served, {PUB: publisher}, verifier, stall_timeout=30.0, provider_refresh=0.2, announce_grace=0.3
    )
    session.book.note_addresses(HELPER, [ADDRESS])
    await asyncio.wait_for(session.run(), 5)
    assert session.entries[served.digest].store.is_complete()  # from the publisher, without the window
    assert session.sched.no_window == {served.digest}
    assert session.sched.sources[HELPER].dropped and session.sched.sources[HELPER].maddrs == [ADDRESS]
    assert not session.book.banned(HELPER)  # named, not self-announced: no record of it was wrong


async def test_a_named_receiver_whose_address_was_never_read_is_left_to_its_record(verifier):
    served = publish()
    publisher = servicer_of(served)
    helper = servicer_of(await take_everything(publisher, served, fresh_for=30.0))
    session = session_for(
        served, {PUB: publisher, HELPER: helper}, verifier, stall_timeout=30.0, provider_refresh=0.2,
        announce_grace=0.3,
    )  # fmt: skip
    await asyncio.wait_for(session.run(), 5)  # behind NAT, a dial without addresses would only fail
    assert HELPER not in session.sched.sources and session.stats.named_providers == 0
    assert session.sched.no_window == {served.digest} and not session.stats.failures


class Scripted:
    """An endpoint whose one stream sends the given parts (a provider misbehaving exactly so)."""

    def __init__(self, parts: list[weights_pb2.ChunkPart]):
        self.parts = parts
        self.requests: list[weights_pb2.ChunksRequest] = []

    async def connect(self, peer_id, maddrs, timeout) -> None:
        pass

    async def open_chunk_stream(self, peer_id, request, timeout):
        self.requests.append(request)

        async def parts():
            for part in self.parts:
                yield part

        return LocalStream(parts())


async def read(parts, verifier, *, fresh_for: float = 30.0):
    served = publish()
    receiving = ServedVersion.of(served.manifest, ChunkStore(served.manifest), raw=served.raw)
    ask = ChunkAsk(Source(PUB, [], publisher=True), served.digest, [0, 1, 2], pick=3, fresh_for=fresh_for)

    class Sink:
        def chunk_started(self, s, digest, index, picked):
            return True

        def chunk_released(self, s, digest, index):
            pass

        def chunk_stored(self, s, entry, index, size, new):
            pass

    endpoint = Scripted([p(served) if callable(p) else p for p in parts])
    outcome = await asyncio.wait_for(
        read_stream(endpoint, ask, receiving, Sink(), verifier, StreamLimits(5.0, 5.0)), 5
    )
    return outcome, endpoint.requests[0]


async def test_a_holders_part_is_read_when_asked_for(verifier):
    outcome, request = await read([weights_pb2.ChunkPart(holders=[OTHER.to_bytes()])], verifier)
    assert request.want_holders  # asked for, because the ask has a freshness window
    assert outcome.failure is None and outcome.state.holders == [HELPER]
    _, request = await read([], verifier, fresh_for=0.0)
    assert not request.want_holders


def chunk_part(index: int):
    def part(served: ServedVersion) -> weights_pb2.ChunkPart:
        data = served.store.get(index)
        return weights_pb2.ChunkPart(index=index, offset=0, chunk_size=len(data), data=data)

    return part


@pytest.mark.parametrize(
    "parts, fresh_for",
    [
        ([weights_pb2.ChunkPart(holders=[OTHER.to_bytes()])], 0.0),  # not asked for
        ([weights_pb2.ChunkPart(holders=[OTHER.to_bytes()] * (MAX_HOLDERS + 1))], 30.0),  # too many
        ([weights_pb2.ChunkPart(holders=[b"x" * 65])], 30.0),  # not a PeerID's size
        ([weights_pb2.ChunkPart(holders=[b""])], 30.0),
        ([weights_pb2.ChunkPart(index=1, holders=[OTHER.to_bytes()])], 30.0),  # a chunk's field too
        ([weights_pb2.ChunkPart(data=b"x", holders=[OTHER.to_bytes()])], 30.0),
    ],
)
async def test_a_bad_holders_part_is_a_violation(verifier, parts, fresh_for):
    outcome, _ = await read(parts, verifier, fresh_for=fresh_for)
    assert outcome.failure is not None and outcome.failure.kind == "violation"
    assert outcome.failure.reason == "unexpected_holders" and outcome.state.holders == []


async def test_nothing_may_follow_a_holders_part(verifier):
    parts = [weights_pb2.ChunkPart(holders=[OTHER.to_bytes()]), chunk_part(0)]
    outcome, _ = await read(parts, verifier)
    assert outcome.failure is not None and outcome.failure.reason == "unexpected_chunk"
    outcome, _ = await read([chunk_part(0), weights_pb2.ChunkPart(holders=[OTHER.to_bytes()])], verifier)
    assert outcome.failure is None and outcome.state.holders == [HELPER]  # after whole chunks: fine
    assert PeerID.from_base58(outcome.state.holders[0]) == OTHER


async def test_a_dial_without_addresses_does_not_stop_a_later_dial_with_them():
    """A source first known without addresses must still be dialled once its record gives some."""
    dials = []

    class Client:
        async def connect(self, peer_id, addrs):
            dials.append((peer_id.to_base58(), [str(a) for a in addrs]))

    loop = P2PLoop.__new__(P2PLoop)  # the dialing logic alone: no thread, no daemon
    loop._dialed, loop.p2p = set(), SimpleNamespace(_client=Client(), peer_id=ME)
    await loop.dial(HELPER, [], 1.0, strict=True)
    assert dials == []
    await loop.dial(HELPER, [ADDRESS], 1.0, strict=True)
    await loop.dial(HELPER, [ADDRESS], 1.0, strict=True)  # once dialled, not again
    assert dials == [(HELPER, ["/ip4/127.0.0.1/tcp/31337"])]
