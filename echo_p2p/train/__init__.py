"""GRPO training, pure ML (no networking): loss maths, batching, replay buffer and the learner.

- ``grpo``: advantages, per-token log-probs, the clipped GRPO loss (pure functions).
- ``batching``: scored groups -> right-padded tensors and micro-batches.
- ``buffer``: ``ScoredGroup`` and ``ReplayBuffer`` (staleness policy); pure Python, no torch.
- ``memory``: bytes per token of a forward/backward from a model's config; the micro-batch token limit of
  a memory budget (``GRPOConfig.micro_batch_memory_mb``).
- ``learner``: ``GRPOConfig`` and ``Learner`` (forward/backward with gradient accumulation).

Used by the trainer peer. Names are re-exported lazily, so ``import echo_p2p.train.buffer`` (the trainer's
ingest path) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ScoredGroup": "buffer",
    "ReplayBuffer": "buffer",
    "AddResult": "buffer",
    "BufferStats": "buffer",
    "recommended_capacity": "buffer",
    "Batch": "batching",
    "build_batch": "batching",
    "split_micro_batches": "batching",
    "group_advantages": "grpo",
    "token_logprobs": "grpo",
    "grpo_loss": "grpo",
    "GRPOConfig": "learner",
    "Learner": "learner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
