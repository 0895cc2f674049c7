"""Which chunk to ask of which provider: the scheduling state of one fetch, without I/O.

Owned here: ``ChunkScheduler`` (per manifest of the chain: the chunks still missing, the chunks in flight and
to whom, pick-mode requests whose first chunk has not come; the providers known to this fetch as
``providers.Source``; the choice of the next requests, ``next_requests``) and ``ChunkAsk`` (one request it
chose). No I/O, no asyncio and no clock of its own: every method that depends on the time takes ``now``, and
randomness comes from the ``rng`` it is given. ``session`` runs the requests it chooses and reports back
(``chunk_started``, ``chunk_stored``, ``release``, ``finished``).

The rules: peer providers are asked first, each for a random set of ``chunks_per_request`` chunks it holds,
at most ``max_inflight_per_provider`` streams and ``provider_request_rate`` streams/s each; the publisher is
asked (in pick mode: chunks of its choice among the candidates, ``publisher_pick`` in the first stream,
then about ``pick_seconds`` of its measured rate) only for chunks no other live provider holds or is
fetching, unless no chunk arrived for ``stall_timeout``; its freshness window is dropped for a manifest in
``no_window``.

Peer providers are judged by their rate (``min_provider_rate``, 0: off): each chunk asked of a peer is due
``HEDGE_SHARE`` of its allowance (``config.chunk_allowance``: ``provider_grace + size / min_provider_rate``,
at most ``chunk_timeout``) after the request, plus the same for the chunks asked before it in the same
stream. A chunk still in flight when it is due is *late*: one other provider that
holds it is asked for it too (a hedged request; the publisher without its freshness window and whatever it
spares), and the first copy that verifies wins. A chunk is in flight to one provider, plus at most one
hedge. Cutting a late stream and dropping its provider (at its deadline, or once a hedge beat it) is the
reader's deadline and the session's call.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from echo_p2p.transport.weights.fetch.config import FetcherConfig, chunk_allowance
from echo_p2p.transport.weights.fetch.providers import Source
from echo_p2p.transport.weights.service import ServedVersion

#: Share of a chunk's allowance (``config.chunk_allowance``) after which it is asked of a second provider.
HEDGE_SHARE = 0.5


@dataclass(frozen=True)
class ChunkAsk:
    """One chunk stream the scheduler chose: ``indices`` of ``digest`` from ``source``.

    ``pick`` 0: the provider sends every index asked; k > 0: at most k chunks of its choice among ``indices``
    (the publisher's pick mode), skipping those it handed out within ``fresh_for`` seconds. ``hedges``: the
    indices already in flight to a late provider, asked again here."""

    source: Source
    digest: str
    indices: list[int]
    pick: int = 0
    fresh_for: float = 0.0
    hedges: tuple[int, ...] = ()


class ChunkScheduler:
    """Chunks missing and in flight for one chain of manifests, and who is asked for what next."""

    def __init__(
        self,
        entries: list[ServedVersion],
        config: FetcherConfig,
        max_chunks_per_request: int,
        now: float,
        rng: random.Random | None = None,
    ):
        self.cfg = config
        self.limit = max_chunks_per_request
        self.rng = rng or random.Random()
        self.entries = {e.digest: e for e in entries}
        self.order = [e.digest for e in entries]
        self.missing = {e.digest: set(e.store.missing()) for e in entries}
        self.inflight: dict[str, dict[int, Source]] = {e.digest: {} for e in entries}
        self.due: dict[str, dict[int, float]] = {e.digest: {} for e in entries}  # peer chunks: when late
        self.hedges: dict[str, dict[int, Source]] = {e.digest: {} for e in entries}  # late chunk -> 2nd
        self.picks: Counter = Counter()  # digest -> chunks asked in pick mode whose first part has not come
        self.sources: dict[str, Source] = {}
        self.no_window: set[str] = set()  # digests asked of the publisher without the freshness window
        self.last_progress = now

    # ---- what is known --------------------------------------------------------------------------------
    def complete(self) -> bool:
        return not any(self.missing.values())

    def chunks_missing(self) -> int:
        return sum(len(m) for m in self.missing.values())

    def alive(self) -> list[Source]:
        return [s for s in self.sources.values() if not s.dropped]

    def orphans(self) -> list[str]:
        """Digests with chunks missing that no live provider holds (nor fetches) any more."""
        alive = self.alive()
        return [d for d in self.order if self.missing[d] and not any(s.lists(d) for s in alive)]

    def busy(self) -> bool:
        """Whether any stream is in flight."""
        return any(s.inflight for s in self.sources.values())

    def stalled(self, now: float) -> bool:
        """No chunk for ``stall_timeout``: the publisher may be asked for anything missing."""
        return now - self.last_progress > self.cfg.stall_timeout

    def state(self) -> dict[str, Any]:
        """The scheduling part of ``FetchSession.state``."""
        return {
            "missing": {d[:12]: len(m) for d, m in self.missing.items()},
            "in_flight": {d[:12]: len(m) for d, m in self.inflight.items()},
            "picks": {d[:12]: n for d, n in self.picks.items()},
            "hedges": {d[:12]: len(h) for d, h in self.hedges.items()},
            "no_window": sorted(d[:12] for d in self.no_window),
        }

    # ---- choosing -------------------------------------------------------------------------------------
    def next_requests(self, now: float) -> list[ChunkAsk]:
        """The streams to open now; each is counted in flight (``finished`` undoes that)."""
        asks: list[ChunkAsk] = []
        stalled = self.stalled(now)
        alive = self.alive()
        self.rng.shuffle(alive)
        for s in sorted(alive, key=lambda s: (s.publisher, s.failures)):
            limit = self.cfg.publisher_streams if s.publisher else self.cfg.max_inflight_per_provider
            while s.inflight < limit and s.busy_until <= now:
                if s.publisher and s.inflight and sum(self.picks.values()) > 1:
                    break  # pipelining only: the open stream still has chunks to start
                if not s.may_request(now, self.cfg.provider_request_rate, self.cfg.provider_request_burst):
                    break  # its request budget is spent: whatever it answers, it costs at most that rate
                ask = self.pick_work(s, alive, stalled, now)
                if ask is None:
                    break
                s.spend_request()
                s.inflight += 1
                self.picks[ask.digest] += ask.pick
                for i in ask.hedges:
                    self.hedges[ask.digest][i] = s
                if not ask.pick:
                    self._mark(ask, now)
                asks.append(ask)
        return asks

    def _mark(self, ask: ChunkAsk, now: float) -> None:
        """The chunks of a non-pick ask are in flight to its source (hedged ones stay with the first); a
        peer's are due at half their allowance each, in the order asked."""
        cfg = self.cfg
        rated = cfg.min_provider_rate > 0 and not ask.source.publisher
        manifest = self.entries[ask.digest].manifest
        due = now
        for i in ask.indices:
            if rated:
                size = manifest.chunks[i].size
                allowance = chunk_allowance(
                    size, cfg.chunk_timeout, cfg.min_provider_rate, cfg.provider_grace
                )
                due += HEDGE_SHARE * allowance
            if i in ask.hedges:
                continue
            self.inflight[ask.digest][i] = ask.source
            self.entries[ask.digest].fetching.add(i)
            if rated:
                self.due[ask.digest][i] = due

    def late(self, digest: str, now: float) -> set[int]:
        """Chunks of ``digest`` in flight to a peer past their due time (or to one dropped meanwhile, whose
        other streams run out their deadlines) and not hedged yet."""
        hedged, inflight = self.hedges[digest], self.inflight[digest]
        return {
            i for i, t in self.due[digest].items() if (t <= now or inflight[i].dropped) and i not in hedged
        }

    def pick_work(self, s: Source, alive: list[Source], stalled: bool, now: float) -> ChunkAsk | None:
        """What to ask of ``s`` next (not yet counted in flight), or None."""
        for digest in self.order:
            if digest not in s.complete and digest not in s.partial:
                continue
            late = {
                i for i in self.late(digest, now) if self.inflight[digest][i] is not s and s.holds(digest, i)
            }
            if late:  # hedged first: the publisher without its window, and whatever it would spare
                count = min(len(late), self.limit if s.publisher else self.cfg.chunks_per_request)
                indices = sorted(late)[:count] if s.publisher else self.rng.sample(sorted(late), count)
                hedges = tuple(indices)
                if s.publisher and self.cfg.publisher_pick:
                    return ChunkAsk(s, digest, indices, len(indices), 0.0, hedges)
                return ChunkAsk(s, digest, indices, hedges=hedges)
            avail = self.missing[digest] - self.inflight[digest].keys()
            if digest not in s.complete:
                avail &= s.have.get(digest, set())
            if s.publisher and self.cfg.spare_publisher and not stalled:
                others = [o for o in alive if o is not s]
                recent = now - self.cfg.stall_timeout  # older "fetching" claims are not spared
                avail = {i for i in avail if not any(o.will_hold(digest, i, recent) for o in others)}
            if not avail:
                continue
            if s.publisher and self.cfg.publisher_pick:
                pick = self.cfg.publisher_pick
                if s.rate:  # as many chunks as arrive in pick_seconds
                    manifest = self.entries[digest].manifest
                    mean_chunk = manifest.total_bytes / manifest.num_chunks
                    pick = max(1, min(self.limit, round(s.rate * self.cfg.pick_seconds / max(mean_chunk, 1))))
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
                fresh_for = self.cfg.publisher_fresh_window if window else 0.0
                return ChunkAsk(s, digest, sorted(avail)[: self.limit], pick, fresh_for)
            count = min(len(avail), self.cfg.chunks_per_request, self.limit)
            return ChunkAsk(s, digest, self.rng.sample(sorted(avail), count))
        return None

    # ---- what the streams report ----------------------------------------------------------------------
    def chunk_started(self, s: Source, digest: str, index: int, picked: bool) -> bool:
        """A stream from ``s`` started chunk ``index`` (``picked``: one of its picks, one pick less in
        flight); the chunk is in flight to ``s`` unless another stream has it. True when this stream now
        holds it in flight."""
        if picked:
            self.picks[digest] -= 1
        holder = self.inflight[digest].get(index)
        if holder is not None:
            return holder is s
        self.inflight[digest][index] = s
        self.entries[digest].fetching.add(index)
        return True

    def release(self, digest: str, index: int, s: Source) -> bool:
        """Chunk ``index`` is no longer in flight to ``s``; True when it is still missing (a retry). A hedge
        in flight for it becomes the chunk's one request (no longer due: the reader's deadline bounds it)."""
        if self.inflight[digest].get(index) is not s:
            return False
        del self.inflight[digest][index]
        self.due[digest].pop(index, None)
        hedge = self.hedges[digest].pop(index, None)
        if hedge is not None and index in self.missing[digest]:
            self.inflight[digest][index] = hedge
            return False
        self.entries[digest].fetching.discard(index)
        return index in self.missing[digest]

    def chunk_stored(self, digest: str, index: int, now: float, s: Source | None = None) -> Source | None:
        """Chunk ``index`` was verified and stored (new): it is neither missing nor in flight any more.
        Returns the provider it was first asked of when ``s`` delivered it as a hedge (that one was late)."""
        self.missing[digest].discard(index)
        first = self.inflight[digest].pop(index, None)
        self.due[digest].pop(index, None)
        hedge = self.hedges[digest].pop(index, None)
        self.entries[digest].fetching.discard(index)
        self.last_progress = now
        return first if s is not None and hedge is s and first is not s else None

    def finished(self, ask: ChunkAsk, picks_left: int, mine: set[int]) -> int:
        """The stream of ``ask`` ended: its picks not started, its hedges and its chunks in flight are
        released. Returns how many of those chunks are still missing (retries)."""
        self.picks[ask.digest] -= picks_left
        ask.source.inflight -= 1
        for i in ask.hedges:
            if self.hedges[ask.digest].get(i) is ask.source:
                del self.hedges[ask.digest][i]
        # a hedge that became the chunk's one request (the first stream ended) is released too
        held = set(mine) | {i for i in ask.hedges if self.inflight[ask.digest].get(i) is ask.source}
        return sum(self.release(ask.digest, i, ask.source) for i in held)
