"""Which addresses a node announces and what status they give (``net.reachability``)."""

from __future__ import annotations

import pytest

from echo_p2p.net.reachability import address_class, daemon_maddr, daemon_options, dialable, swarm_scope

ME = "QmYquueAWWnn6k59J424MwskKCk1b1UNKyzeixHSdHbTAx"
RELAY = "12D3KooWN7iEHyorUbUBPRThLtyGVre3xUeELYgmTmDDpvc16QoN"
LOOP = f"/ip4/127.0.0.1/tcp/4001/p2p/{ME}"
HOME = f"/ip4/192.168.1.2/tcp/4001/p2p/{ME}"
PUBLIC = f"/ip4/11.77.0.20/tcp/4001/p2p/{ME}"
CIRCUIT = f"/ip4/11.77.0.10/tcp/31337/p2p/{RELAY}/p2p-circuit/p2p/{ME}"


def test_address_classes() -> None:
    assert address_class(LOOP) == "loopback" and address_class(HOME) == "private"
    assert (
        address_class("/ip4/10.1.2.3/tcp/1") == "private"
        and address_class("/ip4/100.64.0.1/tcp/1") == "private"
    )
    assert address_class(PUBLIC) == "public" and address_class("/dns4/example.org/tcp/1") == "public"
    assert address_class(CIRCUIT) == "relayed"
    assert address_class("/ip4/0.0.0.0/tcp/1") is None and address_class("/ip4/999.1.1.1/tcp/1") is None


def test_the_swarm_scope_is_the_widest_class_of_its_bootstraps() -> None:
    assert swarm_scope([]) is None
    assert swarm_scope([LOOP]) == "loopback" and swarm_scope([LOOP, HOME]) == "private"
    assert swarm_scope([HOME, PUBLIC]) == "public"


def test_on_the_internet_a_node_announces_public_then_relayed_addresses_never_private_ones() -> None:
    assert dialable([LOOP, HOME, PUBLIC], "public") == ([PUBLIC], "direct")
    assert dialable([LOOP, HOME, CIRCUIT], "public") == ([CIRCUIT], "relayed")  # a home peer behind NAT
    assert dialable([LOOP, HOME], "public") == ([], "unreachable")  # before AutoNAT and the relay answered


def test_on_a_lan_or_one_machine_local_addresses_are_dialable() -> None:
    assert dialable([LOOP, HOME], "private") == ([HOME], "direct")
    assert dialable([LOOP], "loopback") == ([LOOP], "direct")
    assert dialable([LOOP, HOME], "loopback") == ([LOOP, HOME], "direct")
    assert dialable([LOOP, HOME], None) == ([HOME], "direct")  # no bootstrap: its own best class
    assert dialable(["/ip4/0.0.0.0/tcp/1"], None) == ([], "unreachable")


def test_a_relayed_address_is_dialled_through_its_relay_with_a_raw_multihash_peer_id() -> None:
    import base58

    direct = daemon_maddr(PUBLIC)
    assert str(direct) == "/ip4/11.77.0.20/tcp/4001"
    relayed = daemon_maddr(CIRCUIT)
    raw = relayed.to_bytes()
    digest = base58.b58decode(RELAY)
    # /p2p/ (code 421 = a5 03), a length byte, the multihash itself (no CID prefix), then /p2p-circuit
    assert raw.endswith(bytes([0xA5, 0x03, len(digest)]) + digest + bytes([0xA2, 0x02]))
    assert str(relayed) == f"/ip4/11.77.0.10/tcp/31337/p2p/{RELAY}/p2p-circuit"
    with pytest.raises(ValueError):
        daemon_maddr(f"/p2p-circuit/p2p/{ME}")


def test_daemon_options_bound_relay_buffers_reserve_on_static_relays_and_force_reachability_when_told() -> (
    None
):
    from hivemind.p2p import P2P

    from echo_p2p.net.reachability import RELAY_BUFFER_BYTES

    def flags(options: dict) -> dict:
        return P2P.FORCE_REACHABILITY_MAPPING[options["force_reachability"]]

    bare = daemon_options([], "auto")
    assert set(bare) == {"force_reachability"}
    # every node's relay service copies a circuit through small buffers, not p2pd's 2 x 16 MiB
    assert flags(bare) == {"relayBufferSize": RELAY_BUFFER_BYTES} and RELAY_BUFFER_BYTES <= 1 << 20
    assert flags(daemon_options([], "private")) == {
        "forceReachabilityPrivate": 1,
        "relayBufferSize": RELAY_BUFFER_BYTES,
    }
    options = daemon_options([CIRCUIT.split("/p2p-circuit")[0]], "private")
    assert options["use_auto_relay"] and options["trusted_relays"]
    assert flags(options) == {
        "forceReachabilityPrivate": 1,
        "relayDiscovery": 0,
        "relayBufferSize": RELAY_BUFFER_BYTES,
    }
    auto = daemon_options([CIRCUIT.split("/p2p-circuit")[0]], "auto")
    assert flags(auto) == {"relayDiscovery": 0, "relayBufferSize": RELAY_BUFFER_BYTES}


def test_an_unreachable_node_reads_its_addresses_again_within_the_retry_not_the_period() -> None:
    """A first read that fails, or finds no address yet, is not held for the whole period: a weight receiver
    announced nothing for 5 s that way while others waited for its chunks."""
    import concurrent.futures
    import time

    from echo_p2p.net.reachability import Reachability

    answers: list = [RuntimeError("daemon busy"), [], [LOOP], [HOME]]
    reads: list[float] = []

    class Daemon:  # what ``DHT.run_coroutine`` hands back: a future of the daemon's visible addresses
        def run_coroutine(self, _coro, return_future: bool = False):
            reads.append(time.monotonic())
            future: concurrent.futures.Future = concurrent.futures.Future()
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)
            return future

    reach = Reachability(Daemon(), [LOOP], period=3600.0, retry=0.05)
    assert reach.current() == ([], "unreachable")  # the read failed
    assert reach.current() == ([], "unreachable") and len(reads) == 1  # within the retry: not read again
    time.sleep(0.06)
    assert reach.current() == ([], "unreachable") and len(reads) == 2  # read again: no address yet
    time.sleep(0.06)
    assert reach.current() == ([LOOP], "direct") and len(reads) == 3
    time.sleep(0.06)
    assert reach.current() == ([LOOP], "direct") and len(reads) == 3  # reachable: the period holds
