"""The pusher's back-off after failed pushes: short at first, doubling, capped, reset by an ack."""

from __future__ import annotations

from echo_p2p.proto import rollouts_pb2
from echo_p2p.transport.rollout_config import PusherConfig
from echo_p2p.transport.rollout_push import RolloutPusher, _Trainer


def test_backoff_starts_short_doubles_and_is_capped():
    pusher = RolloutPusher(loop=None, directory=None, config=PusherConfig(first_retry=0.5, retry_cooldown=3))
    assert [pusher.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_an_ack_resets_the_failure_count():
    pusher = RolloutPusher(loop=None, directory=None)
    trainer = _Trainer("QmTrainer", [], room=10, stamp=0.0, failures=4)
    assert pusher._settle(trainer, [], rollouts_pb2.PushAck(free_room=7)) == []
    assert trainer.failures == 0 and trainer.room == 7
