"""The trainer-only keys' validator, without a DHT: who may write, and run-record copies that expire."""

from __future__ import annotations

import time
from types import SimpleNamespace

from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.trainer_writers import TrainerWriters, trainer_keys


def test_a_run_record_copy_checked_once_is_refused_once_it_has_expired():
    keys = SwarmKeys("r")
    validator = TrainerWriters(trainer_keys(keys), keys.run)
    validator.owner = ("r", "QmOwner")
    soon = time.time() + 0.2
    validator._verified[b"copy"] = SimpleNamespace(expires_at=soon)  # the owner's record, verified earlier
    assert validator.signed_by_owner(b"copy")
    time.sleep(0.3)
    assert not validator.signed_by_owner(b"copy")  # the verdict is not kept past the record's expiry
    assert not validator.signed_by_owner(b"not a record at all")


def test_one_run_record_stored_again_and_again_is_verified_once_and_held_once():
    """Every keeper stores the owner's record again every few seconds, each time with a new DHT signature of
    its own (it covers the expiration): the verdict is keyed without it, so a bootstrap's cache holds one
    entry per record, not one per store (its memory grew by ~6 MiB in 30 minutes of the soak before)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import MSGPackSerializer

    from echo_p2p.net import run_record as rr
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import SignedRunRecord

    owner, keeper = load_or_create_identity(None), load_or_create_identity(None)
    try:
        now = time.time()
        record = rr.RunRecord(
            run_id="r",
            owner_key=owner.public_key_bytes().decode(),
            trainers=[keeper.peer_id],
            serial=1,
            issued_at=now,
            expires_at=now + 600,
        )
        record_bytes, signature = rr.sign(record, owner)
        wire = SignedRunRecord(peer_id=keeper.peer_id, record=record_bytes, signature=signature).to_wire()
        body = MSGPackSerializer.dumps(wire)
        keys = SwarmKeys("r")
        validator = TrainerWriters(trainer_keys(keys), keys.run)
        validator.owner = ("r", owner.peer_id)
        calls = []
        verify = validator._owners_record
        validator._owners_record = lambda stripped: calls.append(stripped) or verify(stripped)
        for i in range(50):  # 50 stores, each signed anew by its writer
            stored = body + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", b"sig%d" % i)
            assert validator.signed_by_owner(stored)
        assert len(calls) == 1 and len(validator._verified) == 1
        forged = MSGPackSerializer.dumps({**wire, "signature": signature[:-1] + b"\0"})
        assert not validator.signed_by_owner(forged + b"[signature:x]")  # another body: verified on its own
    finally:
        owner.cleanup()
        keeper.cleanup()
