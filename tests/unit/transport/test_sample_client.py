"""The sync trainer's choice of samplers under a flood of fake sampler records (a Sybil), and its stop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest

from echo_p2p.net.records import PeerRecord
from echo_p2p.transport.p2p_loop import P2PLoop
from echo_p2p.transport.rollouts.config import SampleClientConfig
from echo_p2p.transport.rollouts.pull import SampleClient


def sampler(peer_id: str, tps: float) -> SimpleNamespace:
    record = PeerRecord(peer_id=peer_id, role="inference", mode="sync", tokens_per_second=tps)
    return SimpleNamespace(record=record)


def test_fake_fast_samplers_get_a_few_prompts_not_the_batch():
    """A stranger announces 200 samplers at 10^9 tokens/s where nobody answers. Before: they were all asked
    and got nearly every prompt of each round (by announced speed). Now: once samplers have delivered, at
    most ``max_unproven_per_round`` others are tried per round, one prompt each."""
    honest = [sampler("QmHonestA", 300.0), sampler("QmHonestB", 100.0)]
    sybil = [sampler(f"QmSybil{i:03d}", 1e9) for i in range(200)]
    directory = SimpleNamespace(peer_sample=lambda: honest + sybil)
    client = SampleClient(SimpleNamespace(p2p=None), directory, SampleClientConfig(max_unproven_per_round=3))

    fresh = client._candidates(set())  # a fresh run: nobody delivered yet, a few are tried
    assert len(fresh) == 3

    client._proven.update(dict.fromkeys(["QmHonestA", "QmHonestB"]))
    peers = client._candidates(set())
    ids = [p.peer_id for p in peers]
    assert ids[:2] == ["QmHonestA", "QmHonestB"] and len(ids) == 5
    shares = client._shares(list(range(64)), peers)
    assert all(len(shares[i]) == 1 for i in ids[2:])  # one prompt each: 3 asked again next round
    assert len(shares["QmHonestA"]) == 46 and len(shares["QmHonestB"]) == 15  # 300 : 100 (before: 0 : 0)
    assert sorted(x for share in shares.values() for x in share) == list(range(64))
    few = client._shares([1, 2, 3], peers)  # fewer prompts than strangers to try: the proven take them
    assert set(few) <= {"QmHonestA", "QmHonestB"}


def stop_after(event: threading.Event, seconds: float) -> None:
    threading.Timer(seconds, event.set).start()


def test_a_stopping_trainer_is_not_held_by_a_round_in_flight_or_by_samplers_that_left():
    """Before: a sync trainer asked to stop waited out ``sync_timeout`` (60 s) in ``collect`` when its
    samplers stopped first, and was SIGKILLed by the launcher's grace (15 s) without its final checkpoint."""
    loop = P2PLoop()
    try:
        stop = threading.Event()
        directory = SimpleNamespace(peer_sample=lambda: [sampler("QmSilent", 100.0)])
        client = SampleClient(loop, directory, SampleClientConfig(), stop=stop)

        async def silent(peer, task, prompt_ids, n, version, max_new_tokens, timeout):
            await asyncio.sleep(timeout)  # a sampler that never answers within the round
            return [], "timeout"

        client._ask = silent
        stop_after(stop, 0.3)
        t0 = time.monotonic()
        assert client.collect("count", [1, 2], 4, 0, timeout=60.0) == []
        assert time.monotonic() - t0 < 2.0  # within 0.1 s of the stop, not at the round's 30 s deadline

        stop.clear()
        client.directory = SimpleNamespace(peer_sample=lambda: [])  # every sampler gone
        client._refreshed_at = -float("inf")
        stop_after(stop, 0.3)
        t0 = time.monotonic()
        assert client.collect("count", [1, 2], 4, 0, timeout=60.0) == []
        assert time.monotonic() - t0 < 2.0

        stop.set()  # set before the call: nobody is asked
        asked = client.counters["requests"]
        assert client.collect("count", [1], 4, 0, timeout=60.0) == [] and client.counters["requests"] == asked
    finally:
        loop.shutdown()


def test_a_call_on_the_loop_ends_when_its_stop_is_set():
    loop = P2PLoop()
    try:
        stop = threading.Event()
        stop_after(stop, 0.2)
        t0 = time.monotonic()
        with pytest.raises(concurrent.futures.CancelledError):
            loop.run(asyncio.sleep(30), timeout=60.0, stop=stop)
        assert time.monotonic() - t0 < 1.5
        assert loop.run(asyncio.sleep(0, result=7), timeout=5.0, stop=stop) == 7  # done before it looks
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            loop.run(asyncio.sleep(30), timeout=0.2, stop=threading.Event())  # the deadline still holds
        assert time.monotonic() - t0 < 1.5  # at the coroutine's deadline, not the safety net's 5 s later
    finally:
        loop.shutdown()
