"""The announcer thread survives whatever the DHT throws (a GeneratorExit out of hivemind killed it)."""

from __future__ import annotations

import threading
import types

from echo_p2p.roles.base import BasePeer


def test_announcer_keeps_announcing_after_base_exceptions_from_the_dht():
    peer = BasePeer.__new__(BasePeer)
    peer.stop_event = threading.Event()
    peer.config = types.SimpleNamespace(heartbeat_period=0.01, metrics_period=3600.0, record_ttl=1.0)
    peer.trust = None
    peer._signed_run_record = None
    peer.policy_version = None
    peer.identity = types.SimpleNamespace(peer_id="QmTest")
    peer.role = "inference"
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
