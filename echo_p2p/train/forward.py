"""The learner's forward passes: logits of the positions that matter, with the weights the loss sees.

Owned here: ``forward_logits`` (a transformers causal LM computes logits only for the last ``keep`` positions
when it can, ``logits_to_keep``), ``rounded_weights`` (the model's float weights rounded to the policy's
precision while open, the fp32 masters put back after) and ``forward_rows`` (passes without gradient over
prompt + completion rows, a bounded number of logits at a time: the checks that score rows ahead of the loss).
Called by ``train.learner`` (the loss, and the rows the duplicate test and the replay of seeded draws score
ahead of it), ``train.draw_check`` (a replay of its own), ``export`` and benchmarks. Must not import hivemind.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
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


#: Logit elements (rows x positions x vocabulary) ``forward_rows`` computes at once
ROW_LOGIT_ELEMENTS = 1 << 24

#: What ``forward_rows`` hands each chunk to: the index of its first row, its right-padded ``input_ids``
#: [rows, width] and the logits of its last positions (``logits[:, j]`` is position ``width - K + j``)
RowsReader = Callable[[int, torch.Tensor, torch.Tensor], None]


def forward_rows(
    model: torch.nn.Module,
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_token_id: int,
    precision: str,
    readers: Sequence[RowsReader],
) -> None:
    """Forward passes of ``model`` without gradient, with its weights at ``precision``, over ``rows`` of
    (prompt ids, completion ids), right-padded, as few rows at a time as keep the logits under
    ``ROW_LOGIT_ELEMENTS``; each of ``readers`` gets each chunk's logits of the positions that predict a completion
    token (from the one before its earliest completion token to the end)."""
    if not rows:
        return
    device = next(model.parameters()).device
    vocab = _vocab(model)
    longest = max(len(p) + len(c) for p, c in rows)
    per = max(1, ROW_LOGIT_ELEMENTS // (longest * vocab))
    with torch.no_grad(), rounded_weights(model, precision):
        for start in range(0, len(rows), per):
            chunk = rows[start : start + per]
            width = max(len(p) + len(c) for p, c in chunk)
            keep = width - min(len(p) for p, _ in chunk) + 1
            ids = [list(p) + list(c) + [pad_token_id] * (width - len(p) - len(c)) for p, c in chunk]
            mask = [[1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c)) for p, c in chunk]
            input_ids = torch.tensor(ids, device=device)
            logits = forward_logits(model, input_ids, torch.tensor(mask, device=device), keep)
            for read in readers:
                read(start, input_ids, logits)
            del logits


def _vocab(model: torch.nn.Module) -> int:
    """The model's vocabulary size (1 when it does not say: a bound on rows per forward only)."""
    if hasattr(model, "get_input_embeddings"):
        return int(model.get_input_embeddings().weight.shape[0])
    return 1
