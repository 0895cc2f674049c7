"""Directory buckets: which of the run's K keys holds a peer's record, and how K follows the swarm's size.

An inference peer's ``PeerRecord`` and a provider's ``ProviderRecord`` are not stored under one key each
(every reader would read every record: docs/scaling.md, "The directory") but under one of K bucket keys,
chosen by the prefix of the SHA-256 of the peer id (``bucket_of``): stable for a peer, spread evenly over
the buckets whatever peer ids look like (base58 ids share their first characters). Provider records are
keyed by (version slot, bucket): a fetcher of version v reads the slot of v in one or two buckets.

K is one of ``ALLOWED_BUCKETS`` (powers of 4, so that every DHT node can check every bucket key of a run
up front: ``keys.SwarmKeys.bucket_keys``). The run owner's signed run record carries it
(``RunRecord.directory_buckets``, derived from the owner's estimate of the run's peers by
``buckets_for``); a run without a record, or a record without it, has one bucket. Owned here: the rule
and the reading orders; no network I/O.
"""

from __future__ import annotations

import hashlib
import random

#: The values K may take (a record naming another is malformed). 256 buckets hold 16,384 peers at the target.
ALLOWED_BUCKETS = (1, 4, 16, 64, 256)
#: Records a bucket should hold at most: one read of a bucket then returns <= ~64 records of ~1.1 KB.
TARGET_PER_BUCKET = 64
#: Provider records are keyed by ``version % VERSION_SLOTS``: a bounded key set every node can check (a
#: record under the slot of an older version has expired long before the slot comes round again, unless
#: versions come faster than VERSION_SLOTS per record lifetime; readers check the versions a record lists).
VERSION_SLOTS = 16


def bucket_of(peer_id: str, buckets: int) -> int:
    """The bucket (0 .. ``buckets``-1) of ``peer_id``: the top bits of SHA-256 of the id."""
    if buckets not in ALLOWED_BUCKETS:
        raise ValueError(f"directory buckets must be one of {ALLOWED_BUCKETS}, not {buckets}")
    prefix = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")
    return prefix * buckets >> 32


def buckets_for(expected_peers: int) -> int:
    """The smallest allowed K that keeps ``expected_peers`` at ``TARGET_PER_BUCKET`` or fewer per bucket."""
    for k in ALLOWED_BUCKETS:
        if expected_peers <= k * TARGET_PER_BUCKET:
            return k
    return ALLOWED_BUCKETS[-1]


def reading_order(own: int, buckets: int, rng: random.Random | None = None) -> list[int]:
    """Every bucket once: ``own`` first, the others in a random order (a reader reads a prefix of it)."""
    others = [b for b in range(buckets) if b != own]
    (rng or random).shuffle(others)
    return [own, *others]
