"""An async trainer's replay buffer is sized for the inference peers that push to it (it was sized for 8 whatever
the swarm had): one sender until the ingest sees more, then the senders it accepted groups from recently."""

from __future__ import annotations

from echo_p2p.config import TrainerSection
from echo_p2p.roles.trainer.intake import async_buffer_capacity
from echo_p2p.train.buffer import recommended_capacity
from echo_p2p.transport.rollouts.config import PusherConfig
from tests.unit.transport.test_useless_help import make_servicer, mixed, payloads

K = PusherConfig().batch_groups


def test_the_buffer_has_room_for_the_pushes_of_the_senders_seen():
    section = TrainerSection()
    base = recommended_capacity(section.prompts_per_step, section.max_staleness, num_inference_peers=0)
    assert async_buffer_capacity(section, senders=0) == base + K  # before any push: one sender
    assert async_buffer_capacity(section, senders=3) == base + 3 * K
    assert async_buffer_capacity(section, senders=10**6) == base + section.ingest_server.max_streams * K
    fixed = section.model_copy(update={"buffer_capacity": 50})
    assert async_buffer_capacity(fixed, senders=3) == 50  # trainer.buffer_capacity wins


def test_the_ingest_counts_the_senders_it_accepted_groups_from():
    servicer, buffer = make_servicer()
    try:
        assert servicer.active_senders() == 0
        for k, sender in enumerate(["a", "b", "a", "c"]):
            servicer._process(sender, payloads([mixed(k)]))
        assert servicer.active_senders() == 3
        servicer._process("d", payloads([mixed(0)]))  # a duplicate is not accepted: d does not count
        assert servicer.active_senders() == 3
        buffer.resize(async_buffer_capacity(TrainerSection(), servicer.active_senders()))
        assert buffer.capacity == async_buffer_capacity(TrainerSection(), senders=3)
    finally:
        servicer.shutdown()
