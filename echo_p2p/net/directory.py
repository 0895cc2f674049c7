"""The swarm directory: announcing this peer and listing the others, on hivemind's DHT.

Owned here: all reads and writes of the run's peer, trainer and provider records (keys from ``keys.py``, schemas
from ``records.py``). Inference peers' and providers' records are split over K bucket keys (``buckets.py``;
K from the run record, ``use_run_record``): a peer writes its own bucket, and the readers a run depends on
read the trainers plus one or two buckets (``peer_sample``, ``providers``), so a read returns O(trainers +
N/K) records; only ``peers()`` with no buckets named reads them all (tools, tests). Writes are signed per subkey by the peer's own key (hivemind's
RSASignatureValidator), so no peer can overwrite another's record; reads drop records whose signing key
does not match the peer id written inside, records whose subkey is anything but exactly their owner's
key marker (one key, one record), records set to expire more than ``MAX_RECORD_TTL`` from now, records of
other protocol versions (one log line per peer), records larger than their class allows, records in a bucket
their peer id does not hash to, and malformed ones (counted, never raised). Every call has a deadline. Callers: peers (heartbeat), the
``swarm status`` CLI, the transports (finding trainers and providers).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from echo_p2p.net.buckets import ALLOWED_BUCKETS, bucket_of, reading_order
from echo_p2p.net.identity import Identity, peer_id_from_owner_key
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.records import (
    NON_TRAINER_ROLES,
    TRAINER_ROLES,
    BanRecord,
    OtherProtocolError,
    OversizedRecordError,
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
#: Buckets a fetcher reads for its version before it falls back (its own and one random one), and the most
#: it reads in one fall-back when those hold no other provider.
PROVIDER_BUCKETS = 2
PROVIDER_FALLBACK = 6
#: A peer sample of fewer records reads further buckets, at most ``MAX_SAMPLE_KEYS`` keys in all.
MIN_SAMPLE = 8
MAX_SAMPLE_KEYS = 32
#: (peer, protocol) pairs logged once each; a reader remembers at most this many (unchecked, attacker-chosen).
MAX_WARNED = 4096


@dataclass(frozen=True)
class Entry(Generic[R]):
    """A record read from the DHT with its expiration time (DHT time, i.e. wall-clock seconds)."""

    record: R
    expires_at: float


class SwarmDirectory:
    """Reads and writes one run's directory records through a running ``hivemind.DHT``."""

    def __init__(
        self, dht, keys: SwarmKeys, identity: Identity, request_timeout: float = 10.0, buckets: int = 1
    ):
        self.dht = dht
        self.keys = keys
        self.identity = identity
        self.request_timeout = request_timeout
        self.buckets = buckets  # K: the run record's, once known (``use_run_record``)
        self.records_read = 0  # records parsed by this directory's reads (what its reads cost)
        self.keys_read = 0  # DHT keys it read
        self._rng = random.Random()
        self.rejected: Counter[str] = Counter()  # reason -> count, for records dropped on read
        self.read_timeouts = 0  # reads that got no answer within request_timeout (a monitor's "DHT down")
        # per kind of record (peers, trainers, providers, policy, run, bans): reads (one call, its keys asked for
        # at once), their seconds in all and the slowest one: a slow DHT node that a read waits on shows here
        self.reads: Counter[str] = Counter()
        self.read_seconds: Counter[str] = Counter()
        self.slowest_read: dict[str, float] = {}
        self._warned_protocols: set[tuple[str, int]] = set()
        self._trainer_writers: tuple = (None, None)  # (trainer ids, run owner) this node was last told
        self._providers_read: dict[int, tuple[float, list]] = {}  # version -> (monotonic time, entries)

    # ---- writes -----------------------------------------------------------------------------------------
    def announce(self, record: PeerRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store this peer's record for ``ttl`` seconds (a trainer's under ``trainers``, others' under their
        bucket of ``peers``); True when at least one DHT node accepted it."""
        if record.role in TRAINER_ROLES:
            return self._store(self.keys.trainers, record, ttl, timeout)
        return self._store(self.keys.peers(self.buckets, self.own_bucket()), record, ttl, timeout)

    def announce_provider(
        self, record: ProviderRecord, ttl: float, versions: Iterable[int], timeout: float | None = None
    ) -> bool:
        """Store this provider's record in its bucket under the slot of each of ``versions`` (the newest it
        holds, the one it is fetching: where fetchers of those versions look); True when every store landed."""
        keys = {self.keys.providers(self.buckets, self.own_bucket(), v) for v in versions}
        return all([self._store(key, record, ttl, timeout) for key in sorted(keys)]) and bool(keys)

    def own_bucket(self) -> int:
        """This peer's bucket of the run's K (``buckets.bucket_of``)."""
        return bucket_of(self.identity.peer_id, self.buckets)

    def use_run_record(self, trust) -> None:
        """Take K from the run record ``trust`` (a ``RunTrust``) holds; 1 without one (nothing to agree on).
        No ``trust`` at all (a reader with no opinion on the run): K stays as the directory was made."""
        if trust is None:
            return
        record = getattr(trust, "record", None)
        k = getattr(record, "directory_buckets", None) or 1
        if k != self.buckets and k in ALLOWED_BUCKETS:
            logger.info("the run's directory has %d bucket(s)", k)
            self.buckets = k
            self._providers_read.clear()

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
    def peers(self, buckets: Iterable[int] | None = None) -> list[Entry[PeerRecord]]:
        """Valid, unexpired records of the run's inference peers and bootstraps in ``buckets`` (None: every
        bucket, which only tools and tests should want), newest first."""
        wanted = range(self.buckets) if buckets is None else buckets
        keys = {b: self.keys.peers(self.buckets, b) for b in wanted}
        return sorted(
            self._read_keys(keys, PeerRecord, NON_TRAINER_ROLES, kind="peers"),
            key=lambda e: -e.record.updated_at,
        )

    def peer_sample(self, extra: int = 1, at_least: int = MIN_SAMPLE) -> list[Entry[PeerRecord]]:
        """The records of this peer's own bucket and ``extra`` random others (each call draws again): what a
        sync trainer picks samplers from and the peer cache remembers, O(N/K) records. Fewer than
        ``at_least`` there (a run smaller than its K was chosen for): further buckets, twice as many each
        time, up to ``MAX_SAMPLE_KEYS`` keys in all."""
        order = reading_order(self.own_bucket(), self.buckets, self._rng)[:MAX_SAMPLE_KEYS]
        read = min(len(order), 1 + extra)
        entries = self.peers(order[:read])
        while len(entries) < at_least and read < len(order):
            batch = order[read : 2 * read]
            entries += self.peers(batch)
            read += len(batch)
        return sorted(entries, key=lambda e: -e.record.updated_at)

    def trainers(self) -> list[Entry[PeerRecord]]:
        """Every valid, unexpired trainer record, newest first: only the writers this node was told to trust
        (``follow_trust``) are stored by or read from echo_p2p nodes, so a flood of ``peers`` never slows it."""
        entries = self._read(self.keys.trainers, PeerRecord, TRAINER_ROLES, kind="trainers")
        return sorted(entries, key=lambda e: -e.record.updated_at)

    def follow_trust(self, trust) -> bool:
        """Tell this node who may write the trainer-only keys (``trainers``, ``policy``, ``bans``;
        ``net.trainer_writers``): the trainers ``trust`` (a ``RunTrust``) trusts now,
        nobody while a run owner's record is still unknown, anyone when the run declares no trainers; and
        whose signed run records to keep (the owner's, when the run has one). True
        when the node has the set (it is only sent when it changed); False when the DHT did not answer."""
        from echo_p2p.net.trainer_writers import set_trainer_writers

        self.use_run_record(trust)
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

    def providers(self, version: int, max_age: float = 0.0) -> list[Entry[ProviderRecord]]:
        """Valid, unexpired provider records of ``version``'s slot in this peer's bucket and one random other
        (``PROVIDER_BUCKETS``); when those list no other provider, up to ``PROVIDER_FALLBACK`` more buckets.
        The last read of the version is reused while younger than ``max_age`` s (fetches follow each other
        several times a second)."""
        cached = self._providers_read.get(version)
        if cached is not None and time.monotonic() - cached[0] < max_age:
            return list(cached[1])
        order = reading_order(self.own_bucket(), self.buckets, self._rng)
        entries = self._read_providers(version, order[:PROVIDER_BUCKETS])
        if not any(e.record.peer_id != self.identity.peer_id for e in entries):
            entries += self._read_providers(
                version, order[PROVIDER_BUCKETS : PROVIDER_BUCKETS + PROVIDER_FALLBACK]
            )
        self._providers_read = {
            v: c for v, c in self._providers_read.items() if v > version - 8
        }  # bounded: recent versions only
        self._providers_read[version] = (time.monotonic(), entries)
        return entries

    def _read_providers(self, version: int, buckets: list[int]) -> list[Entry[ProviderRecord]]:
        keys = {b: self.keys.providers(self.buckets, b, version) for b in buckets}
        entries = self._read_keys(keys, ProviderRecord, kind="providers")
        return [e for e in entries if version in e.record.versions or e.record.partial]

    def policies(self) -> list[Entry[PolicyRecord]]:
        """Every valid, unexpired publisher record (trust is the caller's business), newest version first."""
        entries = self._read(self.keys.policy, PolicyRecord, kind="policy")
        return sorted(entries, key=lambda e: (-e.record.version, -e.record.updated_at))

    def run_records(self) -> list[Entry[SignedRunRecord]]:
        """Every stored copy of a signed run record (signatures are the caller's business: ``run_record``)."""
        return self._read(self.keys.run, SignedRunRecord, kind="run")

    def ban_records(self) -> list[Entry[BanRecord]]:
        """Every trainer's bans (trust is the caller's business)."""
        return self._read(self.keys.bans, BanRecord, kind="bans")

    def _read(
        self, key: str, cls: type[R], roles: frozenset[str] | None = None, *, kind: str
    ) -> list[Entry[R]]:
        return self._read_keys({None: key}, cls, roles, kind=kind)

    def _read_keys(
        self, keys: dict[int | None, str], cls: type[R], roles: frozenset[str] | None = None, *, kind: str
    ) -> list[Entry[R]]:
        """The valid records under each of ``keys`` (bucket -> key), asked for at once under one deadline;
        under a bucket's key only records whose peer id hashes to that bucket (a ``None`` bucket: any).
        Timed under ``kind`` (``read_figures``)."""
        started = time.monotonic()
        futures = []
        for bucket, key in keys.items():
            self.keys_read += 1
            futures.append((bucket, key, self.dht.get(key, latest=True, return_future=True)))
        deadline = started + self.request_timeout
        out: list[Entry[R]] = []
        try:
            for bucket, key, future in futures:
                try:
                    found = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    future.cancel()
                    self.read_timeouts += 1
                    logger.warning("reading %s timed out after %.1f s", key, self.request_timeout)
                    continue
                out += self._valid(found, cls, roles, bucket)
        finally:
            seconds = time.monotonic() - started
            self.reads[kind] += 1
            self.read_seconds[kind] += seconds
            self.slowest_read[kind] = max(self.slowest_read.get(kind, 0.0), seconds)
        return out

    def read_figures(self) -> dict[str, dict[str, float]]:
        """Per kind of record read: ``reads``, ``seconds`` in all and the ``slowest`` read (for metrics lines)."""
        return {
            kind: {
                "reads": self.reads[kind],
                "seconds": round(self.read_seconds[kind], 3),
                "slowest": round(self.slowest_read[kind], 3),
            }
            for kind in sorted(self.reads)
        }

    def _valid(self, found, cls: type[R], roles: frozenset[str] | None, bucket: int | None) -> list[Entry[R]]:
        from hivemind.utils import get_dht_time

        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        out = []
        for subkey, item in found.value.items():
            if item.expiration_time < now:
                continue
            self.records_read += 1
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
            if bucket is not None and bucket_of(record.peer_id, self.buckets) != bucket:
                self.rejected["wrong_bucket"] += 1
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
        except OversizedRecordError as exc:
            logger.debug("dropping %s", exc)
            self.rejected["too_large"] += 1
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
