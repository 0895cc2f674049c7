"""The DHT child survives many threads sending it large commands at once (``net.node._guard_pipes``).

Before: hivemind's command pipe had no lock on the sending side and a non-blocking descriptor on the
receiving side; with 8 threads sending 100 KB commands the child died within a second
(``UnpicklingError`` / ``EOFError: Ran out of input``) and every later DHT call of the peer waited forever.
"""

from __future__ import annotations

import functools
import os
import threading

import pytest

pytestmark = pytest.mark.timeout(120)


async def _length(dht, node, blob: bytes) -> int:
    return len(blob)


def test_the_dht_child_survives_concurrent_large_commands():
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht

    identity = load_or_create_identity(None)
    dht = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), identity)
    # an ephemeral key file is removed once the daemon has read it: a killed peer leaves no private key behind
    assert not os.path.exists(identity.path)
    results: list[int] = []
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            for j in range(30):
                size = 100_000 + i * 1000 + j
                call = functools.partial(_length, blob=b"x" * size)
                results.append(dht.run_coroutine(call, return_future=True).result(timeout=30) - size)
        except Exception as exc:  # a dead child: the future fails or times out
            errors.append(repr(exc))

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not errors and results == [0] * 240, errors[:3]
        assert dht.is_alive()
        # and it still serves ordinary calls
        assert dht.store("k", "v", expiration_time=__import__("time").time() + 30)
    finally:
        stop_dht(dht)


def _send_a_pipe_end_and_exit(conn, other) -> None:
    # a command carrying a pipe end, as every MPFuture does: unpickling it fetches the descriptor from this
    # process, which exits at once
    conn.send(("command", other))


def test_a_command_whose_sender_exited_is_dropped_and_the_next_one_is_read():
    import multiprocessing as mp

    from echo_p2p.net.node import _WholeMessageReceiver

    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    spare_r, spare_w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_send_a_pipe_end_and_exit, args=(sender, spare_w))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    sender.send(("next", 42))
    guarded = _WholeMessageReceiver(receiver)
    assert guarded.recv() == ("next", 42)  # hivemind's own receive raised here and the DHT child died
    assert guarded.dropped == 1
    for end in (receiver, sender, spare_r, spare_w):
        end.close()
