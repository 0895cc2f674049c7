"""Trusted-trainers files and the manifest check (signature, key, peer id, trust) — no network."""

from __future__ import annotations

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from echo_p2p.guard import trust
from echo_p2p.guard.trust import TrustedTrainers, TrustFileError, check_manifest
from echo_p2p.net.identity import peer_id_from_rsa
from echo_p2p.weights.manifest import ChunkInfo, Manifest, ParamInfo


@pytest.fixture(scope="module")
def keys():
    return RSAPrivateKey(), RSAPrivateKey()


def ssh(key: RSAPrivateKey) -> str:
    return key.get_public_key().to_bytes().decode()


def pid(key: RSAPrivateKey) -> str:
    return peer_id_from_rsa(key.get_public_key())


def manifest_of(key: RSAPrivateKey, **overrides) -> Manifest:
    fields = dict(
        run_id="run",
        version=3,
        stream_id="s1",
        encoding="fp32",
        chunk_size=16,
        params=[ParamInfo(name="w", shape=[4], dtype="float32")],
        chunks=[ChunkInfo(index=0, size=16, sha256="0" * 64)],
        total_bytes=16,
        publisher=pid(key),
        publisher_key=key.get_public_key().to_bytes(),
        created_at=1.0,
    )
    return Manifest(**{**fields, **overrides}).sign(key.sign)


def test_trust_file_takes_ssh_keys_and_peer_ids_with_comments(tmp_path, keys):
    a, b = keys
    path = tmp_path / "trainers.txt"
    path.write_text(f"# run owners\n\n{ssh(a)} trainer-a  # lab GPU\n   {pid(b)}   # by peer id\n")
    trusted = TrustedTrainers.from_file(path)
    assert trusted.peer_ids == {pid(a), pid(b)} and len(trusted) == 2
    assert trusted.is_trusted(pid(a)) and not trusted.is_trusted("QmSomeoneElse")


@pytest.mark.parametrize(
    "line, message",
    [
        ("ssh-rsa AAAAnotakey", "not a valid OpenSSH RSA public key"),
        ("ssh-rsa", "without the key"),
        ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFake x", "not supported"),
        ("hello world", "2 words"),
        ("not-base58-0OIl" * 3, "neither"),
        ("1" * 40, "not a libp2p peer id"),
    ],
)
def test_bad_trust_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.txt"
    path.write_text(f"# header\n{line}\n")
    with pytest.raises(TrustFileError, match=rf"t\.txt, line 2: .*{message}"):
        TrustedTrainers.from_file(path)


def test_empty_or_missing_trust_file_is_an_error(tmp_path):
    (tmp_path / "empty").write_text("# nobody\n")
    with pytest.raises(TrustFileError, match="lists no trainer"):
        TrustedTrainers.from_file(tmp_path / "empty")
    with pytest.raises(TrustFileError, match="cannot read"):
        TrustedTrainers.from_file(tmp_path / "missing")


def test_a_signed_manifest_of_a_trusted_trainer_passes(keys):
    a, _ = keys
    assert check_manifest(manifest_of(a), TrustedTrainers.from_keys([ssh(a)]), "run") is None


def test_forged_manifests_are_refused_with_a_reason(keys):
    a, b = keys
    trusted = TrustedTrainers.from_keys([ssh(a)])
    assert check_manifest(manifest_of(b), trusted) == trust.UNTRUSTED_PUBLISHER
    tampered = manifest_of(a).model_copy(update={"version": 4})
    assert check_manifest(tampered, trusted) == trust.BAD_SIGNATURE
    unsigned = manifest_of(a).model_copy(update={"signature": b""})
    assert check_manifest(unsigned, trusted) == trust.BAD_SIGNATURE
    signed_by_other = manifest_of(a).sign(b.sign)  # a's key and id in the manifest, b's signature
    assert check_manifest(signed_by_other, trusted) == trust.BAD_SIGNATURE
    # b signs with its own key but claims to be a (trusted) publisher: the id must be its key's
    claims_a = manifest_of(b, publisher=pid(a))
    assert check_manifest(claims_a, trusted) == trust.PUBLISHER_KEY_MISMATCH
    garbage_key = manifest_of(a, publisher_key=b"ssh-rsa AAAAgarbage")
    assert check_manifest(garbage_key, trusted) == trust.BAD_PUBLISHER_KEY
    assert check_manifest(manifest_of(a), trusted, run_id="other-run") == trust.WRONG_RUN


def test_key_line_of_an_identity_round_trips(tmp_path, capsys):
    from echo_p2p.net.identity import load_or_create_identity

    identity = load_or_create_identity(str(tmp_path / "trainer.key"))
    trust.main([identity.path])
    line = capsys.readouterr().out.strip()
    assert line.startswith("ssh-rsa ") and line.endswith(identity.peer_id)
    assert TrustedTrainers.from_text(line).peer_ids == {identity.peer_id}
