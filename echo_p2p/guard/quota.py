"""Per-peer quotas: token buckets that bound what any one peer can cost a server per second.

Owned here: ``TokenBucket`` (a rate and a burst; ``charge`` may run into debt for costs known only after
the work, such as CPU seconds spent validating) and ``PeerQuotas`` (one bucket per peer id, a bounded
number of peers remembered). Callers check ``allows`` *before* reading or parsing what a peer sent, so an
over-quota peer is refused for the price of a header. No I/O, no threads of its own; thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class TokenBucket:
    """``rate`` units per second, at most ``burst`` saved up; starts full."""

    def __init__(self, rate: float, burst: float, now: float | None = None) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be > 0")
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp = time.monotonic() if now is None else now

    def _refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def allows(self, amount: float, now: float | None = None) -> bool:
        """True when ``amount`` fits now (nothing is taken)."""
        self._refill(time.monotonic() if now is None else now)
        return self.level >= min(amount, self.burst)

    def charge(self, amount: float, now: float | None = None) -> None:
        """Take ``amount`` (the level may go negative: a debt paid back at ``rate``)."""
        self._refill(time.monotonic() if now is None else now)
        self.level -= amount


class PeerQuotas:
    """One ``TokenBucket`` per peer id; the least recently seen peers are forgotten beyond ``max_peers``."""

    def __init__(self, rate: float, burst: float, max_peers: int = 4096) -> None:
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    def _bucket(self, peer_id: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(peer_id)
        if bucket is None:
            bucket = self._buckets[peer_id] = TokenBucket(self.rate, self.burst, now)
            while len(self._buckets) > self.max_peers:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(peer_id)
        return bucket

    def allows(self, peer_id: str, amount: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._bucket(peer_id, now).allows(amount, now)

    def charge(self, peer_id: str, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._bucket(peer_id, now).charge(amount, now)

    def available(self, peer_id: str, now: float | None = None) -> float:
        """What ``peer_id`` may still take now (0 when in debt)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            bucket = self._bucket(peer_id, now)
            bucket._refill(now)
            return max(0.0, bucket.level)
