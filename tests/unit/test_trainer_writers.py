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
