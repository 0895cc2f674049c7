import pytest

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.keys import SwarmKeys, validate_run_id


def test_keys_carry_protocol_version_and_run_id():
    keys = SwarmKeys("my-run_1")
    assert keys.peers(16, 3) == "echo/v3/my-run_1/peers/16/3"
    assert keys.policy == "echo/v3/my-run_1/policy"
    assert keys.providers(16, 3, 17) == "echo/v3/my-run_1/providers/16/3/1"  # version 17's slot of 16
    assert keys.run == "echo/v3/my-run_1/run"
    assert set(keys.all_keys().values()) == {keys.trainers, keys.policy, keys.run, keys.bans}
    assert keys.trainers == "echo/v3/my-run_1/trainers"


def test_every_bucket_key_of_every_allowed_k_is_known_up_front():
    """DHT nodes check records under the keys they know: each bucket key at each K a run may choose."""
    from echo_p2p.net.buckets import ALLOWED_BUCKETS, VERSION_SLOTS

    keys = SwarmKeys("r").bucket_keys()
    assert len(keys) == sum(ALLOWED_BUCKETS) * (1 + VERSION_SLOTS)
    assert keys[SwarmKeys("r").peers(256, 255)] == "peers"
    assert keys[SwarmKeys("r").providers(4, 0, 123)] == "providers"


def test_two_runs_and_two_protocols_never_share_a_key():
    a, b, a2 = SwarmKeys("a"), SwarmKeys("b"), SwarmKeys("a", protocol=PROTOCOL_VERSION + 1)
    for x, y in ((a, b), (a, a2)):
        assert not set(x.all_keys().values()) & set(y.all_keys().values())
        assert not set(x.bucket_keys()) & set(y.bucket_keys())


@pytest.mark.parametrize("bad", ["", "with space", "a/b", "-lead", "x" * 65, "ü", "dotted.name"])
def test_invalid_run_ids_are_refused(bad):
    with pytest.raises(ValueError, match="invalid run id"):
        validate_run_id(bad)
    with pytest.raises(ValueError):
        SwarmKeys(bad)
