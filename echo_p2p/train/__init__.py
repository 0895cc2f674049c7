"""GRPO training, pure ML (no networking): what a trainer learns from and how (what it refuses is
``echo_p2p.guard``).

- ``config``: ``GRPOConfig``, the update's hyper-parameters (validated without torch).
- ``grpo``: advantages, per-token log-probs, the clipped GRPO loss and its KL term (pure functions).
- ``batching``: scored groups -> right-padded tensors and micro-batches.
- ``memory``: bytes per token of a forward/backward; the micro-batch token limit of a memory budget.
- ``learner``: ``Learner`` (forward/backward with gradient accumulation, drift probes).
- ``reference``: the frozen starting policy of the KL penalty.
- ``scored``: ``ScoredGroup``, a validated group with the rewards the trainer re-computed.
- ``buffer``: ``ReplayBuffer`` (staleness policy); pure Python, no torch.
- ``pacing``: how many groups a trainer grants each sender (the async swarm's pacing rule).
- ``journal``: acknowledged groups on disk until used (a killed trainer loses none).
- ``checkpoint``: atomic policy + optimizer checkpoints.
- ``evaluation``: held-out evaluation on a schedule with a time budget.
- ``trackers``: TensorBoard / wandb figures under TRL's names.

Used by the trainer peer and the co-located loop. Names are re-exported lazily, so
``import echo_p2p.train.buffer`` (the trainer's ingest path) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ScoredGroup": "scored",
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
