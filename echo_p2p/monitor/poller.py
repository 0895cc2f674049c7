"""The monitor's reader: a thread that reads the run's directory every ``poll_period`` and keeps the newest
status and the history.

Owned here: ``Poller`` — ``start()``, ``latest()``, ``history()``, ``stop()``. It reads through a
``SwarmDirectory`` it is given (the process's DHT node: a client-mode node of the monitor CLI, the local
run's watcher node, a bootstrap's node) and never writes. A failed read becomes a status with the
``dht_unreachable`` alert, never an exception. Callers: the monitor CLI, ``echo_p2p.local``,
``echo_p2p.bootstrap``; the web server (``monitor.server``) reads ``latest`` and ``history``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.history import Tracker
from echo_p2p.monitor.sampling import BucketSampler
from echo_p2p.monitor.status import build_status, read_snapshot

logger = logging.getLogger(__name__)


class Poller:
    def __init__(
        self,
        directory,
        run_id: str,
        trust=None,
        config: MonitorConfig | None = None,
        connections: Callable[[], int] | None = None,
    ):
        self.directory = directory
        self.run_id = run_id
        self.trust = trust
        self.config = config or MonitorConfig()
        self.connections = connections
        self.tracker = Tracker(self.config)
        self.sampler = BucketSampler()  # the peer buckets read so far (a few per poll)
        self.polls = 0
        self._latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> dict[str, Any]:
        snapshot = read_snapshot(self.directory, self.run_id, self.trust, self.connections, self.sampler)
        status = build_status(snapshot, self.config, self.tracker)
        self._latest = status  # one reference swap: readers see the old status or the new one
        self.polls += 1
        return status

    def start(self) -> Poller:
        self._thread = threading.Thread(target=self._loop, name="monitor-poller", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            try:
                self.poll_once()
            except Exception:  # a bug in building the status must not end the monitor
                logger.exception("monitor: building the status failed; will retry")
            if self._stop.wait(self.config.poll_period):
                return

    def latest(self) -> dict[str, Any] | None:
        return self._latest

    def history(self, after: float, limit: int) -> list[dict[str, Any]]:
        return self.tracker.since(after, limit)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop reading; waits for a read in progress (each DHT read has its own deadline)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
