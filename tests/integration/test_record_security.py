"""Signed, schema-checked, bucketed directory records between real DHT nodes on 127.0.0.1 (in-process)."""

from __future__ import annotations

import logging

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import RecordValidatorBase
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

pytestmark = pytest.mark.timeout(120)
LOOP = ["/ip4/127.0.0.1/tcp/0"]
K = 4  # directory buckets of the sharded-directory test


class ForgingValidator(RecordValidatorBase):
    """An attacker's node: signs every record with its own key, whatever owner the subkey names."""

    def __init__(self, attacker_key):
        self.key = attacker_key

    def validate(self, record) -> bool:
        return True

    def sign_value(self, record) -> bytes:
        import dataclasses

        from hivemind.utils import MSGPackSerializer

        signature = self.key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + b"[signature:" + signature + b"]"

    def strip_value(self, record) -> bytes:
        return RSASignatureValidator._SIGNATURE_RE.sub(b"", record.value)


@pytest.fixture
def swarm():
    keys = SwarmKeys("sec")
    started = []

    def honest(initial_peers=()):
        ident = load_or_create_identity(None)
        dht = start_dht(NetworkConfig(initial_peers=list(initial_peers), host_maddrs=LOOP), ident, [keys])
        started.append((dht, ident))
        return dht, ident, SwarmDirectory(dht, keys, ident, request_timeout=10)

    yield keys, honest, started
    for dht, ident in started:
        stop_dht(dht)
        ident.cleanup()


def maddrs(dht):
    return [str(m) for m in dht.get_visible_maddrs()]


def test_forged_record_for_someone_elses_subkey_is_rejected(swarm):
    keys, honest, started = swarm
    boot, _, _ = honest()
    victim_dht, victim, victim_dir = honest(maddrs(boot))
    reader_dht, _, reader_dir = honest(maddrs(boot))
    assert victim_dir.announce(PeerRecord(peer_id=victim.peer_id, role="trainer"), ttl=60)

    attacker_ident = load_or_create_identity(None)
    attacker = hivemind.DHT(
        start=True,
        host_maddrs=LOOP,
        initial_peers=maddrs(boot),
        record_validators=[ForgingValidator(attacker_ident.private_key)],
    )
    started.append((attacker, attacker_ident))
    forged = PeerRecord(peer_id=victim.peer_id, role="trainer", state="leaving").to_wire()
    # every honest node refuses to store it (the attacker's own node keeps a copy, which it serves)
    attacker.store(keys.trainers, forged, get_dht_time() + 60, subkey=victim.owner_key)

    for directory in (reader_dir, victim_dir):
        records = {e.record.peer_id: e.record for e in directory.trainers()}
        assert records[victim.peer_id].role == "trainer"
        assert records[victim.peer_id].state == "running"


def test_record_whose_peer_id_does_not_match_its_signing_key_is_dropped(swarm):
    keys, honest, _ = swarm
    boot, _, _ = honest()
    _, victim, _ = honest(maddrs(boot))
    _, liar, liar_dir = honest(maddrs(boot))
    _, _, reader_dir = honest(maddrs(boot))
    # correctly signed by the liar's own key, but claiming to be the victim
    assert liar_dir.announce(PeerRecord(peer_id=victim.peer_id, role="inference"), ttl=60)
    assert reader_dir.peers() == []
    assert reader_dir.rejected["peer_id_mismatch"] == 1


def test_malformed_record_is_refused_by_honest_nodes_and_never_crashes_a_reader(swarm):
    keys, honest, started = swarm
    boot, _, _ = honest()
    _, _, reader_dir = honest(maddrs(boot))
    rogue, rogue_ident = rogue_node(boot, started)
    bad = {
        "protocol": PROTOCOL_VERSION,
        "peer_id": rogue_ident.peer_id,
        "role": "emperor",
        "policy_version": "many",
    }
    rogue.store(keys.peers(1, 0), bad, get_dht_time() + 60, subkey=rogue_ident.owner_key)
    rogue.store(keys.peers(1, 0), b"\xff not even a map", get_dht_time() + 60, subkey=rogue_ident.owner_key)
    assert reader_dir.peers() == []


def test_record_of_another_protocol_version_is_ignored_with_one_log_line(swarm, caplog):
    keys, honest, _ = swarm
    boot, _, _ = honest()
    _, future_peer, future_dir = honest(maddrs(boot))
    _, _, reader_dir = honest(maddrs(boot))
    newer = {
        "protocol": PROTOCOL_VERSION + 1,
        "peer_id": future_peer.peer_id,
        "role": "inference",
        "shiny_new_field": True,
    }
    from hivemind.utils import get_dht_time as now

    stored = future_dir.dht.store(keys.peers(1, 0), newer, now() + 60, subkey=future_peer.owner_key)
    assert stored  # records of another protocol version pass the DHT schema: they are that version's business
    with caplog.at_level(logging.INFO, logger="echo_p2p"):
        assert reader_dir.peers() == []
        assert reader_dir.peers() == []
    lines = [r for r in caplog.records if f"protocol version {PROTOCOL_VERSION + 1}" in r.getMessage()]
    assert len(lines) == 1
    assert reader_dir.rejected["other_protocol"] == 2


def rogue_node(boot, started):
    """A stranger's DHT node: signs with its own key (valid signatures) but runs none of echo_p2p's rules,
    so it keeps whatever it stores and serves it to readers."""
    ident = load_or_create_identity(None)
    dht = hivemind.DHT(
        start=True,
        host_maddrs=LOOP,
        initial_peers=maddrs(boot),
        record_validators=[RSASignatureValidator(ident.private_key)],
    )
    started.append((dht, ident))
    return dht, ident


def test_one_key_holds_one_record_a_flood_of_subkeys_is_refused_and_ignored(swarm):
    """hivemind only asks a subkey to *contain* its signer's key: one key could sign 1,500 peer records and
    hide the run. echo_p2p nodes refuse any subkey other than exactly the owner marker, readers ignore them."""
    keys, honest, started = swarm
    boot, _, _ = honest()
    _, trainer, trainer_dir = honest(maddrs(boot))
    _, _, reader_dir = honest(maddrs(boot))
    assert trainer_dir.announce(PeerRecord(peer_id=trainer.peer_id, role="inference"), ttl=60)
    rogue, rogue_ident = rogue_node(boot, started)
    record = PeerRecord(peer_id=rogue_ident.peer_id, role="inference").to_wire()
    for i in range(50):
        rogue.store(keys.peers(1, 0), record, get_dht_time() + 60, subkey=rogue_ident.owner_key + b"%d" % i)
    # an honest node refuses to store them
    boot_value = boot.get(keys.peers(1, 0), latest=True)
    stored_subkeys = set(boot_value.value) if boot_value is not None else set()
    assert all(s in (trainer.owner_key,) for s in stored_subkeys), len(stored_subkeys)
    # a reader that also asks the rogue node sees only honest records, the rest counted
    found = reader_dir.peers()
    assert [e.record.peer_id for e in found] == [trainer.peer_id]


def test_a_record_stored_to_outlive_its_writer_is_refused_and_ignored(swarm):
    """A ghost trainer stored one record expiring in 10^6 s and left: no echo_p2p node stores an expiry
    beyond MAX_RECORD_TTL, and readers ignore one served by a rogue node."""
    from echo_p2p.net.records import MAX_RECORD_TTL

    keys, honest, started = swarm
    boot, _, _ = honest()
    _, ghost, ghost_dir = honest(maddrs(boot))
    _, _, reader_dir = honest(maddrs(boot))
    record = PeerRecord(peer_id=ghost.peer_id, role="trainer")
    assert not ghost_dir.announce(record, ttl=1e6)  # refused by every honest node, its own included
    assert ghost_dir.announce(record, ttl=MAX_RECORD_TTL)  # the longest honest lifetime is fine
    rogue, rogue_ident = rogue_node(boot, started)
    rogue.store(
        keys.trainers,
        PeerRecord(peer_id=rogue_ident.peer_id, role="trainer").to_wire(),
        get_dht_time() + 1e6,
        subkey=rogue_ident.owner_key,
    )
    assert [e.record.peer_id for e in reader_dir.trainers()] == [ghost.peer_id]


async def _stored_trainer_writers(_dht, node, key: str) -> list[str]:
    """Inside a DHT process: the peer ids whose records this node holds under ``key`` (storage, not network)."""
    from hivemind.dht.routing import DHTID

    from echo_p2p.net.identity import peer_id_from_owner_key

    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None or not hasattr(found.value, "items"):
        return []
    return sorted(peer_id_from_owner_key(subkey) for subkey, _ in found.value.items())


def test_only_the_runs_trainers_write_the_trainers_key(swarm):
    """Keys are cheap: a Sybil makes one record per key under ``peers``. The trainers key takes only the
    trainers the run trusts: a node told them (``follow_trust``) drops what others stored there before, refuses
    new such records, and a reader told them drops a rogue node's answer that holds one."""
    from functools import partial

    from echo_p2p.guard.trust import RunTrust, TrustedTrainers

    keys, honest, started = swarm
    boot, _, boot_dir = honest()
    _, trainer, trainer_dir = honest(maddrs(boot))
    _, stranger, stranger_dir = honest(maddrs(boot))  # echo_p2p code under a stranger's key
    _, _, reader_dir = honest(maddrs(boot))
    stored = partial(_stored_trainer_writers, key=keys.trainers)
    # while the nodes know no trainers (open), the stranger's trainer record lands on the bootstrap
    assert stranger_dir.announce(PeerRecord(peer_id=stranger.peer_id, role="trainer"), ttl=60)
    assert stranger.peer_id in boot.run_coroutine(stored)

    trust = RunTrust(fixed=TrustedTrainers.from_keys([trainer.peer_id]))
    for directory in (boot_dir, trainer_dir, reader_dir):
        assert directory.follow_trust(trust)
    assert boot.run_coroutine(stored) == []  # removed when the node learned the run's trainers
    assert trainer_dir.announce(PeerRecord(peer_id=trainer.peer_id, role="trainer"), ttl=60)
    assert boot.run_coroutine(stored) == [trainer.peer_id]
    stranger_dir.announce(PeerRecord(peer_id=stranger.peer_id, role="trainer"), ttl=60)  # only its own node
    assert boot.run_coroutine(stored) == [trainer.peer_id]  # refused by the told nodes

    # a trainer's record cannot stand in for an inference peer's: no echo_p2p node takes it under peers
    assert not boot_dir._store(
        keys.peers(1, 0), PeerRecord(peer_id=boot_dir.identity.peer_id, role="trainer"), 60
    )
    assert reader_dir.peers() == []

    rogue, rogue_ident = rogue_node(boot, started)  # plain hivemind: keeps and serves what it stores
    rogue.store(
        keys.trainers,
        PeerRecord(peer_id=rogue_ident.peer_id, role="trainer").to_wire(),
        get_dht_time() + 60,
        subkey=rogue_ident.owner_key,
    )
    assert boot.run_coroutine(stored) == [trainer.peer_id]
    for _ in range(3):  # whichever nodes answer first, the untrusted records never reach the reader
        assert [e.record.peer_id for e in reader_dir.trainers()] == [trainer.peer_id]


def test_only_copies_of_the_owners_run_record_are_kept(swarm, tmp_path):
    """Every peer reads the run key on every heartbeat: a node told the run's owner keeps only copies of a run
    record that key signed, so a Sybil cannot make each of its keys store a bogus copy for every reader to
    verify (it keeps a rogue's copy out of the readers' answers too)."""
    from functools import partial

    from echo_p2p.guard.trust import RunTrust
    from echo_p2p.net.records import SignedRunRecord
    from echo_p2p.net.run_record import read_file
    from tests.conftest import write_run_record

    keys, honest, started = swarm
    boot, _, boot_dir = honest()
    _, keeper, keeper_dir = honest(maddrs(boot))
    _, stranger, stranger_dir = honest(maddrs(boot))
    _, _, reader_dir = honest(maddrs(boot))
    owner = load_or_create_identity(None)

    def signed(path, ident, owner_ident) -> SignedRunRecord:
        _, record, signature = read_file(write_run_record(path, keys.run_id, owner_ident, [keeper.peer_id]))
        return SignedRunRecord(peer_id=ident.peer_id, record=record, signature=signature)

    good = signed(tmp_path / "good.record", keeper, owner)
    forged = signed(tmp_path / "forged.record", stranger, stranger)  # a valid record of another "owner"
    trust = RunTrust(owner=owner.peer_id, run_id=keys.run_id)
    assert trust.update([good])
    assert stranger_dir.announce_run_record(forged, ttl=60)  # while the nodes are open: it lands
    stored = partial(_stored_trainer_writers, key=keys.run)
    assert stranger.peer_id in boot.run_coroutine(stored)
    for directory in (boot_dir, reader_dir):
        assert directory.follow_trust(trust)
    assert boot.run_coroutine(stored) == []  # removed once the node knew the owner
    assert keeper_dir.announce_run_record(good, ttl=60)
    stranger_dir.announce_run_record(forged, ttl=60)  # kept by its own node only
    assert boot.run_coroutine(stored) == [keeper.peer_id]
    for _ in range(3):
        assert [e.record.peer_id for e in reader_dir.run_records()] == [keeper.peer_id]
    owner.cleanup()


def test_bucketed_reads_status_sampling_and_refusals(swarm, caplog):
    """The sharded directory (K = 4) between real nodes: peers announce into their buckets, a sampler reads
    two of them, status polls two at a time and counts what it has not seen; old-protocol and misplaced
    records are refused with a reason, too-large ones by every node (readers' own refusal of one, from a node
    without these checks, is in tests/unit/test_buckets.py)."""
    _, honest, _ = swarm
    boot = honest()[0]

    def node() -> SwarmDirectory:
        directory = honest(maddrs(boot))[2]
        directory.buckets = K
        return directory

    writers = [node() for _ in range(4)]
    reader = node()
    for w in writers:
        assert w.announce(PeerRecord(peer_id=w.identity.peer_id, role="inference"), ttl=60)
    home = {w.identity.peer_id for w in writers if w.own_bucket() == reader.own_bucket()}

    # everything, for tools: all four; a sampler's read: its bucket and one other, nothing more
    assert {e.record.peer_id for e in reader.peers()} == {w.identity.peer_id for w in writers}
    reader.keys_read = reader.records_read = 0
    # at_least=0: exactly the two buckets, even when the random peer ids left both empty (with at_least=1 it
    # then reads on, as it should: tests/unit/test_buckets.py; a fresh-clone run drew such ids once)
    sample = {e.record.peer_id for e in reader.peer_sample(at_least=0)}
    assert reader.keys_read == 2
    assert reader.records_read == len(sample) and sample <= {w.identity.peer_id for w in writers}
    assert home <= sample

    # status reading two buckets a poll: an estimate of the rest first, every peer after two polls
    sampler = BucketSampler(per_poll=2)
    snap = read_snapshot(reader, "sec", sampler=sampler)
    assert snap.buckets["known"] == 2 and snap.buckets["read_now"] == 2
    seen = len(snap.peers)
    assert snap.buckets["unseen_peers"] == seen  # two buckets not read, estimated like the two read
    snap = read_snapshot(reader, "sec", sampler=sampler)
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
