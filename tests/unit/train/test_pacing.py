"""The trainer's pacing of its senders: the buffer depth it aims at, and grants split fairly, replaced,
expiring, and small for strangers."""

from __future__ import annotations

import pytest

from echo_p2p.train.pacing import Pacer, PacingConfig

B, S = 16, 4


def pacer(**overrides) -> Pacer:
    return Pacer(PacingConfig(**overrides), batch_groups=B, max_staleness=S)


def test_the_target_is_two_batches_until_arrivals_are_too_stale_for_them():
    p = pacer()
    assert p.target() == 2 * B
    for _ in range(200):
        p.observe(3)  # arrives 3 versions old: waiting one more batch leaves 1 version of slack ...
    assert p.target() == 2 * B
    for _ in range(200):
        p.observe(4)  # ... at 4, a group must be taken by the very next step
    assert p.target() == B
    for _ in range(200):
        p.observe(9)  # even hopeless arrivals never stop the trainer from asking for one batch
    assert p.target() == B


def test_a_group_arriving_stale_counts_by_its_mean_not_its_worst():
    p = pacer()
    for staleness in [2, 4] * 100:
        p.observe(staleness)
    assert p.stats()["arrival_staleness"] == pytest.approx(3, abs=0.2)
    assert p.target() == 2 * B


def test_grants_cover_what_is_missing_split_among_the_senders_that_ask():
    p = pacer()
    assert p.grant("a", usable=0, proven=True, now=0.0) == 2 * B  # alone: all that is missing
    assert p.grant("b", usable=0, proven=True, now=0.1) == 0  # a's grant covers the target
    # a delivered its groups (32 usable) and asks again: its grant is replaced, nothing is missing
    assert p.grant("a", usable=2 * B, proven=True, now=0.2) == 0
    # the trainer took a batch: 16 missing, split between the two senders seen lately
    assert p.grant("b", usable=B, proven=True, now=0.3) == B // 2
    assert p.grant("a", usable=B, proven=True, now=0.4) == B // 2
    assert p.outstanding(now=0.5) == B
    assert p.grant("c", usable=B, proven=True, now=0.5) == 0  # nothing left until someone delivers


def test_a_senders_new_grant_replaces_its_old_one_and_grants_expire():
    p = pacer(grant_seconds=10.0)
    assert p.grant("a", usable=0, proven=True, now=0.0) == 2 * B
    assert p.grant("a", usable=0, proven=True, now=1.0) == 2 * B  # replaced, not added
    assert p.outstanding(now=1.0) == 2 * B
    assert p.outstanding(now=11.5) == 0  # never delivered: void after grant_seconds
    assert p.grant("b", usable=0, proven=True, now=11.6) == 2 * B


def test_strangers_get_small_grants_and_together_at_most_half_the_target():
    p = pacer(newcomer_grant=4)
    grants = [p.grant(f"stranger-{i}", usable=0, proven=False, now=0.01 * i) for i in range(50)]
    assert max(grants) == 4
    assert sum(grants) == B  # half the target of 2B, then nothing more for newcomers
    assert p.grant("honest", usable=0, proven=True, now=1.0) == 1  # 16 missing split among 51 senders
    # once the strangers' grants expire unused, the honest sender gets the room back
    assert p.grant("honest", usable=0, proven=True, now=20.0) == 2 * B


def test_senders_that_stopped_asking_leave_the_split():
    p = pacer(sender_window=5.0)
    p.grant("a", usable=2 * B, proven=True, now=0.0)
    p.grant("b", usable=2 * B, proven=True, now=0.0)
    assert p.grant("a", usable=B, proven=True, now=1.0) == B // 2  # b still counts
    assert p.grant("a", usable=B, proven=True, now=7.0) == B  # b left the window (and a's grant was replaced)


def test_the_ingest_grants_room_queries_and_never_a_refused_sender():
    import asyncio

    from echo_p2p.train.buffer import ReplayBuffer
    from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer

    p = pacer(query_wait=0.2)
    servicer = RolloutIngestServicer(lambda g: None, ReplayBuffer(64, S), current_version=lambda: 7, pacer=p)
    try:
        ack = asyncio.run(servicer._answer("banned-one", [], "banned: this trainer banned the sender"))
        assert ack.error.startswith("banned") and ack.wanted == 0 and p.outstanding() == 0
        ack = asyncio.run(servicer._answer("newcomer", [], None))  # a room query: answered with a grant
        assert ack.wanted == 4 and ack.policy_version == 7 and servicer.stats()["queries"] == 1
        unpaced = RolloutIngestServicer(lambda g: None, ReplayBuffer(64, S))
        assert asyncio.run(unpaced._answer("x", [], None)).wanted == -1  # not paced: sample freely
        unpaced.shutdown()
    finally:
        servicer.shutdown()
