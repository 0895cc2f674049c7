"""One fetch of a policy chain from several providers: the loop that runs it and what each stream's end means.

Owned here: ``FetchSession`` (used by ``fetcher.WeightFetcher._fetch``): reads who provides the chain and
polls partial providers' chunk maps, opens the streams ``scheduler.ChunkScheduler`` chooses, has
``reader.read_stream`` run each, and turns each outcome into counters, a retry elsewhere, a back-off, a
drop for the rest of the fetch or a ban (through the ``ban`` callback it is given); it ends a fetch that
cannot complete (``version_dropped`` at once when the publisher no longer serves a manifest of the chain,
``no_providers`` when nobody alive lists one, ``publisher_gone`` when the publisher has failed every request
for ``no_provider_timeout`` and nobody else lists what is missing, ``no_progress``, ``timeout``,
``stopped``). A peer provider whose chunk misses its rate deadline (``reader.StreamLimits``) is dropped,
skipped, and banned when it does so repeatedly (``_drop_slow``); the scheduler has hedged its late chunks by
then. Its collaborators are passed in: the endpoint (dials and streams), the directory (provider records),
the ``ProviderBook`` (bans across fetches), the ``FetchStats`` it counts in, the verifier thread and the
stop event. Must not
decide what to trust (``trust.py``) nor decode weights (``echo_p2p.weights``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from echo_p2p.net.records import PolicyRecord
from echo_p2p.transport.weights.fetch.config import FetcherConfig, FetchError, FetchProgress, FetchStats
from echo_p2p.transport.weights.fetch.providers import ProviderBook, Source
from echo_p2p.transport.weights.fetch.reader import StreamLimits, StreamOutcome, read_stream
from echo_p2p.transport.weights.fetch.scheduler import ChunkAsk, ChunkScheduler
from echo_p2p.transport.weights.service import ServedVersion, bitmap_indices

logger = logging.getLogger(__name__)


class FetchSession:
    """The chunk transfers of one chain of manifests; ``run`` on the endpoint's loop."""

    def __init__(
        self,
        record: PolicyRecord,
        entries: list[ServedVersion],
        *,
        config: FetcherConfig,
        endpoint,
        directory,
        book: ProviderBook,
        stats: FetchStats,
        ban: Callable[[str, str], None],
        verifier: concurrent.futures.Executor,
        stop: threading.Event | None = None,
        on_progress: Callable[[FetchProgress], None] | None = None,
    ):
        self.cfg = config
        self.endpoint = endpoint
        self.directory = directory
        self.book = book
        self.stats = stats
        self.ban = ban
        self.verifier = verifier
        self.stop = stop
        self.on_progress = on_progress
        self.record = record
        self.started = time.monotonic()
        self.sched = ChunkScheduler(entries, config, endpoint.limits.max_chunks_per_request, self.started)
        self.entries = self.sched.entries
        self.chunks_total = sum(e.manifest.num_chunks for e in entries)
        self.bytes_total = sum(e.manifest.total_bytes for e in entries)
        self.bytes_done = 0
        self.duplicate_bytes = 0
        self.used: set[str] = set()
        self.wake = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.discover_seconds = 0.0
        self.publisher_limits = StreamLimits(config.request_timeout, config.chunk_timeout)
        self.peer_limits = StreamLimits(
            config.request_timeout, config.chunk_timeout, config.min_provider_rate, config.provider_grace
        )
        # digests the publisher answered ``not_held`` for: dropped from its served chain (a newer keyframe)
        self.unserved: set[str] = set()
        # freshness window: digest -> when the publisher last had nothing fresh to pick (all handed out
        # recently); the next provider read decides whether anyone else is known to hold them
        self.empty_picks: dict[str, float] = {}
        self.refresh_now = False
        publisher = Source(record.peer_id, record.maddrs, publisher=True)
        publisher.complete = set(self.sched.order)
        if not book.banned(record.peer_id):
            self.sched.sources[record.peer_id] = publisher

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
            **self.sched.state(),
            "unserved": sorted(d[:12] for d in self.unserved),  # dropped by the publisher
            "since_progress": now - self.sched.last_progress,
            "providers": {s.peer_id: s.state(now) for s in list(self.sched.sources.values())},
            "tasks": len(self.tasks),
        }

    async def run(self) -> None:
        deadline = time.monotonic() + self.cfg.fetch_timeout
        try:  # know the other providers before the first request, so the publisher is spared from the start
            await asyncio.wait_for(self._refresh_providers(self.cfg.provider_reuse), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            pass
        self.discover_seconds = time.monotonic() - self.started
        next_refresh = time.monotonic() + self.cfg.provider_refresh
        refreshing = False
        lonely_since: float | None = None
        try:
            while not self.sched.complete():
                now = time.monotonic()
                if self.stop is not None and self.stop.is_set():
                    raise FetchError("stopped", "the fetcher is shutting down")
                if now > deadline:
                    raise FetchError("timeout")
                dropped = [d for d in self.sched.order if d in self.unserved and self.sched.missing[d]]
                if dropped:  # finishing it is pointless: the newest chain starts at a newer keyframe
                    version = self.entries[dropped[0]].manifest.version
                    raise FetchError(
                        "version_dropped",
                        f"the publisher no longer serves version {version} (a newer keyframe replaced it)",
                    )
                if now - self.sched.last_progress > self.cfg.no_progress_timeout:
                    raise FetchError(
                        "no_progress", f"no chunk arrived for {self.cfg.no_progress_timeout:.0f} s"
                    )
                if (now >= next_refresh or self.refresh_now) and not refreshing:
                    # a forced read (who else holds what the publisher handed out) is not an earlier fetch's
                    max_age = 0.0 if self.refresh_now else self.cfg.provider_refresh
                    refreshing, self.refresh_now = True, False

                    async def refresh(max_age: float = max_age) -> None:
                        nonlocal refreshing, next_refresh
                        try:
                            await asyncio.wait_for(self._refresh_providers(max_age), self.cfg.request_timeout)
                        except asyncio.TimeoutError:
                            logger.debug("reading providers timed out")
                        finally:
                            refreshing = False
                            next_refresh = time.monotonic() + self.cfg.provider_refresh

                    self._spawn(refresh())
                self._poll_haves(now)
                for ask in self.sched.next_requests(now):
                    self._spawn(self._request(ask))
                if not self.sched.busy() and self.sched.orphans():  # nobody alive holds it: only a refresh
                    lonely_since = lonely_since or now
                    if now - lonely_since > self.cfg.no_provider_timeout:
                        raise FetchError("no_providers", "every provider failed or none holds the version")
                else:
                    lonely_since = None
                self._check_publisher(now)
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

    def _check_publisher(self, now: float) -> None:
        """End the fetch when the publisher has failed every request for ``no_provider_timeout`` and no
        other live provider lists what is missing: it is gone (killed, cut off), and waiting on would hold
        this fetch until ``no_progress_timeout`` (60 s) while another trainer publishes newer versions. The
        publisher that only answers slowly or ``busy`` is waited for (an answer resets the clock)."""
        publisher = self.sched.sources.get(self.record.peer_id)
        if publisher is None or publisher.failing_for(now) <= self.cfg.no_provider_timeout:
            return
        others = [s for s in self.sched.alive() if not s.publisher]
        if any(self.sched.missing[d] and any(s.lists(d) for s in others) for d in self.sched.order):
            return
        raise FetchError(
            "publisher_gone",
            f"the publisher failed every request for {publisher.failing_for(now):.0f} s "
            f"({publisher.failures} failures) and no other provider holds the rest",
        )

    # ---- providers ------------------------------------------------------------------------------------
    async def _refresh_providers(self, max_age: float = 0.0) -> None:
        """Read the providers (a read at most ``max_age`` s old is shared with earlier fetches)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            found = await loop.run_in_executor(None, self.directory.providers, self.record.version, max_age)
        except Exception as exc:
            logger.debug("reading providers failed: %r", exc)
            return
        now = time.monotonic()
        self.stats.provider_reads += 1
        wanted = set(self.sched.order)
        sources = self.sched.sources
        for entry in found:
            p = entry.record
            if (
                p.peer_id in (self.endpoint.peer_id, self.record.peer_id)
                or p.stream_id != self.record.stream_id
            ):
                continue
            if self.book.banned(p.peer_id, now):
                continue
            self.book.note_addresses(p.peer_id, p.maddrs)
            complete, partial = set(p.manifests) & wanted, set(p.partial) & wanted
            if not complete and not partial:
                continue
            source = sources.get(p.peer_id)
            if source is None:
                source = sources[p.peer_id] = Source(p.peer_id, p.maddrs)
            source.complete |= complete
            source.partial |= partial - source.complete
        # the publisher had nothing fresh for a digest at least announce_grace before this read: if no other
        # live provider is known to hold it, whoever got those chunks skipped the version, moved on or is
        # banned; ask without the window, at once (the publisher waited only for this read, unless it failed
        # meanwhile). A read sooner after could miss receivers that got them but have not announced yet
        # (provider records are stored at most once a second; later under load): they are asked once listed
        publisher = sources.get(self.record.peer_id)
        for digest, at in list(self.empty_picks.items()):
            if at + self.cfg.announce_grace <= started:
                del self.empty_picks[digest]
                if not any(s.lists(digest) for s in self.sched.alive() if not s.publisher):
                    self.sched.no_window.add(digest)
                    if publisher is not None and not publisher.failures:
                        publisher.busy_until = min(publisher.busy_until, now)
        self.wake.set()

    def _poll_haves(self, now: float) -> None:
        for s in self.sched.alive():
            if s.publisher or s.polling or now < s.next_have:
                continue
            digests = [
                d
                for d in self.sched.order
                if d in s.partial and d not in s.complete and self.sched.missing[d]
            ]
            if digests:
                s.polling = True
                s.next_have = now + self.cfg.have_period
                self._spawn(self._poll_have(s, digests))

    async def _poll_have(self, s: Source, digests: list[str]) -> None:
        try:
            await self.endpoint.connect(s.peer_id, s.maddrs, self.cfg.request_timeout)
            for digest in digests:
                response = await self.endpoint.have(s.peer_id, digest, self.cfg.request_timeout)
                n = self.entries[digest].manifest.num_chunks
                if not response.held:
                    s.forget(digest)
                elif response.complete and response.num_chunks == n:
                    s.complete.add(digest)
                else:
                    s.have[digest] = bitmap_indices(response.bitmap, n)
                    s.note_fetching(digest, bitmap_indices(response.fetching, n), time.monotonic())
                s.answered()
        except Exception as exc:
            self._fail(s, "have_error", exc)
        finally:
            s.polling = False

    # ---- one stream -----------------------------------------------------------------------------------
    async def _request(self, ask: ChunkAsk) -> None:
        """One chunk stream (``reader.read_stream``); its outcome is mapped to a counter, a retry or a ban."""
        limits = self.publisher_limits if ask.source.publisher else self.peer_limits
        if ask.hedges:
            self.stats.slow["hedged"] += len(ask.hedges)
        outcome = await read_stream(self.endpoint, ask, self.entries[ask.digest], self, self.verifier, limits)
        try:
            self._settle(outcome)
        finally:
            self._settle_missing(ask.source, outcome)
            self.stats.retries += self.sched.finished(ask, outcome.state.picks_left, outcome.state.mine)
            self.wake.set()

    def _settle(self, outcome: StreamOutcome) -> None:
        s, digest, failure = outcome.ask.source, outcome.ask.digest, outcome.failure
        if failure is None or failure.kind in ("remote", "violation") or outcome.received:
            s.answered()  # it is there (a refusal or bad data are judged below, not as silence)
        if failure is None:
            if outcome.state.holders:
                self._take_named(digest, outcome.state.holders)
            if outcome.ask.pick and not outcome.state.done:  # all handed out just now: ask who got them
                s.busy_until = time.monotonic() + self.cfg.have_period
                if outcome.ask.fresh_for and digest not in self.empty_picks:
                    self.empty_picks[digest] = time.monotonic()
                    # learn now who else holds them (else: no window for it), unless the publisher said
                    self.refresh_now = not outcome.state.holders
            if outcome.received:  # bytes/s of this stream, smoothed
                s.note_rate(outcome.received / max(outcome.seconds, 1e-3))
            return
        if failure.kind == "violation":
            self.stats.rejected[failure.reason] += 1
            self.ban(s.peer_id, failure.reason)
            s.dropped = True
        elif failure.kind == "remote":
            if failure.reason == "not_held":
                s.forget(digest)
                if s.publisher:  # dropped from the publisher's chain: that version is gone for good
                    self.unserved.add(digest)
            elif failure.reason == "busy":
                s.busy_until = time.monotonic() + 0.5
            else:
                self._fail(s, "remote_error", failure.error)
        elif failure.kind == "broken":
            self.stats.rejected[failure.reason] += 1
            self._fail(s, failure.reason, failure.error)
        elif failure.kind == "slow":
            self.stats.failures["slow"] += 1
            self._drop_slow(s)
        else:  # timeout, error
            self._fail(s, failure.reason, failure.error)

    def _take_named(self, digest: str, holders: list[str]) -> None:
        """The publisher named the peers it just handed chunks of ``digest`` to (``ChunkPart.holders``): each
        is listed as a partial provider of it and its chunk map polled now, so that the chunks come from it
        once it holds them (``have_period`` later at most) rather than after its ``ProviderRecord`` is stored
        (at most once a second) and read. A named peer is dialled at the addresses of the last record of it
        this fetcher read; one never read is skipped (its record will say where it is: a dial without
        addresses fails behind NAT); failing to reach it only drops it from this fetch."""
        now = time.monotonic()
        for peer_id in holders:
            if peer_id in (self.endpoint.peer_id, self.record.peer_id) or self.book.banned(peer_id, now):
                continue
            source = self.sched.sources.get(peer_id)
            if source is None:
                maddrs = self.book.addresses(peer_id)
                if not maddrs:  # never read a record of it: where to dial it is unknown (its record will say)
                    continue
                source = self.sched.sources[peer_id] = Source(peer_id, maddrs, named=True)
            if source.dropped or source.lists(digest):
                continue
            source.partial.add(digest)
            source.next_have = now
            self.stats.named_providers += 1
        self.wake.set()

    def _settle_missing(self, s: Source, outcome: StreamOutcome) -> None:
        """Count the "missing" answers of one stream: a provider that gave ``max_missing_answers`` for
        chunks it advertised is banned; one whose stream brought nothing else backs off."""
        state = outcome.state
        if not state.missing:
            return
        if state.broken:
            self.stats.rejected["claimed_missing"] += state.broken
            if self.book.missing(s.peer_id, state.broken) and not s.dropped:
                self.ban(s.peer_id, "claimed_missing")
                s.dropped = True
        if state.done <= state.missing:
            s.back_off(time.monotonic())

    def _fail(self, s: Source, reason: str, exc: BaseException) -> None:
        self.stats.failures[reason] += 1
        s.failed(time.monotonic())
        logger.info("provider %s: %s (%r)", s.peer_id[-8:], reason, exc)
        if (
            s.publisher
        ):  # the source of truth is never given up on for trouble: it is retried, later and later
            s.busy_until = time.monotonic() + min(0.25 * 2**s.failures, 5.0)
            return
        if s.failures >= self.cfg.max_provider_failures and not s.dropped:
            s.dropped = True
            self.endpoint.forget(s.peer_id)
            if s.rate is None and not s.named:  # nothing ever came: a record at an address nobody serves at
                self.book.ban(s.peer_id, seconds=self.cfg.unreachable_seconds)
                self.stats.failures["unreachable"] += 1
            logger.info(
                "dropping provider %s for this fetch after %d failures (%s)",
                s.peer_id[-8:],
                s.failures,
                reason,
            )

    def _drop_slow(self, s: Source) -> None:
        """A chunk of ``s`` missed its rate deadline, or a hedge delivered it first (a fetch that completes
        from the hedges ends before the late stream's deadline): ``s`` is dropped from this fetch and
        skipped by later fetches for ``unreachable_seconds``; its ``max_slow_drops``-th drop
        within ``missing_window`` bans it (``ban_seconds``). Slowness is not proof of malice (a congested
        honest uplink is slow too), so one drop only skips it; a provider that keeps listing the newest
        versions and keeps failing to deliver them at the minimum rate costs every fetch a hedge, and is
        then banned like one that serves bad data."""
        if s.dropped or s.publisher:
            return
        s.dropped = True
        self.endpoint.forget(s.peer_id)
        self.stats.slow["dropped"] += 1
        if self.book.slow(s.peer_id, self.cfg.max_slow_drops):
            self.stats.slow["banned"] += 1
            self.ban(s.peer_id, "too_slow")
        else:
            self.book.ban(s.peer_id, seconds=self.cfg.unreachable_seconds)
        logger.info(
            "dropping provider %s for this fetch: a chunk slower than %.0f KiB/s",
            s.peer_id[-8:],
            self.cfg.min_provider_rate / 1024,
        )

    # ---- what the reader reports (``reader.ChunkSink``) -------------------------------------------------
    def chunk_started(self, s: Source, digest: str, index: int, picked: bool) -> bool:
        return self.sched.chunk_started(s, digest, index, picked)

    def chunk_released(self, s: Source, digest: str, index: int) -> None:
        self.stats.retries += self.sched.release(digest, index, s)

    def chunk_stored(self, s: Source, entry: ServedVersion, index: int, size: int, new: bool) -> None:
        self.used.add(s.peer_id)
        self.stats.bytes_by_provider[s.peer_id] += size
        if not new:
            self.duplicate_bytes += size
            return
        s.failures = s.wasted = 0
        now = time.monotonic()
        late = self.sched.chunk_stored(entry.digest, index, now, s)
        if late is not None:  # a hedge beat the provider first asked: it was late, whatever it sends now
            self.stats.slow["hedge_won"] += 1
            self._drop_slow(late)
        self.bytes_done += size
        self.wake.set()  # the main loop notices completion (and free candidates) at once
        if self.on_progress is not None:
            try:
                self.on_progress(
                    FetchProgress(
                        version=self.record.version,
                        chunks_done=self.chunks_total - self.sched.chunks_missing(),
                        chunks_total=self.chunks_total,
                        bytes_done=self.bytes_done,
                        bytes_total=self.bytes_total,
                        providers=len(self.used),
                        elapsed=now - self.started,
                    )
                )
            except Exception:
                logger.exception("progress callback failed")
