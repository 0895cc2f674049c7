"""The chunk streams of one fetch session: one stream per request, its parts checked, every outcome mapped.

Owned here: ``ChunkStreams``, the half of ``session._FetchSession`` that runs one chunk stream from one
provider (``_request``), reads and checks its parts against the request and the manifest (``_read``), stores
verified chunks (``_store``), and turns each outcome into a counter, a retry elsewhere, a back-off, a drop
for the rest of the fetch or a ban (``_fail``, ``_settle_missing``). The other half (which chunk to ask of
whom, provider discovery, the session's main loop) is ``session``; the state both read (``f``, ``cfg``,
``entries``, ``missing``, ``inflight``, ``picks``, ...) is set up by ``_FetchSession.__init__``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from echo_p2p.proto import weights_pb2
from echo_p2p.transport.weights.config import FetchProgress
from echo_p2p.transport.weights.providers import Source
from echo_p2p.transport.weights.service import ServedVersion
from echo_p2p.transport.weights.stream import RemoteError, StreamBroken, StreamState, StreamViolation
from echo_p2p.weights.manifest import ChunkDigestError, ChunkError

logger = logging.getLogger("echo_p2p.transport.weights.fetcher")


class ChunkStreams:
    """Mixin of ``_FetchSession``: one chunk stream, from request to verified chunks (see the module doc)."""

    # ---- one stream ---------------------------------------------------------------------------------
    async def _request(self, s: Source, digest: str, indices: list[int], pick: int, fresh_for: float) -> None:
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
        state = StreamState(
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
                if fresh_for and digest not in self.empty_picks:
                    self.empty_picks[digest] = time.monotonic()
                    self.refresh_now = True  # learn now who else holds them (else: no window for it)
            received = sum(
                manifest.chunks[i].size for i in state.done - state.missing if i in state.mine or pick
            )
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
                s.forget(digest)
                if s.publisher:  # dropped from the publisher's chain: that version is gone for good
                    self.unserved.add(digest)
            elif reason == "busy":
                s.busy_until = time.monotonic() + 0.5
            else:
                self._fail(s, "remote_error", exc)
        except StreamBroken as exc:
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
            self._settle_missing(s, state)
            self.picks[digest] -= state.picks_left
            s.inflight -= 1
            for (
                i
            ) in state.mine:  # this request's chunks only (another stream to the same provider keeps its own)
                self._release(digest, i, s)
            self.wake.set()

    async def _read(self, s: Source, entry: ServedVersion, stream, state: StreamState) -> None:
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
                if s.advertised(digest, i):  # a promise broken: counted, and not asked of it again
                    state.broken += 1
                    s.deny(digest, i)
                else:
                    s.have.get(digest, set()).discard(i)
                state.done.add(i)
                state.missing.add(i)
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
            raise StreamBroken("truncated", f"stream ended inside chunk {current}")
        if not state.pick and state.expected - state.done:
            raise StreamBroken("stream_ended", f"{len(state.expected - state.done)} chunks not sent")

    def _settle_missing(self, s: Source, state: StreamState) -> None:
        """Count the "missing" answers of one stream: a provider that gave ``max_missing_answers`` for
        chunks it advertised is banned; one whose stream brought nothing else backs off."""
        if not state.missing:
            return
        if state.broken:
            self.f.stats.rejected["claimed_missing"] += state.broken
            if self.f.book.missing(s.peer_id, state.broken) and not s.dropped:
                self.f._ban(s.peer_id, "claimed_missing")
                s.dropped = True
        if state.done <= state.missing:
            s.back_off(time.monotonic())

    def _release(self, digest: str, index: int, s: Source) -> None:
        if self.inflight[digest].get(index) is s:
            del self.inflight[digest][index]
            self.entries[digest].fetching.discard(index)
            if index in self.missing[digest]:
                self.f.stats.retries += 1

    def _fail(self, s: Source, reason: str, exc: BaseException) -> None:
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
            if s.rate is None:  # nothing ever came from it: a record at an address where nobody serves
                self.f.book.ban(s.peer_id, seconds=self.cfg.unreachable_seconds)
                self.f.stats.failures["unreachable"] += 1
            logger.info(
                "dropping provider %s for this fetch after %d failures (%s)",
                s.peer_id[-8:],
                s.failures,
                reason,
            )

    async def _store(self, s: Source, entry: ServedVersion, index: int, data: bytes) -> None:
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
        s.failures = s.wasted = 0
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
