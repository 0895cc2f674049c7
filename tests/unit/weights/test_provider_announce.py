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
