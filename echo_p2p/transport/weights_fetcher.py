"""Receiver side of the weights transport: find, fetch, verify and atomically apply policy versions.

Owned here: ``FetcherConfig``; ``plan_chain`` (which manifests to fetch: the deltas from the exact version
held, else the newest keyframe and the deltas after it); ``WeightFetcher``, which reads the trainers'
``PolicyRecord``s, accepts manifests only from trusted trainers (``trust.check_manifest``), pulls chunks in
parallel from several providers (the publisher and peers that hold or are fetching the same manifest), checks
every digest, retries a chunk elsewhere on timeout, error, bad digest or a broken stream, bans a provider that
served bad data, and swaps its ``PolicyWeights`` only once every chunk of the chain is verified and applied:
a peer never runs a mixed policy. With ``serve`` on it serves what it holds (chunks of a version being
fetched included) and announces itself as a provider (peer-assisted distribution); the publisher is spared:
it is asked only for chunks no other provider holds or is fetching, and hands different chunks to
different receivers. Callers: the inference peer (``update`` / ``ensure_version`` / ``follow``),
benchmarks, tests. Bad input from peers is counted by reason in ``stats()``, never raised to the caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.identity import Identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.node import visible_maddrs
from echo_p2p.net.records import ManifestRef, PolicyRecord, ProviderRecord
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.trust import TrustedTrainers, check_manifest
from echo_p2p.transport.weights_service import (
    RemoteError,
    ServedVersion,
    ServiceLimits,
    StreamViolation,
    WeightsEndpoint,
    bitmap_indices,
    manifest_digest,
)
from echo_p2p.weights import (
    ChunkDigestError,
    ChunkError,
    Manifest,
    PolicyWeights,
    VersionAssembler,
    WeightsError,
)

logger = logging.getLogger(__name__)


class FetcherConfig(BaseModel):
    """How an inference peer fetches policy versions and helps distribute them."""

    model_config = ConfigDict(extra="forbid")

    serve: bool = Field(
        default=True, description="Peer assistance: serve held chunks and announce as a provider"
    )
    serve_retain: int = Field(
        default=3, ge=1, description="Newest manifests kept for serving after apply (memory: their payloads)"
    )
    poll_period: float = Field(default=1.0, gt=0, description="follow(): seconds between DHT checks")
    max_inflight_per_provider: int = Field(
        default=2, ge=1, description="Concurrent chunk streams per peer provider"
    )
    chunks_per_request: int = Field(default=4, ge=1, description="Chunks asked per stream from a peer")
    publisher_streams: int = Field(
        default=2,
        ge=1,
        description="Chunk streams to the publisher at once; the next opens only when the current one has at "
        "most one chunk left to start (one long stream at a time is fastest)",
    )
    publisher_pick: int = Field(
        default=64,
        ge=0,
        description="Chunks of the publisher's choice in the first stream to it (0: we choose, no super-seeding)",
    )
    pick_seconds: float = Field(
        default=1.0,
        gt=0,
        description="Later streams to the publisher ask for as many chunks as arrive in this long at the "
        "rate measured (short streams keep their candidate lists fresh on slow links)",
    )
    spare_publisher: bool = Field(
        default=True, description="Ask the publisher only for chunks no other provider holds or is fetching"
    )
    publisher_fresh_window: float = Field(
        default=30.0,
        ge=0,
        description="Ask the publisher to skip chunks it handed out this recently (others got them: ask them)",
    )
    stall_timeout: float = Field(
        default=3.0, gt=0, description="No chunk for this long: ask the publisher for anything still missing"
    )
    chunk_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Deadline (s) to receive one whole chunk once it started (or the first)",
    )
    fetch_timeout: float = Field(default=600.0, gt=0, description="Deadline (s) of one whole fetch")
    no_provider_timeout: float = Field(
        default=10.0, gt=0, description="Give up a fetch after this long with nobody left to ask"
    )
    no_progress_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Give up a fetch (kept chunks are reused next time) after this long without a chunk",
    )
    provider_refresh: float = Field(default=1.0, gt=0, description="Seconds between provider list reads")
    have_period: float = Field(default=0.25, gt=0, description="Seconds between chunk-map polls of a peer")
    max_provider_failures: int = Field(
        default=2,
        ge=1,
        description="Timeouts/errors before a peer provider is dropped for the rest of a fetch (the publisher "
        "is retried with a growing back-off instead)",
    )
    ban_seconds: float = Field(
        default=600.0, ge=0, description="How long a provider that served bad data is avoided"
    )
    record_ttl: float = Field(default=30.0, gt=0, description="Lifetime (s) of this peer's ProviderRecord")
    request_timeout: float = Field(
        default=10.0, gt=0, description="Deadline (s) of DHT reads/writes and unary RPCs"
    )
    limits: ServiceLimits = Field(
        default_factory=ServiceLimits, description="Serving limits (peer assistance)"
    )


class PlanError(Exception):
    """No chain of manifests in the record leads to its newest version."""


def plan_chain(record: PolicyRecord, held: tuple[str, int] | None) -> list[ManifestRef]:
    """Manifests to fetch, in apply order, to go from ``held`` = (stream_id, version) to ``record.version``.

    Deltas apply only on exactly (stream_id, base_version): from a held version of the same stream the chain
    is its deltas; otherwise the newest keyframe at or below the target and the deltas after it. Empty when
    ``held`` is already at or past the target on that stream. Raises ``PlanError`` when no chain exists.
    """
    target = record.version
    if held is not None and held[0] == record.stream_id and held[1] >= target:
        return []
    deltas = {r.base_version: r for r in record.manifests if r.base_version is not None}

    def follow(version: int) -> list[ManifestRef] | None:
        chain: list[ManifestRef] = []
        while version != target:
            ref = deltas.get(version)
            if ref is None or ref.version <= version or ref.version > target:
                return None
            chain.append(ref)
            version = ref.version
        return chain

    if held is not None and held[0] == record.stream_id:
        chain = follow(held[1])
        if chain is not None:
            return chain
    keyframes = sorted(
        (r for r in record.manifests if r.base_version is None and r.version <= target),
        key=lambda r: -r.version,
    )
    for keyframe in keyframes:
        chain = follow(keyframe.version)
        if chain is not None:
            return [keyframe, *chain]
    raise PlanError(f"record of {record.peer_id[-8:]} lists no chain to version {target}")


class FetchError(Exception):
    """A fetch that did not complete; ``reason`` is the counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class FetchProgress:
    """Where a fetch stands (passed to the progress callback after each verified chunk)."""

    version: int
    chunks_done: int
    chunks_total: int
    bytes_done: int
    bytes_total: int
    providers: int
    elapsed: float


@dataclass
class FetchStats:
    """Counters of a fetcher (they only grow); ``as_dict`` for the metrics line."""

    versions_applied: int = 0
    fetches_failed: Counter = field(default_factory=Counter)  # reason -> count
    rejected: Counter = field(default_factory=Counter)  # bad input from peers: reason -> count
    failures: Counter = field(
        default_factory=Counter
    )  # transport trouble (timeouts, dead peers): reason -> count
    bytes_by_provider: Counter = field(default_factory=Counter)
    retries: int = 0
    duplicate_bytes: int = 0
    last_fetch_seconds: float | None = None
    last_transfer_seconds: float | None = None
    last_apply_seconds: float | None = None
    last_phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the last fetch
    last_fetch_bytes: int = 0
    banned: dict[str, str] = field(default_factory=dict)  # peer id -> reason

    def as_dict(self) -> dict[str, Any]:
        return {
            "versions_applied": self.versions_applied,
            "fetches_failed": dict(self.fetches_failed),
            "rejected": dict(self.rejected),
            "failures": dict(self.failures),
            "bytes_by_provider": dict(self.bytes_by_provider),
            "retries": self.retries,
            "duplicate_bytes": self.duplicate_bytes,
            "fetch_seconds": self.last_fetch_seconds,
            "transfer_seconds": self.last_transfer_seconds,
            "apply_seconds": self.last_apply_seconds,
            "phases": dict(self.last_phases),
            "fetch_bytes": self.last_fetch_bytes,
            "banned": dict(self.banned),
        }


class WeightFetcher:
    """Holds the newest trusted policy version it could fetch; ``start`` first, ``shutdown`` at the end."""

    def __init__(
        self,
        dht,
        identity: Identity,
        keys: SwarmKeys,
        trusted: TrustedTrainers,
        config: FetcherConfig | None = None,
        endpoint: WeightsEndpoint | None = None,
        on_progress: Callable[[FetchProgress], None] | None = None,
    ):
        self.dht = dht
        self.identity = identity
        self.keys = keys
        self.trusted = trusted
        self.config = config or FetcherConfig()
        self.on_progress = on_progress
        self._own_endpoint = endpoint is None
        self.endpoint = endpoint or WeightsEndpoint(dht, keys, self.config.limits, serve=self.config.serve)
        self.directory = SwarmDirectory(dht, keys, identity, self.config.request_timeout)
        self.stats = FetchStats()
        self._weights: PolicyWeights | None = None
        self._lock = threading.Lock()  # guards _weights
        self._update_lock = threading.Lock()  # one fetch at a time
        self._announce_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._announcer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="provider-announce")
        # digests are checked in one thread: at most one core hashes, the streams and p2pd keep the others
        self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chunk-verifier")
        self._banned_until: dict[str, float] = {}
        self._refused: dict[str, str] = {}  # manifest digest -> reason (never fetched again)
        self._seen_untrusted: set[tuple[str, int]] = set()
        self._resume: dict[str, VersionAssembler] = {}  # partial stores of the last failed fetch
        self._partial: list[str] = []
        self._stream_id: str | None = None
        self._maddrs: list[str] = []
        self._session: _FetchSession | None = None

    # ---- public API -----------------------------------------------------------------------------------
    def start(self) -> WeightFetcher:
        self.endpoint.start()
        self._maddrs = visible_maddrs(self.dht)
        if self.config.serve:
            self._spawn(self._announce_loop, "provider-announcer")
        return self

    @property
    def weights(self) -> PolicyWeights | None:
        """The complete version held now (replaced atomically; never half-applied)."""
        with self._lock:
            return self._weights

    @property
    def version(self) -> int | None:
        w = self.weights
        return None if w is None else w.version

    def update(self) -> PolicyWeights | None:
        """Fetch and apply the newest trusted version if it is newer than the one held.

        Returns the new weights, or None when nothing newer was found or the fetch failed (counted in
        ``stats``; the held version is untouched). Blocks at most ``fetch_timeout`` plus DHT deadlines.
        """
        with self._update_lock:
            t_start = time.monotonic()
            record = None
            try:
                record = self._choose_record()
                if record is None:
                    return None
                return self._fetch(record, t_start)
            except FetchError as exc:
                self.stats.fetches_failed[exc.reason] += 1
                logger.warning(
                    "fetching version %d from %s failed: %s", record.version, record.peer_id[-8:], exc
                )
            except Exception:  # a bug must not take the peer down: count it, keep the held version
                self.stats.fetches_failed["internal_error"] += 1
                logger.exception("policy update failed (version %s)", record.version if record else "?")
            return None

    def ensure_version(self, min_version: int, timeout: float) -> PolicyWeights:
        """Block until a version >= ``min_version`` is held (sync mode); ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            weights = self.weights
            if weights is not None and weights.version >= min_version:
                return weights
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"version {min_version} not received within {timeout:.0f} s (held: {self.version})"
                )
            self.update()
            if self.version is None or self.version < min_version:
                self._stop.wait(min(0.2, max(0.0, deadline - time.monotonic())))

    def follow(self, on_update: Callable[[PolicyWeights], None] | None = None) -> None:
        """Poll for new versions in a background thread (async mode); ``on_update`` after each swap."""

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    weights = self.update()
                    if weights is not None and on_update is not None:
                        on_update(weights)
                except Exception:
                    logger.exception("policy update failed; will retry")
                self._stop.wait(self.config.poll_period)

        self._spawn(loop, "policy-follower")

    def fetch_state(self) -> dict[str, Any] | None:
        """The fetch in progress (for status lines and debugging): chunks missing, providers and their state."""
        session = self._session
        return None if session is None else session.state()

    def stats_dict(self) -> dict[str, Any]:
        """Fetch counters plus what this peer served to others."""
        return {
            "version": self.version,
            **self.stats.as_dict(),
            "served": self.endpoint.servicer.stats.as_dict(),
        }

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop following, announcing and serving (idempotent)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.config.request_timeout + 1)
        self._threads.clear()
        self._announcer.shutdown(wait=True, cancel_futures=True)
        self._verifier.shutdown(wait=True, cancel_futures=True)
        if self._own_endpoint:
            self.endpoint.shutdown(timeout)

    # ---- choosing and checking ------------------------------------------------------------------------
    def _choose_record(self) -> PolicyRecord | None:
        held = self.weights
        best: PolicyRecord | None = None
        for entry in self.directory.policies():
            record = entry.record
            if not self.trusted.is_trusted(record.peer_id):
                if (record.peer_id, record.version) not in self._seen_untrusted:
                    if len(self._seen_untrusted) > 4096:
                        self._seen_untrusted.clear()
                    self._seen_untrusted.add((record.peer_id, record.version))
                    self.stats.rejected["untrusted_record"] += 1
                    logger.info(
                        "ignoring policy version %d of untrusted peer %s", record.version, record.peer_id
                    )
                continue
            if self._banned_until.get(record.peer_id, 0) > time.monotonic():
                continue
            if any(r.digest in self._refused for r in record.manifests if r.version == record.version):
                continue
            if held is not None and record.version <= held.version:
                continue
            key = (record.version, held is not None and record.stream_id == held.stream_id, record.updated_at)
            if best is None or key > (
                best.version,
                held is not None and best.stream_id == held.stream_id,
                best.updated_at,
            ):
                best = record
        return best

    def _refuse(self, digest: str, reason: str, who: str) -> None:
        self.stats.rejected[reason] += 1
        if len(self._refused) > 1024:
            self._refused.clear()
        self._refused[digest] = reason
        logger.warning("refused manifest %s… from %s: %s", digest[:12], who[-8:], reason)

    def _check(self, raw: bytes, ref: ManifestRef, record: PolicyRecord, who: str) -> Manifest | None:
        digest = manifest_digest(raw)
        try:
            manifest = Manifest.from_bytes(raw)
        except ValueError:
            self._refuse(digest, "malformed_manifest", who)
            return None
        reason = check_manifest(manifest, self.trusted, self.keys.run_id)
        if reason is None and (
            manifest.publisher != record.peer_id
            or manifest.stream_id != record.stream_id
            or manifest.version != ref.version
            or manifest.base_version != ref.base_version
            or manifest.num_chunks != ref.num_chunks
            or manifest.total_bytes != ref.total_bytes
        ):
            reason = "manifest_record_mismatch"
        if reason is not None:
            self._refuse(digest, reason, who)
            return None
        return manifest

    # ---- one fetch ------------------------------------------------------------------------------------
    def _fetch(self, record: PolicyRecord, t_start: float) -> PolicyWeights | None:
        phases = {"record": time.monotonic() - t_start}
        held = self.weights
        try:
            refs = plan_chain(record, None if held is None else (held.stream_id, held.version))
        except PlanError as exc:
            raise FetchError("no_chain", str(exc)) from None
        if not refs:
            return None
        try:
            manifests = self.endpoint.run(
                self._get_manifests(record, refs), self.config.request_timeout * 3 + 5
            )
        except TimeoutError:
            raise FetchError("timeout", "manifests not received in time") from None
        phases["manifests"] = time.monotonic() - t_start - sum(phases.values())
        assemblers = []
        for ref, manifest in zip(refs, manifests, strict=True):
            if manifest is None:
                raise FetchError(
                    "manifest_refused" if ref.digest in self._refused else "manifest_unavailable"
                )
            existing = self.endpoint.library.get(ref.digest) if self.config.serve else None
            asm = self._resume.get(ref.digest) or VersionAssembler(manifest)
            if existing is not None:  # chunks this peer already holds (and serves) are not fetched again
                asm.store = existing.store
            assemblers.append(asm)
        self._resume = {ref.digest: asm for ref, asm in zip(refs, assemblers, strict=True)}
        entries = [ServedVersion.of(asm.manifest, asm.store) for asm in assemblers]
        if self.config.serve:
            entries = [self.endpoint.library.add(entry) for entry in entries]
            self._partial = [e.digest for e in entries if not e.complete]
            self._stream_id = record.stream_id
            self._announce_soon()
        phases["announce"] = time.monotonic() - t_start - sum(phases.values())
        session = self._session = _FetchSession(self, record, entries)
        try:
            self.endpoint.run(session.run(), self.config.fetch_timeout + 5)
            phases["discover"] = session.discover_seconds  # the provider list read before the first request
            phases["transfer"] = time.monotonic() - t_start - sum(phases.values())
            self.stats.last_transfer_seconds = phases["transfer"]
        except TimeoutError:
            raise FetchError("timeout", f"not complete within {self.config.fetch_timeout:.0f} s") from None
        finally:
            self._session = None
            self.stats.duplicate_bytes += session.duplicate_bytes
            if self.config.serve and any(not e.complete for e in entries):
                for entry in entries:
                    if not entry.complete:
                        self.endpoint.library.remove(entry.digest)
                self._partial = []
                self._announce_soon()
        t_apply = time.monotonic()
        weights = held
        try:
            for asm in assemblers:
                weights = asm.apply(weights, inplace=weights is not None and weights is not held)
        except WeightsError as exc:
            raise FetchError("apply_failed", f"{type(exc).__name__}: {exc}") from None
        with self._lock:
            self._weights = weights
        self._resume = {}
        self.stats.versions_applied += 1
        self.stats.last_apply_seconds = phases["apply"] = time.monotonic() - t_apply
        self.stats.last_fetch_seconds = time.monotonic() - t_start
        self.stats.last_fetch_bytes = session.bytes_done
        if self.config.serve:
            self._retain(entries)
        phases["serve"] = time.monotonic() - t_start - sum(phases.values())
        self.stats.last_phases = phases
        logger.info(
            "applied version %d (%s) in %.2f s: %.1f MiB from %d providers",
            record.version,
            " + ".join(m.encoding for m in (a.manifest for a in assemblers)),
            self.stats.last_fetch_seconds,
            session.bytes_done / 2**20,
            len(session.used),
        )
        return weights

    async def _get_manifests(self, record: PolicyRecord, refs: list[ManifestRef]) -> list[Manifest | None]:
        """The planned manifests, checked; asked of the publisher, then of providers that list them."""
        found: dict[str, Manifest] = {}
        wanted = {r.digest: r for r in refs}
        candidates = [(record.peer_id, record.maddrs)]
        read_providers = False
        position = 0
        while True:
            need = [d for d in wanted if d not in found and d not in self._refused]
            if not need:
                break
            if position == len(candidates):
                if read_providers:
                    break
                read_providers = True  # the publisher did not give them all: ask providers that list them
                providers = await asyncio.get_running_loop().run_in_executor(None, self.directory.providers)
                candidates += [
                    (e.record.peer_id, e.record.maddrs)
                    for e in providers
                    if e.record.peer_id != self.endpoint.peer_id and set(e.record.manifests) & set(need)
                ]
                continue
            peer_id, maddrs = candidates[position]
            position += 1
            if self._banned_until.get(peer_id, 0) > time.monotonic():
                continue
            try:
                await self.endpoint.connect(peer_id, maddrs, self.config.request_timeout)
                response = await self.endpoint.get_manifests(
                    peer_id,
                    weights_pb2.ManifestsRequest(digests=[bytes.fromhex(d) for d in need]),
                    self.config.request_timeout,
                )
            except Exception as exc:  # a dead or misbehaving peer: try the next one
                self.stats.failures["manifest_request"] += 1
                logger.warning("manifest request to %s failed: %r", peer_id[-8:], exc)
                continue
            for raw in response.manifests[: len(need)]:
                digest = manifest_digest(raw)
                if digest not in wanted:  # not what was asked for: that provider's fault
                    self.stats.rejected["unexpected_manifest"] += 1
                elif digest not in found:
                    manifest = self._check(raw, wanted[digest], record, peer_id)
                    if manifest is not None:
                        found[digest] = manifest
        return [found.get(r.digest) for r in refs]

    # ---- serving and announcing -----------------------------------------------------------------------
    def _retain(self, fetched: list[ServedVersion]) -> None:
        entries = [e for e in self.endpoint.library.entries() if e.complete]
        keep = {e.digest for e in entries[-self.config.serve_retain :]} | {e.digest for e in fetched}
        self.endpoint.library.retain(keep)
        self._partial = []
        self._announce_soon()

    def _provider_record(self) -> ProviderRecord:
        complete = [e for e in self.endpoint.library.entries() if e.complete][-64:]
        return ProviderRecord(
            peer_id=self.identity.peer_id,
            versions=sorted({e.manifest.version for e in complete})[-64:],
            encodings=sorted({e.manifest.encoding for e in complete}),
            maddrs=self._maddrs,
            stream_id=self._stream_id,
            manifests=[e.digest for e in complete],
            partial=self._partial[:16],
        )

    def _announce_soon(self) -> None:
        """Announce in the background (in call order; the record reflects the state when it is sent)."""
        if self.config.serve and not self._stop.is_set():
            try:
                self._announcer.submit(self.announce)
            except RuntimeError:  # shut down meanwhile
                pass

    def announce(self) -> bool:
        """Store this peer's ProviderRecord now (done by itself after each change and on a heartbeat)."""
        if not self.config.serve:
            return False
        with self._announce_lock:
            try:
                return self.directory.announce_provider(self._provider_record(), self.config.record_ttl)
            except Exception as exc:  # announcing is best effort; the heartbeat retries
                logger.debug("provider announcement failed: %r", exc)
                return False

    def _announce_loop(self) -> None:
        while not self._stop.wait(self.config.record_ttl / 3):
            if len(self.endpoint.library):
                self.announce()

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _ban(self, peer_id: str, reason: str) -> None:
        if peer_id not in self.stats.banned:
            logger.warning(
                "provider %s served bad data (%s): not asking it again for %.0f s",
                peer_id,
                reason,
                self.config.ban_seconds,
            )
        self.stats.banned[peer_id] = reason
        self._banned_until[peer_id] = time.monotonic() + self.config.ban_seconds


class _Source:
    """One provider during one fetch: what it holds, what is in flight to it, how it behaved."""

    def __init__(self, peer_id: str, maddrs: Iterable[str], publisher: bool = False):
        self.peer_id = peer_id
        self.maddrs = list(maddrs)
        self.publisher = publisher
        self.complete: set[str] = set()
        self.partial: set[str] = set()
        self.have: dict[str, set[int]] = {}
        self.fetching: dict[str, set[int]] = {}
        self.inflight = 0
        self.failures = 0
        self.dropped = False
        self.busy_until = 0.0
        self.next_have = 0.0
        self.polling = False
        self.rate: float | None = None  # bytes/s of its recent streams

    def holds(self, digest: str, index: int) -> bool:
        return digest in self.complete or index in self.have.get(digest, ())


class _FetchSession:
    """The chunk transfers of one chain of manifests; runs on the endpoint's loop."""

    def __init__(self, fetcher: WeightFetcher, record: PolicyRecord, entries: list[ServedVersion]):
        self.f = fetcher
        self.cfg = fetcher.config
        self.record = record
        self.entries = {e.digest: e for e in entries}
        self.order = [e.digest for e in entries]
        self.missing = {e.digest: set(e.store.missing()) for e in entries}
        self.inflight: dict[str, dict[int, _Source]] = {e.digest: {} for e in entries}
        self.picks: Counter = Counter()  # digest -> chunks asked in pick mode whose first part has not come
        self.sources: dict[str, _Source] = {}
        self.chunks_total = sum(e.manifest.num_chunks for e in entries)
        self.bytes_total = sum(e.manifest.total_bytes for e in entries)
        self.bytes_done = 0
        self.duplicate_bytes = 0
        self.used: set[str] = set()
        self.wake = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.started = time.monotonic()
        self.last_progress = self.started
        self.discover_seconds = 0.0
        publisher = _Source(record.peer_id, record.maddrs, publisher=True)
        publisher.complete = set(self.order)
        if fetcher._banned_until.get(record.peer_id, 0) <= time.monotonic():
            self.sources[record.peer_id] = publisher

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("fetch task failed: %r", task.exception())
        self.wake.set()

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "version": self.record.version,
            "elapsed": now - self.started,
            "missing": {d[:12]: len(m) for d, m in self.missing.items()},
            "in_flight": {d[:12]: len(m) for d, m in self.inflight.items()},
            "picks": {d[:12]: n for d, n in self.picks.items()},
            "since_progress": now - self.last_progress,
            "providers": {
                s.peer_id: {
                    "publisher": s.publisher,
                    "dropped": s.dropped,
                    "in_flight": s.inflight,
                    "failures": s.failures,
                    "busy_for": max(0.0, s.busy_until - now),
                    "complete": len(s.complete),
                    "partial": len(s.partial),
                    "have": {d[:12]: len(h) for d, h in s.have.items()},
                    "rate": s.rate,
                }
                for s in list(self.sources.values())
            },
            "tasks": len(self.tasks),
        }

    def _alive(self) -> list[_Source]:
        return [s for s in self.sources.values() if not s.dropped]

    async def run(self) -> None:
        deadline = time.monotonic() + self.cfg.fetch_timeout
        try:  # know the other providers before the first request, so the publisher is spared from the start
            await asyncio.wait_for(self._refresh_providers(), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            pass
        self.discover_seconds = time.monotonic() - self.started
        next_refresh = time.monotonic() + self.cfg.provider_refresh
        refreshing = False
        lonely_since: float | None = None
        try:
            while any(self.missing.values()):
                now = time.monotonic()
                if now > deadline:
                    raise FetchError("timeout")
                if now - self.last_progress > self.cfg.no_progress_timeout:
                    raise FetchError(
                        "no_progress", f"no chunk arrived for {self.cfg.no_progress_timeout:.0f} s"
                    )
                if now >= next_refresh and not refreshing:
                    refreshing = True

                    async def refresh() -> None:
                        nonlocal refreshing, next_refresh
                        try:
                            await self._refresh_providers()
                        finally:
                            refreshing = False
                            next_refresh = time.monotonic() + self.cfg.provider_refresh

                    self._spawn(refresh())
                self._poll_haves(now)
                self._schedule(now)
                busy = any(s.inflight for s in self.sources.values())
                if not busy and not self._alive():
                    lonely_since = lonely_since or now
                    if now - lonely_since > self.cfg.no_provider_timeout:
                        raise FetchError("no_providers", "every provider failed or none holds the version")
                else:
                    lonely_since = None
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in list(self.tasks):
                task.cancel()
            for entry in self.entries.values():
                entry.fetching.clear()

    # ---- providers ------------------------------------------------------------------------------------
    async def _refresh_providers(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(None, self.f.directory.providers)
        except Exception as exc:
            logger.debug("reading providers failed: %r", exc)
            return
        now = time.monotonic()
        wanted = set(self.order)
        for entry in found:
            p = entry.record
            if (
                p.peer_id in (self.f.endpoint.peer_id, self.record.peer_id)
                or p.stream_id != self.record.stream_id
            ):
                continue
            if self.f._banned_until.get(p.peer_id, 0) > now:
                continue
            complete, partial = set(p.manifests) & wanted, set(p.partial) & wanted
            if not complete and not partial:
                continue
            source = self.sources.get(p.peer_id)
            if source is None:
                source = self.sources[p.peer_id] = _Source(p.peer_id, p.maddrs)
            source.complete |= complete
            source.partial |= partial - source.complete
        self.wake.set()

    def _poll_haves(self, now: float) -> None:
        for s in self._alive():
            if s.publisher or s.polling or now < s.next_have:
                continue
            digests = [d for d in self.order if d in s.partial and d not in s.complete and self.missing[d]]
            if digests:
                s.polling = True
                s.next_have = now + self.cfg.have_period
                self._spawn(self._poll_have(s, digests))

    async def _poll_have(self, s: _Source, digests: list[str]) -> None:
        try:
            await self.f.endpoint.connect(s.peer_id, s.maddrs, self.cfg.request_timeout)
            for digest in digests:
                response = await self.f.endpoint.have(s.peer_id, digest, self.cfg.request_timeout)
                n = self.entries[digest].manifest.num_chunks
                if not response.held:
                    s.partial.discard(digest)
                elif response.complete and response.num_chunks == n:
                    s.complete.add(digest)
                else:
                    s.have[digest] = bitmap_indices(response.bitmap, n)
                    s.fetching[digest] = bitmap_indices(response.fetching, n)
        except Exception as exc:
            self._fail(s, "have_error", exc)
        finally:
            s.polling = False

    # ---- scheduling -----------------------------------------------------------------------------------
    def _schedule(self, now: float) -> None:
        stalled = now - self.last_progress > self.cfg.stall_timeout
        alive = self._alive()
        random.shuffle(alive)
        for s in sorted(alive, key=lambda s: (s.publisher, s.failures)):
            limit = self.cfg.publisher_streams if s.publisher else self.cfg.max_inflight_per_provider
            while s.inflight < limit and s.busy_until <= now:
                if s.publisher and s.inflight and sum(self.picks.values()) > 1:
                    break  # pipelining only: the open stream still has chunks to start
                work = self._pick_work(s, alive, stalled)
                if work is None:
                    break
                digest, indices, pick, fresh_for = work
                s.inflight += 1
                self.picks[digest] += pick
                if not pick:
                    for i in indices:
                        self.inflight[digest][i] = s
                        self.entries[digest].fetching.add(i)
                self._spawn(self._request(s, digest, indices, pick, fresh_for))

    def _pick_work(
        self, s: _Source, alive: list[_Source], stalled: bool
    ) -> tuple[str, list[int], int] | None:
        limit = self.f.endpoint.limits.max_chunks_per_request
        for digest in self.order:
            if digest not in s.complete and digest not in s.partial:
                continue
            avail = self.missing[digest] - self.inflight[digest].keys()
            if digest not in s.complete:
                avail &= s.have.get(digest, set())
            if s.publisher and self.cfg.spare_publisher and not stalled:
                others = [o for o in alive if o is not s]
                avail = {
                    i
                    for i in avail
                    if not any(o.holds(digest, i) or i in o.fetching.get(digest, ()) for o in others)
                }
            if not avail:
                continue
            if s.publisher and self.cfg.publisher_pick:
                pick = self.cfg.publisher_pick
                if s.rate:  # as many chunks as arrive in pick_seconds
                    mean_chunk = (
                        self.entries[digest].manifest.total_bytes / self.entries[digest].manifest.num_chunks
                    )
                    pick = max(1, min(limit, round(s.rate * self.cfg.pick_seconds / max(mean_chunk, 1))))
                pick = min(pick, len(avail) - self.picks[digest])
                if pick <= 0:  # the picks in flight already cover every candidate
                    continue
                # the freshness window makes receivers wait for each other: only among peers that serve
                window = self.cfg.spare_publisher and self.cfg.serve and not stalled
                return digest, sorted(avail)[:limit], pick, self.cfg.publisher_fresh_window if window else 0.0
            chosen = random.sample(sorted(avail), min(len(avail), self.cfg.chunks_per_request, limit))
            return digest, chosen, 0, 0.0
        return None

    # ---- one stream ---------------------------------------------------------------------------------
    async def _request(
        self, s: _Source, digest: str, indices: list[int], pick: int, fresh_for: float
    ) -> None:
        """One chunk stream from ``s``; every outcome is mapped to a counter, a retry or a ban here."""
        entry = self.entries[digest]
        manifest = entry.manifest
        request = weights_pb2.ChunksRequest(
            stream_id=manifest.stream_id,
            version=manifest.version,
            digest=bytes.fromhex(digest),
            indices=indices,
            pick=pick,
            fresh_for=fresh_for,
        )
        state = _StreamState(
            expected=set(indices), mine=set() if pick else set(indices), pick=pick, picks_left=pick
        )
        stream = None
        started = time.monotonic()
        try:
            try:
                await self.f.endpoint.connect(s.peer_id, s.maddrs, self.cfg.request_timeout)
                stream = await self.f.endpoint.open_chunk_stream(s.peer_id, request, self.cfg.request_timeout)
                await self._read(s, entry, stream, state)
            finally:  # chunks already received are verified (and kept) whatever happened after them
                if stream is not None:
                    stream.close()
                results = await asyncio.gather(*state.verifying, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            if pick and not state.done:  # the publisher handed all of them out just now: ask who got them
                s.busy_until = time.monotonic() + self.cfg.have_period
            received = sum(manifest.chunks[i].size for i in state.done if i in state.mine or pick)
            if received:  # bytes/s of this stream, smoothed
                rate = received / max(time.monotonic() - started, 1e-3)
                s.rate = rate if s.rate is None else 0.5 * s.rate + 0.5 * rate
        except StreamViolation as exc:
            self.f.stats.rejected[exc.reason] += 1
            self.f._ban(s.peer_id, exc.reason)
            s.dropped = True
        except RemoteError as exc:
            reason = str(exc)
            if reason == "not_held":
                s.complete.discard(digest)
                s.partial.discard(digest)
            elif reason == "busy":
                s.busy_until = time.monotonic() + 0.5
            else:
                self._fail(s, "remote_error", exc)
        except _Broken as exc:
            self.f.stats.rejected[exc.reason] += 1
            self._fail(s, exc.reason, exc)
        except asyncio.IncompleteReadError as exc:
            self.f.stats.rejected["truncated"] += 1
            self._fail(s, "truncated", exc)
        except (asyncio.TimeoutError, TimeoutError) as exc:
            self._fail(s, "timeout", exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(s, "error", exc)
        finally:
            self.picks[digest] -= state.picks_left
            s.inflight -= 1
            for (
                i
            ) in state.mine:  # this request's chunks only (another stream to the same provider keeps its own)
                self._release(digest, i, s)
            self.wake.set()

    async def _read(self, s: _Source, entry: ServedVersion, stream, state: _StreamState) -> None:
        """Read parts until the stream ends, checking each against the request and the manifest.

        A completed chunk is verified in a worker thread while the stream goes on (``state.verifying``).
        """
        digest, manifest = entry.digest, entry.manifest
        current: int | None = None
        pieces: list[bytes] = []
        got = 0
        deadline = time.monotonic() + self.cfg.chunk_timeout  # for the chunk being received (or the first)
        while True:
            part = await stream.next(max(0.0, deadline - time.monotonic()))
            if part is None:
                break
            if part.error:
                raise RemoteError(part.error)
            i = part.index
            if i not in state.expected or i in state.done:
                raise StreamViolation("unexpected_chunk", f"chunk {i} was not asked for")
            if part.missing:
                s.have.get(digest, set()).discard(i)
                state.done.add(i)
                self._release(digest, i, s)
                continue
            size = manifest.chunks[i].size
            if current != i:
                if current is not None:
                    raise StreamViolation("truncated", f"chunk {current} ended at {got} bytes")
                current, pieces, got = i, [], 0
                deadline = time.monotonic() + self.cfg.chunk_timeout  # a slow provider cannot hold it forever
                if state.picks_left:
                    state.picks_left -= 1
                    self.picks[digest] -= 1
                if i not in self.inflight[digest]:
                    self.inflight[digest][i] = s
                    entry.fetching.add(i)
                    state.mine.add(i)
            if part.offset != got:
                raise StreamViolation("bad_offset", f"chunk {i}: offset {part.offset}, expected {got}")
            data = part.data  # each access to a bytes field copies it: once only
            if part.chunk_size != size or got + len(data) > size:
                raise StreamViolation("oversized", f"chunk {i} exceeds its {size} bytes")
            pieces.append(data)
            got += len(data)
            if got == size:
                chunk = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                state.verifying.append(asyncio.ensure_future(self._store(s, entry, i, chunk)))
                state.done.add(i)
                current, pieces, got = None, [], 0
                deadline = time.monotonic() + self.cfg.chunk_timeout  # for the next chunk's first part
        if current is not None:
            raise _Broken("truncated", f"stream ended inside chunk {current}")
        if not state.pick and state.expected - state.done:
            raise _Broken("stream_ended", f"{len(state.expected - state.done)} chunks not sent")

    def _release(self, digest: str, index: int, s: _Source) -> None:
        if self.inflight[digest].get(index) is s:
            del self.inflight[digest][index]
            self.entries[digest].fetching.discard(index)
            if index in self.missing[digest]:
                self.f.stats.retries += 1

    def _fail(self, s: _Source, reason: str, exc: BaseException) -> None:
        self.f.stats.failures[reason] += 1
        s.failures += 1
        logger.info("provider %s: %s (%r)", s.peer_id[-8:], reason, exc)
        if (
            s.publisher
        ):  # the source of truth is never given up on for trouble: it is retried, later and later
            s.busy_until = time.monotonic() + min(0.25 * 2**s.failures, 5.0)
            return
        if s.failures >= self.cfg.max_provider_failures and not s.dropped:
            s.dropped = True
            self.f.endpoint.forget(s.peer_id)
            logger.info(
                "dropping provider %s for this fetch after %d failures (%s)",
                s.peer_id[-8:],
                s.failures,
                reason,
            )

    async def _store(self, s: _Source, entry: ServedVersion, index: int, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            new = await loop.run_in_executor(self.f._verifier, entry.store.put, index, data)
        except ChunkDigestError:
            raise StreamViolation(
                "bad_digest", f"chunk {index} of version {entry.manifest.version}"
            ) from None
        except ChunkError as exc:
            raise StreamViolation("bad_chunk", str(exc)) from None
        self.used.add(s.peer_id)
        self.f.stats.bytes_by_provider[s.peer_id] += len(data)
        if not new:
            self.duplicate_bytes += len(data)
            return
        s.failures = 0
        self.missing[entry.digest].discard(index)
        self.inflight[entry.digest].pop(index, None)
        entry.fetching.discard(index)
        self.bytes_done += len(data)
        self.last_progress = time.monotonic()
        self.wake.set()  # the main loop notices completion (and free candidates) at once
        if self.f.on_progress is not None:
            try:
                self.f.on_progress(
                    FetchProgress(
                        version=self.record.version,
                        chunks_done=self.chunks_total - sum(len(m) for m in self.missing.values()),
                        chunks_total=self.chunks_total,
                        bytes_done=self.bytes_done,
                        bytes_total=self.bytes_total,
                        providers=len(self.used),
                        elapsed=time.monotonic() - self.started,
                    )
                )
            except Exception:
                logger.exception("progress callback failed")


@dataclass
class _StreamState:
    """Bookkeeping of one chunk stream."""

    expected: set[int]  # indices asked for (candidates, in pick mode)
    mine: set[int]  # indices this stream marked in flight
    pick: int  # 0: the provider sends every index asked; k: at most k of its choice
    picks_left: int  # pick mode: chunks the provider may still start
    done: set[int] = field(default_factory=set)  # indices fully received (or reported missing)
    verifying: list[asyncio.Future] = field(default_factory=list)


class _Broken(Exception):
    """A stream that ended early (the provider died or cut it): counted, retried elsewhere, not banned."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
