"""One fetch of a policy chain from several providers: scheduling, streams, retries, bans.

Owned here: ``_FetchSession`` (used by ``WeightFetcher._fetch``: which chunk to ask of which provider,
per-chunk deadlines, retries elsewhere on timeout, error, bad digest or a broken stream, banning a provider
that served bad data, sparing the publisher, ending a fetch that cannot complete: ``version_dropped`` at
once when the publisher no longer serves a manifest of the chain, ``no_providers`` when nobody alive lists
one). The streams themselves (request, parts, verification, failures) are ``session_streams.ChunkStreams``;
per-provider state is ``providers.Source``, the stream reader ``stream``, the errors and progress
records a fetch reports (``FetchError``, ``FetchProgress``) ``config``. Split from ``fetcher`` so that the
fetcher keeps the peer-facing API (records, trust, chains, atomic apply) and this module the transfer.
Must not decide what to trust (``trust.py``) nor decode weights (``echo_p2p.weights``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from echo_p2p.net.records import PolicyRecord
from echo_p2p.transport.weights.config import FetchError
from echo_p2p.transport.weights.providers import Source
from echo_p2p.transport.weights.service import ServedVersion, bitmap_indices
from echo_p2p.transport.weights.session_streams import ChunkStreams

if TYPE_CHECKING:
    from echo_p2p.transport.weights.fetcher import WeightFetcher

logger = logging.getLogger("echo_p2p.transport.weights.fetcher")


class _FetchSession(ChunkStreams):
    """The chunk transfers of one chain of manifests; runs on the endpoint's loop."""

    def __init__(self, fetcher: WeightFetcher, record: PolicyRecord, entries: list[ServedVersion]):
        self.f = fetcher
        self.cfg = fetcher.config
        self.record = record
        self.entries = {e.digest: e for e in entries}
        self.order = [e.digest for e in entries]
        self.missing = {e.digest: set(e.store.missing()) for e in entries}
        self.inflight: dict[str, dict[int, Source]] = {e.digest: {} for e in entries}
        self.picks: Counter = Counter()  # digest -> chunks asked in pick mode whose first part has not come
        self.sources: dict[str, Source] = {}
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
        # digests the publisher answered ``not_held`` for: dropped from its served chain (a newer keyframe)
        self.unserved: set[str] = set()
        # freshness window: digest -> when the publisher last had nothing fresh to pick (all handed out
        # recently); the next provider read decides whether anyone else is known to hold them
        self.empty_picks: dict[str, float] = {}
        self.no_window: set[str] = set()  # digests asked of the publisher without the window
        self.refresh_now = False
        publisher = Source(record.peer_id, record.maddrs, publisher=True)
        publisher.complete = set(self.order)
        if not fetcher.book.banned(record.peer_id):
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
            "unserved": sorted(d[:12] for d in self.unserved),  # dropped by the publisher
            "no_window": sorted(d[:12] for d in self.no_window),
            "since_progress": now - self.last_progress,
            "providers": {s.peer_id: s.state(now) for s in list(self.sources.values())},
            "tasks": len(self.tasks),
        }

    def _alive(self) -> list[Source]:
        return [s for s in self.sources.values() if not s.dropped]

    def _orphans(self) -> list[str]:
        """Digests with chunks missing that no live provider holds (nor fetches) any more."""
        alive = self._alive()
        return [d for d in self.order if self.missing[d] and not any(s.lists(d) for s in alive)]

    async def run(self) -> None:
        deadline = time.monotonic() + self.cfg.fetch_timeout
        try:  # know the other providers before the first request, so the publisher is spared from the start
            await asyncio.wait_for(self._refresh_providers(self.cfg.provider_reuse), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            pass
        stop = getattr(self.f, "_stop", None)
        self.discover_seconds = time.monotonic() - self.started
        next_refresh = time.monotonic() + self.cfg.provider_refresh
        refreshing = False
        lonely_since: float | None = None
        try:
            while any(self.missing.values()):
                now = time.monotonic()
                if stop is not None and stop.is_set():
                    raise FetchError("stopped", "the fetcher is shutting down")
                if now > deadline:
                    raise FetchError("timeout")
                dropped = [d for d in self.order if d in self.unserved and self.missing[d]]
                if dropped:  # finishing it is pointless: the newest chain starts at a newer keyframe
                    version = self.entries[dropped[0]].manifest.version
                    raise FetchError(
                        "version_dropped",
                        f"the publisher no longer serves version {version} (a newer keyframe replaced it)",
                    )
                if now - self.last_progress > self.cfg.no_progress_timeout:
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
                self._schedule(now)
                busy = any(s.inflight for s in self.sources.values())
                if not busy and self._orphans():  # a manifest nobody alive holds: only a refresh may help
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
    async def _refresh_providers(self, max_age: float = 0.0) -> None:
        """Read the providers (a read at most ``max_age`` s old is shared with earlier fetches)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            found = await loop.run_in_executor(None, self.f.directory.providers, max_age)
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
            if self.f.book.banned(p.peer_id, now):
                continue
            complete, partial = set(p.manifests) & wanted, set(p.partial) & wanted
            if not complete and not partial:
                continue
            source = self.sources.get(p.peer_id)
            if source is None:
                source = self.sources[p.peer_id] = Source(p.peer_id, p.maddrs)
            source.complete |= complete
            source.partial |= partial - source.complete
        # the publisher had nothing fresh for a digest before this read: if no other live provider is known
        # to hold it, whoever got those chunks skipped the version, moved on or is banned; ask without the
        # window, at once (the publisher waited only for this read, unless it failed meanwhile)
        publisher = self.sources.get(self.record.peer_id)
        for digest, at in list(self.empty_picks.items()):
            if at <= started:
                del self.empty_picks[digest]
                if not any(s.lists(digest) for s in self._alive() if not s.publisher):
                    self.no_window.add(digest)
                    if publisher is not None and not publisher.failures:
                        publisher.busy_until = min(publisher.busy_until, now)
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

    async def _poll_have(self, s: Source, digests: list[str]) -> None:
        try:
            await self.f.endpoint.connect(s.peer_id, s.maddrs, self.cfg.request_timeout)
            for digest in digests:
                response = await self.f.endpoint.have(s.peer_id, digest, self.cfg.request_timeout)
                n = self.entries[digest].manifest.num_chunks
                if not response.held:
                    s.forget(digest)
                elif response.complete and response.num_chunks == n:
                    s.complete.add(digest)
                else:
                    s.have[digest] = bitmap_indices(response.bitmap, n)
                    s.note_fetching(digest, bitmap_indices(response.fetching, n), time.monotonic())
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
                if not s.may_request(now, self.cfg.provider_request_rate, self.cfg.provider_request_burst):
                    break  # its request budget is spent: whatever it answers, it costs at most that rate
                work = self._pick_work(s, alive, stalled)
                if work is None:
                    break
                digest, indices, pick, fresh_for = work
                s.spend_request()
                s.inflight += 1
                self.picks[digest] += pick
                if not pick:
                    for i in indices:
                        self.inflight[digest][i] = s
                        self.entries[digest].fetching.add(i)
                self._spawn(self._request(s, digest, indices, pick, fresh_for))

    def _pick_work(
        self, s: Source, alive: list[Source], stalled: bool
    ) -> tuple[str, list[int], int, float] | None:
        limit = self.f.endpoint.limits.max_chunks_per_request
        for digest in self.order:
            if digest not in s.complete and digest not in s.partial:
                continue
            avail = self.missing[digest] - self.inflight[digest].keys()
            if digest not in s.complete:
                avail &= s.have.get(digest, set())
            if s.publisher and self.cfg.spare_publisher and not stalled:
                others = [o for o in alive if o is not s]
                recent = time.monotonic() - self.cfg.stall_timeout  # older "fetching" claims are not spared
                avail = {i for i in avail if not any(o.will_hold(digest, i, recent) for o in others)}
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
                # the freshness window makes receivers wait for each other: only among peers that serve,
                # and not once a provider read found nobody else holding what the publisher handed out
                window = (
                    self.cfg.spare_publisher
                    and self.cfg.serve
                    and not stalled
                    and digest not in self.no_window
                )
                return digest, sorted(avail)[:limit], pick, self.cfg.publisher_fresh_window if window else 0.0
            chosen = random.sample(sorted(avail), min(len(avail), self.cfg.chunks_per_request, limit))
            return digest, chosen, 0, 0.0
        return None
