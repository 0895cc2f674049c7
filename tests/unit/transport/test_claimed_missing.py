"""A provider that claims chunks it does not serve is banned like one that serves bad chunks; an honest partial
provider is not. Real ``FetchSession`` and ``WeightsServicer``s in-process (``local_weights``)."""

from __future__ import annotations

import asyncio
import time

from echo_p2p.net.directory import Entry
from echo_p2p.net.records import ProviderRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.fetch.providers import MAX_TRACKED_PROVIDERS, ProviderBook, Source
from echo_p2p.transport.weights.fetch.scheduler import ChunkAsk
from echo_p2p.transport.weights.fetch.session import FetchSession
from echo_p2p.transport.weights.service import ServedVersion, WeightsServicer, _bitmap
from echo_p2p.weights.manifest import ChunkStore
from tests.unit.transport.local_weights import PUB, publish, servicer_of, session_for

LIAR, PARTIAL = "QmLiar", "QmPartial"


def empty_copy(served: ServedVersion, held: range = range(0)) -> ServedVersion:
    """The same manifest with only the chunks ``held`` (a partial provider; none: a liar's store)."""
    store = ChunkStore(served.manifest)
    for i in held:
        store.put(i, served.store.get(i))
    return ServedVersion.of(served.manifest, store, raw=served.raw)


def announce(session: FetchSession, *records: ProviderRecord) -> None:
    session.directory.providers = lambda version, max_age=0.0: [
        Entry(record=r, expires_at=time.time() + 30) for r in records
    ]


def record_of(peer_id: str, served: ServedVersion, partial: bool = False) -> ProviderRecord:
    digests = [served.digest]
    return ProviderRecord(
        peer_id=peer_id,
        stream_id=served.manifest.stream_id,
        manifests=[] if partial else digests,
        partial=digests if partial else [],
    )


class LyingMap(WeightsServicer):
    """A partial provider whose chunk map says it holds everything (it holds nothing)."""

    async def rpc_have(self, request, context):
        n = self.library.entries()[0].manifest.num_chunks
        return weights_pb2.HaveResponse(held=True, num_chunks=n, bitmap=_bitmap(range(n), n))


async def test_a_provider_listing_a_version_it_answers_missing_for_is_banned_and_the_fetch_completes(
    verifier,
):
    served = publish()
    publisher, liar = servicer_of(served), servicer_of(empty_copy(served))
    session = session_for(served, {PUB: publisher, LIAR: liar}, verifier)
    announce(session, record_of(LIAR, served))  # "every chunk held": the publisher is spared for all of them
    cfg = session.cfg
    await asyncio.wait_for(session.run(), 20)

    assert session.entries[served.digest].store.is_complete()
    assert session.stats.banned == {LIAR: "claimed_missing"}
    # banned at the max_missing_answers-th answer; streams already open to it may add their few
    broken = session.stats.rejected["claimed_missing"]
    in_flight = cfg.max_inflight_per_provider * cfg.chunks_per_request
    assert cfg.max_missing_answers <= broken <= cfg.max_missing_answers + in_flight
    assert liar.stats.streams <= cfg.max_missing_answers + cfg.max_inflight_per_provider
    assert liar.stats.bytes_served == 0
    assert publisher.stats.bytes_served == served.manifest.total_bytes  # each chunk once, from the publisher

    again = session_for(served, {PUB: publisher, LIAR: liar}, verifier, book=session.book)  # same fetcher
    announce(again, record_of(LIAR, served))
    await asyncio.wait_for(again._refresh_providers(), 5)
    assert LIAR not in again.sched.sources  # the ban outlives the fetch


async def test_an_honest_partial_provider_serves_what_it_holds_and_is_never_banned(verifier):
    served = publish()
    publisher = servicer_of(served)
    partial = servicer_of(empty_copy(served, held=range(5)))  # chunks 0-4 of 10, fetching the rest
    session = session_for(served, {PUB: publisher, PARTIAL: partial}, verifier, stall_timeout=0.2)
    announce(session, record_of(PARTIAL, served, partial=True))
    await asyncio.wait_for(session.run(), 20)

    assert session.entries[served.digest].store.is_complete()
    assert session.stats.banned == {}
    assert session.stats.rejected["claimed_missing"] == 0
    assert partial.stats.bytes_served > 0  # it was used, for what it holds


async def test_missing_counts_only_for_chunks_the_provider_advertised(verifier):
    served = publish()
    partial = servicer_of(empty_copy(served, held=range(5)))
    session = session_for(served, {PUB: servicer_of(served), PARTIAL: partial}, verifier)
    source = session.sched.sources[PARTIAL] = Source(PARTIAL, [])
    source.partial.add(served.digest)
    source.have[served.digest] = set(range(5))
    # chunks 7 and 8 were never in its map: an honest "missing", not counted
    source.inflight += 1
    await asyncio.wait_for(session._request(ChunkAsk(source, served.digest, [7, 8])), 5)
    assert session.stats.rejected["claimed_missing"] == 0 and session.book.missing_count(PARTIAL) == 0
    assert not source.dropped

    source.have[served.digest] = set(range(10))  # now it claims chunk 9 too (it does not hold it)
    source.inflight += 1
    await asyncio.wait_for(session._request(ChunkAsk(source, served.digest, [9])), 5)
    assert session.stats.rejected["claimed_missing"] == 1 and session.book.missing_count(PARTIAL) == 1
    assert not source.holds(served.digest, 9)  # not asked of it again
    assert source.busy_until > time.monotonic()  # a stream of nothing but "missing": it backs off


async def test_a_partial_provider_whose_chunk_map_lies_is_banned(verifier):
    served = publish()
    publisher, liar = servicer_of(served), LyingMap(servicer_of(empty_copy(served)).library)
    session = session_for(served, {PUB: publisher, LIAR: liar}, verifier)
    announce(session, record_of(LIAR, served, partial=True))
    await asyncio.wait_for(session.run(), 20)
    assert session.entries[served.digest].store.is_complete()
    assert session.stats.banned == {LIAR: "claimed_missing"}
    assert liar.stats.bytes_served == 0


def test_the_book_bans_at_the_bound_within_the_window_and_forgets_old_answers():
    book = ProviderBook(ban_seconds=100.0, max_missing=4, missing_window=50.0)
    assert not book.missing(LIAR, 3, now=0.0)
    assert not book.missing(LIAR, 1, now=60.0)  # the first three are older than the window
    assert book.missing_count(LIAR) == 1
    assert not book.missing(LIAR, 2, now=61.0)
    assert book.missing(LIAR, 1, now=62.0)  # four within 50 s
    book.ban(LIAR, now=62.0)
    assert book.banned(LIAR, now=161.0) and not book.banned(LIAR, now=163.0)
    assert book.missing_count(LIAR) == 0  # a ban starts the count afresh
    assert not book.missing(PUB, 0, now=0.0) and book.missing_count(PUB) == 0


def test_the_book_stays_bounded_whatever_the_number_of_providers():
    book = ProviderBook(ban_seconds=100.0, max_missing=4, missing_window=50.0)
    for i in range(MAX_TRACKED_PROVIDERS + 100):
        book.missing(f"Qm{i}", 100, now=float(i) / 1000)  # count capped at max_missing per peer
        book.ban(f"Qm{i}", now=0.0)
    assert len(book._banned_until) <= MAX_TRACKED_PROVIDERS
    assert len(book._missing) <= MAX_TRACKED_PROVIDERS
    assert book.banned(f"Qm{MAX_TRACKED_PROVIDERS + 99}", now=1.0)  # the newest are kept


def test_back_off_doubles_for_streams_of_nothing_and_is_capped():
    source = Source(LIAR, [])
    waits = []
    for _ in range(8):
        source.back_off(now=100.0)
        waits.append(source.busy_until - 100.0)
        source.busy_until = 0.0
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_the_request_budget_bounds_streams_per_second_to_one_provider():
    source = Source(LIAR, [])
    opened = 0
    for tick in range(1000):  # 10 s in 10 ms steps, asking as fast as the scheduler runs
        if source.may_request(now=tick / 100, rate=20.0, burst=4):
            source.spend_request()
            opened += 1
    assert opened <= 4 + 20 * 10
    assert opened >= 20 * 10  # and an honest provider gets the whole rate


def test_a_fetching_claim_older_than_stall_timeout_no_longer_spares_the_publisher():
    """A partial provider that says it is fetching every chunk and never holds one would make every
    receiver spare the publisher until the whole fetch stalls, again after each publisher stream."""
    s = session_for(publish(), {}, None)
    digest, publisher = s.sched.order[0], s.sched.sources[PUB]
    peer = s.sched.sources[PARTIAL] = Source(PARTIAL, [])
    peer.partial.add(digest)
    now = time.monotonic()
    peer.note_fetching(digest, set(range(10)), now)
    assert (
        s.sched.pick_work(publisher, s.sched.alive(), stalled=False, now=time.monotonic()) is None
    )  # fresh claims: the publisher is spared
    peer.note_fetching(digest, set(range(10)), now + 1)  # read again later: each claim keeps its first date
    assert peer.fetching_since[digest][0] == now
    old = now - 2 * s.cfg.stall_timeout
    peer.fetching_since[digest] = {i: old if i < 5 else now for i in range(10)}
    candidates = s.sched.pick_work(publisher, s.sched.alive(), stalled=False, now=time.monotonic()).indices
    assert candidates == [0, 1, 2, 3, 4]  # claimed too long ago: the publisher is asked for them
