"""A trainer alone in its run looks for no gradient round, and its steps are plain AdamW steps on its own
gradients (a real ``SyncedOptimizer`` on a real in-process hivemind DHT on 127.0.0.1).

Before: hivemind pre-schedules a gradient round before every epoch and cancels it at the epoch when no other
trainer is known, so a lone trainer's averager declared itself and searched for a group in the DHT at every
version (3 a second for the tiny model), for nothing: without it the swarm's machinery costs 0.55x per
version in the README run (``docs/scaling.md``). Once another trainer is seen, rounds are pre-scheduled as
hivemind does."""

from __future__ import annotations

from unittest import mock

import hivemind
import pytest
import torch

from echo_p2p.collab.optimizer import CollabOptimizerConfig, make_collab_optimizer, shutdown_optimizer
from echo_p2p.train.config import OptimizerConfig

EPOCHS = 4


@pytest.fixture
def dht():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield node
    finally:
        node.shutdown()


@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_a_lone_trainer_schedules_no_gradient_round_and_steps_as_plain_adamw(dht, reuse_grad_buffers):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    adam = OptimizerConfig()
    config = CollabOptimizerConfig(
        target_batch_size=2,
        batch_size_per_step=1,
        matchmaking_time=1.0,
        reuse_grad_buffers=reuse_grad_buffers,
    )  # an epoch (a version) is two local steps: its update is the mean of their gradients
    optimizer = make_collab_optimizer(dht, "lone", model.parameters(), config, adam)
    averager = optimizer.grad_averager
    scheduled = mock.patch.object(averager, "schedule_step", wraps=averager.schedule_step).start()
    plain = adam.adamw(reference.parameters())
    for r in reference.parameters():  # hivemind builds the optimizer's state with one step on zero gradients
        r.grad = torch.zeros_like(r)
    plain.step()
    try:
        for epoch in range(EPOCHS):
            grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(2)]
            for local in grads:
                for p, g in zip(model.parameters(), local, strict=True):
                    if reuse_grad_buffers and p.grad is not None:
                        p.grad.add_(g)  # the buffers accumulate; hivemind zeroes them at the epoch
                    else:
                        p.grad = g.clone()
                optimizer.step(batch_size=1)
            for r, g0, g1 in zip(reference.parameters(), *grads, strict=True):
                r.grad = (g0 + g1) / 2
            plain.step()
            assert optimizer.local_epoch == epoch + 1
            assert optimizer.scheduled_grads is None
        assert optimizer.tracker.global_progress.num_peers <= 1  # none seen but itself
        assert scheduled.call_count == 0, f"a lone trainer scheduled {scheduled.call_count} gradient rounds"
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-7)
    finally:
        mock.patch.stopall()
        assert shutdown_optimizer(optimizer)
