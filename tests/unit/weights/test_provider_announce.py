"""A weight fetcher's provider record goes out coalesced: one store per ``announce_gap`` at most, always with
the newest state (a fetch's start, its end and the next version's start used to be three DHT stores)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from echo_p2p.transport.weights.config import FetcherConfig
from echo_p2p.transport.weights.fetcher import WeightFetcher


class Directory:
    def __init__(self) -> None:
        self.stored: list[tuple[float, int]] = []

    def announce_provider(self, record, ttl) -> bool:
        self.stored.append((time.monotonic(), record))
        return True


def fetcher(gap: float) -> tuple[WeightFetcher, Directory, list[int]]:
    """The fetcher's announcing part only: its state is a counter standing for the held versions."""
    f = WeightFetcher.__new__(WeightFetcher)
    f.config = FetcherConfig(announce_gap=gap)
    f.reach = None
    f.directory = Directory()
    f._stop = threading.Event()
    f._announce_lock = threading.Lock()
    f._store_lock = threading.Lock()
    f._announce_pending = False
    f._announced_at = -float("inf")
    f._announcer = concurrent.futures.ThreadPoolExecutor(1)
    state = [0]
    f._provider_record = lambda: state[0]
    return f, f.directory, state


def test_changes_within_the_gap_go_out_in_one_store_of_the_newest_state():
    f, directory, state = fetcher(gap=2.0)
    try:
        state[0] = 1
        f._announce_soon()  # the first change goes out at once
        deadline = time.monotonic() + 5
        while not directory.stored and time.monotonic() < deadline:
            time.sleep(0.01)
        for version in range(2, 12):  # ten changes in 0.2 s
            state[0] = version
            f._announce_soon()
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while len(directory.stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        values = [value for _, value in directory.stored]
        assert values == [1, 11]  # one more store, with the last state
        assert directory.stored[1][0] - directory.stored[0][0] >= 1.9
    finally:
        f._stop.set()
        f._announcer.shutdown(wait=True)


def test_a_change_after_a_store_is_never_lost():
    f, directory, state = fetcher(gap=0.1)
    try:
        for version in range(1, 6):  # each change right after the store of the one before
            state[0] = version
            f._announce_soon()
            deadline = time.monotonic() + 5
            while (
                not (directory.stored and directory.stored[-1][1] == version) and time.monotonic() < deadline
            ):
                time.sleep(0.01)
        assert [value for _, value in directory.stored] == [1, 2, 3, 4, 5]
    finally:
        f._stop.set()
        f._announcer.shutdown(wait=True)
