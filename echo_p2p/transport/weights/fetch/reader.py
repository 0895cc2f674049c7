"""One chunk stream, from request to verified chunks, and how it ended: the receiver's stream reader.

Owned here: ``read_stream`` (opens one ``rpc_get_chunks`` stream for a ``scheduler.ChunkAsk``, reads its
parts and checks each against the request and the manifest, has every complete chunk verified and stored in
the ``verifier`` thread while the stream goes on, and returns a ``StreamOutcome``), ``StreamState`` (the
bookkeeping of one stream), ``StreamFailure`` / ``StreamBroken`` (how a stream can end early) and
``ChunkSink`` (what a reader tells its session while a stream runs: a chunk started, answered "missing",
stored). It decides nothing about the provider: ``session`` turns the outcome into counters, retries,
back-offs, drops and bans. Frames are read by ``stream.ChunkStream``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from hivemind.p2p import PeerID

from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.fetch.config import chunk_allowance
from echo_p2p.transport.weights.fetch.providers import Source
from echo_p2p.transport.weights.fetch.scheduler import ChunkAsk
from echo_p2p.transport.weights.service import MAX_HOLDER_BYTES, MAX_HOLDERS, ServedVersion
from echo_p2p.transport.weights.stream import RemoteError, StreamViolation
from echo_p2p.weights.manifest import ChunkDigestError, ChunkError


class StreamSlow(Exception):
    """A chunk from a provider judged by its rate missed its deadline (``StreamLimits.chunk_seconds``)."""


class StreamBroken(Exception):
    """A stream that ended early (the provider died or cut it): counted, retried elsewhere, not banned."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class StreamState:
    """Bookkeeping of one chunk stream."""

    expected: set[int]  # indices asked for (candidates, in pick mode)
    mine: set[int]  # indices this stream holds in flight
    pick: int  # 0: the provider sends every index asked; k: at most k of its choice
    picks_left: int  # pick mode: chunks the provider may still start
    done: set[int] = field(default_factory=set)  # indices fully received (or reported missing)
    missing: set[int] = field(default_factory=set)  # indices the provider answered "missing" for
    broken: int = 0  # of those, chunks it had advertised (a broken promise)
    holders: list[str] = field(default_factory=list)  # peers it named as having just got skipped chunks
    verifying: list[asyncio.Future] = field(default_factory=list)


@dataclass(frozen=True)
class StreamFailure:
    """How a stream ended early.

    ``violation``: the provider broke the protocol or served a bad chunk (``reason`` names how: a ban);
    ``remote``: it sent an error frame (``reason`` is its message); ``broken``: the stream ended early
    (``truncated``, ``stream_ended``); ``slow``: a chunk missed the rate deadline; ``timeout``: dialling,
    opening or (without a rate) a chunk took too long; ``error``: anything else."""

    kind: Literal["violation", "remote", "broken", "slow", "timeout", "error"]
    reason: str
    error: BaseException


@dataclass
class StreamOutcome:
    """What one stream brought: its bookkeeping, the bytes of the chunks it delivered in full, how long it
    ran, and how it failed (None: it ended cleanly)."""

    ask: ChunkAsk
    state: StreamState
    received: int
    seconds: float
    failure: StreamFailure | None = None


class ChunkSink(Protocol):
    """What a reader reports while its stream runs (the fetch session implements it)."""

    def chunk_started(self, s: Source, digest: str, index: int, picked: bool) -> bool:
        """A chunk's first part came; True when this stream now holds it in flight."""
        ...

    def chunk_released(self, s: Source, digest: str, index: int) -> None:
        """The chunk is no longer in flight to ``s`` (answered "missing")."""
        ...

    def chunk_stored(self, s: Source, entry: ServedVersion, index: int, size: int, new: bool) -> None:
        """The chunk was verified and stored (``new``: it was missing)."""
        ...


@dataclass(frozen=True)
class StreamLimits:
    """The reader's deadlines: dialling and opening (``request_timeout``), each chunk (``chunk_timeout``),
    and for a provider judged by its rate (``min_rate`` > 0) each chunk within ``grace + size / min_rate``
    of its turn (the stream's start or the previous chunk's end), at most ``chunk_timeout``."""

    request_timeout: float
    chunk_timeout: float
    min_rate: float = 0.0
    grace: float = 0.0

    def chunk_seconds(self, size: int) -> float:
        """Seconds one chunk of ``size`` bytes may take from its turn (``config.chunk_allowance``)."""
        return chunk_allowance(size, self.chunk_timeout, self.min_rate, self.grace)


async def read_stream(
    endpoint,
    ask: ChunkAsk,
    entry: ServedVersion,
    sink: ChunkSink,
    verifier: concurrent.futures.Executor,
    limits: StreamLimits,
) -> StreamOutcome:
    """Run the stream of ``ask`` from ``endpoint`` (``connect``, ``open_chunk_stream``) to its end.

    Never raises for anything the provider does (cancellation passes through): every ending is in the
    returned outcome. Chunks received before a failure are verified and kept."""
    s, digest, manifest = ask.source, ask.digest, entry.manifest
    request = weights_pb2.ChunksRequest(
        stream_id=manifest.stream_id,
        version=manifest.version,
        digest=bytes.fromhex(digest),
        indices=ask.indices,
        pick=ask.pick,
        fresh_for=ask.fresh_for,
        want_holders=ask.fresh_for > 0,
    )
    state = StreamState(
        expected=set(ask.indices),
        mine=set() if ask.pick else set(ask.indices),
        pick=ask.pick,
        picks_left=ask.pick,
    )
    stream = None
    started = time.monotonic()
    failure: StreamFailure | None = None
    try:
        try:
            await endpoint.connect(s.peer_id, s.maddrs, limits.request_timeout)
            stream = await endpoint.open_chunk_stream(s.peer_id, request, limits.request_timeout)
            await _read(ask, entry, stream, state, sink, verifier, limits)
        finally:  # chunks already received are verified (and kept) whatever happened after them
            if stream is not None:
                stream.close()
            results = await asyncio.gather(*state.verifying, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    except StreamViolation as exc:
        failure = StreamFailure("violation", exc.reason, exc)
    except RemoteError as exc:
        failure = StreamFailure("remote", str(exc), exc)
    except StreamBroken as exc:
        failure = StreamFailure("broken", exc.reason, exc)
    except StreamSlow as exc:
        failure = StreamFailure("slow", "slow", exc)
    except asyncio.IncompleteReadError as exc:
        failure = StreamFailure("broken", "truncated", exc)
    except (asyncio.TimeoutError, TimeoutError) as exc:
        failure = StreamFailure("timeout", "timeout", exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        failure = StreamFailure("error", "error", exc)
    received = sum(manifest.chunks[i].size for i in state.done - state.missing if i in state.mine or ask.pick)
    return StreamOutcome(ask, state, received, time.monotonic() - started, failure)


async def _read(
    ask: ChunkAsk,
    entry: ServedVersion,
    stream,
    state: StreamState,
    sink: ChunkSink,
    verifier: concurrent.futures.Executor,
    limits: StreamLimits,
) -> None:
    """Read parts until the stream ends, checking each against the request and the manifest.

    A completed chunk is verified in the verifier thread while the stream goes on (``state.verifying``).
    """
    s, digest, manifest = ask.source, entry.digest, entry.manifest
    current: int | None = None
    pieces: list[bytes] = []
    got = 0
    turn = time.monotonic()  # when the chunk being received (or the next) could start coming
    # before a chunk's first part its size is not known: the largest it can be
    deadline = turn + limits.chunk_seconds(max(manifest.chunks[i].size for i in state.expected))
    while True:
        try:
            part = await stream.next(max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            if limits.min_rate > 0:
                raise StreamSlow(f"a chunk not complete at {limits.min_rate:.0f} B/s") from None
            raise
        if part is None:
            break
        if part.error:
            raise RemoteError(part.error)
        if state.holders:
            raise StreamViolation("unexpected_chunk", "a part after the holders part")
        if part.holders:
            state.holders = _holders(part, ask, current)
            continue
        i = part.index
        if i not in state.expected or i in state.done:
            raise StreamViolation("unexpected_chunk", f"chunk {i} was not asked for")
        if part.missing:
            if s.advertised(digest, i):  # a promise broken: counted, and not asked of it again
                state.broken += 1
                s.deny(digest, i)
            else:
                s.have.get(digest, set()).discard(i)
            state.done.add(i)
            state.missing.add(i)
            sink.chunk_released(s, digest, i)
            continue
        size = manifest.chunks[i].size
        if current != i:
            if current is not None:
                raise StreamViolation("truncated", f"chunk {current} ended at {got} bytes")
            current, pieces, got = i, [], 0
            # a slow provider cannot hold it forever: with a rate, the whole chunk counts from its turn
            start = turn if limits.min_rate > 0 else time.monotonic()
            deadline = start + limits.chunk_seconds(size)
            picked = state.picks_left > 0
            if picked:
                state.picks_left -= 1
            if sink.chunk_started(s, digest, i, picked):
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
            state.verifying.append(asyncio.ensure_future(_store(s, entry, i, chunk, sink, verifier)))
            state.done.add(i)
            current, pieces, got = None, [], 0
            turn = time.monotonic()
            left = [manifest.chunks[j].size for j in state.expected - state.done]
            deadline = turn + limits.chunk_seconds(max(left, default=0))  # for the next chunk's first part
    if current is not None:
        raise StreamBroken("truncated", f"stream ended inside chunk {current}")
    if not state.pick and state.expected - state.done:
        raise StreamBroken("stream_ended", f"{len(state.expected - state.done)} chunks not sent")


def _holders(part: weights_pb2.ChunkPart, ask: ChunkAsk, current: int | None) -> list[str]:
    """The peers a ``holders`` part names (base58), checked: asked for (a pick with ``fresh_for``), between
    chunks, nothing else in the part, at most MAX_HOLDERS PeerIDs of 1..MAX_HOLDER_BYTES bytes."""
    if not (ask.pick and ask.fresh_for > 0):
        raise StreamViolation("unexpected_holders", "holders named without being asked")
    if current is not None or part.data or part.missing or part.index or part.offset or part.chunk_size:
        raise StreamViolation("unexpected_holders", "a holders part that carries a chunk too")
    raw = list(part.holders)
    if len(raw) > MAX_HOLDERS or any(not 0 < len(h) <= MAX_HOLDER_BYTES for h in raw):
        raise StreamViolation("unexpected_holders", f"{len(raw)} holders, or one of a bad size")
    return [PeerID(h).to_base58() for h in raw]


async def _store(
    s: Source,
    entry: ServedVersion,
    index: int,
    data: bytes,
    sink: ChunkSink,
    verifier: concurrent.futures.Executor,
) -> None:
    loop = asyncio.get_running_loop()
    try:
        new = await loop.run_in_executor(verifier, entry.store.put, index, data)
    except ChunkDigestError:
        raise StreamViolation("bad_digest", f"chunk {index} of version {entry.manifest.version}") from None
    except ChunkError as exc:
        raise StreamViolation("bad_chunk", str(exc)) from None
    sink.chunk_stored(s, entry, index, len(data), new)
