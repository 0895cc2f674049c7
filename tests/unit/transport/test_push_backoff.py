"""The pusher's back-off after failed pushes: short at first, doubling, capped, reset by an ack."""

from __future__ import annotations

from echo_p2p.proto import rollouts_pb2
from echo_p2p.transport.rollouts.config import PusherConfig
from echo_p2p.transport.rollouts.grants import TrainerState
from echo_p2p.transport.rollouts.push import RolloutPusher


def test_backoff_starts_short_doubles_and_is_capped():
    pusher = RolloutPusher(loop=None, directory=None, config=PusherConfig(first_retry=0.5, retry_cooldown=3))
    assert [pusher.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_an_ack_resets_the_failure_count():
    pusher = RolloutPusher(loop=None, directory=None)
    trainer = TrainerState("QmTrainer", [], room=10, stamp=0.0, failures=4)
    assert pusher._settle(trainer, [], rollouts_pb2.PushAck(free_room=7)) == []
    assert trainer.failures == 0 and trainer.room == 7


def test_a_full_trainer_is_probed_again_soon_not_after_its_next_announcement(monkeypatch):
    from echo_p2p.rollout import Completion, RolloutGroup
    from echo_p2p.transport.rollouts.ingest import Status
    from echo_p2p.transport.rollouts.push import _Item
    from echo_p2p.transport.rollouts.refusals import Reason

    pusher = RolloutPusher(loop=None, directory=None, config=PusherConfig(full_recheck=0.2))
    trainer = TrainerState("QmTrainer", [], room=5, stamp=0.0, wanted=-1)  # a trainer that does not pace
    pusher._ledger.trainers = {trainer.peer_id: trainer}
    pusher._refreshed_at = float("inf")  # no directory read in this test
    group = RolloutGroup(
        task="count",
        prompt_id=1,
        prompt_token_ids=[1, 2],
        completions=[Completion(token_ids=[3], logprobs=[-0.1], claimed_reward=1.0, finished=True)] * 2,
        policy_version=0,
        sampler_peer_id="QmSampler",
        sampled_at=0.0,
    )
    item = _Item(group, b"")
    full = rollouts_pb2.GroupAck(
        rollout_id=group.rollout_id, status=Status.REJECTED, reason=Reason.BUFFER_FULL.value
    )
    now = [1000.0]
    monkeypatch.setattr("echo_p2p.transport.rollouts.push.time.monotonic", lambda: now[0])
    assert pusher._settle(trainer, [item], rollouts_pb2.PushAck(acks=[full], free_room=0, wanted=-1)) == [
        item
    ]
    assert trainer.room == 0
    assert pusher._choose() is None  # just said full
    now[0] += 0.25
    assert pusher._choose() is trainer  # probed again after full_recheck, well before a 2 s heartbeat
    assert pusher._choose() is None  # one probe per full_recheck


def _group(version: int):
    from echo_p2p.rollout import Completion, RolloutGroup

    return RolloutGroup(
        task="count",
        prompt_id=1,
        prompt_token_ids=[1, 2],
        completions=[Completion(token_ids=[3], logprobs=[-0.1], claimed_reward=1.0, finished=True)] * 2,
        policy_version=version,
        sampler_peer_id="QmSampler",
        sampled_at=0.0,
    )


def test_acks_report_the_trainer_version_and_too_stale_refusals_raise_the_stale_floor():
    from echo_p2p.transport.rollouts.ingest import Status
    from echo_p2p.transport.rollouts.push import _Item
    from echo_p2p.transport.rollouts.refusals import Reason

    pusher = RolloutPusher(loop=None, directory=None)
    seen: list[int] = []
    pusher.on_trainer_version = seen.append
    trainer = TrainerState("QmTrainer", [], room=10, stamp=0.0)
    old, fresh = _group(3), _group(9)
    acks = [
        rollouts_pb2.GroupAck(
            rollout_id=old.rollout_id, status=Status.REJECTED, reason=Reason.TOO_STALE.value
        ),
        rollouts_pb2.GroupAck(rollout_id=fresh.rollout_id, status=Status.ACCEPTED),
    ]
    pusher._settle(
        trainer, [_Item(old, b""), _Item(fresh, b"")], rollouts_pb2.PushAck(acks=acks, policy_version=9)
    )
    assert pusher.stale_floor == 3 and pusher.trainer_version == 9 and seen == [9]
    pusher._settle(trainer, [], rollouts_pb2.PushAck(policy_version=9))
    assert seen == [9]  # called only when the version moves
    pusher._settle(trainer, [], rollouts_pb2.PushAck(policy_version=10))
    assert seen == [9, 10]


def test_refusals_of_one_kind_are_logged_once_per_period_with_a_count(caplog, monkeypatch):
    """A policy at its plateau repeats itself: hundreds of duplicate_content refusals a minute were each a
    warning line (4,942 in 3 minutes); now one line per trainer and reason every 10 s, with the count."""
    import logging

    from echo_p2p.transport.rollouts.ingest import Status
    from echo_p2p.transport.rollouts.push import REFUSAL_LOG_PERIOD, _Item
    from echo_p2p.transport.rollouts.refusals import Reason

    pusher = RolloutPusher(loop=None, directory=None)
    now = [0.0]
    pusher._refusals_log._clock = lambda: now[0]
    trainer = TrainerState("QmTrainer", [], room=10, stamp=0.0)
    monkeypatch.setattr(logging.getLogger("echo_p2p"), "propagate", True)  # off once a CLI set up logging
    caplog.set_level(logging.WARNING, logger="echo_p2p.transport.rollouts.push")

    def refuse(n: int) -> None:
        items = [_Item(_group(5), b"") for _ in range(n)]
        acks = [
            rollouts_pb2.GroupAck(
                rollout_id=i.group.rollout_id, status=Status.REJECTED, reason=Reason.DUPLICATE_CONTENT.value
            )
            for i in items
        ]
        pusher._settle(trainer, items, rollouts_pb2.PushAck(acks=acks, free_room=10))

    refuse(300)
    now[0] += REFUSAL_LOG_PERIOD
    refuse(1)
    lines = [r.getMessage() for r in caplog.records if "rejected rollout" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[1].endswith(f"(x 300 in the last {REFUSAL_LOG_PERIOD:.0f} s)"), lines[1]
    assert pusher.rejected[Reason.DUPLICATE_CONTENT.value] == 301  # the metrics count every one


def test_whole_pushes_refused_are_counted_by_reason_and_a_ban_is_said_once_per_trainer(caplog):
    pusher = RolloutPusher(loop=None, directory=None)
    a, b = TrainerState("QmA", [], room=1, stamp=0.0), TrainerState("QmB", [], room=1, stamp=0.0)
    for trainer, error in [
        (a, "banned: this trainer banned the sender"),
        (a, "banned: this trainer banned the sender"),
        (b, "banned: this trainer banned the sender"),
        (b, "rate_limited: beyond 100 B/s"),
        (b, "x" * 500),  # a stranger's words are bounded
    ]:
        pusher._refused(trainer, error)
    stats = pusher.stats()
    assert stats["pushes_refused"] == {"banned": 3, "rate_limited": 1, "x" * 32: 1}
    assert stats["banned_by"] == 2
    assert [r.getMessage() for r in caplog.records if "banned this peer" in r.getMessage()] == [
        "trainer QmA banned this peer: its pushes are refused unread",
        "trainer QmB banned this peer: its pushes are refused unread",
    ]
