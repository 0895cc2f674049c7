"""The addresses of peers a node has met, kept next to its identity: a restart joins the run even when every
bootstrap it was given is down.

Owned here: ``PeerCache`` — load (bounded, validated) and save (atomic) the cache file
``<identity file>.peers.json``, and ``choose`` which addresses to keep: the configured bootstraps first,
then the run's trusted trainers, then a bounded share of other peers, each peer once. Callers: the peers
(``roles.base``), which add the cache to their initial peers at start and refresh it on their heartbeat.

Everything in the file came from DHT records, that is from strangers: a peer's own addresses are only kept
when its record says they are direct (not relayed), strangers' entries are capped (``max_others``) so that
a swarm of fake peers cannot fill the cache and isolate the node at its next start, and a bad line is
skipped, never fatal.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from echo_p2p.net.network_config import check_maddr

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 * 1024


def peer_id_of(maddr: str) -> str | None:
    """The peer id an address ends with (``.../p2p/<id>``), or None."""
    head, sep, tail = maddr.rpartition("/p2p/")
    return tail if sep and tail and "/" not in tail else None


class PeerCache:
    """See the module doc. ``path`` None: no cache (an ephemeral identity has nowhere to keep one)."""

    def __init__(self, path: str | Path | None, max_entries: int = 24, max_others: int = 8) -> None:
        self.path = Path(path) if path else None
        self.max_entries = max_entries
        self.max_others = max_others

    @classmethod
    def next_to(cls, identity_path: str | None, **kwargs) -> PeerCache:
        return cls(f"{identity_path}.peers.json" if identity_path else None, **kwargs)

    def load(self) -> list[str]:
        """The cached addresses, newest choice first; [] when there is no (readable) cache."""
        if self.path is None or not self.path.is_file():
            return []
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError("too large")
            data = json.loads(self.path.read_text())
            entries = data["maddrs"] if isinstance(data, dict) else []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the peer cache %s: %s", self.path, exc)
            return []
        out: list[str] = []
        for maddr in entries[: self.max_entries] if isinstance(entries, list) else []:
            try:
                out.append(check_maddr(maddr, need_peer_id=True))
            except ValueError:
                continue
        return out

    def choose(
        self,
        bootstraps: Sequence[str],
        trainers: Iterable[str],
        others: Iterable[str],
        own_peer_id: str | None = None,
    ) -> list[str]:
        """The addresses to keep: ``bootstraps``, then ``trainers``' (trusted), then at most ``max_others``
        other peers' addresses; one address per peer (its first), never our own."""
        chosen: list[str] = []
        seen = {own_peer_id} if own_peer_id else set()
        budget = {"boot": self.max_entries, "trainer": self.max_entries, "other": self.max_others}
        for kind, maddrs in (("boot", bootstraps), ("trainer", trainers), ("other", others)):
            for maddr in maddrs:
                pid = peer_id_of(maddr)
                if pid is None or pid in seen or "/p2p-circuit" in maddr or budget[kind] <= 0:
                    continue
                seen.add(pid)
                budget[kind] -= 1
                chosen.append(maddr)
                if len(chosen) >= self.max_entries:
                    return chosen
        return chosen

    def save(self, maddrs: Sequence[str]) -> bool:
        """Write ``maddrs`` (atomically); True when written."""
        if self.path is None or not maddrs:
            return False
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"saved_at": time.time(), "maddrs": list(maddrs)[: self.max_entries]}))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("could not write the peer cache %s: %s", self.path, exc)
            return False
        return True
