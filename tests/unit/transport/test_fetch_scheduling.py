"""Who is asked for which chunk: peers first, the publisher only for what no peer holds (fake providers)."""

from __future__ import annotations

from echo_p2p.transport.weights.providers import Source
from echo_p2p.transport.weights.session import _FetchSession
from tests.unit.transport.local_weights import publish, session_for


def session(**config) -> tuple[_FetchSession, str]:
    s = session_for(publish(), {}, None, **config)  # 10 chunks; no provider is ever called here
    return s, s.order[0]


def test_the_publisher_is_spared_the_chunks_a_peer_holds():
    s, digest = session(chunks_per_request=4)
    publisher = s.sources["QmPub"]
    peer = s.sources["QmPeer"] = Source("QmPeer", [])
    peer.complete.add(digest)
    alive = [publisher, peer]
    assert s._pick_work(publisher, alive, stalled=False) is None
    d, indices, pick, _ = s._pick_work(peer, alive, stalled=False)
    assert d == digest and len(indices) == 4 and pick == 0
    # stalled (no progress for stall_timeout): the publisher may be asked for anything missing
    d, candidates, pick, fresh_for = s._pick_work(publisher, alive, stalled=True)
    assert len(candidates) == 10 and pick == min(10, s.cfg.publisher_pick) and fresh_for == 0


def test_the_publisher_gets_what_no_peer_holds_or_fetches_with_a_freshness_window():
    s, digest = session()
    publisher = s.sources["QmPub"]
    partial = s.sources["QmPartial"] = Source("QmPartial", [])
    partial.partial.add(digest)
    partial.have[digest] = {0, 1, 2}
    partial.fetching[digest] = {3, 4}
    alive = [publisher, partial]
    d, candidates, pick, fresh_for = s._pick_work(publisher, alive, stalled=False)
    assert candidates == [5, 6, 7, 8, 9] and pick >= 1 and fresh_for == s.cfg.publisher_fresh_window
    _, indices, _, _ = s._pick_work(partial, alive, stalled=False)
    assert set(indices) <= {0, 1, 2}  # a partial peer is asked only for chunks it said it holds


def test_a_dropped_peer_leaves_everything_to_the_publisher():
    s, digest = session()
    publisher = s.sources["QmPub"]
    peer = s.sources["QmPeer"] = Source("QmPeer", [])
    peer.complete.add(digest)
    peer.dropped = True
    _, candidates, _, _ = s._pick_work(publisher, s._alive(), stalled=False)
    assert candidates == list(range(10))


def test_chunks_in_flight_are_not_asked_twice_and_picks_are_bounded():
    s, digest = session(publisher_pick=4)
    publisher = s.sources["QmPub"]
    for i in range(8):
        s.inflight[digest][i] = publisher
    _, candidates, pick, _ = s._pick_work(publisher, [publisher], stalled=False)
    assert candidates == [8, 9] and pick == 2
    s.picks[digest] = 2  # two picks already on their way cover both candidates
    assert s._pick_work(publisher, [publisher], stalled=False) is None


def test_a_failing_peer_is_dropped_but_the_publisher_only_backs_off():
    s, digest = session(max_provider_failures=2)
    publisher = s.sources["QmPub"]
    peer = s.sources["QmPeer"] = Source("QmPeer", [])
    s.f.endpoint.forget = lambda peer_id: None
    for _ in range(3):
        s._fail(peer, "timeout", TimeoutError())
        s._fail(publisher, "timeout", TimeoutError())
    assert peer.dropped and not publisher.dropped
    assert s._alive() == [publisher]
    assert publisher.busy_until > 0  # retried later, not never
    assert s.f.stats.failures["timeout"] == 6


def test_a_provider_that_never_delivered_is_skipped_by_later_fetches_for_a_while():
    """Keys are cheap: a stranger's provider records at addresses where nobody serves cost every fetch
    ``max_provider_failures`` failed requests each. A provider dropped without having delivered a chunk is
    skipped for ``unreachable_seconds``; one that delivered before is only dropped for this fetch."""
    s, _ = session(max_provider_failures=2, unreachable_seconds=60.0)
    s.f.endpoint.forget = lambda peer_id: None
    ghost, flaky = Source("QmGhost", []), Source("QmFlaky", [])
    flaky.rate = 1e6  # it served chunks earlier in this fetch
    for source in (ghost, flaky):
        for _ in range(2):
            s._fail(source, "timeout", TimeoutError())
    assert ghost.dropped and flaky.dropped
    assert s.f.book.banned("QmGhost") and not s.f.book.banned("QmFlaky")
    assert s.f.stats.failures["unreachable"] == 1
    now = s.f.book.clock()
    assert not s.f.book.banned("QmGhost", now + 61.0)  # for a while, not for good
    s.f.book.ban("QmGhost", now, seconds=1.0)  # a shorter ban never shortens one in force
    assert s.f.book.banned("QmGhost", now + 30.0)
