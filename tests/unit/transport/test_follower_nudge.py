"""The weight follower polls slowly but reads the policy record at once when nudged (an ack said a newer
version exists), and merges nudges that come faster than NUDGE_GAP."""

from __future__ import annotations

import math
import time

from echo_p2p.transport.weights.fetch.config import FetcherConfig
from echo_p2p.transport.weights.fetch.fetcher import NUDGE_GAP, WeightFetcher


def follower(poll_period: float) -> tuple[WeightFetcher, list[float]]:
    """A real fetcher, never started (no DHT: nothing here reads one), whose ``update`` only records when the
    follower checked."""
    from echo_p2p.guard.trust import TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys

    fetcher = WeightFetcher(
        None,
        load_or_create_identity(None),
        SwarmKeys("r"),
        TrustedTrainers.from_keys([]),
        FetcherConfig(poll_period=poll_period),
        endpoint=object(),  # never served from: the follower's loop is what is tested
    )
    checks: list[float] = []
    fetcher.update = lambda: checks.append(time.monotonic())
    return fetcher, checks


def stop(fetcher: WeightFetcher) -> None:
    fetcher.shutdown(timeout=5)
    assert not fetcher._threads


def test_a_nudge_makes_the_follower_check_now():
    fetcher, checks = follower(poll_period=30.0)
    fetcher.follow()
    try:
        deadline = time.monotonic() + 5
        while not checks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(checks) == 1  # the first check, then a 30 s poll period
        time.sleep(0.2)
        assert len(checks) == 1
        fetcher.nudge()
        while len(checks) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(checks) == 2
    finally:
        stop(fetcher)


def test_nudges_in_a_burst_are_merged():
    fetcher, checks = follower(poll_period=30.0)
    fetcher.follow()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        for _ in range(50):
            fetcher.nudge()
            time.sleep(0.002)
        burst = time.monotonic() - started  # ~0.1 s; longer on a busy machine (the sleeps overrun)
        time.sleep(0.3)
        # the first check, at most one per NUDGE_GAP during the burst, one after it: not one per nudge
        assert 2 <= len(checks) <= 2 + math.ceil(burst / NUDGE_GAP), (checks, burst)
        assert len(checks) < 25, checks
    finally:
        stop(fetcher)
