import os

import pytest

from echo_p2p.metrics import MetricsWriter, read_metrics
from echo_p2p.net.identity import IdentityError, load_or_create_identity, peer_id_from_owner_key


def test_identity_is_created_then_reloaded_with_the_same_peer_id(tmp_path):
    path = tmp_path / "sub" / "id.key"
    first = load_or_create_identity(str(path))
    assert path.exists() and oct(path.stat().st_mode & 0o777) == "0o400"
    second = load_or_create_identity(str(path))
    assert first.peer_id == second.peer_id and first.peer_id.startswith("Qm")
    assert peer_id_from_owner_key(first.owner_key) == first.peer_id


def test_hivemind_derives_the_same_peer_id_from_the_file(tmp_path):
    from hivemind.p2p import PeerID

    ident = load_or_create_identity(str(tmp_path / "id.key"))
    assert PeerID.from_identity((tmp_path / "id.key").read_bytes()).to_base58() == ident.peer_id


def test_ephemeral_identity_is_removed_when_dropped_without_cleanup():
    """A holder that only signs records (no DHT, no cleanup call) leaves no private key behind."""
    import gc

    ident = load_or_create_identity(None)
    folder = os.path.dirname(ident.path)
    assert os.path.exists(ident.path)
    del ident
    gc.collect()
    assert not os.path.exists(folder)


def test_ephemeral_identity_is_removed_on_cleanup():
    ident = load_or_create_identity(None)
    assert ident.ephemeral and os.path.exists(ident.path)
    ident.cleanup()
    assert not os.path.exists(ident.path)


def test_garbage_identity_file_gives_a_clear_error(tmp_path):
    bad = tmp_path / "id.key"
    bad.write_bytes(b"not a key at all")
    with pytest.raises(IdentityError, match="not a valid libp2p RSA private key"):
        load_or_create_identity(str(bad))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file; unreadability is tested via a directory")
def test_unreadable_identity_file_gives_a_clear_error(tmp_path):
    bad = tmp_path / "id.key"
    bad.write_bytes(b"x")
    bad.chmod(0)
    with pytest.raises(IdentityError, match="cannot read"):
        load_or_create_identity(str(bad))


def test_identity_path_that_is_a_directory_gives_a_clear_error(tmp_path):
    with pytest.raises(IdentityError, match="cannot read identity file"):
        load_or_create_identity(str(tmp_path))


def test_owner_key_garbage_gives_none():
    assert peer_id_from_owner_key(b"[owner:garbage]") is None
    assert peer_id_from_owner_key(b"no marker") is None


def test_metrics_lines_carry_common_fields(tmp_path):
    w = MetricsWriter(str(tmp_path / "m"), "inference", "QmPeer")
    w.write(3, tokens_per_second=10.0)
    w.write(4, tokens_per_second=11.0)
    lines = read_metrics(str(tmp_path / "m" / "inference-QmPeer.jsonl"))
    assert [(x["role"], x["peer_id"], x["version"], x["tokens_per_second"]) for x in lines] == [
        ("inference", "QmPeer", 3, 10.0),
        ("inference", "QmPeer", 4, 11.0),
    ]
    assert MetricsWriter(None, "trainer", "Qm").write(1, x=1) is None
