"""A trainer that a round's leader counted in its group, but whose answer to the join request never arrived,
stops looking for a group at once, and the leader's round stops waiting for it (real
``TaggedGradientAverager``s on two in-process hivemind DHTs, 127.0.0.1).

Seen in a fault-free soak (docs/reliability.md): the requester's stream ended before the leader's answer
("failed to request potential leader ... StopAsyncIteration"), so it kept looking for a group until its
step's deadline, 9 s, while the leader's round waited out its reducer timeout for the parts it never sent and
came back partial: two publish gaps of 8.7 and 8.3 s in a row. Here both averagers lose every answer they
give to a join request (the stream ends first), as that leader's did; the counted one answers the leader's
part and tells the leader's run it sends none, so neither waits out a timeout."""

from __future__ import annotations

import time
import typing

import pytest
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from echo_p2p.collab.averagers import TaggedGradientAverager
from tests.unit.collab.pairs import averager_pair

DEADLINE_S = 12.0  # each round's own deadline: how long the counted trainer looked for a group before
NEXT_CHUNK_S = 4.0  # the leader waits this long for a sender's first part, twice that for a reducer's


class AnswersLost(TaggedGradientAverager):
    """Runs a join request through its matchmaking as hivemind does (the requester is accepted and counted;
    the group of two is assembled), but the stream ends before any answer reaches the requester."""

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # noqa: UP006 (hivemind reads typing's form)
        async for _ in self._matchmaking.rpc_join_group(request, context):
            pass  # ACCEPTED, then BEGIN_ALLREDUCE: neither is sent
        return
        yield  # an async generator, as hivemind's handler


@pytest.fixture
def averagers():
    with averager_pair(
        AnswersLost,
        "lost-join-answer-test",
        min_matchmaking_time=3.0,
        request_timeout=1.0,
        next_chunk_timeout=NEXT_CHUNK_S,
    ) as pair:
        for averager in pair:
            averager.group_size_fn = lambda: 2  # a group is assembled as soon as both joined
        yield pair


def test_a_trainer_counted_in_a_round_it_never_learned_of_stops_looking_and_the_round_stops_waiting(
    averagers,
):
    for averager in averagers:
        averager.accumulate_grads_(batch_size=1)
    t0 = time.monotonic()
    controls = [averager.step(wait=False, timeout=DEADLINE_S) for averager in averagers]
    ended: dict[int, float] = {}
    outcomes: dict[int, object] = {}
    while len(ended) < 2 and time.monotonic() - t0 < DEADLINE_S + 5:
        for i, control in enumerate(controls):
            if i not in ended and control.done():
                ended[i] = time.monotonic() - t0
                try:
                    outcomes[i] = control.result(0)
                except Exception as exc:  # (concurrent.futures.CancelledError is one too)
                    outcomes[i] = exc
        time.sleep(0.02)
    assert len(ended) == 2, f"rounds still running after {DEADLINE_S + 5:.0f} s: {ended}"
    leaders = [i for i, outcome in outcomes.items() if isinstance(outcome, dict)]
    assert len(leaders) == 1, f"exactly one round (the leader's) should complete: {outcomes}"
    (leader,) = leaders
    counted = 1 - leader
    # the counted trainer's search ended at once, not at its deadline (before: "could not find a group"
    # after DEADLINE_S)
    assert isinstance(outcomes[counted], Exception), outcomes[counted]
    assert ended[counted] < DEADLINE_S / 2, (
        f"the counted trainer looked for a group for {ended[counted]:.1f} s"
    )
    # the leader's round waited out neither its reducer timeout for the counted one's results nor its sender
    # timeout for its parts (before: both; the counted one's answer ends the first, its note to the leader's
    # run the second), and says it arrived only in part
    leader_id = averagers[leader].peer_id
    assert outcomes[leader][leader_id] == TaggedGradientAverager.PARTIAL, outcomes[leader]
    assert ended[leader] < NEXT_CHUNK_S - 1, (
        f"the leader's round waited {ended[leader]:.1f} s for the counted one"
    )


def test_only_a_leader_this_search_asked_can_end_it_with_a_part_of_an_unknown_round() -> None:
    """A stranger's part of a made-up round must not end a trainer's search (else one message per round fails
    every round of it): only a leader asked in this search can have counted it, and only while no leader
    accepted it and it assembled no group."""
    from types import SimpleNamespace

    from hivemind.averaging.control import AveragingStage

    leader, stranger = object(), object()

    def judged(sender, *, stage=AveragingStage.LOOKING_FOR_GROUP, accepted_by=None, assembled=False) -> bool:
        matchmaking = SimpleNamespace(
            step_control=SimpleNamespace(stage=stage),
            current_leader=accepted_by,
            assembled_group=SimpleNamespace(done=lambda: assembled),
            potential_leaders=SimpleNamespace(past_attempts={(leader, 123.0)}),
        )
        # the predicate alone, on what it reads of the averager (no averager process)
        return TaggedGradientAverager._counted_in_unknown_round(
            SimpleNamespace(_matchmaking=matchmaking), sender
        )

    assert judged(leader)
    assert not judged(stranger)  # never asked: its part is left to hivemind (waited on, then BAD_GROUP_ID)
    assert not judged(leader, accepted_by=leader)  # a follower waiting for its leader's answer
    assert not judged(leader, assembled=True)  # a leader whose own round is about to begin
    assert not judged(leader, stage=AveragingStage.AWAITING_TRIGGER)  # in a round, waiting for its trigger
