"""The sync trainer's choice of samplers under a flood of fake sampler records (a Sybil)."""

from __future__ import annotations

from types import SimpleNamespace

from echo_p2p.net.records import PeerRecord
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
