"""A fetch that cannot complete ends fast: a real ``FetchSession`` against real ``WeightsServicer``s in-process.

The endpoint here is the client side of ``WeightsEndpoint`` without p2pd: its calls go straight to the
servicers' ``rpc_have`` / ``rpc_get_chunks``, so the session, the servicer (``pick``, ``fresh_for``,
``not_held``) and their interplay are the real ones. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from echo_p2p.net.directory import Entry
from echo_p2p.net.records import ProviderRecord
from echo_p2p.transport.weights.fetch.config import FetchError
from echo_p2p.transport.weights.fetch.providers import Source
from echo_p2p.transport.weights.fetch.session import FetchSession
from echo_p2p.transport.weights.service import ServedVersion, WeightsServicer
from tests.unit.transport.local_weights import PUB, publish, servicer_of, session_for, take_everything


def setup(verifier, **config) -> tuple[FetchSession, WeightsServicer, ServedVersion]:
    served = publish()
    publisher = servicer_of(served)
    return session_for(served, {PUB: publisher}, verifier, **config), publisher, served


async def test_a_version_the_publisher_dropped_fails_at_once_instead_of_hanging(verifier):
    # defaults: stall 3 s, no progress 60 s, fetch 600 s; the publisher stays alive and answers not_held
    session, publisher, served = setup(verifier)
    await take_everything(publisher, served)  # the other receiver skips/moves on: nobody serves them
    publisher.library.remove(served.digest)  # a newer keyframe replaced the chain after our manifests came
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 10)
    assert info.value.reason == "version_dropped"
    assert time.monotonic() - t0 < 5
    assert not session.tasks and not session.entries[served.digest].fetching


async def test_chunks_handed_to_a_receiver_nobody_can_ask_are_fetched_without_the_window(verifier):
    # stall_timeout far away: only dropping the freshness window can make the publisher send them
    # provider reads come faster than the defaults (1 s, 1.5 s after the empty pick); the rules are the same
    session, publisher, served = setup(verifier, stall_timeout=30.0, provider_refresh=0.2, announce_grace=0.3)
    await take_everything(publisher, served)
    t0 = time.monotonic()
    await asyncio.wait_for(session.run(), 5)
    assert session.entries[served.digest].store.is_complete()
    assert session.sched.no_window == {served.digest}
    assert time.monotonic() - t0 < 3


async def test_the_window_stays_while_another_provider_lists_the_version(verifier):
    session, _, served = setup(verifier)
    helper = ProviderRecord(peer_id="QmHelper", stream_id=served.manifest.stream_id, partial=[served.digest])
    session.directory.providers = lambda version, max_age=0.0: [
        Entry(record=helper, expires_at=time.time() + 30)
    ]
    session.empty_picks[served.digest] = time.monotonic()
    await session._refresh_providers()
    assert (
        served.digest not in session.sched.no_window
    )  # the helper got them: ask it (the publisher is spared)
    fresh_for = session.sched.pick_work(
        session.sched.sources[PUB], session.sched.alive(), stalled=False, now=time.monotonic()
    ).fresh_for
    assert fresh_for == session.cfg.publisher_fresh_window

    session.sched.sources["QmHelper"].forget(served.digest)  # not_held: it moved on, and its record says so
    session.directory.providers = lambda version, max_age=0.0: []
    session.empty_picks[served.digest] = time.monotonic()
    await session._refresh_providers()
    # a read right after the empty pick could miss receivers that got the chunks but have not announced yet
    assert served.digest not in session.sched.no_window and served.digest in session.empty_picks
    session.empty_picks[served.digest] = time.monotonic() - session.cfg.announce_grace
    await session._refresh_providers()  # one that gave them time to announce: nobody holds them
    assert served.digest in session.sched.no_window
    assert session.stats.provider_reads == 3  # each read counted (FetchStats: a peer never found shows it)
    fresh_for = session.sched.pick_work(
        session.sched.sources[PUB], session.sched.alive(), stalled=False, now=time.monotonic()
    ).fresh_for
    assert fresh_for == 0.0


def test_a_provider_that_forgot_a_version_no_longer_spares_the_publisher(verifier):
    session, _, served = setup(verifier)
    peer = session.sched.sources["QmPeer"] = Source("QmPeer", [])
    peer.partial.add(served.digest)
    peer.have[served.digest] = set(range(5))
    peer.fetching[served.digest] = set(range(5, 10))
    publisher = session.sched.sources[PUB]
    assert (
        session.sched.pick_work(publisher, session.sched.alive(), stalled=False, now=time.monotonic()) is None
    )  # all of it is coming
    peer.forget(served.digest)  # have: held=False (it skipped the version or moved on)
    candidates = session.sched.pick_work(
        publisher, session.sched.alive(), stalled=False, now=time.monotonic()
    ).indices
    assert candidates == list(range(10))
    assert session.sched.orphans() == []  # the publisher still serves it


async def test_nobody_left_holding_a_manifest_ends_the_fetch_after_no_provider_timeout(verifier):
    session, _, served = setup(verifier, no_provider_timeout=0.5)
    session.sched.sources[PUB].dropped = True  # e.g. banned meanwhile; no peer lists the version
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 5)
    assert info.value.reason == "no_providers"


async def test_a_fetch_ends_promptly_when_the_fetcher_stops(verifier):
    session, _, _ = setup(verifier)
    session.sched.sources[PUB].busy_until = time.monotonic() + 60  # nothing will arrive for a long while
    asyncio.get_running_loop().call_later(0.3, session.stop.set)
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 5)
    assert info.value.reason == "stopped" and time.monotonic() - t0 < 2


async def test_a_publisher_that_died_mid_fetch_ends_it_after_no_provider_timeout(verifier):
    # the publisher was killed after the manifests came: every dial fails. Before: the publisher (never
    # dropped) was retried until no_progress_timeout, 60 s, while another trainer published newer versions
    session, _, _ = setup(verifier, no_provider_timeout=0.5)

    async def refused(*args, **kwargs):
        raise ConnectionRefusedError("failed to dial: connection refused")

    session.endpoint.open_chunk_stream = refused
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        await asyncio.wait_for(session.run(), 10)
    assert info.value.reason == "publisher_gone", info.value
    assert time.monotonic() - t0 < 5
    assert session.sched.sources[PUB].failures >= 1


async def test_a_publisher_that_fails_while_a_peer_holds_the_rest_does_not_end_the_fetch(verifier):
    session, _, served = setup(verifier, no_provider_timeout=0.3, provider_refresh=0.05)
    session.endpoint.peers["QmPeer"] = servicer_of(served)
    helper = ProviderRecord(peer_id="QmPeer", stream_id=served.manifest.stream_id, manifests=[served.digest])
    listed_from = time.monotonic() + 0.2  # the publisher is asked (and fails) before the peer is known
    session.directory.providers = lambda version, max_age=0.0: (
        [Entry(record=helper, expires_at=time.time() + 30)] if time.monotonic() > listed_from else []
    )
    serve = session.endpoint.open_chunk_stream

    async def publisher_gone(peer_id, request, timeout):
        if peer_id == PUB:
            raise ConnectionRefusedError("failed to dial: connection refused")
        await asyncio.sleep(0.5)  # the peer is slow: the publisher has failed for longer by then
        return await serve(peer_id, request, timeout)

    session.endpoint.open_chunk_stream = publisher_gone
    await asyncio.wait_for(session.run(), 10)
    assert session.entries[served.digest].store.is_complete()
    publisher = session.sched.sources[PUB]
    assert publisher.failures >= 1 and publisher.failing_for(time.monotonic()) > 0.3  # not given up


def test_an_answer_resets_how_long_a_provider_has_been_failing():
    s = Source("QmA", [])
    assert s.failing_for(10.0) == 0.0
    s.failed(10.0)
    s.failed(12.0)
    assert s.failing_for(15.0) == 5.0 and s.failures == 2
    s.answered()
    assert s.failing_for(15.0) == 0.0
    s.failed(20.0)
    assert s.failing_for(21.0) == 1.0
