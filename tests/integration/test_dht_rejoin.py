"""A DHT node whose routing table emptied pings its way back (``net.node.rejoin_dht``).

Seen in the chaos soak (benchmarks/soak.py): a trainer cut off by a 37 s partition lost every DHT neighbour
(hivemind drops peers that do not answer) and nothing refilled its table. It stayed alone for 27 minutes
with its libp2p connections open, its records stored only by itself: the other trainer never saw it again.
Here both sides forget each other, as a partition makes them; the rejoin brings them back, and a record
stored by the rejoined node is read by the other one.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


async def _forget_everyone(_dht, node) -> int:
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.peer_id_to_uid)


def test_a_node_that_lost_every_neighbour_rejoins_and_its_records_reach_the_others():
    from hivemind.utils import get_dht_time

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import neighbour_counts, rejoin_dht, start_dht, stop_dht, visible_maddrs

    loopback = ["/ip4/127.0.0.1/tcp/0"]
    first = start_dht(NetworkConfig(host_maddrs=loopback), load_or_create_identity(None))
    second = None
    try:
        maddrs = visible_maddrs(first)
        second = start_dht(
            NetworkConfig(initial_peers=maddrs, host_maddrs=loopback), load_or_create_identity(None)
        )
        assert neighbour_counts(second)[0] == 1
        for dht in (first, second):  # the partition: each side dropped the other
            assert dht.run_coroutine(_forget_everyone) == 0
        assert neighbour_counts(second)[0] == 0
        # alone, a record is stored by its writer only: the other node does not find it
        assert second.store("alone", b"x", get_dht_time() + 60)
        assert first.get("alone", latest=True) is None

        answered, table = rejoin_dht(second, maddrs, timeout=5.0)
        assert answered >= 1 and table >= 1, (answered, table)
        assert neighbour_counts(first)[0] == 1  # the ping asked the other side to add it back too
        assert second.store("back", b"y", get_dht_time() + 60)
        found = first.get("back", latest=True)
        assert found is not None and found.value == b"y"
    finally:
        for dht in (second, first):
            if dht is not None:
                stop_dht(dht)
