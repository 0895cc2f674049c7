"""A weight fetcher's provider record goes out coalesced: one store per ``announce_gap`` at most, always with
the newest state (a fetch's start, its end and the next version's start used to be three DHT stores)."""

from __future__ import annotations

import threading
import time

from echo_p2p.transport.weights.fetch.announce import CoalescedStore


def store(gap: float) -> tuple[CoalescedStore, list[tuple[float, int]], list[int], threading.Event]:
    """A store of a counter standing for the held versions; returns it, what it stored (when, which
    state), the state and its stop event."""
    stored: list[tuple[float, int]] = []
    state = [0]
    stop = threading.Event()

    def write() -> bool:
        stored.append((time.monotonic(), state[0]))  # the record is built when the store runs
        return True

    return CoalescedStore(write, gap, stop, "test-announce"), stored, state, stop


def test_changes_within_the_gap_go_out_in_one_store_of_the_newest_state():
    announcer, stored, state, stop = store(gap=2.0)
    try:
        state[0] = 1
        announcer.soon()  # the first change goes out at once
        deadline = time.monotonic() + 5
        while not stored and time.monotonic() < deadline:
            time.sleep(0.01)
        for version in range(2, 12):  # ten changes in 0.2 s
            state[0] = version
            announcer.soon()
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while len(stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        values = [value for _, value in stored]
        assert values == [1, 11]  # one more store, with the last state
        assert stored[1][0] - stored[0][0] >= 1.9
    finally:
        stop.set()
        announcer.shutdown()


def test_a_change_after_a_store_is_never_lost():
    announcer, stored, state, stop = store(gap=0.1)
    try:
        for version in range(1, 6):  # each change right after the store of the one before
            state[0] = version
            announcer.soon()
            deadline = time.monotonic() + 5
            while not (stored and stored[-1][1] == version) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [value for _, value in stored] == [1, 2, 3, 4, 5]
    finally:
        stop.set()
        announcer.shutdown()


def test_a_fetcher_counts_its_provider_stores_and_why_one_did_not_go_out():
    """``FetchStats.announcements``: a peer that others never find as a provider shows why (its stores
    failed, or it held itself unreachable and stored nothing)."""
    from types import SimpleNamespace

    from echo_p2p.guard.trust import TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.reachability import Reachability
    from echo_p2p.transport.weights.fetch.config import FetcherConfig
    from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher

    library = SimpleNamespace(entries=lambda: [])

    def fetcher(reach: Reachability, **config) -> WeightFetcher:  # real, never started: no DHT
        return WeightFetcher(
            None,
            load_or_create_identity(None),
            SwarmKeys("r"),
            TrustedTrainers.from_keys([]),
            FetcherConfig(**config),
            endpoint=SimpleNamespace(library=library),
            reach=reach,
        )

    # no daemon to ask for its addresses: unreachable, nothing stored
    alone = fetcher(Reachability(None))
    assert alone.announce() is False and alone.stats.as_dict()["announcements"] == {"unreachable": 1}
    dialable = Reachability(None, maddrs=["/ip4/127.0.0.1/tcp/1/p2p/QmX"], status="direct", period=3600.0)
    dialable._read_at = time.monotonic()  # read just now: kept for the period
    reachable = fetcher(dialable)
    outcomes = iter([True, False])
    reachable.directory.announce_provider = lambda *_a, **_k: next(outcomes)
    assert reachable.announce() and not reachable.announce()
    reachable.directory.announce_provider = lambda *_a, **_k: 1 / 0  # a DHT error: best effort, counted
    assert reachable.announce() is False
    assert reachable.stats.as_dict()["announcements"] == {"stored": 1, "failed": 2}
    quiet = fetcher(dialable, serve=False)
    assert quiet.announce() is False and quiet.stats.announcements == {"not_serving": 1}
