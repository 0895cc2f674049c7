"""Fuzz: the directory's record parser (``SwarmDirectory._parse``, records' ``from_wire``) given any value a
DHT node can return under any subkey. Each value becomes a record of the asked type whose peer id is the
signing key's, or ``None`` with exactly one reason counted; nothing raises, and what the parser remembers
about refused records stays bounded however many arrive."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.records import ManifestRef, PeerRecord, PolicyRecord, ProviderRecord, RecordError
from tests.unit.fuzz.fuzzing import FUZZ, broken, values

pytestmark = pytest.mark.timeout(120)
KINDS = (PeerRecord, ProviderRecord, PolicyRecord)
REASONS = {"other_protocol", "malformed", "peer_id_mismatch"}


@pytest.fixture(scope="module")
def honest(identity) -> dict[type, dict]:
    peer_id = identity.peer_id
    ref = ManifestRef(version=3, digest="ab" * 32, encoding="fp32", total_bytes=10, num_chunks=1)
    return {
        PeerRecord: PeerRecord(peer_id=peer_id, role="inference", maddrs=["/ip4/127.0.0.1/tcp/1"]).to_wire(),
        ProviderRecord: ProviderRecord(peer_id=peer_id, manifests=["ab" * 32], stream_id="s").to_wire(),
        PolicyRecord: PolicyRecord(peer_id=peer_id, stream_id="s", version=3, manifests=[ref]).to_wire(),
    }


def directory(identity) -> SwarmDirectory:
    return SwarmDirectory(None, SwarmKeys("fuzz"), identity)


@FUZZ
@given(data=st.data())
def test_any_value_under_any_subkey_is_a_record_of_its_signer_or_one_counted_refusal(identity, honest, data):
    kind = data.draw(st.sampled_from(KINDS))
    value = data.draw(broken(honest[kind]) | values | st.just(honest[kind]))
    subkey = data.draw(st.just(identity.owner_key) | st.binary(max_size=80) | values)
    d = directory(identity)
    record = d._parse(subkey, value, kind)
    if record is None:
        assert sum(d.rejected.values()) == 1 and set(d.rejected) <= REASONS, d.rejected
        return
    assert isinstance(record, kind) and not d.rejected
    assert subkey == identity.owner_key and record.peer_id == identity.peer_id
    assert kind.from_wire(record.to_wire()) == record  # what was accepted reads back the same


@FUZZ
@given(st.sampled_from(KINDS), values)
def test_from_wire_returns_a_record_or_raises_a_record_error(kind, value):
    try:
        record = kind.from_wire(value)
    except RecordError as exc:
        assert str(exc)
        return
    assert isinstance(record, kind)


def test_what_the_parser_remembers_about_refused_records_stays_bounded(identity, honest):
    """Records of other protocol versions are logged once per (peer, version): a flood of distinct ones,
    with long made-up peer ids (never checked: the record is refused before), must not grow that memory."""
    d = directory(identity)
    for i in range(20_000):
        value = {**honest[PeerRecord], "protocol": PROTOCOL_VERSION + 1 + i, "peer_id": f"Qm{i}" + "x" * 1000}
        assert d._parse(identity.owner_key, value, PeerRecord) is None
    assert d.rejected["other_protocol"] == 20_000
    assert len(d._warned_protocols) <= 4096
    assert all(len(who) <= 128 for who, _ in d._warned_protocols)
