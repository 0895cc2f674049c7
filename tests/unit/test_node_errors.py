"""The DHT start's errors in words: a clock off the bootstrap's, initial peers that do not answer."""

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
