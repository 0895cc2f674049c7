"""reference.py: the KL penalty's reference is a frozen copy of the starting policy, on the loss's grid."""

from __future__ import annotations

import pytest
import torch

from echo_p2p.train.config import DerivedSettings, GRPOConfig, OptimizerConfig
from echo_p2p.train.learner import Learner
from echo_p2p.train.reference import reference_policy


def test_reference_is_frozen_and_stays_the_starting_policy_while_the_policy_trains(
    tiny_model, random_groups
) -> None:
    model = tiny_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = reference_policy(model)
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    config = GRPOConfig(kl_beta=0.5, max_grad_norm=None, drift_probe_sequences=0)
    learner = Learner(model, config, ref_model=reference)
    optimizer = OptimizerConfig(lr=1e-2).adamw(model.parameters())
    groups = random_groups(seed=4)
    first = learner.step(groups, optimizer)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is still the reference
    second = learner.step(groups, optimizer)
    assert second["kl"] > 1e-6  # the policy moved, the reference did not
    for name, p in reference.named_parameters():
        assert p.grad is None
        torch.testing.assert_close(p, start[name], atol=0, rtol=0, msg=name)
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())


def test_reference_on_the_loss_grid_makes_the_kl_exactly_zero_before_any_update(
    tiny_model, random_groups
) -> None:
    """A trainer computing at bf16 (``policy_precision``) whose fp32 weights are off that grid: the reference
    holds the rounded values, so the KL of the unchanged policy is 0; an fp32 copy would not be."""
    model = tiny_model()
    groups = random_groups(seed=5)
    config = GRPOConfig(kl_beta=0.1, max_grad_norm=None)
    bf16 = DerivedSettings(policy_precision="bf16")
    rounded = Learner(model, config, reference_policy(model, "bf16"), bf16).compute_gradients(groups)
    assert rounded["kl"] == 0.0
    unrounded = Learner(model, config, reference_policy(model, "fp32"), bf16).compute_gradients(groups)
    assert unrounded["kl"] > 0.0
    for p in reference_policy(model, "bf16").parameters():
        assert p.dtype == torch.float32 and torch.equal(p, p.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="unknown precision"):
        reference_policy(model, "int8")
