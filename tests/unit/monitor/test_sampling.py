"""``swarm status`` and the monitor read a few directory buckets per poll and say how many peers they have
not seen: an estimate from the buckets read, 0 once every bucket has been read."""

from __future__ import annotations

import json
import time

from echo_p2p.monitor.sampling import BucketSampler
from echo_p2p.monitor.status import build_status, read_snapshot
from echo_p2p.net.buckets import bucket_of
from echo_p2p.net.directory import Entry
from echo_p2p.net.records import PeerRecord
from echo_p2p.swarm import format_table
from tests.unit.monitor.fakes import FakeDirectory


class BucketedDirectory(FakeDirectory):
    """A directory of ``per_bucket`` inference peers in each of ``k`` buckets (no trainer); counts the
    buckets read."""

    def __init__(self, k: int, per_bucket: int):
        super().__init__()
        self.buckets, self.rejected = k, {}
        self.by_bucket: dict[int, list[Entry]] = {b: [] for b in range(k)}
        i = 0
        while any(len(v) < per_bucket for v in self.by_bucket.values()):
            peer_id = f"Qm{i:044d}"
            i += 1
            bucket = self.by_bucket[bucket_of(peer_id, k)]
            if len(bucket) < per_bucket:
                bucket.append(Entry(PeerRecord(peer_id=peer_id, role="inference"), time.time() + 60))
        self.reads: list[list[int]] = []

    def peers(self, buckets):
        self.reads.append(list(buckets))
        return [e for b in buckets for e in self.by_bucket[b]]

    def trainers(self):
        return []


def test_a_poll_reads_at_most_its_share_of_buckets_and_estimates_the_peers_not_seen():
    directory = BucketedDirectory(k=64, per_bucket=3)
    sampler = BucketSampler(per_poll=16)
    first = read_snapshot(directory, "r", sampler=sampler)
    assert len(directory.reads[-1]) == 16
    assert len(first.peers) == 16 * 3
    assert first.buckets == {"total": 64, "read_now": 16, "known": 16, "unseen_peers": 48 * 3}
    status = build_status(first)
    assert status["summary"]["peers_unseen"] == 144 and status["directory"]["known"] == 16
    json.dumps(status, allow_nan=False)
    assert "not seen: ~144 peer(s) (16 of 64 directory bucket(s) read)" in format_table(
        "r", status["peers"], status["directory"]
    )
    for _ in range(3):  # the buckets not read yet come next: after K / per_poll polls, every one once
        snap = read_snapshot(directory, "r", sampler=sampler)
    assert sorted(b for read in directory.reads for b in read) == list(range(64))
    assert len(snap.peers) == 64 * 3 and snap.buckets["unseen_peers"] == 0
    # then the least recently read first
    read_snapshot(directory, "r", sampler=sampler)
    assert directory.reads[-1] == directory.reads[0]


def test_a_small_run_is_read_whole_every_poll():
    directory = BucketedDirectory(k=4, per_bucket=2)
    snap = read_snapshot(directory, "r")  # a one-shot status: a fresh sampler
    assert sorted(directory.reads[-1]) == [0, 1, 2, 3] and len(snap.peers) == 8
    assert snap.buckets["unseen_peers"] == 0
    assert "not seen: ~0 peer(s) (4 of 4" in format_table("r", [], build_status(snap)["directory"])
