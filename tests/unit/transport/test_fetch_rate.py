"""Weight providers judged by the rate they deliver: per-chunk deadlines from ``min_provider_rate``, hedged
requests for late chunks, slow providers dropped, skipped and (again and again) banned.

The scheduler and the deadlines are tested as pure logic; the session against real ``WeightsServicer``s
in-process (``local_weights``) that serve slowly on purpose: never, a few bytes at a time, or each chunk
just before the old per-chunk timeout. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from echo_p2p.net.directory import Entry
from echo_p2p.net.records import ProviderRecord
from echo_p2p.transport.weights.fetch.config import FetcherConfig, chunk_allowance
from echo_p2p.transport.weights.fetch.providers import ProviderBook, Source
from echo_p2p.transport.weights.fetch.reader import StreamLimits
from echo_p2p.transport.weights.fetch.scheduler import HEDGE_SHARE, ChunkScheduler
from echo_p2p.transport.weights.service import ServedVersion, ServiceLimits, WeightLibrary, WeightsServicer
from echo_p2p.weights.manifest import ChunkStore
from tests.unit.transport.local_weights import PUB, publish, servicer_of, session_for

NOW = 1000.0
SLOW = "QmSlow"
#: In-process chunks are 400 bytes: a rate and grace scaled so that 400 bytes take 0.2 + 0.4 s at most.
RATE = dict(min_provider_rate=1000.0, provider_grace=0.2)


def test_a_chunk_may_take_grace_plus_its_size_at_the_minimum_rate_never_more_than_chunk_timeout():
    limits = StreamLimits(request_timeout=10, chunk_timeout=30, min_rate=64 * 1024, grace=2.0)
    assert limits.chunk_seconds(64 * 1024) == pytest.approx(3.0)
    assert limits.chunk_seconds(4 << 20) == 30  # a 4 MiB chunk: 66 s at the rate, capped
    assert StreamLimits(request_timeout=10, chunk_timeout=30).chunk_seconds(100) == 30  # no rate: as before
    # a big chunk is hedged at half of chunk_timeout at most, whatever the rate
    assert chunk_allowance(4 << 20, 30.0, 64 * 1024, 2.0) * HEDGE_SHARE == 15.0
    defaults = FetcherConfig()
    assert defaults.min_provider_rate == 64 * 1024 and defaults.provider_grace == 2.0


def scheduler(**config) -> tuple[ChunkScheduler, str, Source, Source]:
    served = publish()
    receiving = ServedVersion.of(served.manifest, ChunkStore(served.manifest), raw=served.raw)
    sched = ChunkScheduler([receiving], FetcherConfig(**{**RATE, **config}), 64, NOW, rng=random.Random(0))
    publisher = sched.sources[PUB] = Source(PUB, [], publisher=True)
    slow = sched.sources[SLOW] = Source(SLOW, [])
    for s in (publisher, slow):
        s.complete.add(served.digest)
    return sched, served.digest, publisher, slow


def test_chunks_asked_of_a_peer_are_due_at_the_minimum_rate_in_the_order_asked():
    sched, digest, _, slow = scheduler(chunks_per_request=4, max_inflight_per_provider=1)
    (ask,) = [a for a in sched.next_requests(NOW) if a.source is slow]
    due = [sched.due[digest][i] - NOW for i in ask.indices]
    first = HEDGE_SHARE * (0.2 + 400 / 1000)  # half of each chunk's allowance, one after the other
    assert due == pytest.approx([first, 2 * first, 3 * first, 4 * first])
    assert sched.late(digest, NOW + first - 0.01) == set()
    assert sched.late(digest, NOW + first + 0.01) == {ask.indices[0]}


def test_a_late_chunk_is_hedged_once_by_the_publisher_without_its_window_and_the_hedge_can_win():
    sched, digest, publisher, slow = scheduler(chunks_per_request=4, max_inflight_per_provider=1)
    asks = sched.next_requests(NOW)
    assert [a.source for a in asks] == [slow]  # the publisher is spared: the peer holds everything
    first = asks[0].indices[0]
    later = NOW + 0.7  # the first two chunks of the stream are late by now (due 0.3 s and 0.6 s)
    late = sched.late(digest, later)
    assert first in late and len(late) == 2
    publisher.tokens = None  # its request budget is full again
    (hedge,) = sched.next_requests(later)
    assert hedge.source is publisher and set(hedge.hedges) == late and hedge.fresh_for == 0.0
    assert hedge.pick == len(late) and sched.late(digest, later) == set()  # hedged once, not twice
    assert sched.inflight[digest][first] is slow  # still the slow peer's too: whichever comes first
    # the publisher starts and delivers the first late chunk: a hedge that won
    assert not sched.chunk_started(publisher, digest, first, picked=True)
    assert sched.chunk_stored(digest, first, later + 0.1, publisher)
    # the slow stream is cut: its other late chunk stays in flight to the publisher's hedge
    other = (late - {first}).pop()
    rest = set(asks[0].indices) - late
    assert sched.finished(asks[0], 0, set(asks[0].indices)) == len(rest)  # retried: never hedged
    assert sched.inflight[digest][other] is publisher and other not in sched.due[digest]
    assert sched.finished(hedge, hedge.pick - 1, set()) == 1  # the hedge ended without it: retried
    assert other not in sched.inflight[digest]


def test_a_late_chunk_is_hedged_by_another_peer_that_holds_it():
    sched, digest, publisher, slow = scheduler(chunks_per_request=2, max_inflight_per_provider=1)
    del sched.sources[PUB]
    (ask,) = sched.next_requests(NOW)
    helper = sched.sources["QmHelper"] = Source("QmHelper", [])
    helper.partial.add(digest)
    helper.have[digest] = {ask.indices[0]}  # it holds only the first chunk asked of the slow peer
    hedge = sched.pick_work(helper, sched.alive(), stalled=False, now=NOW + 5)
    assert hedge.indices == [ask.indices[0]] and hedge.hedges == (ask.indices[0],) and hedge.pick == 0


def test_chunks_in_flight_to_a_dropped_peer_are_late_at_once():
    sched, digest, _, slow = scheduler(chunks_per_request=4, max_inflight_per_provider=2)
    asks = sched.next_requests(NOW)
    assert sched.late(digest, NOW) == set()
    slow.dropped = True  # its first stream missed a deadline: its second runs out its own meanwhile
    assert sched.late(digest, NOW) == {i for a in asks for i in a.indices}


def test_without_a_minimum_rate_nothing_is_due_nor_hedged():
    sched, digest, _, slow = scheduler(min_provider_rate=0.0)
    sched.next_requests(NOW)
    assert sched.due[digest] == {} and sched.late(digest, NOW + 100) == set()


def test_the_book_bans_at_the_third_slow_drop_within_the_window():
    book = ProviderBook(ban_seconds=100.0, max_missing=8, missing_window=50.0)
    assert not book.slow(SLOW, 3, now=0.0)
    assert not book.slow(SLOW, 3, now=60.0)  # the first is older than the window
    assert not book.slow(SLOW, 3, now=61.0)
    assert book.slow(SLOW, 3, now=62.0)
    assert not book.slow(SLOW, 3, now=63.0)  # a ban starts the count afresh


class SlowServicer(WeightsServicer):
    """Serves valid chunks, slowly: ``never`` (no byte), ``drip`` (10 bytes every 0.1 s) or ``late`` (each
    chunk after ``late`` seconds)."""

    def __init__(self, library: WeightLibrary, mode: str, late: float = 0.0):
        super().__init__(library, ServiceLimits(part_size=10) if mode == "drip" else None)
        self.mode, self.late = mode, late

    async def _throttle(self, nbytes: int) -> None:
        await asyncio.sleep({"never": 3600.0, "drip": 0.1, "late": self.late, "fast": 0.0}[self.mode])


def with_slow_provider(verifier, mode: str, late: float = 0.0, **config):
    served = publish()
    publisher = servicer_of(served)
    slow = SlowServicer(servicer_of(served).library, mode, late)
    session = session_for(
        served, {PUB: publisher, SLOW: slow}, verifier, **{**RATE, "stall_timeout": 30.0, **config}
    )
    record = ProviderRecord(peer_id=SLOW, stream_id=served.manifest.stream_id, manifests=[served.digest])
    session.directory.providers = lambda version, max_age=0.0: [
        Entry(record=record, expires_at=time.time() + 30)
    ]
    return session, served, publisher, slow


@pytest.mark.parametrize("mode", ["never", "drip", "late"])
async def test_a_slow_provider_is_dropped_and_skipped_and_the_fetch_completes_from_the_publisher(
    verifier, mode
):
    # "late": each chunk 5 s after it was asked (the old chunk_timeout, 30 s, let it through)
    session, served, publisher, _ = with_slow_provider(verifier, mode, late=5.0)
    t0 = time.monotonic()
    await asyncio.wait_for(session.run(), 10)
    elapsed = time.monotonic() - t0
    assert session.entries[served.digest].store.is_complete()
    # stall_timeout is 30 s: only the hedges and the drop can have brought the publisher in
    assert elapsed < 3.0, session.stats
    assert session.stats.slow["hedged"] >= 1 and session.stats.slow["hedge_won"] >= 1
    assert session.stats.slow["dropped"] == 1  # at its deadline, or as soon as a hedge beat it
    assert session.sched.sources[SLOW].dropped
    assert session.book.banned(SLOW) and session.stats.banned == {}  # skipped for a while, not banned
    assert not session.book.banned(SLOW, session.book.clock() + session.cfg.unreachable_seconds + 1)
    assert publisher.stats.bytes_served >= served.manifest.total_bytes - 400 * 2


async def test_a_provider_slow_again_and_again_is_banned(verifier):
    book = None
    for _ in range(3):
        if book is not None:
            book._banned_until.pop(SLOW, None)  # its skip is over: the next fetch asks it again
        session, served, _, _ = with_slow_provider(verifier, "never", book=book)
        book = session.book
        await asyncio.wait_for(session.run(), 10)
        assert session.entries[served.digest].store.is_complete()
    assert session.stats.banned == {SLOW: "too_slow"} and session.stats.slow["banned"] == 1
    assert book.banned(SLOW, book.clock() + session.cfg.unreachable_seconds + 1)


async def test_an_honest_provider_above_the_minimum_rate_is_neither_hedged_nor_dropped(verifier):
    # 400-byte chunks 0.05 s apart (8 kB/s, 8x the minimum rate here)
    session, served, publisher, honest = with_slow_provider(verifier, "late", late=0.05)
    await asyncio.wait_for(session.run(), 10)
    assert session.entries[served.digest].store.is_complete()
    assert session.stats.slow == {} and session.stats.failures.get("slow", 0) == 0
    assert publisher.stats.bytes_served == 0 and honest.stats.bytes_served == served.manifest.total_bytes
