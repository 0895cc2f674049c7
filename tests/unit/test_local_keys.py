"""What a local run makes before it starts a process: the bootstrap's address, known to every peer at once."""

from __future__ import annotations

import socket
from pathlib import Path

from echo_p2p.local_keys import FIRST_PORT, bootstrap_address, free_port_below_ephemeral
from echo_p2p.net.identity import load_or_create_identity


def test_the_bootstrap_port_is_free_and_below_the_ports_the_kernel_hands_out():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port_below_ephemeral()
        assert FIRST_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # nothing listens there


def test_the_bootstrap_address_names_the_identity_it_will_run_with(tmp_path):
    identity_path, listen, maddr = bootstrap_address(tmp_path)
    peer_id = load_or_create_identity(str(identity_path)).peer_id  # the file the bootstrap is given
    assert maddr == f"{listen}/p2p/{peer_id}"
    assert listen.startswith("/ip4/127.0.0.1/tcp/")
    again = bootstrap_address(tmp_path)
    assert again[2].endswith(peer_id)  # a restarted local run in the same folder keeps the bootstrap's id
