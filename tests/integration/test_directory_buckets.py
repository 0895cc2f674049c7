"""The sharded directory between real DHT nodes on 127.0.0.1: peers announce into their buckets, a sampler
reads two of them, status polls a few at a time and counts what it has not seen; old-protocol, oversized and
misplaced records are refused with a reason (a too-large one already by every node; readers' own refusal
of one, from a node without these checks, is in the unit tests)."""

from __future__ import annotations

import logging

import pytest
from hivemind.utils import get_dht_time

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.monitor.sampling import BucketSampler
from echo_p2p.monitor.status import build_status, read_snapshot
from echo_p2p.net.buckets import bucket_of
from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.network_config import NetworkConfig
from echo_p2p.net.node import start_dht, stop_dht
from echo_p2p.net.records import MAX_VALUE_BYTES, PeerRecord, ProviderRecord

pytestmark = pytest.mark.timeout(180)
LOOP = ["/ip4/127.0.0.1/tcp/0"]
K = 4


@pytest.fixture
def nodes():
    keys = SwarmKeys("buckets")
    started = []

    def node(initial_peers=()):
        ident = load_or_create_identity(None)
        dht = start_dht(NetworkConfig(initial_peers=list(initial_peers), host_maddrs=LOOP), ident, [keys])
        started.append((dht, ident))
        return SwarmDirectory(dht, keys, ident, request_timeout=10, buckets=K)

    yield node
    for dht, ident in started:
        stop_dht(dht)
        ident.cleanup()


def test_bucketed_reads_status_sampling_and_refusals(nodes, caplog):
    boot = nodes()
    first = [str(m) for m in boot.dht.get_visible_maddrs()]
    writers = [nodes(first) for _ in range(4)]
    reader = nodes(first)
    for w in writers:
        assert w.announce(PeerRecord(peer_id=w.identity.peer_id, role="inference"), ttl=60)
    by_bucket = {b: {w.identity.peer_id for w in writers if w.own_bucket() == b} for b in range(K)}

    # everything, for tools: all four; a sampler's read: its bucket and one other, nothing more
    assert {e.record.peer_id for e in reader.peers()} == {w.identity.peer_id for w in writers}
    reader.keys_read = reader.records_read = 0
    sample = {e.record.peer_id for e in reader.peer_sample(at_least=1)}  # (a sparser sample reads on)
    assert reader.keys_read == 2
    read = [b for b in range(K) if by_bucket[b] & sample or not by_bucket[b]]
    assert reader.records_read == len(sample) and sample <= {w.identity.peer_id for w in writers}
    assert by_bucket[reader.own_bucket()] <= sample and len(read) >= 1

    # status reading two buckets a poll: an estimate of the rest first, every peer after two polls
    sampler = BucketSampler(per_poll=2)
    snap = read_snapshot(reader, "buckets", sampler=sampler)
    assert snap.buckets["known"] == 2 and snap.buckets["read_now"] == 2
    seen = len(snap.peers)
    assert snap.buckets["unseen_peers"] == seen  # two buckets not read, estimated like the two read
    snap = read_snapshot(reader, "buckets", sampler=sampler)
    assert len(snap.peers) == 4 and snap.buckets == {"total": K, "read_now": 2, "known": K, "unseen_peers": 0}
    assert build_status(snap)["summary"]["peers_unseen"] == 0

    # a fetcher finds a provider of its version only in that version's slot
    provider = writers[0]
    assert provider.announce_provider(
        ProviderRecord(peer_id=provider.identity.peer_id, versions=[3]), 60, [3]
    )
    reader.keys_read = 0
    found = set()
    for _ in range(10):
        found |= {e.record.peer_id for e in reader.providers(3)}
    assert found == {provider.identity.peer_id}
    assert reader.providers(4) == []  # another version's slot: nobody there

    # refusals: an old-protocol record under the new layout, a record in the wrong bucket, an oversized one
    old, misplaced, big = writers[1], writers[2], writers[3]
    old_record = {**PeerRecord(peer_id=old.identity.peer_id, role="inference").to_wire(), "protocol": 2}
    assert PROTOCOL_VERSION == 3
    old_key = reader.keys.peers(K, old.own_bucket())
    assert old.dht.store(old_key, old_record, get_dht_time() + 60, subkey=old.identity.owner_key)
    wrong = (misplaced.own_bucket() + 1) % K
    record = PeerRecord(peer_id=misplaced.identity.peer_id, role="inference").to_wire()
    assert misplaced.dht.store(
        reader.keys.peers(K, wrong), record, get_dht_time() + 60, subkey=misplaced.identity.owner_key
    )
    huge = {
        **PeerRecord(peer_id=big.identity.peer_id, role="inference").to_wire(),
        "pad": "x" * MAX_VALUE_BYTES,
    }
    key = reader.keys.peers(K, big.own_bucket())
    # too large: refused by every node (above MAX_VALUE_BYTES; above PeerRecord.max_wire_bytes, the schema)
    assert not big.dht.store(key, huge, get_dht_time() + 60, subkey=big.identity.owner_key)
    over = {**PeerRecord(peer_id=big.identity.peer_id, role="inference").to_wire(), "pad": "x" * 9000}
    assert not big.dht.store(key, over, get_dht_time() + 60, subkey=big.identity.owner_key)
    caplog.set_level(logging.INFO, logger="echo_p2p.net.directory")
    reader.rejected.clear()
    ids = {e.record.peer_id for e in reader.peers()}
    assert old.identity.peer_id not in ids
    assert misplaced.identity.peer_id in ids and big.identity.peer_id in ids  # their own records stand
    assert reader.rejected == {"other_protocol": 1, "wrong_bucket": 1}, reader.rejected
    assert (
        f"ignoring peer {old.identity.peer_id}: record of protocol version 2 (this peer speaks 3"
        in caplog.text
    )
    assert bucket_of(misplaced.identity.peer_id, K) != wrong
