"""Sizing micro-batches by memory: the bytes one token costs in a training forward/backward, and the
token limit per micro-batch that a memory budget (``GRPOConfig.micro_batch_memory_mb``) allows.

Owned here: ``bytes_per_token`` (an estimate from a model's config: its vocabulary, depth and widths),
``fixed_bytes`` and ``memory_token_limit`` ((budget - fixed) / bytes per token). Called by ``learner.Learner`` once per model. Pure
arithmetic on config attributes: imports no torch, runs no model.

What a token costs during ``Learner.compute_gradients`` (float32 activations, measured with peak RSS):

- **logits**: ``vocab x 4`` bytes per copy, and ``LOGITS_COPIES`` copies live at the peak: the logits
  (kept for the backward of ``grpo.token_logprobs``) and their gradient. A 49,152-token vocabulary
  (SmolLM2) is 192 KiB per copy per token.
- **decoder layers**: what autograd keeps for the backward, ``HIDDEN_FLOATS x hidden + MLP_FLOATS x
  intermediate`` floats per layer (norms, q/k/v, attention output, residuals; the gated MLP's gate, up,
  activation and product). SmolLM2-135M (30 layers, hidden 576, MLP 1536): 1.4 MiB per token estimated,
  ~1.3 MiB measured, more than its logits. Attention scores are not counted: SDPA's kernels do not keep
  ``L x L`` per head, and rows are short (long rows with the eager attention would exceed the estimate).
- **fixed per pass** (``fixed_bytes``): the dense weight gradients of the embedding and the output
  projection before they are added to ``.grad`` (2 x 108 MiB for SmolLM2), taken off the budget first.

Logits are counted for every token although a transformers model computes them only for the positions
that predict completion tokens (``learner``'s ``logits_to_keep``): rows with long prompts and short
completions then use less than the budget, rows that are mostly completion use about all of it.

The estimate is deliberately a little above what was measured (a 50k-vocabulary model in
``tests/unit/train/test_memory.py``: 395 KiB per token measured, 404 estimated; SmolLM2 above), so that a
micro-batch sized by it stays within its budget. Tokens are padded tokens (rows x width), the
unit of ``batching.split_micro_batches``. Parameters, gradients and optimizer state are not activations:
they are outside the budget.
"""

from __future__ import annotations

from typing import Any

#: Logits-sized float32 tensors alive at once per token (logits + their gradient; ``grpo.token_logprobs``).
LOGITS_COPIES = 2
#: Floats per token per decoder layer kept for the backward, per unit of ``hidden_size``.
HIDDEN_FLOATS = 10
#: Floats per token per decoder layer kept for the backward, per unit of ``intermediate_size``.
MLP_FLOATS = 4
#: Weight-gradient temporaries per pass, in units of ``vocab x hidden`` floats: the embedding's dense
#: gradient and the output projection's, before they are added to ``.grad``.
EMBEDDING_GRAD_COPIES = 2
#: Activation bytes (float32).
FLOAT_BYTES = 4
MIB = 1 << 20


def bytes_per_token(config: Any) -> int:
    """Estimated peak bytes one padded token adds to a forward/backward of a causal LM with this config
    (a transformers ``PretrainedConfig`` or anything with the same attribute names).

    Reads ``vocab_size``, ``num_hidden_layers``, ``hidden_size`` and ``intermediate_size`` (missing ones
    count as 0; a missing ``intermediate_size`` as ``4 x hidden_size``). Raises ``ValueError`` when the
    config has no ``vocab_size``.
    """
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ValueError("the model's config has no vocab_size: cannot size micro-batches by memory")
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    intermediate = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    logits = LOGITS_COPIES * vocab
    per_layer = HIDDEN_FLOATS * hidden + MLP_FLOATS * intermediate
    return FLOAT_BYTES * (logits + layers * per_layer)


def fixed_bytes(config: Any) -> int:
    """Bytes a forward/backward pass needs whatever its size: the weight-gradient temporaries of the
    embedding and of the output projection (``EMBEDDING_GRAD_COPIES x vocab x hidden`` floats)."""
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return FLOAT_BYTES * EMBEDDING_GRAD_COPIES * vocab * hidden


def memory_token_limit(config: Any, budget_mib: float) -> int:
    """Most padded tokens per micro-batch whose pass fits in ``budget_mib`` MiB: ``(budget - fixed_bytes)
    / bytes_per_token``, at least 1 (a budget below the fixed part still trains, one row at a time)."""
    if budget_mib <= 0:
        raise ValueError("the memory budget must be > 0 MiB")
    room = budget_mib * MIB - fixed_bytes(config)
    return max(1, int(room // bytes_per_token(config)))
