"""The announcer thread survives whatever the DHT throws (a GeneratorExit out of hivemind killed it)."""

from __future__ import annotations

import threading
import types

from echo_p2p.roles.base import BasePeer
from tests.unit.conftest import unstarted_peer


class Peer(BasePeer):
    """What every peer does, with no role's own work."""

    role = "inference"


def base_peer(**settings) -> Peer:
    return unstarted_peer(Peer, **settings)


def test_announcer_keeps_announcing_after_base_exceptions_from_the_dht():
    peer = base_peer(heartbeat_period=0.01, metrics_period=3600.0, record_ttl=1.0)
    failures = [GeneratorExit(), RuntimeError("dht down"), __import__("asyncio").CancelledError()]
    calls = []

    def announce(*_args, **_kwargs):
        calls.append(1)
        if failures:
            raise failures.pop(0)
        if len(calls) >= 5:
            peer.stop_event.set()
        return True

    peer.announce = announce
    peer._status = lambda: None
    thread = threading.Thread(target=peer._announce_loop, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(calls) >= 5 and not failures


def test_the_record_is_announced_every_heartbeat_while_other_heartbeat_work_hangs():
    """A DHT store of the run record or the role's bans that takes long must not let the peer's own record
    (3 heartbeats' life) lapse: a trainer went missing from ``swarm status`` under CI load that way."""
    peer = base_peer(heartbeat_period=0.02, metrics_period=3600.0, record_ttl=0.06)
    stuck = threading.Event()
    announced = []
    peer.announce = lambda *_a, **_k: announced.append(1) or True
    peer._keep_run_record = lambda: None
    peer.refresh_trust = lambda: None
    peer.on_heartbeat = lambda: stuck.wait(10)  # a store that hangs
    peer._status = lambda: None
    peer._remember_peers = lambda: None
    threads = [threading.Thread(target=t, daemon=True) for t in (peer._announce_loop, peer._chores_loop)]
    for t in threads:
        t.start()
    try:
        threading.Event().wait(0.6)
        assert len(announced) >= 10, f"{len(announced)} announcements in 0.6 s at a 0.02 s heartbeat"
    finally:
        peer.stop_event.set()
        stuck.set()
        for t in threads:
            t.join(5)


def test_an_empty_dht_routing_table_is_refilled_at_most_every_few_seconds_and_beats_the_dht_signal(
    monkeypatch,
):
    import echo_p2p.roles.base as base

    peer = base_peer()
    boot = "/ip4/127.0.0.1/tcp/1/p2p/QmBoot"
    peer.config = peer.config.model_copy(
        update={"network": peer.config.network.model_copy(update={"initial_peers": [boot]})}
    )
    peer.dht = object()
    peer._remembered = ["/ip4/127.0.0.1/tcp/2/p2p/QmMet"]
    peer.peer_cache = types.SimpleNamespace(load=lambda: [boot])
    beats = []
    peer.watchdog = types.SimpleNamespace(beat=beats.append)
    table = [0]
    pinged = []
    monkeypatch.setattr(base, "neighbour_counts", lambda dht, timeout, connections=True: (table[0], 3))

    def rejoin(dht, maddrs, timeout):
        pinged.append(list(maddrs))
        return 1, 2

    monkeypatch.setattr(base, "rejoin_dht", rejoin)
    peer._keep_dht_neighbours()
    assert pinged == [["/ip4/127.0.0.1/tcp/1/p2p/QmBoot", "/ip4/127.0.0.1/tcp/2/p2p/QmMet"]]  # each once
    assert peer.dht_rejoins == 1 and beats == ["dht"]
    peer._keep_dht_neighbours()  # still empty a heartbeat later: not again before REJOIN_EVERY
    assert len(pinged) == 1 and beats == ["dht"]
    table[0] = 4
    peer._keep_dht_neighbours()  # neighbours: no rejoin, the signal beats
    assert len(pinged) == 1 and beats == ["dht", "dht"]


def test_a_dht_that_does_not_answer_leaves_the_dht_signal_unbeaten_and_the_heartbeat_going(monkeypatch):
    """A frozen DHT child: counting its neighbours times out. That must not end the heartbeat's round (its
    metrics line tells the stall), and the watchdog's 'dht' signal must not beat."""
    import echo_p2p.roles.base as base

    peer = base_peer()
    peer.dht = object()
    beats = []
    peer.watchdog = types.SimpleNamespace(beat=beats.append)

    def frozen(dht, timeout, connections=True):
        raise TimeoutError("no answer")

    monkeypatch.setattr(base, "neighbour_counts", frozen)
    peer._keep_dht_neighbours()  # returns, raises nothing
    assert beats == []


def test_the_final_metrics_line_comes_after_the_heartbeats_last_status_line(tmp_path):
    """A heartbeat under way when the peer stops writes its status line after the stop: the line marked
    ``final`` (the run's totals) must still be the file's last (a late-trainer run's trainer wrote a status
    line 1 s after its final one)."""
    import json

    peer = unstarted_peer(Peer, tmp_path, heartbeat_period=0.01, metrics_period=0.0)
    in_heartbeat, stopping = threading.Event(), threading.Event()
    peer._keep_dht_neighbours = lambda: None
    peer._keep_run_record = lambda: None
    peer.refresh_trust = lambda: None
    peer._remember_peers = lambda: None

    def on_heartbeat() -> None:  # a DHT call that returns only once the peer is stopping
        in_heartbeat.set()
        stopping.wait(10)

    peer.on_heartbeat = on_heartbeat
    original_shutdown = peer.on_shutdown
    peer.on_shutdown = lambda: (stopping.set(), original_shutdown())
    peer._chores = threading.Thread(target=peer._chores_loop, daemon=True)
    peer._chores.start()
    assert in_heartbeat.wait(10)
    peer.shutdown()
    assert not peer._chores.is_alive()
    (path,) = tmp_path.glob("*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) >= 2 and not lines[0].get("final"), lines  # the heartbeat's line, then the final one
    assert lines[-1].get("final") and sum(bool(x.get("final")) for x in lines) == 1, lines


def test_a_heartbeat_longer_than_a_record_lives_is_counted_and_names_its_slowest_chore(caplog):
    """A heartbeat whose chores take longer than ``record_ttl`` says so: its publisher election and status
    line were that late (a CI failover took 15 s where 3-5 s is usual, and nothing said why)."""
    peer = base_peer(heartbeat_period=0.01, metrics_period=3600.0, record_ttl=0.05)
    beats = []
    peer._keep_dht_neighbours = lambda: None
    peer._keep_run_record = lambda: None
    peer.refresh_trust = lambda: None
    peer._status = lambda: None
    peer._remember_peers = lambda: None

    def on_heartbeat():
        beats.append(1)
        if len(beats) == 2:
            threading.Event().wait(0.2)  # one slow DHT call
        if len(beats) >= 4:
            peer.stop_event.set()

    peer.on_heartbeat = on_heartbeat
    with caplog.at_level("WARNING", logger="echo_p2p.roles.base"):
        peer._chores_loop()
    assert peer.slow_heartbeats == 1
    slow = [r.getMessage() for r in caplog.records if "a heartbeat took" in r.getMessage()]
    assert len(slow) == 1 and "the most in role" in slow[0], slow
