import pytest

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.records import OtherProtocolError, PeerRecord, ProviderRecord, RecordError, _value_type


def test_peer_record_round_trip():
    rec = PeerRecord(
        peer_id="QmX",
        role="inference",
        policy_version=3,
        maddrs=["/ip4/127.0.0.1/tcp/1/p2p/QmX"],
        tokens_per_second=12.5,
    )
    wire = rec.to_wire()
    assert wire["protocol"] == PROTOCOL_VERSION
    assert PeerRecord.from_wire(wire) == rec


def test_unknown_fields_are_ignored():
    wire = PeerRecord(peer_id="QmX", role="trainer").to_wire() | {"new_field_from_the_future": [1, 2]}
    assert PeerRecord.from_wire(wire).peer_id == "QmX"


def test_other_protocol_version_is_a_distinct_error():
    wire = PeerRecord(peer_id="QmX", role="trainer").to_wire() | {
        "protocol": PROTOCOL_VERSION + 1,
        "role": "?",
    }
    with pytest.raises(OtherProtocolError) as info:
        PeerRecord.from_wire(wire)
    assert info.value.protocol == PROTOCOL_VERSION + 1


@pytest.mark.parametrize(
    "value",
    [
        None,
        [1, 2],
        b"bytes",
        {"role": "trainer", "peer_id": "QmX"},  # no protocol
        {"protocol": "1", "role": "trainer", "peer_id": "QmX"},  # protocol not an int
        {"protocol": PROTOCOL_VERSION, "role": "emperor", "peer_id": "QmX"},
        {"protocol": PROTOCOL_VERSION, "role": "trainer"},  # no peer id
        {"protocol": PROTOCOL_VERSION, "role": "trainer", "peer_id": "QmX", "policy_version": -1},
        {"protocol": PROTOCOL_VERSION, "role": "trainer", "peer_id": "QmX", "maddrs": ["a"] * 100},
        {"protocol": PROTOCOL_VERSION, "role": "trainer", "peer_id": "x" * 1000},
        {
            "protocol": PROTOCOL_VERSION,
            "role": "inference",
            "peer_id": "QmX",
            "tokens_per_second": float("inf"),
        },
        {
            "protocol": PROTOCOL_VERSION,
            "role": "inference",
            "peer_id": "QmX",
            "rollouts_per_second": float("nan"),
        },
        {"protocol": PROTOCOL_VERSION, "role": "trainer", "peer_id": "QmX", "updated_at": float("nan")},
    ],
)
def test_malformed_records_raise_record_error(value):
    with pytest.raises(RecordError):
        PeerRecord.from_wire(value)


def test_provider_record_round_trip():
    rec = ProviderRecord(peer_id="QmY", versions=[4, 5], encodings=["int8-delta"])
    assert ProviderRecord.from_wire(rec.to_wire()) == rec


def test_dht_schema_type_accepts_valid_and_future_records_unchanged_and_refuses_malformed():
    typ = _value_type(PeerRecord)
    good = PeerRecord(peer_id="QmX", role="trainer").to_wire() | {"extra": 1}
    assert typ.validate(good) is good  # hivemind refuses any conversion: the raw map must come back
    future = {"protocol": PROTOCOL_VERSION + 1, "anything": "goes"}
    assert typ.validate(future) is future
    with pytest.raises(ValueError):
        typ.validate({"protocol": PROTOCOL_VERSION, "role": "nope", "peer_id": "QmX"})


def test_directory_reads_one_record_per_owner_key_and_no_far_expiry():
    """What a reader keeps of what any DHT node serves (a node without echo_p2p's rules included)."""
    from concurrent.futures import Future

    from hivemind.utils import ValueWithExpiration, get_dht_time

    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.records import MAX_RECORD_TTL, PeerRecord

    honest, flooder = load_or_create_identity(None), load_or_create_identity(None)
    now = get_dht_time()

    def entry(ident, ttl):
        return ValueWithExpiration(PeerRecord(peer_id=ident.peer_id, role="trainer").to_wire(), now + ttl)

    served = {honest.owner_key: entry(honest, MAX_RECORD_TTL)}
    served.update({flooder.owner_key + b"%d" % i: entry(flooder, 60) for i in range(20)})
    served[b"x" + flooder.owner_key] = entry(flooder, 60)
    served[flooder.owner_key] = entry(flooder, 1e6)

    class FakeDht:
        def get(self, key, latest, return_future):
            future = Future()
            future.set_result(ValueWithExpiration(served, now + 60))
            return future

    directory = SwarmDirectory(FakeDht(), SwarmKeys("r"), honest)
    assert [e.record.peer_id for e in directory.trainers()] == [honest.peer_id]
    assert directory.rejected == {"bad_subkey": 21, "expiry_too_far": 1}
    directory.rejected.clear()  # the same records read as ``peers``: a trainer record there is out of place
    assert directory.peers() == []
    assert directory.rejected == {"bad_subkey": 21, "expiry_too_far": 1, "wrong_key_for_role": 1}
    assert directory.records_read == 2 * 23 and directory.keys_read == 2  # parsed or not, each was read
    honest.cleanup()
    flooder.cleanup()


def test_the_largest_honest_group_fits_the_wire_bound_that_trainers_enforce():
    """Trainers refuse frames above ``RolloutGroup.max_wire_bytes`` unread: every honest group must fit,
    token ids as large as 32 bits and log-probs as precise as a double included."""
    from echo_p2p.rollout import Completion, RolloutGroup

    prompt, group_size, completion = 1024, 16, 512
    group = RolloutGroup(
        task="arithmetic" * 6,
        prompt_id=2**62,
        prompt_token_ids=[2**32 - 1] * prompt,
        completions=[
            Completion(
                token_ids=[2**32 - 1] * completion, logprobs=[-1 / 3] * completion, claimed_reward=1 / 3
            )
            for _ in range(group_size)
        ],
        policy_version=2**62,
        sampler_peer_id="Qm" + "x" * 126,
        sampled_at=1.0e9 + 1 / 3,
        weights_stream="f" * 64,
        sampling_seed="ab" * 16,
    )
    size = len(group.to_bytes())
    bound = RolloutGroup.max_wire_bytes(prompt, group_size, completion)
    assert size <= bound < 1.1 * size + 4096, (size, bound)


def test_fetches_share_one_provider_read_within_its_max_age():
    """Each fetch of a version read every provider record (a Sybil's keys can each store one), several times
    a second: a read younger than ``max_age`` is reused; ``max_age=0`` reads again."""
    from concurrent.futures import Future

    from hivemind.utils import ValueWithExpiration, get_dht_time

    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys

    ident = load_or_create_identity(None)
    now = get_dht_time()
    record = ProviderRecord(peer_id=ident.peer_id, versions=[1]).to_wire()  # K = 1: one key per version
    gets = []

    class FakeDht:
        def get(self, key, latest, return_future):
            gets.append(key)
            future = Future()
            future.set_result(
                ValueWithExpiration({ident.owner_key: ValueWithExpiration(record, now + 60)}, now + 60)
            )
            return future

    directory = SwarmDirectory(FakeDht(), SwarmKeys("r"), ident)
    assert [e.record.peer_id for e in directory.providers(1, max_age=1.0)] == [ident.peer_id]
    assert [e.record.peer_id for e in directory.providers(1, max_age=1.0)] == [ident.peer_id]
    assert len(gets) == 1
    directory.providers(1)
    assert len(gets) == 2
    directory.providers(2, max_age=1.0)  # another version: another key, not the cached read
    assert gets[-1] == SwarmKeys("r").providers(1, 0, 2) and len(gets) == 3
    ident.cleanup()
