"""What a receiver knows about each provider during one fetch.

Owned here: ``Source`` (one provider during one fetch: the manifests it lists complete or partial, the
chunks it said it holds or is fetching, streams in flight to it, failures). Used by ``session``; must not
open streams nor decide trust.
"""

from __future__ import annotations

from collections.abc import Iterable


class Source:
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

    def lists(self, digest: str) -> bool:
        """Whether it may still serve chunks of ``digest`` (complete, or partial and not gone since)."""
        return digest in self.complete or digest in self.partial

    def holds(self, digest: str, index: int) -> bool:
        return digest in self.complete or (digest in self.partial and index in self.have.get(digest, ()))

    def will_hold(self, digest: str, index: int) -> bool:
        """Holds chunk ``index`` of ``digest`` or is fetching it (so it will serve it soon)."""
        return self.holds(digest, index) or (
            digest in self.partial and index in self.fetching.get(digest, ())
        )

    def forget(self, digest: str) -> None:
        """It no longer holds ``digest`` (``not_held``, or ``have`` said so): ask it nothing of it again."""
        self.complete.discard(digest)
        self.partial.discard(digest)
        self.have.pop(digest, None)
        self.fetching.pop(digest, None)
