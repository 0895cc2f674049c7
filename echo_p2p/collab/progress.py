"""A trainer's progress record in the DHT, stored at every step only while other trainers need it.

Owned here: ``PacedProgressTracker``, the ``hivemind.optim.ProgressTracker`` that ``SyncedOptimizer`` uses.
Called by ``echo_p2p.collab.sync`` only. Must not talk to anything but hivemind's DHT.

Why
---
hivemind's tracker stores the trainer's progress record (epoch, samples accumulated; signed) every time the
optimizer reports progress: twice per epoch, and an epoch is one step of ours. Other trainers read those
records to count samples towards the next epoch and to notice a new or a lost trainer. A trainer alone in
its run needs none of that per step; the record only has to stay alive (hivemind re-stores it every half
``metadata_expiration``) and tell a newcomer roughly which epoch the run is at (the newcomer then downloads
the actual state: ``SyncedOptimizer``). With the tiny preset's ~3 steps a second the per-step store was the
largest DHT load of a README run: 6 stores a second, each a traversal plus a store on every replica
(``benchmarks/profile_swarm.py``).

How
---
While the last progress read counted no other trainer (``global_progress.num_peers <= 1``), a report asks
for a store at most once every ``lone_interval`` seconds; the reports in between only update the local
record, which the next store carries. A newcomer reads an epoch at most that old (plus one store). Once the
trainer reads another trainer's record (within one progress refresh of it appearing) every report stores
again, as in hivemind.

A paced record is older than the trainer's own progress, so a progress read takes this trainer's entry from
its local progress, not from the DHT: hivemind counts the samples of the stored records, and a read that
came between an epoch's reports and the next store lost the samples reported since (a lone trainer then
missed an epoch it had the samples for; ``tests/integration/test_collab_optimizer.py``, under load).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import ValueWithExpiration


class _PacedEvent(threading.Event):
    """hivemind's ``should_report_progress``: ``set`` is a store request, granted while the tracker knows
    of another trainer and otherwise once per ``interval`` seconds; always at shutdown (it wakes the
    reporter to end it)."""

    def __init__(self, tracker: PacedProgressTracker, interval: float) -> None:
        super().__init__()
        self._tracker = tracker
        self._interval = interval
        self._last_granted = -float("inf")
        self.skipped = 0

    def set(self) -> None:
        now = time.monotonic()
        tracker = self._tracker
        alone = tracker.global_progress.num_peers <= 1 and not tracker.shutdown_triggered.is_set()
        if alone and now - self._last_granted < self._interval:
            self.skipped += 1
            return
        self._last_granted = now
        super().set()


class PacedProgressTracker(ProgressTracker):
    """``ProgressTracker`` whose store requests are paced while this trainer is alone (module doc).

    :param lone_interval: fewest seconds between two stores requested by progress reports while no other
        trainer is known; 0 stores at every report, as hivemind does
    """

    def __init__(self, *args: Any, lone_interval: float, start: bool, **kwargs: Any) -> None:
        if lone_interval < 0:
            raise ValueError("lone_interval must be >= 0")
        super().__init__(*args, start=False, **kwargs)
        # replaced before the reporter starts waiting on it
        self.should_report_progress = _PacedEvent(self, lone_interval)
        if start:
            self.start()

    @property
    def reports_not_stored(self) -> int:
        """Progress reports that asked for no store of their own (a later store carried them)."""
        return self.should_report_progress.skipped

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        """hivemind's reading of the run's progress records, with this trainer's own stored record (when there
        is one) replaced by its local progress (module doc)."""
        if isinstance(metadata, dict) and metadata:
            mine = self.local_progress.peer_id
            fresh = self.local_progress.dict()
            metadata = {
                key: ValueWithExpiration(fresh, entry.expiration_time)
                if isinstance(getattr(entry, "value", None), dict) and entry.value.get("peer_id") == mine
                else entry
                for key, entry in metadata.items()
            }
        return super()._parse_swarm_progress_data(metadata)
