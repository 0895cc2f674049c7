"""The sharded directory: a peer's bucket is stable and buckets are even; the readers a run depends on read
their own bucket and one other (counted: keys and records read), providers the slot of their version; records
in the wrong bucket, too large or of another protocol are refused with a reason."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import Future

import pytest

from echo_p2p.net.buckets import ALLOWED_BUCKETS, TARGET_PER_BUCKET, bucket_of, buckets_for, reading_order


class FakeDht:
    """A dictionary store with hivemind's ``store``/``get`` shape (no network): the directory's reads and
    writes go to keys exactly as on the DHT, so what it reads can be counted."""

    def __init__(self):
        self.data: dict[str, dict] = {}
        self.gets: list[str] = []

    def store(self, key, value, expiration_time, subkey, return_future):
        from hivemind.utils import ValueWithExpiration

        self.data.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        future = Future()
        future.set_result(True)
        return future

    def get(self, key, latest, return_future):
        from hivemind.utils import ValueWithExpiration, get_dht_time

        self.gets.append(key)
        future = Future()
        found = self.data.get(key)
        future.set_result(None if found is None else ValueWithExpiration(dict(found), get_dht_time() + 60))
        return future


@pytest.fixture(scope="module")
def idents():
    from echo_p2p.net.identity import load_or_create_identity

    made = [load_or_create_identity(None) for _ in range(10)]
    yield made
    for ident in made:
        ident.cleanup()


def directory(dht, ident, buckets: int):
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.keys import SwarmKeys

    return SwarmDirectory(dht, SwarmKeys("r"), ident, buckets=buckets)


def test_a_peers_bucket_is_stable_and_peers_spread_evenly_over_the_buckets():
    rng = random.Random(0)
    ids = [
        "Qm" + "".join(rng.choice("abcdefghijkmnopqrstuvwxyzABCDEFGH123456789") for _ in range(44))
        for _ in range(8000)
    ]
    for k in ALLOWED_BUCKETS:
        assert all(bucket_of(i, k) == bucket_of(i, k) for i in ids[:50])
        counts = Counter(bucket_of(i, k) for i in ids)
        assert set(counts) == set(range(k))  # every bucket used, none outside
        if k <= 16:
            mean = len(ids) / k
            assert max(counts.values()) < 1.15 * mean and min(counts.values()) > 0.85 * mean, counts
    # a prefix of the hash: a peer's bucket at 4K is one of the 4 that split its bucket at K
    assert all(bucket_of(i, 16) // 4 == bucket_of(i, 4) for i in ids[:200])
    with pytest.raises(ValueError):
        bucket_of(ids[0], 3)


def test_k_follows_the_expected_size_and_a_reading_order_starts_at_home():
    assert buckets_for(10) == 1 and buckets_for(TARGET_PER_BUCKET) == 1
    assert buckets_for(TARGET_PER_BUCKET + 1) == 4
    assert buckets_for(10_000) == 256 and buckets_for(10**9) == 256
    order = reading_order(5, 16, random.Random(1))
    assert order[0] == 5 and sorted(order) == list(range(16))


def test_a_sync_trainer_or_peer_cache_reads_two_buckets_not_all(idents):
    from echo_p2p.net.records import PeerRecord

    k = 4
    dht = FakeDht()
    for ident in idents:  # every peer announces into its own bucket
        d = directory(dht, ident, k)
        assert d.announce(PeerRecord(peer_id=ident.peer_id, role="inference"), ttl=60)
        assert ident.owner_key in dht.data[d.keys.peers(k, bucket_of(ident.peer_id, k))]
    per_bucket = Counter(bucket_of(i.peer_id, k) for i in idents)
    reader = directory(dht, idents[0], k)
    sample = reader.peer_sample(at_least=1)  # buckets full enough: two of them
    read = list(dht.gets)
    assert len(read) == 2 and read[0] == reader.keys.peers(k, reader.own_bucket())
    read_buckets = [int(key.rsplit("/", 1)[1]) for key in read]
    assert reader.keys_read == 2
    assert reader.records_read == len(sample) == sum(per_bucket[b] for b in read_buckets)
    assert {e.record.peer_id for e in sample} == {
        i.peer_id for i in idents if bucket_of(i.peer_id, k) in read_buckets
    }
    # everything, for tools: every bucket once
    assert {e.record.peer_id for e in reader.peers()} == {i.peer_id for i in idents}
    assert reader.keys_read == 2 + k
    # a sample smaller than asked for (10 peers in 4 buckets, 11 wanted): every bucket, each once
    reader.keys_read, dht.gets = 0, []
    assert {e.record.peer_id for e in reader.peer_sample(at_least=11)} == {i.peer_id for i in idents}
    assert reader.keys_read == k and len(set(dht.gets)) == k


def test_a_fetcher_reads_the_slot_of_its_version_in_two_buckets_and_falls_back_when_they_hold_none(idents):
    from echo_p2p.net.directory import PROVIDER_BUCKETS, PROVIDER_FALLBACK
    from echo_p2p.net.records import ProviderRecord

    k = 16
    dht = FakeDht()
    old, new = idents[:6], idents[6:7]
    for ident in old:  # providers of version 3 (their slot only)
        directory(dht, ident, k).announce_provider(
            ProviderRecord(peer_id=ident.peer_id, versions=[3]), 60, [3]
        )
    reader = directory(dht, idents[9], k)
    entries = reader.providers(3)
    assert set(dht.gets) <= {reader.keys.providers(k, b, 3) for b in range(k)}
    found_here = {bucket_of(i.peer_id, k) for i in old}
    first_two = [int(key.rsplit("/", 2)[1]) for key in dht.gets[:PROVIDER_BUCKETS]]
    if found_here & set(first_two):  # one of its two buckets held a provider: nothing more read
        assert reader.keys_read == PROVIDER_BUCKETS
    else:  # nobody there: it read further buckets
        assert reader.keys_read == PROVIDER_BUCKETS + PROVIDER_FALLBACK
    assert reader.records_read == len(entries)
    # a version nobody lists yet: two buckets, then the fall-back, and never the other version's records
    dht.gets.clear()
    assert reader.providers(7) == []
    assert len(dht.gets) == PROVIDER_BUCKETS + PROVIDER_FALLBACK
    assert all(key.endswith("/7") for key in dht.gets)
    # the provider of the new version is found under its slot once it announces there
    d = directory(dht, new[0], k)
    d.announce_provider(ProviderRecord(peer_id=new[0].peer_id, versions=[3, 7]), 60, [7])
    reader.buckets = k
    found = set()
    for _ in range(20):  # random other buckets: within a few reads it is met
        found |= {e.record.peer_id for e in reader.providers(7)}
    assert new[0].peer_id in found


def test_records_in_the_wrong_bucket_too_large_or_of_the_old_protocol_are_refused_and_counted(idents):
    from hivemind.utils import get_dht_time

    from echo_p2p import PROTOCOL_VERSION
    from echo_p2p.net.records import MAX_STR, OversizedRecordError, PeerRecord

    k = 4
    dht = FakeDht()
    ident = idents[1]
    reader = directory(dht, idents[2], k)
    wrong = (bucket_of(ident.peer_id, k) + 1) % k
    record = PeerRecord(peer_id=ident.peer_id, role="inference").to_wire()
    dht.store(reader.keys.peers(k, wrong), record, get_dht_time() + 60, ident.owner_key, True)
    assert reader.peers([wrong]) == [] and reader.rejected["wrong_bucket"] == 1
    # too large: every field within its own bound cannot make it, a stranger's extra field can
    big = {**record, "padding": "x" * PeerRecord.max_wire_bytes}
    with pytest.raises(OversizedRecordError):
        PeerRecord.from_wire(big)
    home = bucket_of(ident.peer_id, k)
    dht.store(reader.keys.peers(k, home), big, get_dht_time() + 60, ident.owner_key, True)
    assert reader.peers([home]) == [] and reader.rejected["too_large"] == 1
    # an old peer's record, under the new key layout: refused with a reason
    old = {**record, "protocol": PROTOCOL_VERSION - 1}
    dht.store(reader.keys.peers(k, home), old, get_dht_time() + 60, ident.owner_key, True)
    assert reader.peers([home]) == [] and reader.rejected["other_protocol"] == 1
    # the fields themselves are bounded: the largest honest record fits
    largest = PeerRecord(
        peer_id="Q" * 128, role="inference", maddrs=["m" * MAX_STR] * 16, stalled=["s" * 32] * 8
    )
    assert PeerRecord.from_wire(largest.to_wire()) == largest


def test_the_directory_takes_k_from_the_run_record():
    from types import SimpleNamespace

    from echo_p2p.net.identity import load_or_create_identity

    ident = load_or_create_identity(None)
    d = directory(FakeDht(), ident, 1)
    d.use_run_record(SimpleNamespace(record=SimpleNamespace(directory_buckets=64)))
    assert d.buckets == 64 and d.own_bucket() == bucket_of(ident.peer_id, 64)
    d.use_run_record(SimpleNamespace(record=None))  # no record: one bucket
    assert d.buckets == 1
    d.buckets = 16
    d.use_run_record(None)  # a reader told nothing about the run: K as it was made
    assert d.buckets == 16
    ident.cleanup()


def test_reads_are_timed_per_kind_with_the_slowest_one_kept(idents):
    """A read waits on its slowest key: the figures say so per kind of record (what a slow DHT node costs)."""
    import threading
    import time

    class SlowDht(FakeDht):
        delay = 0.0

        def get(self, key, latest, return_future):
            future = Future()
            threading.Timer(self.delay, lambda: future.set_result(None)).start()
            return future

    dht = SlowDht()
    d = directory(dht, idents[0], 4)
    d.trainers()
    dht.delay = 0.2
    started = time.monotonic()
    d.peers()  # 4 buckets asked at once: one wait
    assert time.monotonic() - started < 0.2 * 4
    d.policies()
    figures = d.read_figures()
    assert set(figures) == {"trainers", "peers", "policy"}
    assert figures["peers"]["reads"] == 1 and 0.2 <= figures["peers"]["slowest"] < 0.7
    assert figures["trainers"]["slowest"] < 0.1 <= 0.2 <= figures["policy"]["seconds"]
