"""The cache of peers met (``net.peer_cache``): bounded, validated, bootstraps and trusted trainers first."""

from __future__ import annotations

import json

from echo_p2p.net.peer_cache import PeerCache, peer_id_of


def addr(port: int, pid: str) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{pid}"


def test_choose_keeps_bootstraps_then_trusted_trainers_then_a_few_others_one_address_per_peer() -> None:
    cache = PeerCache(None, max_entries=6, max_others=2)
    boot, t1, t2 = addr(1, "QmBoot"), addr(2, "QmT1"), addr(3, "QmT2")
    others = [addr(10 + i, f"QmO{i}") for i in range(5)]
    chosen = cache.choose([boot], [t1, addr(99, "QmT1"), t2], [addr(4, "QmMe"), *others], own_peer_id="QmMe")
    assert chosen == [boot, t1, t2, others[0], others[1]]  # the Sybil-ish tail is capped at max_others
    relayed = "/ip4/11.0.0.1/tcp/1/p2p/QmR/p2p-circuit/p2p/QmX"
    assert cache.choose([], [relayed], []) == []  # a relayed address is no entry point for a DHT node
    assert peer_id_of(boot) == "QmBoot" and peer_id_of("/ip4/1.2.3.4/tcp/1") is None


def test_save_and_load_round_trip_and_a_bad_file_is_ignored(tmp_path) -> None:
    cache = PeerCache.next_to(str(tmp_path / "me.id"), max_entries=3)
    assert cache.path == tmp_path / "me.id.peers.json" and cache.load() == []
    entries = [addr(1, "QmA"), addr(2, "QmB")]
    assert cache.save(entries) and cache.load() == entries
    cache.path.write_text(json.dumps({"maddrs": ["not an address", addr(3, "QmC"), "/ip4/1.2.3.4/tcp/5"]}))
    assert cache.load() == [addr(3, "QmC")]  # malformed and peer-id-less lines are skipped
    cache.path.write_text("{broken")
    assert cache.load() == []
    cache.path.write_text(json.dumps({"maddrs": [addr(i, f"Qm{i}") for i in range(10)]}))
    assert len(cache.load()) == 3  # bounded
    assert not PeerCache.next_to(None).save(entries)  # an ephemeral identity keeps no cache
