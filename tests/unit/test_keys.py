import pytest

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.keys import SwarmKeys, validate_run_id


def test_keys_carry_protocol_version_and_run_id():
    keys = SwarmKeys("my-run_1")
    assert keys.peers == "echo/v2/my-run_1/peers"
    assert keys.policy == "echo/v2/my-run_1/policy"
    assert keys.providers == "echo/v2/my-run_1/providers"
    assert keys.run == "echo/v2/my-run_1/run"
    assert set(keys.all_keys().values()) == {
        keys.peers,
        keys.trainers,
        keys.policy,
        keys.providers,
        keys.run,
        keys.bans,
    }
    assert keys.trainers == "echo/v2/my-run_1/trainers"


def test_two_runs_and_two_protocols_never_share_a_key():
    a, b, a2 = SwarmKeys("a"), SwarmKeys("b"), SwarmKeys("a", protocol=PROTOCOL_VERSION + 1)
    assert not set(a.all_keys().values()) & set(b.all_keys().values())
    assert not set(a.all_keys().values()) & set(a2.all_keys().values())


@pytest.mark.parametrize("bad", ["", "with space", "a/b", "-lead", "x" * 65, "ü", "dotted.name"])
def test_invalid_run_ids_are_refused(bad):
    with pytest.raises(ValueError, match="invalid run id"):
        validate_run_id(bad)
    with pytest.raises(ValueError):
        SwarmKeys(bad)
