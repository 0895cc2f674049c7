"""The ``swarm status`` table: one line per peer, with its reachability and how much of its time each sampler
waits for grants."""

from __future__ import annotations

from echo_p2p.swarm import format_table
from tests.unit.monitor.fakes import INF_A, TRAINER, row


def test_the_table_shows_reachability_and_each_samplers_waiting_share_and_a_dash_where_there_is_none():
    peers = [
        row(
            TRAINER,
            "trainer",
            mode="async",
            tokens_per_second=None,
            rollouts_per_second=70.0,
            free_buffer_room=12,
            reachability="direct",
        ),
        row(
            INF_A,
            mode="async",
            tokens_per_second=11000.0,
            rollouts_per_second=40.0,
            waiting_for_grants=0.67,
            reachability="relayed",
        ),
    ]
    for r in peers:
        r.setdefault("free_buffer_room", None)
        r["last_seen_s"] = 1.0
    lines = format_table("demo", peers).splitlines()
    assert lines[0] == "run demo: 2 peer(s)"
    assert lines[1].split()[-2:] == ["WAIT", "SEEN"] and lines[1].split()[5] == "REACH"
    trainer_line, sampler_line = lines[2], lines[3]
    assert trainer_line.split()[-2:] == ["-", "1s"]  # a trainer has no grants to wait for
    assert sampler_line.split()[-2:] == ["67%", "1s"]
    # the column the --json output already had: a peer behind NAT is reached through a relay
    assert trainer_line.split()[4] == "direct" and sampler_line.split()[4] == "relayed"
