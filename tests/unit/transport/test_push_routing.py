"""Where the pusher sends a group: to the trainer whose grant it was sampled under.

The chaos soak saw 10-12 s version stalls with no fault: a sampler took grants from two trainers and pushed
every group to the one with the most room, which refused most of them as ``not_granted``; the groups owed
to that trainer also came off the other trainer's grants, so the other sat with an empty buffer while its
partner waited for it at the epoch's all-reduce. These tests drive the real sender step against a scripted
trainer side (no network)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.transport.rollouts.config import PusherConfig
from echo_p2p.transport.rollouts.grants import TrainerState
from echo_p2p.transport.rollouts.ingest import Status
from echo_p2p.transport.rollouts.push import RolloutPusher
from echo_p2p.transport.rollouts.refusals import Reason


class _Loop:
    """What the sender thread needs of a ``P2PLoop``: ``run`` a push coroutine, ``forget`` a peer."""

    def run(self, coro, timeout=None):
        return asyncio.run(coro)

    def forget(self, peer_id) -> None:
        pass


Answer = Callable[[TrainerState, list], rollouts_pb2.PushAck]


def _pusher(answer: Answer, trainers: dict[str, int]) -> tuple[RolloutPusher, list[tuple[str, list[int]]]]:
    """A pusher whose trainers (id -> grant to this peer) answer pushes with ``answer``; the pushes made,
    as (trainer, prompt ids), are listed in the second value."""
    pusher = RolloutPusher(loop=_Loop(), directory=None, config=PusherConfig(batch_groups=32))
    pusher._refreshed_at = float("inf")  # no directory read
    pusher._ledger.trainers = {
        peer: TrainerState(peer, [], room=100, stamp=0.0, wanted=grant) for peer, grant in trainers.items()
    }
    pushes: list[tuple[str, list[int]]] = []

    async def push(trainer: TrainerState, batch: list) -> rollouts_pb2.PushAck:
        pushes.append((trainer.peer_id, [item.group.prompt_id for item in batch]))
        return answer(trainer, batch)

    pusher._push = push
    return pusher, pushes


def _groups(first: int, n: int) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            task="count",
            prompt_id=first + i,
            prompt_token_ids=[1, 2],
            completions=[
                Completion(token_ids=[3], logprobs=[-0.1], claimed_reward=float(k), finished=True)
                for k in range(2)
            ],
            policy_version=0,
            sampler_peer_id="QmSampler",
            sampled_at=0.0,
        )
        for i in range(n)
    ]


def _accept(wanted: int = 0) -> Answer:
    def answer(trainer: TrainerState, batch: list) -> rollouts_pb2.PushAck:
        acks = [rollouts_pb2.GroupAck(rollout_id=i.group.rollout_id, status=Status.ACCEPTED) for i in batch]
        return rollouts_pb2.PushAck(acks=acks, free_room=100, wanted=wanted)

    return answer


def _drain(pusher: RolloutPusher, steps: int = 10) -> None:
    for _ in range(steps):
        if not pusher._pending:
            return
        pusher._step()


def test_each_group_goes_to_the_trainer_whose_grant_it_was_sampled_under():
    pusher, pushes = _pusher(_accept(), {"QmA": 3, "QmB": 2})
    pusher._ledger.trainers["QmB"].room = 1000  # the old rule sent everything to the roomiest trainer
    assert pusher.reserve(5, timeout=0) == 5
    assert pusher.submit(_groups(0, 5)) == 5
    _drain(pusher)
    sent = dict(pushes)
    assert sorted(sent) == ["QmA", "QmB"], pushes
    assert len(sent["QmA"]) == 3 and len(sent["QmB"]) == 2, pushes
    stats = pusher.stats()["by_trainer"]
    assert stats["QmA"]["acked"] == 3 and stats["QmB"]["acked"] == 2
    assert "not_granted" not in stats["QmA"] and "not_granted" not in stats["QmB"]


def test_groups_owed_to_one_trainer_do_not_come_off_another_trainers_grant():
    """Four groups sampled for A wait in the outbox; B's ack grants 4: all 4 are B's to sample (the old
    rule took every undelivered group off every grant, and B got nothing)."""
    pusher, _ = _pusher(_accept(), {"QmA": 4, "QmB": 0})
    assert pusher.reserve(4, timeout=0) == 4
    pusher.submit(_groups(0, 4))
    b = pusher._ledger.trainers["QmB"]
    pusher._settle(b, [], rollouts_pb2.PushAck(free_room=100, wanted=4))
    assert b.wanted == 4
    a = pusher._ledger.trainers["QmA"]
    pusher._settle(a, [], rollouts_pb2.PushAck(free_room=100, wanted=6))
    assert a.wanted == 2  # its own 4 groups are on their way
    assert pusher.reserve(10, timeout=0) == 6


def test_a_group_its_owner_refuses_takes_another_trainers_grant_instead_of_a_new_sample():
    def answer(trainer: TrainerState, batch: list) -> rollouts_pb2.PushAck:
        status, reason = (
            (Status.REJECTED, Reason.NOT_GRANTED.value) if trainer.peer_id == "QmA" else (Status.ACCEPTED, "")
        )
        acks = [
            rollouts_pb2.GroupAck(rollout_id=i.group.rollout_id, status=status, reason=reason) for i in batch
        ]
        return rollouts_pb2.PushAck(acks=acks, free_room=100, wanted=0)

    pusher, pushes = _pusher(answer, {"QmA": 2, "QmB": 0})
    assert pusher.reserve(2, timeout=0) == 2
    pusher.submit(_groups(0, 2))
    pusher._step()  # to A, whose grant expired meanwhile: refused
    assert pushes == [("QmA", [0, 1])]
    pusher._ledger.trainers["QmB"].wanted = 3  # B grants this peer 3
    pusher._step()
    assert pushes[1] == ("QmB", [0, 1])
    assert pusher.stats()["by_trainer"]["QmB"]["acked"] == 2
    assert pusher._ledger.trainers["QmB"].wanted == 0  # the ack's own grant (0), nothing owed any more
    assert pusher._ledger.trainers["QmA"].owed == 0 and pusher._ledger.trainers["QmB"].owed == 0


def test_a_refused_group_waits_for_a_grant_rather_than_bouncing_between_trainers():
    def answer(trainer: TrainerState, batch: list) -> rollouts_pb2.PushAck:
        if not batch:  # a room query: nobody wants more
            return rollouts_pb2.PushAck(free_room=100, wanted=0)
        acks = [
            rollouts_pb2.GroupAck(
                rollout_id=i.group.rollout_id, status=Status.REJECTED, reason=Reason.NOT_GRANTED.value
            )
            for i in batch
        ]
        return rollouts_pb2.PushAck(acks=acks, free_room=100, wanted=0)

    pusher, pushes = _pusher(answer, {"QmA": 1, "QmB": 0})
    pusher.reserve(1, timeout=0)
    pusher.submit(_groups(0, 1))
    for _ in range(5):
        pusher._step()
    assert [p for p in pushes if p[1]] == [("QmA", [0])]  # pushed once; since then only room queries
    assert len(pushes) == 5
    assert len(pusher._pending) == 1  # kept until some trainer grants it


def test_grants_reserved_and_never_submitted_are_released_at_the_next_reserve():
    pusher, _ = _pusher(_accept(), {"QmA": 3})
    a = pusher._ledger.trainers["QmA"]
    assert pusher.reserve(3, timeout=0) == 3 and a.owed == 3
    # the sampling failed: nothing submitted; the next ack's grant must not be cut by groups never coming
    pusher.reserve(1, timeout=0)
    pusher._settle(a, [], rollouts_pb2.PushAck(free_room=100, wanted=5))
    assert a.owed == 0 and a.wanted == 5


def test_a_trainer_that_does_not_pace_takes_what_is_sampled_the_roomiest_first():
    pusher, pushes = _pusher(_accept(wanted=-1), {"QmA": -1, "QmB": -1})
    pusher._ledger.trainers["QmA"].room = 3
    assert pusher.reserve(4, timeout=0) == 4
    pusher.submit(_groups(0, 4))
    _drain(pusher)
    assert pushes[0] == ("QmB", [0, 1, 2, 3])
