"""Who is asked for which chunk: peers first, the publisher only for what no peer holds (the pure
``ChunkScheduler``, fake providers), and what a failing provider costs (``FetchSession._fail``)."""

from __future__ import annotations

import random

from echo_p2p.transport.weights.fetch.config import FetcherConfig
from echo_p2p.transport.weights.fetch.providers import Source
from echo_p2p.transport.weights.fetch.scheduler import ChunkScheduler
from echo_p2p.transport.weights.service import ServedVersion
from echo_p2p.weights.manifest import ChunkStore
from tests.unit.transport.local_weights import PUB, publish, session_for

NOW = 1000.0


def scheduler(**config) -> tuple[ChunkScheduler, str, Source]:
    """A scheduler for an empty store of a 10-chunk version, its digest, and the publisher's ``Source``."""
    served = publish()
    receiving = ServedVersion.of(served.manifest, ChunkStore(served.manifest), raw=served.raw)
    sched = ChunkScheduler([receiving], FetcherConfig(**config), 64, NOW, rng=random.Random(0))
    publisher = sched.sources[PUB] = Source(PUB, [], publisher=True)
    publisher.complete.add(served.digest)
    return sched, served.digest, publisher


def peer(sched: ChunkScheduler, name: str, digest: str) -> Source:
    source = sched.sources[name] = Source(name, [])
    source.complete.add(digest)
    return source


def test_the_publisher_is_spared_the_chunks_a_peer_holds():
    sched, digest, publisher = scheduler(chunks_per_request=4)
    other = peer(sched, "QmPeer", digest)
    alive = [publisher, other]
    assert sched.pick_work(publisher, alive, stalled=False, now=NOW) is None
    ask = sched.pick_work(other, alive, stalled=False, now=NOW)
    assert ask.digest == digest and len(ask.indices) == 4 and ask.pick == 0
    # stalled (no progress for stall_timeout): the publisher may be asked for anything missing
    ask = sched.pick_work(publisher, alive, stalled=True, now=NOW)
    assert len(ask.indices) == 10 and ask.pick == min(10, sched.cfg.publisher_pick) and ask.fresh_for == 0


def test_the_publisher_gets_what_no_peer_holds_or_fetches_with_a_freshness_window():
    sched, digest, publisher = scheduler()
    partial = sched.sources["QmPartial"] = Source("QmPartial", [])
    partial.partial.add(digest)
    partial.have[digest] = {0, 1, 2}
    partial.note_fetching(digest, {3, 4}, NOW)
    alive = [publisher, partial]
    ask = sched.pick_work(publisher, alive, stalled=False, now=NOW)
    assert (
        ask.indices == [5, 6, 7, 8, 9] and ask.pick >= 1 and ask.fresh_for == sched.cfg.publisher_fresh_window
    )
    ask = sched.pick_work(partial, alive, stalled=False, now=NOW)
    assert set(ask.indices) <= {0, 1, 2}  # a partial peer is asked only for chunks it said it holds


def test_a_dropped_peer_leaves_everything_to_the_publisher():
    sched, digest, publisher = scheduler()
    peer(sched, "QmPeer", digest).dropped = True
    assert sched.orphans() == []
    ask = sched.pick_work(publisher, sched.alive(), stalled=False, now=NOW)
    assert ask.indices == list(range(10))


def test_chunks_in_flight_are_not_asked_twice_and_picks_are_bounded():
    sched, digest, publisher = scheduler(publisher_pick=4)
    for i in range(8):
        sched.inflight[digest][i] = publisher
    ask = sched.pick_work(publisher, [publisher], stalled=False, now=NOW)
    assert ask.indices == [8, 9] and ask.pick == 2
    sched.picks[digest] = 2  # two picks already on their way cover both candidates
    assert sched.pick_work(publisher, [publisher], stalled=False, now=NOW) is None


def test_next_requests_counts_what_it_asks_in_flight_and_finished_releases_it():
    sched, digest, publisher = scheduler(chunks_per_request=4, max_inflight_per_provider=2)
    other = peer(sched, "QmPeer", digest)
    asks = sched.next_requests(NOW)
    to_peer = [a for a in asks if a.source is other]
    assert len(to_peer) == 2 and other.inflight == 2  # its stream limit
    asked = {i for a in to_peer for i in a.indices}
    assert len(asked) == 8 and set(sched.inflight[digest]) == asked
    assert sched.entries[digest].fetching == asked  # what this peer announces as "fetching"
    assert not [a for a in asks if a.source is publisher]  # the peer holds the other two as well: spared
    first = to_peer[0]
    sched.chunk_stored(digest, first.indices[0], NOW + 1)  # one came, the stream then failed
    assert sched.finished(first, 0, set(first.indices)) == 3  # the other three go back as retries
    assert other.inflight == 1 and sched.last_progress == NOW + 1
    assert not set(first.indices) & set(sched.inflight[digest])


def test_a_failing_peer_is_dropped_but_the_publisher_only_backs_off():
    s = session_for(publish(), {}, None, max_provider_failures=2)
    publisher = s.sched.sources[PUB]
    other = s.sched.sources["QmPeer"] = Source("QmPeer", [])
    for _ in range(3):
        s._fail(other, "timeout", TimeoutError())
        s._fail(publisher, "timeout", TimeoutError())
    assert other.dropped and not publisher.dropped
    assert s.sched.alive() == [publisher]
    assert publisher.busy_until > 0  # retried later, not never
    assert s.stats.failures["timeout"] == 6


def test_a_provider_that_never_delivered_is_skipped_by_later_fetches_for_a_while():
    """Keys are cheap: a stranger's provider records at addresses where nobody serves cost every fetch
    ``max_provider_failures`` failed requests each. A provider dropped without having delivered a chunk is
    skipped for ``unreachable_seconds``; one that delivered before is only dropped for this fetch."""
    s = session_for(publish(), {}, None, max_provider_failures=2, unreachable_seconds=60.0)
    ghost, flaky = Source("QmGhost", []), Source("QmFlaky", [])
    flaky.rate = 1e6  # it served chunks earlier in this fetch
    for source in (ghost, flaky):
        for _ in range(2):
            s._fail(source, "timeout", TimeoutError())
    assert ghost.dropped and flaky.dropped
    assert s.book.banned("QmGhost") and not s.book.banned("QmFlaky")
    assert s.stats.failures["unreachable"] == 1
    now = s.book.clock()
    assert not s.book.banned("QmGhost", now + 61.0)  # for a while, not for good
    s.book.ban("QmGhost", now, seconds=1.0)  # a shorter ban never shortens one in force
    assert s.book.banned("QmGhost", now + 30.0)
