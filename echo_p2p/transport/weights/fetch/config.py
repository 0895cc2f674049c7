"""Settings, counters and reports of a weight fetcher: ``FetcherConfig`` (validated with the peer's config,
before anything starts) and the rate rule's per-chunk allowance (``chunk_allowance``), ``FetchStats`` (what the metrics line reports), ``FetchProgress`` (passed to the
progress callback) and ``FetchError`` (a fetch that did not complete). Pure data; the machinery is
``fetcher``, ``session``, ``scheduler`` and ``reader``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.net.records import MAX_RECORD_TTL
from echo_p2p.transport.weights.service import ServiceLimits


class FetcherConfig(BaseModel):
    """How an inference peer fetches policy versions and helps distribute them."""

    model_config = ConfigDict(extra="forbid")

    serve: bool = Field(
        default=True, description="Peer assistance: serve held chunks and announce as a provider"
    )
    serve_retain: int = Field(
        default=3, ge=1, description="Newest manifests kept for serving after apply (memory: their payloads)"
    )
    poll_period: float = Field(default=1.0, gt=0, description="follow(): seconds between DHT checks")
    max_inflight_per_provider: int = Field(
        default=2, ge=1, description="Concurrent chunk streams per peer provider"
    )
    chunks_per_request: int = Field(default=4, ge=1, description="Chunks asked per stream from a peer")
    publisher_streams: int = Field(
        default=2,
        ge=1,
        description="Chunk streams to the publisher at once; the next opens only when the current one has at "
        "most one chunk left to start (one long stream at a time is fastest)",
    )
    publisher_pick: int = Field(
        default=64,
        ge=0,
        description="Chunks of the publisher's choice in the first stream to it (0: we choose, no super-seeding)",
    )
    pick_seconds: float = Field(
        default=1.0,
        gt=0,
        description="Later streams to the publisher ask for as many chunks as arrive in this long at the "
        "rate measured (short streams keep their candidate lists fresh on slow links)",
    )
    spare_publisher: bool = Field(
        default=True, description="Ask the publisher only for chunks no other provider holds or is fetching"
    )
    publisher_fresh_window: float = Field(
        default=30.0,
        ge=0,
        description="Ask the publisher to skip chunks it handed out this recently (others got them: ask them); "
        "dropped for a manifest once the publisher has nothing fresh left and no other provider lists it",
    )
    stall_timeout: float = Field(
        default=3.0, gt=0, description="No chunk for this long: ask the publisher for anything still missing"
    )
    chunk_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Deadline (s) to receive one whole chunk once it started (or the first)",
    )
    min_provider_rate: float = Field(
        default=64 * 1024,
        ge=0,
        description="Bytes/s a peer provider must deliver each chunk at: a chunk may take provider_grace + "
        "size / min_provider_rate from its turn in the stream (at most chunk_timeout); one not complete by "
        "then ends the stream as 'slow' and drops the provider from the fetch, and one not complete by half "
        "of that (counted from the request, through the chunks asked before it) is asked of another provider "
        "too (0: chunk_timeout only, no hedging). The publisher is exempt",
    )
    provider_grace: float = Field(
        default=2.0,
        gt=0,
        description="Seconds a peer provider gets for each chunk on top of size / min_provider_rate (dial, "
        "request, queueing, the first byte)",
    )
    max_slow_drops: int = Field(
        default=3,
        ge=1,
        description="Drops for slowness within missing_window after which a provider is banned for "
        "ban_seconds; before that each drop only skips it for unreachable_seconds",
    )
    fetch_timeout: float = Field(default=600.0, gt=0, description="Deadline (s) of one whole fetch")
    no_provider_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Give up a fetch after this long with nobody left to ask for a manifest of it (a version "
        "the publisher dropped from its chain fails at once: version_dropped), or after this long of "
        "failed requests to the publisher while no other provider lists what is missing (publisher_gone: "
        "killed or cut off; kept chunks are reused next time)",
    )
    no_progress_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Give up a fetch (kept chunks are reused next time) after this long without a chunk",
    )
    provider_refresh: float = Field(
        default=1.0, gt=0, description="Seconds between provider list reads during a fetch"
    )
    provider_reuse: float = Field(
        default=5.0,
        ge=0,
        description="A fetch starts from a provider list read at most this many seconds ago (fetches follow "
        "each other several times a second, and every read parses every provider's record); it reads again "
        "after provider_refresh s",
    )
    announce_grace: float = Field(
        default=1.5,
        ge=0,
        description="When the publisher had nothing fresh to pick (it handed the chunks to other receivers "
        "within publisher_fresh_window), only a providers read that started this long after is trusted to say "
        "that nobody else holds them (then the window is dropped): a receiver stores its provider record at "
        "most once a second, and one read at once could not see the receivers fetching beside it yet",
    )
    have_period: float = Field(default=0.25, gt=0, description="Seconds between chunk-map polls of a peer")
    max_provider_failures: int = Field(
        default=2,
        ge=1,
        description="Timeouts/errors before a peer provider is dropped for the rest of a fetch (the publisher "
        "is retried with a growing back-off instead)",
    )
    ban_seconds: float = Field(
        default=600.0,
        ge=0,
        description="How long a provider that served bad data, or claimed chunks it does not serve, is avoided",
    )
    unreachable_seconds: float = Field(
        default=60.0,
        ge=0,
        description="How long a provider dropped from a fetch without having delivered a chunk is skipped by "
        "later fetches (keys are cheap: a stranger's provider records at addresses where nobody serves would "
        "otherwise be tried again by every fetch)",
    )
    max_missing_answers: int = Field(
        default=8,
        ge=1,
        description="'missing' answers for chunks a provider advertised (its manifest listed complete, or the "
        "chunk set in its chunk map) after which it is banned; an honest provider gives none",
    )
    missing_window: float = Field(
        default=600.0, gt=0, description="Seconds over which a provider's 'missing' answers add up"
    )
    provider_request_rate: float = Field(
        default=20.0,
        gt=0,
        description="Chunk streams opened per second to one provider at most (a bound on what any one "
        "provider can cost, whatever it answers)",
    )
    provider_request_burst: int = Field(
        default=4, ge=1, description="Chunk streams that may open to one provider at once within that rate"
    )
    record_ttl: float = Field(
        default=30.0, gt=0, le=MAX_RECORD_TTL, description="Lifetime (s) of this peer's ProviderRecord"
    )
    announce_gap: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="Fewest seconds between two ProviderRecord stores: changes within it (a fetch's start, "
        "its end, the next version's start) go out together, in one store of the newest state",
    )
    request_timeout: float = Field(
        default=10.0, gt=0, description="Deadline (s) of DHT reads/writes and unary RPCs"
    )
    limits: ServiceLimits = Field(
        default_factory=ServiceLimits, description="Serving limits (peer assistance)"
    )


def chunk_allowance(size: int, chunk_timeout: float, min_rate: float, grace: float) -> float:
    """Seconds one chunk of ``size`` bytes may take from its turn in a stream: ``grace + size / min_rate``, at
    most ``chunk_timeout`` (``chunk_timeout`` when ``min_rate`` is 0: no rate)."""
    if min_rate <= 0:
        return chunk_timeout
    return min(chunk_timeout, grace + size / min_rate)


@dataclass
class FetchStats:
    """Counters of a fetcher (they only grow); ``as_dict`` for the metrics line."""

    versions_applied: int = 0
    fetches_failed: Counter = field(default_factory=Counter)  # reason -> count
    rejected: Counter = field(default_factory=Counter)  # bad input from peers: reason -> count
    failures: Counter = field(
        default_factory=Counter
    )  # transport trouble (timeouts, dead peers): reason -> count
    bytes_by_provider: Counter = field(default_factory=Counter)
    # peer providers judged by their rate: chunks hedged (asked of a second provider because the first was
    # late), hedges that delivered first (hedge_won), providers dropped from a fetch for a missed chunk
    # deadline (dropped: skipped by later fetches for unreachable_seconds) and banned for it (banned)
    slow: Counter = field(default_factory=Counter)
    retries: int = 0
    duplicate_bytes: int = 0
    last_fetch_seconds: float | None = None
    last_transfer_seconds: float | None = None
    last_apply_seconds: float | None = None
    last_phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the last fetch
    last_fetch_bytes: int = 0
    banned: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    # this peer's ProviderRecord stores: stored, failed (no DHT node took it) or skipped (unreachable: nobody
    # could dial it; not_serving); a peer that others never find shows it here
    announcements: Counter = field(default_factory=Counter)
    provider_reads: int = 0  # reads of the providers of a version being fetched
    # providers the publisher named as holding chunks it skipped as fresh (``ChunkPart.holders``) that the
    # fetch did not list for that manifest yet: asked at once instead of after their records are read
    named_providers: int = 0
    last_providers_seen: int = 0  # other peers the last fetch's reads listed as holding or fetching it
    # where a fetcher's time went, summed over its life (the ``last_*`` figures above are one fetch's, which a
    # metrics line samples; these tell a run's slow fetches apart from its sampled one): seconds of the
    # fetches that applied a version, by phase, and of those that failed; the policy-record reads that
    # choose what to fetch (every poll and nudge, those that found nothing newer included) and their seconds
    fetch_seconds_total: float = 0.0
    phases_total: Counter = field(default_factory=Counter)
    failed_seconds_total: float = 0.0
    record_reads: int = 0
    record_read_seconds_total: float = 0.0

    def fetched(self, phases: dict[str, float], seconds: float) -> None:
        """A fetch that applied a version: ``phases`` (seconds by phase) and its whole ``seconds``."""
        self.versions_applied += 1
        self.last_phases, self.last_fetch_seconds = phases, seconds
        self.phases_total.update(phases)
        self.fetch_seconds_total += seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "versions_applied": self.versions_applied,
            "fetches_failed": dict(self.fetches_failed),
            "rejected": dict(self.rejected),
            "failures": dict(self.failures),
            "bytes_by_provider": dict(self.bytes_by_provider),
            "slow": dict(self.slow),
            "retries": self.retries,
            "duplicate_bytes": self.duplicate_bytes,
            "fetch_seconds": self.last_fetch_seconds,
            "transfer_seconds": self.last_transfer_seconds,
            "apply_seconds": self.last_apply_seconds,
            "phases": dict(self.last_phases),
            "fetch_bytes": self.last_fetch_bytes,
            "banned": dict(self.banned),
            "announcements": dict(self.announcements),
            "provider_reads": self.provider_reads,
            "named_providers": self.named_providers,
            "providers_seen": self.last_providers_seen,
            "fetch_seconds_total": round(self.fetch_seconds_total, 3),
            "phases_total": {k: round(v, 3) for k, v in self.phases_total.items()},
            "failed_seconds_total": round(self.failed_seconds_total, 3),
            "record_reads": self.record_reads,
            "record_read_seconds_total": round(self.record_read_seconds_total, 3),
        }


class FetchError(Exception):
    """A fetch that did not complete; ``reason`` is the counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class FetchProgress:
    """Where a fetch stands (passed to the progress callback after each verified chunk)."""

    version: int
    chunks_done: int
    chunks_total: int
    bytes_done: int
    bytes_total: int
    providers: int
    elapsed: float
