"""The swarm directory: announcing this peer and listing the others, on hivemind's DHT.

Owned here: all reads and writes of the run's peer, trainer and provider records (keys from ``keys.py``, schemas
from ``records.py``). Writes are signed per subkey by the peer's own key (hivemind's
RSASignatureValidator), so no peer can overwrite another's record; reads drop records whose signing key
does not match the peer id written inside, records whose subkey is anything but exactly their owner's
key marker (one key, one record), records set to expire more than ``MAX_RECORD_TTL`` from now, records of
other protocol versions (one log line per peer) and malformed ones (counted, never raised). Every call has a deadline. Callers: peers (heartbeat), the
``swarm status`` CLI, the transports (finding trainers and providers).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Generic, TypeVar

from echo_p2p.net.identity import Identity, peer_id_from_owner_key
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.records import (
    NON_TRAINER_ROLES,
    TRAINER_ROLES,
    BanRecord,
    OtherProtocolError,
    PeerRecord,
    PolicyRecord,
    ProviderRecord,
    RecordError,
    SignedRunRecord,
    WireRecord,
    rule_violation,
)

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=WireRecord)
#: (peer, protocol) pairs logged once each; a reader remembers at most this many (unchecked, attacker-chosen).
MAX_WARNED = 4096


@dataclass(frozen=True)
class Entry(Generic[R]):
    """A record read from the DHT with its expiration time (DHT time, i.e. wall-clock seconds)."""

    record: R
    expires_at: float


class SwarmDirectory:
    """Reads and writes one run's directory records through a running ``hivemind.DHT``."""

    def __init__(self, dht, keys: SwarmKeys, identity: Identity, request_timeout: float = 10.0):
        self.dht = dht
        self.keys = keys
        self.identity = identity
        self.request_timeout = request_timeout
        self.rejected: Counter[str] = Counter()  # reason -> count, for records dropped on read
        self.read_timeouts = 0  # reads that got no answer within request_timeout (a monitor's "DHT down")
        self._warned_protocols: set[tuple[str, int]] = set()
        self._trainer_writers: tuple = (None, None)  # (trainer ids, run owner) this node was last told
        self._providers_read: tuple[float, list] | None = None  # (monotonic time, entries) of the last read

    # ---- writes -----------------------------------------------------------------------------------------
    def announce(self, record: PeerRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store this peer's record for ``ttl`` seconds (a trainer's under ``trainers``, others' under ``peers``);
        True when at least one DHT node accepted it."""
        key = self.keys.trainers if record.role in TRAINER_ROLES else self.keys.peers
        return self._store(key, record, ttl, timeout)

    def announce_provider(self, record: ProviderRecord, ttl: float, timeout: float | None = None) -> bool:
        return self._store(self.keys.providers, record, ttl, timeout)

    def announce_policy(self, record: PolicyRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store this publisher's newest-policy pointer (subkey: its own key) for ``ttl`` seconds."""
        return self._store(self.keys.policy, record, ttl, timeout)

    def announce_run_record(self, record: SignedRunRecord, ttl: float, timeout: float | None = None) -> bool:
        """Re-store the run owner's signed record (subkey: this peer's key) for ``ttl`` seconds."""
        return self._store(self.keys.run, record, ttl, timeout)

    def announce_bans(self, record: BanRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store this trainer's bans (subkey: its own key) for ``ttl`` seconds."""
        return self._store(self.keys.bans, record, ttl, timeout)

    def _store(self, key: str, record: WireRecord, ttl: float, timeout: float | None = None) -> bool:
        from hivemind.utils import get_dht_time

        future = self.dht.store(
            key,
            record.to_wire(),
            expiration_time=get_dht_time() + ttl,
            subkey=self.identity.owner_key,
            return_future=True,
        )
        try:
            return bool(future.result(timeout=timeout or self.request_timeout))
        except TimeoutError:
            future.cancel()
            logger.warning("storing %s timed out after %.1f s", key, timeout or self.request_timeout)
            return False

    # ---- reads ------------------------------------------------------------------------------------------
    def peers(self) -> list[Entry[PeerRecord]]:
        """Every valid, unexpired record of the run's inference peers and bootstraps, newest first."""
        entries = self._read(self.keys.peers, PeerRecord, NON_TRAINER_ROLES)
        return sorted(entries, key=lambda e: -e.record.updated_at)

    def trainers(self) -> list[Entry[PeerRecord]]:
        """Every valid, unexpired trainer record, newest first: only the writers this node was told to trust
        (``follow_trust``) are stored by or read from echo_p2p nodes, so a flood of ``peers`` never slows it."""
        entries = self._read(self.keys.trainers, PeerRecord, TRAINER_ROLES)
        return sorted(entries, key=lambda e: -e.record.updated_at)

    def everyone(self) -> list[Entry[PeerRecord]]:
        """Trainers and other peers, newest first (``swarm status``, the monitor, the peer cache)."""
        return sorted(self.trainers() + self.peers(), key=lambda e: -e.record.updated_at)

    def follow_trust(self, trust) -> bool:
        """Tell this node who may write the trainer-only keys (``trainers``, ``policy``, ``bans``;
        ``net.trainer_writers``): the trainers ``trust`` (a ``RunTrust``) trusts now,
        nobody while a run owner's record is still unknown, anyone when the run declares no trainers; and
        whose signed run records to keep (the owner's, when the run has one). True
        when the node has the set (it is only sent when it changed); False when the DHT did not answer."""
        from echo_p2p.net.trainer_writers import set_trainer_writers

        told = (trust.trusted_ids(), trust.owner) if trust is not None else (None, None)
        if told == self._trainer_writers:
            return True
        try:
            set_trainer_writers(self.dht, self.keys, told[0], owner=told[1], timeout=self.request_timeout)
        except Exception as exc:  # a DHT process that died or did not answer: try again next time
            logger.warning("telling the DHT node the run's trainers failed: %r", exc)
            return False
        self._trainer_writers = told
        return True

    def providers(self, max_age: float = 0.0) -> list[Entry[ProviderRecord]]:
        """Every valid, unexpired provider record; the last read's when it is younger than ``max_age`` s
        (fetches follow each other several times a second, and a Sybil's keys can each store a provider
        record: a read parses every one)."""
        cached = self._providers_read
        if cached is not None and time.monotonic() - cached[0] < max_age:
            return list(cached[1])
        entries = self._read(self.keys.providers, ProviderRecord)
        self._providers_read = (time.monotonic(), entries)
        return entries

    def policies(self) -> list[Entry[PolicyRecord]]:
        """Every valid, unexpired publisher record (trust is the caller's business), newest version first."""
        entries = self._read(self.keys.policy, PolicyRecord)
        return sorted(entries, key=lambda e: (-e.record.version, -e.record.updated_at))

    def run_records(self) -> list[Entry[SignedRunRecord]]:
        """Every stored copy of a signed run record (signatures are the caller's business: ``run_record``)."""
        return self._read(self.keys.run, SignedRunRecord)

    def ban_records(self) -> list[Entry[BanRecord]]:
        """Every trainer's bans (trust is the caller's business)."""
        return self._read(self.keys.bans, BanRecord)

    def _read(self, key: str, cls: type[R], roles: frozenset[str] | None = None) -> list[Entry[R]]:
        from hivemind.utils import get_dht_time

        future = self.dht.get(key, latest=True, return_future=True)
        try:
            found = future.result(timeout=self.request_timeout)
        except TimeoutError:
            future.cancel()
            self.read_timeouts += 1
            logger.warning("reading %s timed out after %.1f s", key, self.request_timeout)
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        out = []
        for subkey, item in found.value.items():
            if item.expiration_time < now:
                continue
            violation = rule_violation(subkey, item.expiration_time, now)
            if violation is not None:
                self.rejected[violation] += 1
                continue
            record = self._parse(subkey, item.value, cls)
            if record is None:
                continue
            if roles is not None and getattr(record, "role", None) not in roles:
                self.rejected["wrong_key_for_role"] += 1
                continue
            out.append(Entry(record, item.expiration_time))
        return out

    def _parse(self, subkey: object, value: object, cls: type[R]) -> R | None:
        try:
            record = cls.from_wire(value)
        except OtherProtocolError as exc:
            who = str(value.get("peer_id", "?") if isinstance(value, dict) else "?")[:128]
            if (who, exc.protocol) not in self._warned_protocols:
                if len(self._warned_protocols) >= MAX_WARNED:  # bounded: a flood of them is logged again
                    self._warned_protocols.clear()
                self._warned_protocols.add((who, exc.protocol))
                logger.info("ignoring peer %s: %s", who, exc)
            self.rejected["other_protocol"] += 1
            return None
        except RecordError as exc:
            logger.debug("dropping malformed %s: %s", cls.__name__, exc)
            self.rejected["malformed"] += 1
            return None
        owner = peer_id_from_owner_key(subkey) if isinstance(subkey, bytes) else None
        if owner is None or owner != getattr(record, "peer_id", None):
            logger.debug("dropping %s whose peer id does not match its signing key", cls.__name__)
            self.rejected["peer_id_mismatch"] += 1
            return None
        return record


#: Seconds a peer that joined with the run owner's address (and the doctor) looks for the owner's run record
#: at start before it says what it found instead (``run_record.explain_missing``): the bootstrap that keeps
#: the record has it from its start, so a few reads settle it.
RUN_RECORD_WAIT = 3.0


def find_run_record(
    directory: SwarmDirectory, trust, timeout: float = RUN_RECORD_WAIT, stop=None
) -> str | None:
    """Read the run's key until ``trust`` (a ``guard.trust.RunTrust`` told the owner, with no record yet)
    takes a valid record of its owner from the stored copies (``trust.record``); None then, or when ``stop``
    (a ``threading.Event``) is set. After ``timeout``: why none is valid and how to fix it, for a person."""
    from echo_p2p.net.run_record import explain_missing

    deadline = time.monotonic() + timeout
    while stop is None or not stop.is_set():
        found = [e.record for e in directory.run_records()]
        if trust.update(found):
            return None
        if time.monotonic() >= deadline:
            return explain_missing(found, trust.run_id, trust.owner, min_serial=trust.min_serial)
        if stop is None:
            time.sleep(0.5)
        else:
            stop.wait(0.5)
    return None


def wait_for(predicate, timeout: float, period: float = 0.2) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` passes; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(period)
