"""A record stored in the background, coalesced: the weight fetcher's ProviderRecord after each change.

Owned here: ``CoalescedStore``. ``soon`` schedules one store and returns; changes until that store starts
go out with it, and stores are at least ``gap`` seconds apart. A fetch changes what a peer serves several
times (its start, its end, the next version's start), and every store is a signed DHT write that every
storing node validates: at ~2 fetched versions a second that was ~6 stores a second per peer. No I/O of its
own: ``store`` (the caller's) does the writing and builds the record when it runs, so the record is the
state at that moment. Thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable


class CoalescedStore:
    """Runs ``store`` (-> stored or not) now (``now``) or soon, coalesced (``soon``); ``stop`` ends the wait
    of a scheduled store, which then does not run."""

    def __init__(self, store: Callable[[], bool], gap: float, stop: threading.Event, name: str) -> None:
        self._store = store
        self.gap = gap
        self._stop = stop
        self._lock = threading.Lock()  # guards _pending
        self._store_lock = threading.Lock()  # one store at a time
        self._pending = False  # a store is scheduled and has not read the state yet
        self._stored_at = -float("inf")  # monotonic time of the last store
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def soon(self) -> None:
        """Store in the background, at most one store per ``gap``, carrying the state when it is sent (every
        change before it is in it; a change after it schedules the next)."""
        if self._stop.is_set():
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        try:
            self._executor.submit(self._coalesced)
        except RuntimeError:  # shut down meanwhile
            pass

    def now(self) -> bool:
        """Store now (after any store in progress)."""
        with self._store_lock:
            self._stored_at = time.monotonic()
            return self._store()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _coalesced(self) -> None:
        self._stop.wait(max(0.0, self._stored_at + self.gap - time.monotonic()))
        with self._lock:
            self._pending = False  # from here on, a change schedules another store
        if not self._stop.is_set():
            self.now()
