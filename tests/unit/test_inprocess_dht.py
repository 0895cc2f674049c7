"""``InProcessDHT``: a node start that hivemind ends with a BaseException reaches ``start_dht`` as an ordinary
start error (which it explains and knocks again on), and the creation is held until it is done."""

from __future__ import annotations

import pytest

from echo_p2p.net.inprocess_dht import InProcessDHT


def test_a_start_ended_by_generator_exit_is_a_start_error(monkeypatch):
    from hivemind.dht.node import DHTNode

    async def interrupted(*args, **kwargs):
        raise GeneratorExit

    monkeypatch.setattr(DHTNode, "create", interrupted)
    dht = InProcessDHT()
    dht.start()
    try:
        assert dht._creating is not None  # held: a pending task only weakly referenced can be collected
        with pytest.raises(RuntimeError, match="start was interrupted"):
            dht.wait_until_ready(timeout=10)
        assert dht._creating.result(timeout=5) is None  # the creation ended (its error went to _ready)
    finally:
        dht.shutdown()
    assert not dht.is_alive()
