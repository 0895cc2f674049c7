"""The DHT start's errors in words (a clock off the bootstrap's, initial peers that do not answer), and a
neighbour count that comes back in time when the libp2p daemon does not answer."""

from __future__ import annotations

from echo_p2p.net.network_config import NetworkConfig
from echo_p2p.net.node import _explain_start_error

BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/QmVBs4rtbHeMREzjEUBfqKvRsHfvPFy9RFAZMr9K23gFyb"


def test_a_clock_off_the_bootstraps_is_named_with_the_offset_and_the_fix():
    # hivemind's refusal (DHTProtocol.call_ping, strict), as the DHT start raises it
    exc = RuntimeError(
        "ValidationError('local time must be within 3 seconds  of others(local: 1764684000.00000, "
        "peer: 1764683700.00000)')"
    )
    text = _explain_start_error(exc, NetworkConfig(initial_peers=[BOOT]))
    assert "this machine's clock is +300 s off the bootstrap's" in text
    assert "set the clock" in text


def test_initial_peers_that_do_not_answer_are_named_with_how_long_they_were_tried():
    exc = RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping.")
    text = _explain_start_error(exc, NetworkConfig(initial_peers=[BOOT], knock_timeout=4))
    assert text.startswith(f"none of the initial peers answered within 4 s: {BOOT}")
    assert "--knock-timeout" in text


class _DaemonThatDoesNotAnswer:
    """A DHT whose routing table holds two peers and whose libp2p daemon never lists its connections (as a
    loaded p2pd left the call for over 10 s); ``run_coroutine`` runs the coroutine as hivemind's DHT does,
    after a pickle round trip (it crosses into the DHT's child process)."""

    def __init__(self) -> None:
        import types

        async def list_peers():
            await __import__("asyncio").sleep(3600)

        self.node = types.SimpleNamespace(
            protocol=types.SimpleNamespace(
                routing_table=types.SimpleNamespace(peer_id_to_uid={"a": 1, "b": 2})
            ),
            p2p=types.SimpleNamespace(list_peers=list_peers),
        )

    def run_coroutine(self, coro, return_future=False):
        import asyncio
        import concurrent.futures
        import pickle
        import threading

        coro = pickle.loads(pickle.dumps(coro))
        future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(
            target=lambda: future.set_result(asyncio.run(coro(self, self.node))), daemon=True
        ).start()
        return future


def test_a_daemon_that_does_not_list_its_connections_leaves_the_routing_table_count_in_time(monkeypatch):
    import time

    import echo_p2p.net.node as node

    monkeypatch.setattr(node, "LIST_PEERS_TIMEOUT", 0.3)
    dht = _DaemonThatDoesNotAnswer()
    began = time.monotonic()
    assert node.neighbour_counts(dht, timeout=10.0) == (2, -1)  # the table; connections unknown
    assert time.monotonic() - began < 0.3 + 1.0
    began = time.monotonic()
    assert node.neighbour_counts(dht, timeout=10.0, connections=False) == (2, -1)  # no daemon call at all
    assert time.monotonic() - began < 0.3
    assert node.neighbour_counts(dht, timeout=0.2) == (2, -1)  # at most half the caller's deadline
