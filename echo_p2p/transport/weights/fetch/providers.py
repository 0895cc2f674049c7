"""What a receiver knows about each provider: during one fetch, and across fetches.

Owned here: ``Source`` (one provider during one fetch: the manifests it lists complete or partial, the
chunks it said it holds or is fetching, the chunks it then answered "missing" for, streams in flight to it,
failures, its measured rate, its back-off and its request budget) and ``ProviderBook`` (kept by the fetcher
for its lifetime: which providers are banned or skipped until when, the "missing" answers each gave for
chunks it had advertised, and its recent drops for slowness).
Used by ``scheduler``, ``session`` and ``fetcher``; must not open streams nor decide trust.

A provider advertises a chunk by listing its manifest as complete in its ``ProviderRecord`` (it then holds
every chunk) or by setting the chunk's bit in its ``rpc_have`` map (a partial provider is asked only for
those). An honest provider never answers "missing" for a chunk it advertised: chunk stores only grow, and a
version it dropped is answered ``not_held``. Such answers are therefore counted as broken promises and,
past ``FetcherConfig.max_missing_answers`` within ``missing_window``, the provider is banned like one that
served bad data.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

#: Providers the book remembers at most (bans and "missing" counts; the oldest entries are forgotten first).
MAX_TRACKED_PROVIDERS = 4096
#: Back-off after a stream that brought nothing because the provider answered "missing": 0.25 s doubling
#: with each such stream in a row, at most this long.
MAX_BACKOFF = 5.0


class Source:
    """One provider during one fetch: what it holds, what is in flight to it, how it behaved."""

    def __init__(self, peer_id: str, maddrs: Iterable[str], publisher: bool = False, named: bool = False):
        self.peer_id = peer_id
        self.maddrs = list(maddrs)
        self.publisher = publisher
        # known from the publisher naming it (``ChunkPart.holders``), dialled at the addresses of an older
        # record of it: failing to reach it there says nothing against what it announces now
        self.named = named
        self.complete: set[str] = set()
        self.partial: set[str] = set()
        self.have: dict[str, set[int]] = {}
        self.fetching: dict[str, set[int]] = {}
        self.fetching_since: dict[str, dict[int, float]] = {}  # when each "fetching" claim was first seen
        self.inflight = 0
        self.failures = 0
        self.failing_since: float | None = None  # its first failure since it last answered (monotonic)
        self.dropped = False
        self.busy_until = 0.0
        self.next_have = 0.0
        self.polling = False
        self.rate: float | None = None  # bytes/s of its recent streams
        self.denied: dict[str, set[int]] = {}  # chunks it answered "missing" for: not asked of it again
        self.wasted = 0  # streams in a row that brought nothing but "missing" answers
        self.tokens: float | None = None  # request budget (token bucket); None: full
        self.tokens_at = 0.0

    def state(self, now: float) -> dict[str, Any]:
        """For ``WeightFetcher.fetch_state`` (status lines and debugging)."""
        return {
            "publisher": self.publisher,
            "named": self.named,
            "dropped": self.dropped,
            "in_flight": self.inflight,
            "failures": self.failures,
            "failing_for": self.failing_for(now),
            "busy_for": max(0.0, self.busy_until - now),
            "complete": len(self.complete),
            "partial": len(self.partial),
            "have": {d[:12]: len(h) for d, h in self.have.items()},
            "denied": {d[:12]: len(h) for d, h in self.denied.items()},
            "rate": self.rate,
        }

    def failed(self, now: float) -> None:
        """A request to it failed (an error or a timeout, no answer)."""
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = now

    def answered(self) -> None:
        """It answered a request (chunks, a chunk map, or a refusal: it is there)."""
        self.failing_since = None

    def failing_for(self, now: float) -> float:
        """Seconds every request to it has failed (0 while it answers)."""
        return 0.0 if self.failing_since is None else now - self.failing_since

    def lists(self, digest: str) -> bool:
        """Whether it may still serve chunks of ``digest`` (complete, or partial and not gone since)."""
        return digest in self.complete or digest in self.partial

    def holds(self, digest: str, index: int) -> bool:
        if index in self.denied.get(digest, ()):
            return False
        return digest in self.complete or (digest in self.partial and index in self.have.get(digest, ()))

    def advertised(self, digest: str, index: int) -> bool:
        """Whether it said it holds chunk ``index`` (listed complete, or set in its last chunk map)."""
        return digest in self.complete or index in self.have.get(digest, ())

    def deny(self, digest: str, index: int) -> None:
        """It answered "missing" for chunk ``index``: do not count on it for that chunk any more."""
        self.denied.setdefault(digest, set()).add(index)
        self.have.get(digest, set()).discard(index)

    def note_rate(self, rate: float) -> None:
        """A stream of it delivered at ``rate`` bytes/s: smoothed into ``rate``."""
        self.rate = rate if self.rate is None else 0.5 * self.rate + 0.5 * rate

    def back_off(self, now: float) -> None:
        """A stream brought nothing but "missing" answers: wait 0.25 s, doubling in a row, ≤ MAX_BACKOFF."""
        self.wasted += 1
        self.busy_until = max(self.busy_until, now + min(0.25 * 2 ** (self.wasted - 1), MAX_BACKOFF))

    def may_request(self, now: float, rate: float, burst: float) -> bool:
        """Whether its request budget (``rate`` streams/s, ``burst`` at once) allows opening a stream now."""
        if self.tokens is None:
            self.tokens, self.tokens_at = burst, now
        self.tokens = min(burst, self.tokens + (now - self.tokens_at) * rate)
        self.tokens_at = now
        return self.tokens >= 1.0

    def spend_request(self) -> None:
        self.tokens = (self.tokens if self.tokens is not None else 0.0) - 1.0

    def will_hold(self, digest: str, index: int, claimed_after: float = -math.inf) -> bool:
        """Holds chunk ``index`` of ``digest`` or is fetching it (so it will serve it soon). A "fetching"
        claim first made before ``claimed_after`` no longer counts: a chunk fetched that long ago would be
        held by now (a provider that says it fetches everything forever must not stall the publisher)."""
        if self.holds(digest, index):
            return True
        if digest not in self.partial or index not in self.fetching.get(digest, ()):
            return False
        return self.fetching_since.get(digest, {}).get(index, math.inf) >= claimed_after

    def note_fetching(self, digest: str, indices: set[int], now: float) -> None:
        """Its chunk map says it is fetching ``indices`` now (each claim dated from when it was first seen)."""
        since = self.fetching_since.get(digest, {})
        self.fetching[digest] = indices
        self.fetching_since[digest] = {i: since.get(i, now) for i in indices}

    def forget(self, digest: str) -> None:
        """It no longer holds ``digest`` (``not_held``, or ``have`` said so): ask it nothing of it again."""
        self.complete.discard(digest)
        self.partial.discard(digest)
        self.have.pop(digest, None)
        self.fetching.pop(digest, None)
        self.fetching_since.pop(digest, None)


class ProviderBook:
    """Bans, broken promises and last known addresses of providers, kept across fetches; bounded to
    MAX_TRACKED_PROVIDERS."""

    def __init__(self, ban_seconds: float, max_missing: int, missing_window: float, clock=time.monotonic):
        self.ban_seconds = ban_seconds
        self.max_missing = max_missing
        self.missing_window = missing_window
        self.clock = clock
        self._banned_until: dict[str, float] = {}
        self._missing: dict[str, deque[float]] = {}  # peer -> times of its last "missing" answers
        self._slow: dict[str, deque[float]] = {}  # peer -> times it was last dropped for slowness
        self._addresses: dict[str, list[str]] = {}  # peer -> the maddrs of its newest ProviderRecord read

    def banned(self, peer_id: str, now: float | None = None) -> bool:
        until = self._banned_until.get(peer_id)
        return until is not None and until > (self.clock() if now is None else now)

    def ban(self, peer_id: str, now: float | None = None, seconds: float | None = None) -> None:
        """Avoid ``peer_id`` for ``seconds`` (default ``ban_seconds``); a longer ban in force is kept."""
        now = self.clock() if now is None else now
        until = max(
            now + (self.ban_seconds if seconds is None else seconds), self._banned_until.pop(peer_id, now)
        )
        self._banned_until[peer_id] = until  # re-inserted last: the oldest are forgotten first
        self._missing.pop(peer_id, None)
        _bound(self._banned_until, lambda until: until <= now)

    def note_addresses(self, peer_id: str, maddrs: Iterable[str]) -> None:
        """Remember the addresses a provider's record gave (for when it is named without a record)."""
        self._addresses.pop(peer_id, None)
        self._addresses[peer_id] = list(maddrs)  # inserted last: the oldest are forgotten first
        _bound(self._addresses, lambda maddrs: False)

    def addresses(self, peer_id: str) -> list[str]:
        return list(self._addresses.get(peer_id, ()))

    def missing(self, peer_id: str, count: int, now: float | None = None) -> bool:
        """Record ``count`` "missing" answers for chunks ``peer_id`` advertised; True when it has now given
        ``max_missing`` of them within ``missing_window`` seconds (the caller bans it)."""
        if count <= 0:
            return False
        now = self.clock() if now is None else now
        return self._record(self._missing, peer_id, count, self.max_missing, now) >= self.max_missing

    def slow(self, peer_id: str, max_drops: int, now: float | None = None) -> bool:
        """Record that ``peer_id`` was dropped from a fetch for slowness; True when that is its
        ``max_drops``-th drop within ``missing_window`` seconds (the caller bans it)."""
        now = self.clock() if now is None else now
        if self._record(self._slow, peer_id, 1, max_drops, now) < max_drops:
            return False
        del self._slow[peer_id]  # a ban starts the count afresh
        return True

    def _record(
        self, table: dict[str, deque[float]], peer_id: str, count: int, limit: int, now: float
    ) -> int:
        """Add ``count`` events of ``peer_id`` at ``now`` to ``table`` (its last ``limit`` kept) and forget
        those older than ``missing_window``; how many it holds now."""
        times = table.pop(peer_id, None) or deque(maxlen=limit)
        table[peer_id] = times  # re-inserted last: the oldest are forgotten first
        times.extend([now] * min(count, limit))
        while times and times[0] < now - self.missing_window:
            times.popleft()
        _bound(table, lambda t: not t or t[-1] < now - self.missing_window)
        return len(times)

    def missing_count(self, peer_id: str) -> int:
        return len(self._missing.get(peer_id, ()))


def _bound(table: dict, expired) -> None:
    """Keep ``table`` within MAX_TRACKED_PROVIDERS: expired entries first, then the oldest."""
    if len(table) <= MAX_TRACKED_PROVIDERS:
        return
    for key in [k for k, v in table.items() if expired(v)]:
        del table[key]
    while len(table) > MAX_TRACKED_PROVIDERS:
        del table[next(iter(table))]
