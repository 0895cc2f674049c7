"""The reference policy of the KL penalty (``GRPOConfig.kl_beta``, TRL's ``beta``): a frozen copy of the
starting policy.

Owned here: ``reference_policy(model, precision)``. Called by the trainer peer and the co-located loop right
after the policy is loaded from the run's model spec and **before** any checkpoint or other trainer's state
is loaded into it, so that the reference is the run's starting policy on every trainer: a fresh one, a
resumed one (``--resume``) and one that joins late and downloads the others' state rebuild the same
reference from the same spec (the tiny preset from its seed, a model directory or GGUF file from its
bytes); a checkpoint never holds it. ``Learner`` computes its log-probs for the KL term.

Cost: one more copy of the model's parameters in the policy's dtype (the fp32 trainer's: 0.5 GiB for
SmolLM2-135M) and one forward pass without gradient per micro-batch. Must not import hivemind.
"""

from __future__ import annotations

import copy

import torch

_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def reference_policy(model: torch.nn.Module, precision: str = "fp32") -> torch.nn.Module:
    """A frozen deep copy of ``model`` (no gradients, eval mode) whose floating-point values are rounded to
    ``precision`` ('fp32': as they are; 'bf16' / 'fp16': rounded, kept in their own dtype), the weights the
    loss sees at that ``DerivedSettings.policy_precision``: the KL to the reference is exactly 0 before the first
    update, whether or not the policy itself starts on that grid."""
    if precision not in _DTYPES:
        raise ValueError(f"unknown precision {precision!r} (fp32, bf16, fp16)")
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    reference.eval()
    dtype = _DTYPES[precision]
    if dtype is not None:
        with torch.no_grad():
            for p in reference.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    p.copy_(p.to(dtype))
    return reference
