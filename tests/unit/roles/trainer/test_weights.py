"""A trainer's own weights: a fresh run starts on its receivers' grid; weights gone non-finite are reloaded
from the last good state, or the trainer says it has none."""

from __future__ import annotations

import math

import torch

from echo_p2p.config import TrainerSection
from echo_p2p.roles.trainer.weights import params_finite, reload_last_good, start_on_serving_grid
from echo_p2p.train.checkpoint import CheckpointManager


class NoPeers:
    """An optimizer alone in its run: there is no other trainer to load state from."""

    def __init__(self, model=None, good=None):
        self.model, self.good, self.loaded = model, good, None

    def load_state_dict(self, state):
        self.loaded = state

    def load_state_from_peers(self):
        if self.good is None:
            raise RuntimeError("no peers to load state from")
        self.model.load_state_dict(self.good)


def poison(model):
    with torch.no_grad():
        next(model.parameters())[0, 0] = math.nan


def test_reload_from_the_last_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoints = CheckpointManager(tmp_path, keep_last=1)
    checkpoints.save(4, model.state_dict(), {"opt": 1}, {"steps": 4})
    poison(model)
    assert not params_finite(model)
    optimizer = NoPeers()
    assert reload_last_good(model, optimizer, checkpoints) == "checkpoint version 4"
    assert params_finite(model) and all(torch.equal(model.state_dict()[k], v) for k, v in good.items())
    assert optimizer.loaded == {"opt": 1}


def test_reload_from_the_other_trainers_and_none_when_nobody_has_a_good_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    poison(model)
    assert reload_last_good(model, NoPeers(model, good), None) == "other trainers"
    assert params_finite(model)
    poison(model)
    assert reload_last_good(model, NoPeers(), CheckpointManager(tmp_path / "empty")) is None


def test_a_fresh_trainer_starts_on_the_grid_its_receivers_hold():
    torch.manual_seed(0)
    for encoding, dtype in (("auto", torch.bfloat16), ("patch", torch.bfloat16), ("fp16", torch.float16)):
        model = torch.nn.Linear(2, 2)
        section = TrainerSection(encoding={"encoding": encoding, "serving_dtype": "bf16"})
        before = [p.detach().clone() for p in model.parameters()]
        assert start_on_serving_grid(model, section.encoding) > 0
        for p, b in zip(model.parameters(), before, strict=True):
            assert p.dtype == torch.float32
            assert torch.equal(p, p.to(dtype).float())  # the receivers' cast is exact at version 0
            assert torch.equal(p, b.to(dtype).float())  # round to nearest, nothing else
    model = torch.nn.Linear(2, 2)
    section = TrainerSection(encoding={"encoding": "int8-delta"})  # fp32 receivers: left alone
    before = [p.detach().clone() for p in model.parameters()]
    assert start_on_serving_grid(model, section.encoding) == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
