"""The learner's forward passes: logits of the positions that matter, with the weights the loss sees.

Owned here: ``forward_logits`` (a transformers causal LM computes logits only for the last ``keep`` positions
when it can, ``logits_to_keep``) and ``rounded_weights`` (the model's float weights rounded to the policy's
precision while open, the fp32 masters put back after). Called by ``train.learner`` (the loss, the duplicate
test), ``train.draw_check`` (replays of seeded draws), ``export`` and benchmarks. Must not import hivemind.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int | None = None
) -> torch.Tensor:
    """Logits of the last ``keep`` positions when the model can compute only those, else (or with ``keep``
    None) of all positions."""
    kwargs: dict[str, Any] = {"attention_mask": attention_mask}
    if hasattr(getattr(model, "config", None), "use_cache"):
        kwargs["use_cache"] = False  # a transformers model: no KV cache in a training forward
    if keep is not None and keep < input_ids.shape[1] and _takes_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = keep
    out = model(input_ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out


@functools.cache
def _takes_logits_to_keep(model_type: type) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


_PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def rounded_weights(model: torch.nn.Module, precision: str) -> Iterator[None]:
    """While open, ``model``'s float parameters hold their values rounded to ``precision`` ('fp32': left
    as they are; 'bf16' / 'fp16'), in their own dtype; the master values are put back on exit, gradients are
    left as computed (straight through)."""
    dtype = _PRECISIONS[precision]
    masters: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for p in model.parameters() if dtype is not None else ():
                if p.is_floating_point() and p.dtype != dtype:
                    masters.append((p, p.detach().clone()))
                    p.copy_(p.to(dtype))
        yield
    finally:
        with torch.no_grad():
            for p, master in masters:
                p.copy_(master)
