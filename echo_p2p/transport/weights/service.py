"""Serving policy versions over hivemind P2P streams: the servicer, what it serves, and its endpoint.

Owned here: ``WeightLibrary`` (the signed manifests and verified chunk stores a process serves, complete
or still being fetched), ``WeightsServicer`` (a hivemind ``ServicerBase``: ``rpc_get_manifests``,
``rpc_have`` and the server-streaming ``rpc_get_chunks``, with per-request limits, stream limits, an
optional upload rate limit and byte counters), ``WeightsEndpoint`` (one per process and DHT: a ``P2PLoop``
on a replica of the DHT's daemon, the servicer registered under the run's namespace)
and the client calls (the chunk stream itself is read by ``stream.ChunkStream``, which refuses frames
larger than a part before reading them).
Callers: ``WeightPublisher`` (trainers) and ``WeightFetcher`` (inference peers). Must not decode weights
(``echo_p2p.weights`` does) nor decide what to trust (``trust.py`` does). Peers' bad requests get an
error message and a counter, never an exception in the caller.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar  # noqa: UP035 (hivemind's ServicerBase reads typing.AsyncIterator)

from hivemind.p2p import P2P, P2PContext, PeerID
from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.net.keys import SwarmKeys
from echo_p2p.proto import weights_pb2
from echo_p2p.transport.p2p_loop import P2PLoop
from echo_p2p.transport.streams import LingeringServicer
from echo_p2p.transport.weights.stream import ChunkStream
from echo_p2p.weights.manifest import ChunkStore, Manifest

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: hivemind's per-message cap (p2pd persistent connection); stream messages stay far below it.
MAX_MESSAGE = 4 * 1024 * 1024
#: Bytes a ChunkPart adds around its data (field tags, varints): frames may exceed part_size by this much.
PART_OVERHEAD = 256
#: Peers one ``ChunkPart.holders`` names at most (each chunk remembers this many recent recipients).
MAX_HOLDERS = 8
#: Bytes of one PeerID in ``ChunkPart.holders`` at most (a multihash of a key: 34 to 39 bytes in practice).
MAX_HOLDER_BYTES = 64


class ServiceLimits(BaseModel):
    """What one serving process accepts and sends (per request, per peer, in total)."""

    model_config = ConfigDict(extra="forbid")

    part_size: int = Field(
        default=1 << 20, gt=0, le=3 << 20, description="Bytes of chunk data per stream message (< 4 MiB cap)"
    )
    max_chunks_per_request: int = Field(default=64, gt=0, description="Chunks one rpc_get_chunks may ask for")
    max_request_bytes: int = Field(
        default=512 << 20, gt=0, description="Chunk bytes one rpc_get_chunks may ask for"
    )
    max_streams_per_peer: int = Field(
        default=8, gt=0, description="Concurrent chunk streams served to one peer; more get 'busy'"
    )
    max_streams_total: int = Field(
        default=64, gt=0, description="Concurrent chunk streams served in total; more get 'busy'"
    )
    max_manifests_response_bytes: int = Field(
        default=3 << 19, gt=0, le=2 << 20, description="Bytes of manifests per rpc_get_manifests answer"
    )
    max_digests_per_request: int = Field(default=64, gt=0, description="Manifests one request may name")
    upload_rate_limit: float | None = Field(
        default=None,
        gt=0,
        description="Bytes/s this process uploads at most, all streams together (None: no cap)",
    )


def manifest_digest(raw: bytes) -> str:
    """The id of a manifest on the wire and in DHT records: sha256 (hex) of ``Manifest.to_bytes()``."""
    return hashlib.sha256(raw).hexdigest()


@dataclass
class ServedVersion:
    """One manifest this process serves, with its chunk store (complete, or being filled by a fetch)."""

    manifest: Manifest
    raw: bytes
    digest: str
    store: ChunkStore
    fetching: set[int] = field(default_factory=set)  # chunk indices being fetched now (partial entries)
    added_at: float = field(default_factory=time.monotonic)

    @property
    def complete(self) -> bool:
        return self.store.is_complete()

    @classmethod
    def of(cls, manifest: Manifest, store: ChunkStore, raw: bytes | None = None) -> ServedVersion:
        raw = manifest.to_bytes() if raw is None else raw
        return cls(manifest=manifest, raw=raw, digest=manifest_digest(raw), store=store)


class WeightLibrary:
    """Thread-safe digest -> ``ServedVersion`` map: what the servicer may hand out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, ServedVersion] = {}

    def add(self, entry: ServedVersion) -> ServedVersion:
        with self._lock:
            return self._entries.setdefault(entry.digest, entry)

    def get(self, digest: str) -> ServedVersion | None:
        with self._lock:
            return self._entries.get(digest)

    def remove(self, digest: str) -> None:
        with self._lock:
            self._entries.pop(digest, None)

    def retain(self, keep: Iterable[str]) -> None:
        """Drop every entry whose digest is not in ``keep``."""
        keep = set(keep)
        with self._lock:
            for digest in [d for d in self._entries if d not in keep]:
                del self._entries[digest]

    def entries(self) -> list[ServedVersion]:
        """Every entry, oldest version first (keyframe before the delta of the same version)."""
        with self._lock:
            items = list(self._entries.values())
        return sorted(items, key=lambda e: (e.manifest.version, e.manifest.base_version is not None))

    def select(self, stream_id: str, min_version: int) -> list[ServedVersion]:
        return [
            e
            for e in self.entries()
            if (not stream_id or e.manifest.stream_id == stream_id) and e.manifest.version >= min_version
        ]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass
class ServiceStats:
    """Counters of a servicer (read them for metrics; they only grow)."""

    bytes_served: int = 0
    chunks_served: int = 0
    streams: int = 0
    manifests_served: int = 0
    holders_named: int = 0  # pick streams that ended naming who got the chunks skipped as fresh
    bytes_by_peer: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)  # reason -> count

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_served": self.bytes_served,
            "chunks_served": self.chunks_served,
            "streams": self.streams,
            "manifests_served": self.manifests_served,
            "holders_named": self.holders_named,
            "refused": dict(self.refused),
        }


def _bitmap(indices: Iterable[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        if 0 <= i < n:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def bitmap_indices(bitmap: bytes, n: int) -> set[int]:
    """Indices set in a ``HaveResponse`` bitmap (bits beyond ``n`` ignored)."""
    return {i for i in range(min(n, len(bitmap) * 8)) if bitmap[i // 8] >> (i % 8) & 1}


class WeightsServicer(LingeringServicer):
    """Answers manifest, availability and chunk requests from other peers out of a ``WeightLibrary``.

    ``rpc_get_chunks`` ends with an end frame and keeps its stream until the receiver closes it (``streams``:
    a provider that closed first could see its last parts dropped by a stream reset): up to
    ``stream_linger`` s, what the tail of a stream takes through a relay on a home uplink."""

    END_FRAME = frozenset({"rpc_get_chunks"})
    stream_linger = 30.0

    def __init__(self, library: WeightLibrary, limits: ServiceLimits | None = None):
        self.library = library
        self.limits = limits or ServiceLimits()
        self.stats = ServiceStats()
        self._streams_by_peer: Counter = Counter()
        self._streams_total = 0
        # digest -> (times each chunk was handed out, monotonic time it last was, its last MAX_HOLDERS
        # recipients: chunk -> (PeerID bytes, when), newest first); all in pick mode
        self._served_count: dict[
            str, tuple[list[int], list[float], dict[int, deque[tuple[bytes, float]]]]
        ] = {}
        self._next_send = 0.0  # upload rate limit: monotonic time when the next byte may leave

    def _refuse(self, reason: str) -> str:
        self.stats.refused[reason] += 1
        return reason

    async def rpc_get_manifests(
        self, request: weights_pb2.ManifestsRequest, context: P2PContext
    ) -> weights_pb2.ManifestsResponse:
        if len(request.digests) > self.limits.max_digests_per_request:
            return weights_pb2.ManifestsResponse(error=self._refuse("too_many_digests"))
        if request.digests:
            entries = [self.library.get(bytes(d).hex()) for d in request.digests if len(d) == 32]
            found = [e for e in entries if e is not None]
        else:
            found = self.library.select(request.stream_id, request.min_version)
        out, size, truncated = [], 0, False
        for entry in found:
            if size + len(entry.raw) > self.limits.max_manifests_response_bytes:
                truncated = True
                break
            out.append(entry.raw)
            size += len(entry.raw)
        self.stats.manifests_served += len(out)
        return weights_pb2.ManifestsResponse(manifests=out, truncated=truncated)

    async def rpc_have(
        self, request: weights_pb2.HaveRequest, context: P2PContext
    ) -> weights_pb2.HaveResponse:
        entry = self.library.get(bytes(request.digest).hex()) if len(request.digest) == 32 else None
        if entry is None:
            return weights_pb2.HaveResponse(held=False)
        n = entry.manifest.num_chunks
        held = [i for i in range(n) if entry.store.has(i)]
        return weights_pb2.HaveResponse(
            held=True,
            complete=len(held) == n,
            num_chunks=n,
            bitmap=_bitmap(held, n),
            fetching=_bitmap(list(entry.fetching), n),
        )

    async def rpc_get_chunks(
        self, request: weights_pb2.ChunksRequest, context: P2PContext
    ) -> AsyncIterator[weights_pb2.ChunkPart]:
        error, entry, indices = self._check_chunks_request(request)
        if error is not None:
            yield weights_pb2.ChunkPart(error=self._refuse(error))
            return
        peer = context.remote_id.to_base58() if context.remote_id is not None else "?"
        peer_bytes = context.remote_id.to_bytes() if context.remote_id is not None else b""
        limits = self.limits
        if (
            self._streams_total >= limits.max_streams_total
            or self._streams_by_peer[peer] >= limits.max_streams_per_peer
        ):
            yield weights_pb2.ChunkPart(error=self._refuse("busy"))
            return
        self._streams_total += 1
        self._streams_by_peer[peer] += 1
        self.stats.streams += 1
        unfinished: tuple[int, float] | None = None  # a picked chunk not fully sent yet, its previous time
        try:
            sent: set[int] = set()
            ran_out = False  # pick mode: no candidate left to send (held, not sent, not fresh)
            for position in range(request.pick or len(indices)):
                if request.pick:
                    unfinished = self._pick(entry, indices, sent, request.fresh_for)
                    if unfinished is None:
                        ran_out = True
                        break
                    index = unfinished[0]
                else:
                    index = indices[position]
                sent.add(index)
                if not entry.store.has(index):
                    yield weights_pb2.ChunkPart(index=index, missing=True)
                    continue
                data = entry.store.get(index)
                size = entry.manifest.chunks[index].size
                for offset in range(0, max(len(data), 1), limits.part_size):
                    piece = data[offset : offset + limits.part_size]
                    await self._throttle(len(piece))
                    yield weights_pb2.ChunkPart(index=index, offset=offset, chunk_size=size, data=piece)
                    self.stats.bytes_served += len(piece)
                    self.stats.bytes_by_peer[peer] += len(piece)
                self.stats.chunks_served += 1
                if request.pick and entry.digest in self._served_count:  # the window runs from the last byte
                    _, last, handed_to = self._served_count[entry.digest]
                    last[index] = time.monotonic()
                    recipients = handed_to.setdefault(index, deque(maxlen=MAX_HOLDERS))
                    recipients.appendleft((peer_bytes, last[index]))
                unfinished = None
            if ran_out and request.want_holders and request.fresh_for > 0:
                holders = self._recent_holders(entry, indices, sent, request.fresh_for, peer_bytes)
                if holders:  # the receiver asks them (rpc_have) instead of waiting for their records
                    self.stats.holders_named += 1
                    yield weights_pb2.ChunkPart(holders=holders)
        finally:
            if unfinished is not None and entry.digest in self._served_count:  # nobody got it: not handed out
                counts, last, _ = self._served_count[entry.digest]
                counts[unfinished[0]] -= 1
                last[unfinished[0]] = unfinished[1]
            self._streams_total -= 1
            self._streams_by_peer[peer] -= 1
            if self._streams_by_peer[peer] <= 0:
                del self._streams_by_peer[peer]

    def _check_chunks_request(
        self, request: weights_pb2.ChunksRequest
    ) -> tuple[str | None, ServedVersion | None, list[int]]:
        if len(request.digest) != 32:
            return "bad_request", None, []
        entry = self.library.get(bytes(request.digest).hex())
        if (
            entry is None
            or entry.manifest.stream_id != request.stream_id
            or entry.manifest.version != request.version
        ):
            return "not_held", None, []
        indices = list(request.indices)
        if len(indices) > self.limits.max_chunks_per_request:
            return "too_many_chunks", None, []
        n = entry.manifest.num_chunks
        if any(i >= n for i in indices) or len(set(indices)) != len(indices):
            return "bad_request", None, []
        wanted = request.pick or len(indices)
        chunk_bytes = sorted((entry.manifest.chunks[i].size for i in indices), reverse=True)[:wanted]
        if sum(chunk_bytes) > self.limits.max_request_bytes:
            return "too_many_bytes", None, []
        return None, entry, indices

    def _pick(
        self, entry: ServedVersion, indices: list[int], sent: set[int], fresh_for: float
    ) -> tuple[int, float] | None:
        """The held chunk of ``indices`` (not yet in this stream) handed out least often, or None.

        Returns (index, the time it was last handed out before), so that an interrupted send can be undone.
        Chunks handed out within the last ``fresh_for`` seconds are skipped: whoever got them serves them.
        """
        state = self._served_count.get(entry.digest)
        if state is None:
            n = entry.manifest.num_chunks
            state = self._served_count[entry.digest] = ([0] * n, [float("-inf")] * n, {})
            while len(self._served_count) > 64:  # forget the oldest manifests' counts
                del self._served_count[next(iter(self._served_count))]
        counts, last, _ = state
        now = time.monotonic()
        held = [i for i in indices if i not in sent and entry.store.has(i)]
        if fresh_for > 0:
            held = [i for i in held if now - last[i] >= fresh_for]
        if not held:
            return None
        least = min(counts[i] for i in held)
        chosen = random.choice([i for i in held if counts[i] == least])
        previous = last[chosen]
        counts[chosen] += 1
        last[chosen] = now
        return chosen, previous

    def _recent_holders(
        self, entry: ServedVersion, indices: list[int], sent: set[int], fresh_for: float, requester: bytes
    ) -> list[bytes]:
        """The peers (newest first, at most MAX_HOLDERS) that were handed, within ``fresh_for`` s, a
        candidate of ``indices`` this stream skipped as fresh; never the requester itself."""
        handed = self._served_count[entry.digest][2] if entry.digest in self._served_count else {}
        now = time.monotonic()
        recent = sorted(
            (
                (at, holder)
                for i in indices
                if i not in sent
                for holder, at in handed.get(i, ())
                if now - at < fresh_for and holder != requester
            ),
            reverse=True,
        )
        return list(dict.fromkeys(holder for _, holder in recent))[:MAX_HOLDERS]

    async def _throttle(self, nbytes: int) -> None:
        rate = self.limits.upload_rate_limit
        if not rate:
            return
        now = time.monotonic()
        start = max(now, self._next_send)
        self._next_send = start + nbytes / rate
        if start > now:
            await asyncio.sleep(start - now)


class WeightsEndpoint:
    """One process's weights transport on one DHT: loop thread, P2P replica, library and servicer.

    A trainer's publisher and an inference peer's fetcher each use one; a process that does both passes
    the same endpoint to both (a p2pd accepts one servicer per handler name).
    """

    def __init__(self, dht, keys: SwarmKeys, limits: ServiceLimits | None = None, *, serve: bool = True):
        self.dht = dht
        self.keys = keys
        self.library = WeightLibrary()
        self.servicer = WeightsServicer(self.library, limits)
        self.serve = serve
        self.namespace = f"echo-v{keys.protocol}-{keys.run_id}-weights"
        self.loop: P2PLoop | None = None
        self.p2p: P2P | None = None
        self.peer_id: str = ""

    @property
    def limits(self) -> ServiceLimits:
        return self.servicer.limits

    def start(self, timeout: float = 30.0) -> WeightsEndpoint:
        """Start the loop on a replica of the DHT's P2P daemon and register the servicer (idempotent)."""
        if self.loop is not None:
            return self
        loop = P2PLoop.from_dht(self.dht, timeout, name="echo-weights-loop")
        try:
            if self.serve:
                loop.add_servicer(self.servicer, self.namespace, timeout)
        except BaseException:
            loop.shutdown()
            raise
        self.loop, self.p2p, self.peer_id = loop, loop.p2p, loop.peer_id
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.loop is None:
            return
        loop, self.loop = self.loop, None
        if self.serve:
            try:
                loop.remove_servicer(self.servicer, self.namespace, timeout)
            except Exception:  # the daemon may be gone already
                pass
        loop.shutdown(timeout)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        assert self.loop is not None, "start() first"
        return self.loop.run(coro, timeout)

    # ---- client side (called on the loop) ------------------------------------------------------------
    def handle_name(self, method: str) -> str:
        return WeightsServicer._get_handle_name(self.namespace, method)

    async def connect(self, peer_id: str, maddrs: Iterable[str], timeout: float) -> None:
        """Make sure the daemon can reach ``peer_id`` (dial its announced addresses once; raises on failure)."""
        await self.loop.dial(peer_id, maddrs, timeout, strict=True)

    def forget(self, peer_id: str) -> None:
        if self.loop is not None:
            self.loop.forget(peer_id)

    async def get_manifests(
        self, peer_id: str, request: weights_pb2.ManifestsRequest, timeout: float
    ) -> weights_pb2.ManifestsResponse:
        return await asyncio.wait_for(
            self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id),
                self.handle_name("rpc_get_manifests"),
                request,
                weights_pb2.ManifestsResponse,
            ),
            timeout,
        )

    async def have(self, peer_id: str, digest: str, timeout: float) -> weights_pb2.HaveResponse:
        return await asyncio.wait_for(
            self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id),
                self.handle_name("rpc_have"),
                weights_pb2.HaveRequest(digest=bytes.fromhex(digest)),
                weights_pb2.HaveResponse,
            ),
            timeout,
        )

    async def open_chunk_stream(
        self, peer_id: str, request: weights_pb2.ChunksRequest, timeout: float
    ) -> ChunkStream:
        """Open ``rpc_get_chunks`` at ``peer_id``; read its parts with ``ChunkStream.next(deadline)``."""
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer_id), self.handle_name("rpc_get_chunks")
            ),
            timeout,
        )
        try:
            await asyncio.wait_for(_send_request(request, writer), timeout)
        except BaseException:
            writer.close()
            raise
        return ChunkStream(reader, writer, max_frame=self.limits.part_size + PART_OVERHEAD)


async def _send_request(request: weights_pb2.ChunksRequest, writer: asyncio.StreamWriter) -> None:
    await P2P.send_protobuf(request, writer)
    await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
