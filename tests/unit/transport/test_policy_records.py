"""The DHT records of the weights transport: PolicyRecord and the ProviderRecord fields it added."""

from __future__ import annotations

import pytest

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.records import ManifestRef, PolicyRecord, ProviderRecord, RecordError, _value_type

DIGEST = "ab" * 32


def policy(**kw) -> PolicyRecord:
    ref = ManifestRef(
        version=3, base_version=None, digest=DIGEST, encoding="fp32", total_bytes=10, num_chunks=1
    )
    return PolicyRecord(peer_id="QmX", stream_id="s1", version=3, keyframe_version=3, manifests=[ref], **kw)


def test_policy_record_round_trips_and_stays_small():
    record = policy(maddrs=["/ip4/127.0.0.1/tcp/1/p2p/QmX"])
    assert PolicyRecord.from_wire(record.to_wire()) == record
    refs = [
        ManifestRef(
            version=v, base_version=v - 1, digest=DIGEST, encoding="int8-delta", total_bytes=1, num_chunks=1
        )
        for v in range(1, 11)
    ]
    import msgpack

    big = record.model_copy(update={"manifests": refs})
    assert len(msgpack.packb(big.to_wire())) < 2500  # a keyframe interval's worth of deltas


@pytest.mark.parametrize(
    "change",
    [
        {"stream_id": ""},
        {"version": -1},
        {
            "manifests": [
                {"version": 1, "digest": "XYZ", "encoding": "fp32", "total_bytes": 1, "num_chunks": 1}
            ]
        },
        {
            "manifests": [
                {
                    "version": 1,
                    "digest": DIGEST.upper(),
                    "encoding": "fp32",
                    "total_bytes": 1,
                    "num_chunks": 1,
                }
            ]
        },
        {
            "manifests": [
                {"version": 1, "digest": DIGEST, "encoding": "fp32", "total_bytes": 1, "num_chunks": 1}
            ]
            * 65
        },
    ],
)
def test_malformed_policy_records_are_refused(change):
    with pytest.raises(RecordError):
        PolicyRecord.from_wire(policy().to_wire() | change)
    with pytest.raises(ValueError):  # and refused by the DHT schema validator at store time
        _value_type(PolicyRecord).validate(policy().to_wire() | change)


def test_provider_record_digests_are_checked():
    record = ProviderRecord(peer_id="QmX", stream_id="s1", manifests=[DIGEST], partial=[DIGEST])
    assert ProviderRecord.from_wire(record.to_wire()) == record
    with pytest.raises(RecordError):
        ProviderRecord.from_wire(record.to_wire() | {"partial": ["nope"]})
    old_style = {
        "protocol": PROTOCOL_VERSION,
        "peer_id": "QmX",
        "versions": [1],
    }  # before the new fields: still valid
    assert ProviderRecord.from_wire(old_style).manifests == []


def test_schema_validator_covers_the_policy_key():
    from hivemind.dht.schema import SchemaValidator

    from echo_p2p.net.records import schema_validator

    validator = schema_validator(SwarmKeys("run-x"))
    assert isinstance(validator, SchemaValidator)
    assert any(SwarmKeys("run-x").policy in str(f) for f in validator._schemas[0].__fields__)
