"""What a status reader knows of the run's inference peers when it reads only some directory buckets a poll.

The directory holds the inference peers' records in K bucket keys (``net.buckets``). ``swarm status`` and the
monitor read at most ``BUCKETS_PER_POLL`` of them per poll (those never read first, then the least recently
read), keep each bucket's last read, and show the union of what they remember that has not expired. What
they have not seen is estimated, never hidden: ``unseen`` = the buckets not read yet times the mean count of
the buckets read. With K <= ``BUCKETS_PER_POLL`` every poll reads everything and ``unseen`` is 0. Owned here:
``BucketSampler``; the reads themselves are ``SwarmDirectory.peers``. Callers: ``monitor.status.read_snapshot``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from echo_p2p.net.buckets import bucket_of

#: Bucket keys one poll reads at most: a poll costs <= this many reads of ~N/K records each.
BUCKETS_PER_POLL = 16


@dataclass(frozen=True)
class Sample:
    """One poll's view: the entries remembered, and how much of the directory they cover."""

    entries: list  # Entry[PeerRecord], unexpired, from every bucket read so far
    buckets: int  # K
    read_now: int  # buckets this poll read
    known: int  # buckets read at least once (of K)
    unseen: int  # estimated peers in the buckets never read


class BucketSampler:
    """Reads the run's peer buckets a few at a time and remembers them (one per status reader)."""

    def __init__(self, per_poll: int = BUCKETS_PER_POLL):
        self.per_poll = per_poll
        self._k: int | None = None
        self._read: dict[int, tuple[float, list]] = {}  # bucket -> (monotonic time of the read, entries)

    def poll(self, directory) -> Sample:
        """Read the next buckets through ``directory`` (a ``SwarmDirectory``) and return what is known."""
        from hivemind.utils import get_dht_time

        k = directory.buckets
        if k != self._k:  # the run changed its K: what was read belongs to other keys
            self._k, self._read = k, {}
        order = sorted(range(k), key=lambda b: self._read.get(b, (-1.0,))[0])[: self.per_poll]
        by_bucket: dict[int, list] = {b: [] for b in order}
        for entry in directory.peers(order):
            by_bucket.setdefault(bucket_of(entry.record.peer_id, k), []).append(entry)
        now = time.monotonic()
        for b, entries in by_bucket.items():
            self._read[b] = (now, entries)
        dht_now = get_dht_time()
        entries = [e for _, got in self._read.values() for e in got if e.expires_at >= dht_now]
        counts = [len(got) for _, got in self._read.values()]
        missing = k - len(self._read)
        unseen = round(missing * sum(counts) / len(counts)) if counts and missing else 0
        return Sample(entries, k, len(order), len(self._read), unseen)
