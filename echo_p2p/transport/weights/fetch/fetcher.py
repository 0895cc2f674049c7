"""Receiver side of the weights transport: find, fetch, verify and atomically apply policy versions.

Owned here: ``WeightFetcher``, which reads the trainers' ``PolicyRecord``s, accepts manifests only from
trusted trainers (``manifests``), pulls chunks in parallel from several providers (the publisher and peers
that hold or are fetching the same manifest), checks every digest, retries a chunk elsewhere on timeout,
error, bad digest or a broken stream, asks a second provider for a chunk the first is late with, drops a
peer provider below ``min_provider_rate``, bans a provider that served bad data (or was too slow again and
again), and swaps its ``PolicyWeights`` only once every chunk of the chain is verified and applied: a peer
never runs a mixed policy. With ``serve`` on it serves what it holds (chunks of a version being fetched
included) and announces itself as a provider (peer-assisted distribution); the publisher is spared: it is
asked only for chunks no other provider holds or is fetching, and hands different chunks to different
receivers. Which manifests to fetch is ``chain.plan_chain``; the transfer itself is a
``session.FetchSession``, given this fetcher's collaborators (endpoint, directory, provider book, stats,
verifier thread, stop event) and ``_ban`` as its ban callback; the settings, counters and reports
(``FetcherConfig``, ``FetchStats``, ``FetchError``, ``FetchProgress``) are ``config``; the provider record's
coalesced stores are ``announce``.
Callers: the inference peer (``update`` / ``ensure_version`` / ``follow``),
benchmarks, tests. Bad input from peers is counted by reason in ``stats()``, never raised to the caller.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from echo_p2p.guard.trust import TrustedTrainers
from echo_p2p.logs import VERSION_LINE_PERIOD, RateLimitedLog
from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.identity import Identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.reachability import Reachability
from echo_p2p.net.records import PolicyRecord, ProviderRecord
from echo_p2p.transport.weights.fetch.announce import CoalescedStore
from echo_p2p.transport.weights.fetch.chain import PlanError, plan_chain
from echo_p2p.transport.weights.fetch.config import FetcherConfig, FetchError, FetchProgress, FetchStats
from echo_p2p.transport.weights.fetch.manifests import ManifestCheck, get_manifests
from echo_p2p.transport.weights.fetch.providers import MAX_TRACKED_PROVIDERS, ProviderBook
from echo_p2p.transport.weights.fetch.session import FetchSession
from echo_p2p.transport.weights.service import ServedVersion, WeightsEndpoint
from echo_p2p.weights.codec import VersionAssembler, merge_changes
from echo_p2p.weights.manifest import WeightsError
from echo_p2p.weights.model_io import PolicyWeights

logger = logging.getLogger(__name__)

#: Failures that mean the record read was already stale (its version left the publisher's chain): the newest
#: record is read and fetched at once instead of after ``poll_period``.
_STALE_REASONS = frozenset({"version_dropped", "manifest_unavailable"})

#: Seconds the follower waits after a check before it heeds the next nudge (acks can nudge many times a second).
NUDGE_GAP = 0.05


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
        reach: Reachability | None = None,
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
        self._failed_log = RateLimitedLog(logger, 10.0)
        self._applied_log = RateLimitedLog(
            logger, VERSION_LINE_PERIOD, "{n} versions applied in {seconds:.0f} s"
        )
        self._weights: PolicyWeights | None = None
        self._lock = threading.Lock()  # guards _weights
        self._update_lock = threading.Lock()  # one fetch at a time
        self._stop = threading.Event()
        self._nudged = threading.Event()
        self._threads: list[threading.Thread] = []
        self._announcer = CoalescedStore(
            self._store_provider_record, self.config.announce_gap, self._stop, "provider-announce"
        )
        # digests are checked in one thread: at most one core hashes, the streams and p2pd keep the others
        self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chunk-verifier")
        self.book = ProviderBook(
            self.config.ban_seconds, self.config.max_missing_answers, self.config.missing_window
        )
        self.manifests = ManifestCheck(trusted, keys.run_id, self.stats)
        self._seen_untrusted: set[tuple[str, int]] = set()
        self._resume: dict[str, VersionAssembler] = {}  # partial stores of the last failed fetch
        self._partial: list[str] = []
        self._fetching: int | None = None  # the version of ``_partial``: its slot is announced too
        self._stream_id: str | None = None
        self.reach = reach  # this node's announced addresses (set in start() when None)
        self._session: FetchSession | None = None

    # ---- public API -----------------------------------------------------------------------------------
    def start(self) -> WeightFetcher:
        self.endpoint.start()
        if self.reach is None:
            self.reach = Reachability(self.dht)
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
        ``stats``; the held version is untouched). A fetch whose version left the publisher's chain while it
        ran fails at once (``version_dropped``) and the newest record is then fetched right away (from its
        keyframe when the deltas from the held version are gone). Blocks at most ``fetch_timeout`` (twice,
        in that case) plus DHT deadlines.
        """
        with self._update_lock:
            stale_version: int | None = None
            for _ in range(2):
                t_start = time.monotonic()
                record = None
                try:
                    try:
                        record = self._choose_record()
                    finally:
                        self.stats.record_reads += 1
                        self.stats.record_read_seconds_total += time.monotonic() - t_start
                    if record is None or (stale_version is not None and record.version <= stale_version):
                        return None
                    return self._fetch(record, t_start)
                except FetchError as exc:
                    self.stats.fetches_failed[exc.reason] += 1
                    self.stats.failed_seconds_total += time.monotonic() - t_start
                    if exc.reason == "stopped":
                        logger.info("fetch of version %d stopped: shutting down", record.version)
                        return None
                    self._failed_log.warning(  # one line per reason every 10 s: a newer version is routine
                        exc.reason,
                        "fetching version %d from %s failed: %s",
                        record.version,
                        record.peer_id[-8:],
                        exc,
                    )
                    if exc.reason not in _STALE_REASONS or self._stop.is_set():
                        return None
                    stale_version = record.version  # a newer record is out: fetch it now
                except Exception:  # a bug must not take the peer down: count it, keep the held version
                    self.stats.fetches_failed["internal_error"] += 1
                    self.stats.failed_seconds_total += time.monotonic() - t_start
                    logger.exception("policy update failed (version %s)", record.version if record else "?")
                    return None
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

    def published_version(self) -> int | None:
        """The newest version this peer holds or a trusted, not banned trainer announces (one DHT read,
        bounded by ``request_timeout``); None when there is none. Cheap: nothing is fetched."""
        versions = [
            e.record.version
            for e in self.directory.policies()
            if self.trusted.is_trusted(e.record.peer_id) and not self.book.banned(e.record.peer_id)
        ]
        held = self.version
        return max([*versions, *([] if held is None else [held])], default=None)

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
                self._nudged.wait(self.config.poll_period)  # a nudge (or the stop) ends the wait early
                self._nudged.clear()
                self._stop.wait(NUDGE_GAP)  # nudges coming faster than this are merged

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
            "directory_reads": self.directory.read_figures(),
        }

    def nudge(self) -> None:
        """Tell the follower a newer version exists (e.g. a trainer's ack said so): it reads the policy
        record now instead of at its next poll."""
        self._nudged.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop following, announcing and serving (idempotent)."""
        self._stop.set()
        self._nudged.set()
        for thread in self._threads:
            thread.join(timeout=self.config.request_timeout + 1)
        self._threads.clear()
        self._announcer.shutdown()
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
            if self.book.banned(record.peer_id):
                continue
            refused = self.manifests.refused
            if any(r.digest in refused for r in record.manifests if r.version == record.version):
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
            asked = get_manifests(
                record,
                refs,
                check=self.manifests,
                endpoint=self.endpoint,
                directory=self.directory,
                book=self.book,
                request_timeout=self.config.request_timeout,
            )
            manifests = self.endpoint.run(asked, self.config.request_timeout * 3 + 5)
        except TimeoutError:
            raise FetchError("timeout", "manifests not received in time") from None
        except concurrent.futures.CancelledError:  # the endpoint's loop was shut down under the call
            raise FetchError("stopped", "the weights endpoint shut down") from None
        phases["manifests"] = time.monotonic() - t_start - sum(phases.values())
        assemblers = []
        for ref, manifest in zip(refs, manifests, strict=True):
            if manifest is None:
                raise FetchError(
                    "manifest_refused" if ref.digest in self.manifests.refused else "manifest_unavailable"
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
            self._fetching = record.version if self._partial else None
            self._stream_id = record.stream_id
            self._announce_soon()
        phases["announce"] = time.monotonic() - t_start - sum(phases.values())
        self.directory.use_run_record(self.trusted)
        session = self._session = FetchSession(
            record,
            entries,
            config=self.config,
            endpoint=self.endpoint,
            directory=self.directory,
            book=self.book,
            stats=self.stats,
            ban=self._ban,
            verifier=self._verifier,
            stop=self._stop,
            on_progress=self.on_progress,
        )
        try:
            self.endpoint.run(session.run(), self.config.fetch_timeout + 5)
            phases["discover"] = session.discover_seconds  # the provider list read before the first request
            self.stats.last_providers_seen = sum(not s.publisher for s in session.sched.sources.values())
            phases["transfer"] = time.monotonic() - t_start - sum(phases.values())
            self.stats.last_transfer_seconds = phases["transfer"]
        except TimeoutError:
            raise FetchError("timeout", f"not complete within {self.config.fetch_timeout:.0f} s") from None
        except concurrent.futures.CancelledError:  # the endpoint's loop was shut down under the call
            raise FetchError("stopped", "the weights endpoint shut down") from None
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
        changed: dict | None = {}  # what differs from `held`, for engines that update in place
        try:
            for asm in assemblers:
                weights = asm.apply(weights, inplace=weights is not None and weights is not held)
                changed = merge_changes(changed, weights.changed)
        except WeightsError as exc:
            raise FetchError("apply_failed", f"{type(exc).__name__}: {exc}") from None
        assert weights is not None
        if held is None or changed is None:
            weights.changed, weights.changed_since = None, None
        else:
            weights.changed, weights.changed_since = changed, held.version
        with self._lock:
            self._weights = weights
        self._resume = {}
        self.stats.last_apply_seconds = phases["apply"] = time.monotonic() - t_apply
        self.stats.last_fetch_bytes = session.bytes_done
        if self.config.serve:
            self._retain(entries)
        phases["serve"] = time.monotonic() - t_start - sum(phases.values())
        self.stats.fetched(phases, time.monotonic() - t_start)
        self._applied_log.info(
            "applied",
            "applied version %d (%s) in %.2f s: %.1f MiB from %d providers",
            record.version,
            " + ".join(m.encoding for m in (a.manifest for a in assemblers)),
            self.stats.last_fetch_seconds,
            session.bytes_done / 2**20,
            len(session.used),
        )
        return weights

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
            maddrs=self.reach.current()[0] if self.reach is not None else [],
            stream_id=self._stream_id,
            manifests=[e.digest for e in complete],
            partial=self._partial[:16],
        )

    def _announce_soon(self) -> None:
        """Announce in the background, coalesced (``announce.CoalescedStore``: one store per ``announce_gap``
        at most, with the state when it is sent)."""
        if self.config.serve:
            self._announcer.soon()

    def announce(self) -> bool:
        """Store this peer's ProviderRecord now (done by itself after each change and on a heartbeat)."""
        return self._announcer.now()

    def _store_provider_record(self) -> bool:
        if not self.config.serve:
            self.stats.announcements["not_serving"] += 1
            return False
        if self.reach is not None and self.reach.current()[1] == "unreachable":
            self.stats.announcements["unreachable"] += 1
            return False  # nobody could dial us: offering chunks would only cost others failed dials
        try:
            self.directory.use_run_record(self.trusted)  # the run record's K, as the role's directory
            record = self._provider_record()
            versions = [*record.versions[-1:], *([] if self._fetching is None else [self._fetching])]
            stored = self.directory.announce_provider(record, self.config.record_ttl, versions)
        except Exception as exc:  # announcing is best effort; the heartbeat retries
            logger.debug("provider announcement failed: %r", exc)
            stored = False
        self.stats.announcements["stored" if stored else "failed"] += 1
        return stored

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
                "banning provider %s (%s): not asking it again for %.0f s",
                peer_id,
                reason,
                self.config.ban_seconds,
            )
            if len(self.stats.banned) >= MAX_TRACKED_PROVIDERS:  # bounded: forget the oldest
                del self.stats.banned[next(iter(self.stats.banned))]
        self.stats.banned[peer_id] = reason
        self.book.ban(peer_id)
