"""Every node's p2pd runs with echo_p2p's own flags (``net.reachability.daemon_options``).

Before: a node's relay service copied each relayed connection through two 16 MiB buffers (hivemind's p2pd
default); the soak's bootstrap, relaying two home peers, grew by tens of MiB at each of their reconnections.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


def _p2pd_cmdlines() -> list[list[str]]:
    import psutil

    return [p.cmdline() for p in psutil.Process().children(recursive=True) if p.name().startswith("p2pd")]


@pytest.mark.parametrize("client_mode", [False, True])
def test_a_nodes_daemon_relays_through_bounded_buffers(client_mode):
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.net.reachability import RELAY_BUFFER_BYTES

    before = _p2pd_cmdlines()
    network = NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], reachability="public")
    dht = start_dht(network, load_or_create_identity(None), client_mode=client_mode, in_process=True)
    try:
        started = [c for c in _p2pd_cmdlines() if c not in before]
        assert len(started) == 1, started
        assert f"-relayBufferSize={RELAY_BUFFER_BYTES}" in started[0]
        assert "-forceReachabilityPublic=1" in started[0]
    finally:
        stop_dht(dht)
