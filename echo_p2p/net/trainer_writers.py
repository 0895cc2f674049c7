"""Who may write the run's trainer-only keys: the trainers the run trusts, checked by every echo_p2p DHT node.

Trainers announce under a key of their own (``SwarmKeys.trainers``), apart from the inference peers' ``peers``,
and only trainers write ``policy`` (the publisher's newest version) and ``bans``. So the readers that only
need trainers (the pushers, the publisher election, every inference peer's weight fetcher, the shared bans)
read a few records whatever a Sybil stores: keys are cheap, and one record per key under ``peers`` still
lets a thousand keys make a thousand records there (docs/scaling.md, "What a stranger costs").

``TrainerWriters`` is a hivemind record validator that each node runs on those keys (``trainer_keys``) of
each run it serves. It holds the peer ids its peer trusts as trainers (``RunTrust``: the run record's trainers or a
trusted-trainers file), or None for "anyone" (a run that declares no trainers, or a node that has not been
told). A record whose signing key is not among them fails validation, which hivemind applies both ways:
- a node **refuses to store** it (a stranger's trainer record never lands on an echo_p2p node that knows the
  run's trainers);
- a node **drops a whole answer** that contains one, as hivemind does for any dictionary that fails a
  validator: an attacker's own DHT node that serves a flood under the key costs the reader one check, not a
  parse per record. Answers from honest nodes hold only trusted trainers' records.
When the trusted set changes (a new run record serial), ``set_trainer_writers`` updates the validator inside
the DHT process and removes the stored and cached records of writers no longer trusted, so that an honest
node's answers stay valid for readers that already know the new set. The same validator keeps, under the
run's ``run`` key, only copies of a run record its owner signed and that has not expired (when the run has
an owner): every peer reads that key on every heartbeat, and a Sybil's keys could otherwise each store one
bogus copy there for every reader to verify.

Callers: ``net.node.start_dht`` (one validator per run, open), ``SwarmDirectory.follow_trust``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from functools import partial

from echo_p2p.net.identity import peer_id_from_owner_key

logger = logging.getLogger(__name__)

#: Owner markers whose peer id a validator remembers (an RSA key parse each otherwise; attacker-chosen keys).
PEER_ID_CACHE = 1024


class TrainerWriters:
    """A hivemind ``RecordValidatorBase`` (duck-typed: hivemind is imported lazily) for one run's trainer-only keys.

    ``allowed``: the peer ids that may write it, or None for anyone. Runs before the signature check (priority
    above ``RSASignatureValidator``'s 10), so a refused record costs no RSA verification.
    """

    def __init__(self, keys: Iterable[str], run_key: str, allowed: Iterable[str] | None = None) -> None:
        from hivemind.dht.routing import DHTID

        self.keys = tuple(keys)
        self.key_ids = {DHTID.generate(source=key).to_bytes(): key for key in self.keys}
        self.run_key_id = DHTID.generate(source=run_key).to_bytes()
        self.allowed: frozenset[str] | None = None if allowed is None else frozenset(allowed)
        self.owner: tuple[str, str] | None = None  # (run id, owner peer id) whose signed run records it keeps
        self._peer_ids: OrderedDict[bytes, str | None] = OrderedDict()
        # a value without its writer's signature -> the owner's RunRecord in it, or None
        self._verified: OrderedDict[bytes, object] = OrderedDict()

    def validate(self, record) -> bool:
        if record.key == self.run_key_id:
            return self.owner is None or self.signed_by_owner(record.value)
        if record.key not in self.key_ids or self.allowed is None:
            return True
        return self.writer(record.subkey) in self.allowed

    def signed_by_owner(self, value: bytes) -> bool:
        """Whether a stored run record (its DHT value, writer's signature included) is one the run's owner
        signed and that has not expired: copies of anything else are refused like untrusted writers'."""
        from hivemind.dht.crypto import RSASignatureValidator

        # keyed without the writer's DHT signature, which changes with every store (it covers the expiration):
        # each keeper's re-store every few seconds was a new entry, and a bootstrap's memory grew with them
        # until the cache was full (~6 MiB in 30 minutes of the soak, docs/reliability.md)
        stripped = RSASignatureValidator._SIGNATURE_RE.sub(b"", value)
        record = _cached(self._verified, stripped, self._owners_record)
        return record is not None and record.expires_at > time.time()

    def _owners_record(self, stripped: bytes):
        from hivemind.utils import MSGPackSerializer

        from echo_p2p.net.records import SignedRunRecord
        from echo_p2p.net.run_record import newest_valid

        try:
            wire = MSGPackSerializer.loads(stripped)
            run_id, owner = self.owner
            return newest_valid([SignedRunRecord.from_wire(wire)], run_id, owner)[0]
        except Exception:
            return None

    def writer(self, subkey_bytes: bytes) -> str | None:
        """Peer id of the key in a msgpack'd ``[owner:...]`` subkey (None when it is not one)."""
        return _cached(self._peer_ids, subkey_bytes, _writer)

    # the rest of hivemind's RecordValidatorBase interface: this validator signs and strips nothing
    def sign_value(self, record) -> bytes:
        return record.value

    def strip_value(self, record) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 20

    def merge_with(self, other) -> bool:
        return False


def trainer_keys(keys) -> tuple[str, ...]:
    """The keys of a run (``SwarmKeys``) that only its trainers write."""
    return (keys.trainers, keys.policy, keys.bans)


def set_trainer_writers(
    dht, keys, allowed: Iterable[str] | None, owner: str | None = None, timeout: float = 10.0
) -> int:
    """Set who may write the trainer-only keys of run ``keys`` (``SwarmKeys``) on the node of ``dht`` (a running
    ``hivemind.DHT``), and whose signed run records its ``run`` key keeps (``owner``'s peer id; None: any),
    and remove what breaks that from its storage and cache; returns how many records were removed. Raises
    ``TimeoutError`` past ``timeout`` (the DHT process did not answer)."""
    peer_ids = None if allowed is None else sorted(set(allowed))
    run_owner = None if owner is None else (keys.run_id, owner)
    coroutine = partial(_apply, first_key=trainer_keys(keys)[0], peer_ids=peer_ids, owner=run_owner)
    return int(dht.run_coroutine(coroutine, return_future=True).result(timeout=timeout))


async def _apply(
    _dht, node, first_key: str, peer_ids: list[str] | None, owner: tuple[str, str] | None
) -> int:
    """Runs inside the DHT process (``DHT.run_coroutine``)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    validators = getattr(node.protocol.record_validator, "_validators", [])
    mine = [v for v in validators if isinstance(v, TrainerWriters) and v.keys[0] == first_key]
    if not mine:
        return 0
    validator = mine[0]
    validator.allowed = None if peer_ids is None else frozenset(peer_ids)
    validator.owner = owner
    removed = 0
    for key_id in (*validator.key_ids, validator.run_key_id):
        for storage in (node.protocol.storage, node.protocol.cache):
            found = storage.get(DHTID.from_bytes(key_id))
            value = found.value if found is not None else None
            if value is None or not hasattr(value, "items"):
                continue
            with value.freeze():
                items = [(subkey, item.value, item.expiration_time) for subkey, item in value.items()]
            for subkey, item_value, expiration_time in items:
                record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), item_value, expiration_time)
                if not validator.validate(record):
                    del value[subkey]
                    removed += 1
    if removed:
        logger.info("removed %d record(s) of writers the run does not trust under %s", removed, first_key)
    return removed


def _writer(subkey_bytes: bytes) -> str | None:
    from hivemind.utils import MSGPackSerializer

    try:
        subkey = MSGPackSerializer.loads(subkey_bytes)
    except Exception:
        return None
    return peer_id_from_owner_key(subkey) if isinstance(subkey, bytes) else None


def _cached(cache: OrderedDict, key: bytes, compute):
    """``compute(key)``, remembered in ``cache`` (least recently used first out, ``PEER_ID_CACHE`` entries):
    what a validator works out from attacker-chosen bytes is worked out once per distinct value."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = compute(key)
    if len(cache) > PEER_ID_CACHE:
        cache.popitem(last=False)
    return value
