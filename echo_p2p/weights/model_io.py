"""The weights a receiver holds, and moving them in and out of a model.

Owned here: `PolicyWeights` (the tensors of one version of one publisher's stream), `named_tensors` (what a
model publishes) and `load_into_model` (copy weights into a model, names and shapes checked first). Used by
the codec (`codec`), trainer and inference peers. Pure torch: no hivemind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from echo_p2p.weights.manifest import ParamMismatchError


@dataclass
class PolicyWeights:
    """Weights a receiver holds: the tensors of one version of one publisher's stream.

    The float tensors are the stream's state and must be kept as they are (the next delta applies to
    them): float32 in an int8-delta stream, the serving dtype (bf16 or fp16) in a patch or auto stream
    (exactly the trainer's weights cast to it after a patch); load a cast copy into the model with `load_into_model`.
    ``changed`` says what differs from version ``changed_since`` when only part of it does (after patches):
    per tensor name, the flat positions that changed (None: the whole tensor); a name absent from it did not
    change. ``changed=None``: unknown, treat every tensor as new.
    """

    version: int
    stream_id: str
    tensors: dict[str, torch.Tensor]
    changed: dict[str, torch.Tensor | None] | None = None
    changed_since: int | None = None


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors to publish for `model`: its state dict (parameters and persistent buffers), detached.

    A tensor that several names share (tied input/output embeddings) is listed once, under its first
    state-dict name; `load_into_model` writes it back through that name, which updates every alias.
    """
    seen: set[tuple] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict(keep_vars=True).items():
        if t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                continue
            seen.add(key)
        out.append((name, t.detach()))
    return out


def load_into_model(model: torch.nn.Module, weights: PolicyWeights | Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` into `model` (cast to each tensor's dtype and device) under ``torch.no_grad()``.

    The names must be exactly those of `named_tensors(model)`; shapes are checked before anything is copied.
    """
    tensors = weights.tensors if isinstance(weights, PolicyWeights) else weights
    targets = dict(named_tensors(model))
    if set(targets) != set(tensors):
        missing = sorted(set(targets) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(targets))[:5]
        raise ParamMismatchError(f"weights do not match the model: missing {missing}, extra {extra}")
    for name, t in targets.items():
        if t.shape != tensors[name].shape:
            raise ParamMismatchError(
                f"{name}: model shape {list(t.shape)}, weights {list(tensors[name].shape)}"
            )
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(tensors[name])
