"""A fetcher's time accounting: every fetch that applied a version adds its phases to the totals (the
``last_*`` figures keep only one fetch, which a metrics line samples); a failed fetch's seconds and every
policy-record read are counted too."""

from __future__ import annotations

import time
from types import SimpleNamespace

from echo_p2p.transport.weights.fetch.config import FetcherConfig, FetchError, FetchStats
from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher


def test_fetches_add_up_by_phase_and_the_last_one_is_kept_apart():
    stats = FetchStats()
    stats.fetched({"record": 0.1, "transfer": 0.5}, 0.6)
    stats.fetched({"record": 0.2, "transfer": 1.5, "apply": 0.1}, 1.8)
    assert stats.versions_applied == 2
    assert (
        stats.last_phases == {"record": 0.2, "transfer": 1.5, "apply": 0.1}
        and stats.last_fetch_seconds == 1.8
    )
    line = stats.as_dict()
    assert line["fetch_seconds_total"] == 2.4 and line["fetch_seconds"] == 1.8
    assert line["phases_total"] == {"record": 0.3, "transfer": 2.0, "apply": 0.1}


def fetcher() -> WeightFetcher:
    """A real fetcher, never started (no DHT): its record choice and fetch are replaced below."""
    from echo_p2p.guard.trust import TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys

    return WeightFetcher(
        None,
        load_or_create_identity(None),
        SwarmKeys("r"),
        TrustedTrainers.from_keys([]),
        FetcherConfig(),
        endpoint=object(),
    )


def test_record_reads_and_a_failed_fetchs_seconds_are_counted():
    f = fetcher()
    record = SimpleNamespace(version=3, peer_id="QmTrainer")

    def choose():
        time.sleep(0.02)
        return record

    def fail(rec, t_start):
        time.sleep(0.03)
        raise FetchError("timeout", "not complete")

    f._choose_record, f._fetch = choose, fail
    assert f.update() is None
    assert f.stats.record_reads == 1 and f.stats.record_read_seconds_total >= 0.02
    assert f.stats.fetches_failed["timeout"] == 1 and f.stats.failed_seconds_total >= 0.05
    assert f.stats.fetch_seconds_total == 0.0 and f.stats.versions_applied == 0

    f._choose_record = lambda: None  # a poll that finds nothing newer: a read, no fetch, no failure
    failed = f.stats.failed_seconds_total
    assert f.update() is None
    assert f.stats.record_reads == 2 and f.stats.failed_seconds_total == failed
    line = f.stats.as_dict()
    assert line["record_reads"] == 2 and line["failed_seconds_total"] >= 0.05
