"""``GRPOConfig`` (the hyperparameters of a GRPO update), ``OptimizerConfig`` (the AdamW that applies it) and
``DerivedSettings`` (what the loss takes from the run and the peer, never from the user).

``OptimizerConfig`` is the one optimizer setting of every trainer: trainer peers build their
``hivemind.Optimizer``'s AdamW with it (``collab.optimizer``) and the co-located loop its plain AdamW
(``colocated``), both through ``OptimizerConfig.adamw``, so a setting means the same in both. Kept apart from
the learner so that configs can be parsed and validated without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    import torch

LossAggregation = Literal["token_mean", "seq_mean"]
Precision = Literal["fp32", "bf16", "fp16"]
Objective = Literal["ppo", "decoupled"]
BehaviourWeight = Literal["truncate", "mask", "off"]


class OptimizerConfig(BaseModel):
    """The AdamW of every trainer: each update of a trainer peer's swarm-wide ``hivemind.Optimizer`` (one per
    policy version) and each step of the co-located loop. Every trainer of a run must use the same values."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(
        default=1e-3,
        gt=0,
        description="AdamW learning rate. 1e-3 is the tiny preset's (2e-3 learned faster early and stayed "
        "noisier); the smollm2 preset sets 1e-6, which suits 0.1-7B pretrained LMs.",
    )
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="AdamW betas (torch's and TRL's). With beta2 0.99 the tiny policy fell from 0.99 to "
        "0.87-0.90 once it was right: near convergence the rare groups that still teach have small "
        "gradients, and a short second-moment memory let Adam take full-size steps on them.",
    )
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")

    def adamw(self, params: Iterable[torch.Tensor]) -> torch.optim.AdamW:
        """A torch AdamW over ``params`` with these settings."""
        import torch

        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )


class GRPOConfig(BaseModel):
    """Hyper-parameters of the GRPO update (loss, advantages, micro-batching)."""

    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(
        default=0.2, ge=0, description="PPO clip below: the ratio is clipped at ``1 - clip_low``."
    )
    clip_high: float = Field(
        default=0.2,
        ge=0,
        description="PPO clip above: the ratio is clipped at ``1 + clip_high`` (DAPO's clip-higher: 0.28).",
    )
    objective: Objective = Field(
        default="decoupled",
        description="'decoupled' (decoupled PPO, AReaL): the clip is taken against a proximal policy of the "
        "trainer's (``proximal``) and the sampler's mismatch is a capped per-token weight (``behaviour_cap`` "
        "/ ``behaviour_weight``), so tokens of quantised or stale samplers still teach. 'ppo': the ratio to "
        "the sampler's behaviour log-probs is clipped (a token whose ratio left the clip range teaches "
        "nothing). The same on on-policy data; with rollouts 4 versions stale the tiny model learned 0.99x "
        "as fast as on-policy under 'decoupled', 0.77x under 'ppo' (``benchmarks/objectives.py``, README).",
    )
    behaviour_cap: float = Field(
        default=2.0,
        gt=0,
        description="'decoupled' objective: bound of the per-token weight (trainer policy / sampler).",
    )
    behaviour_weight: BehaviourWeight = Field(
        default="truncate",
        description="'decoupled' objective: a weight above ``behaviour_cap`` is cut to it ('truncate'), the "
        "token is left out ('mask', AReaL's choice), or no weight is applied at all ('off': the sampler's "
        "log-probs are ignored and its tokens are treated as on-policy).",
    )
    proximal: Literal["current", "previous_version"] = Field(
        default="previous_version",
        description="'decoupled' objective: the proximal policy the clip is taken against. 'current': this "
        "policy before the update (no clip in effect with one optimizer step per batch). 'previous_version': "
        "the policy one version before the current one, its log-probs approximated without a forward pass "
        "by interpolating between the sampler's and the current ones by version (AReaL's approximation): "
        "a token k versions stale whose probability moved more than the clip range per version in the "
        "direction of its advantage stops teaching. Needs the current version (``compute_gradients``).",
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Async mode: truncate the importance ratio at this value on top of the clip (bounds the "
        "A<0, large-ratio branch the clip leaves open), e.g. 2.0. None: off. See ``grpo``.",
    )
    ratio_cap: float | None = Field(
        default=10.0,
        gt=1,
        description="Hard bound on the importance ratio inside the objective (dual clip): a token whose ratio "
        "is above it adds ``ratio_cap * |A|`` to the loss and no gradient. Bounds what any reported "
        "behaviour log-prob can do to the loss (``grpo``). None: unbounded. Must exceed ``1 + clip_high``.",
    )
    drift_probe_sequences: int = Field(
        default=16,
        ge=0,
        description="Sequences of each batch re-scored after an update that makes a new version, to measure "
        "how far the policy moved (``Learner.measure_drift``; ``guard.drift``): one small forward pass per "
        "version. 0: not measured (stale groups are then not judged by their log-prob gap).",
    )
    kl_beta: float = Field(
        default=0.0,
        ge=0,
        description="TRL's ``beta``: coefficient of the per-token k3 KL penalty to a reference policy, "
        "``exp(ref - logp) - (ref - logp) - 1``, added to each completion token's loss and reported as ``kl``. "
        "> 0: trainer peers and the co-located loop keep a frozen copy of the starting policy "
        "(``train.reference``; one more copy of the model's parameters). 0: no reference is built.",
    )
    scale_rewards: bool = Field(
        default=True,
        description="Divide group-centred rewards by the group's std (GRPO). False: Dr. GRPO (centre only).",
    )
    adv_eps: float = Field(default=1e-6, gt=0, description="Added to the group std before dividing.")
    loss_agg: LossAggregation = Field(
        default="token_mean",
        description="'token_mean' (DAPO: every completion token of the batch weighs the same) or "
        "'seq_mean' (original GRPO: mean per completion, then mean over completions).",
    )
    micro_batch_size: int | None = Field(
        default=256,
        ge=1,
        description="Most completions (rows) per forward/backward pass; None: no row limit.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        description="Most padded tokens (rows x width) per forward/backward pass; None: no token limit.",
    )
    micro_batch_memory_mb: float | None = Field(
        default=1024.0,
        gt=0,
        description="Memory budget (MiB) of the activations of one forward/backward pass (logits, their "
        "gradient, what the decoder layers keep for the backward). The learner turns it into a limit of "
        "padded tokens per micro-batch from the model's vocabulary, depth and widths "
        "(``echo_p2p.train.memory``); the smallest of this, ``max_tokens_per_micro_batch`` and "
        "``micro_batch_size`` applies. 1024 MiB: 465 tokens of SmolLM2-135M (49k vocabulary, 30 layers), "
        "no limit in practice for the tiny model. None: no memory-derived limit.",
    )
    max_grad_norm: float | None = Field(
        default=1.0,
        gt=0,
        description="Clip the total gradient norm to this after accumulation; None: no clipping (the norm "
        "is still reported).",
    )


@dataclass(frozen=True)
class DerivedSettings:
    """What the learner's loss takes from the run and the peer rather than from a user setting: a trainer
    peer derives it from the run settings, its tokenizer, its encoding and its reputation settings
    (``roles.trainer``), the co-located loop from its own sampling and tokenizer. The defaults suit a
    sampler at temperature 1 with no top-k / top-p, holding the trainer's own fp32 weights."""

    #: Temperature, top-k (0 = off) and top-p (1 = off) of the log-probs: those the samplers sampled at
    #: (the run's ``temperature`` / ``top_k`` / ``top_p``), since the behaviour log-probs were computed at them.
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    #: Token id written in padding positions (never attended, never scored): the tokenizer's.
    pad_token_id: int = 0
    #: The weights the loss is computed with: fp32 uses the model's own weights; bf16 / fp16 rounds them to
    #: that dtype for the forward and backward (values kept in float32) and the optimizer updates the fp32
    #: master weights with that gradient (straight through). A trainer peer uses the dtype its inference
    #: peers hold (``trainer.encoding``), so that its policy is exactly theirs: with fp32 master weights at
    #: lr 1e-6 most updates stay below bf16's resolution and the receivers' cast lags the trainer
    #: (docs/protocol.md section 3.6).
    policy_precision: Precision = "fp32"
    #: Completions whose behaviour log-probs differ from this policy's by more than this many nats per
    #: token on average, on top of the group's allowance for the policy's own movement since it was
    #: sampled, are left out of the loss (a sampler that lies about them); None: all are used. Trainer
    #: peers take ``trainer.reputation.exclude_logprob_gap`` (docs/security.md).
    max_logprob_gap: float | None = None
    #: The samplers' weights are the trainer's only up to its lossy 8-bit encodings (``trainer.encoding``
    #: int8, int8-delta, or auto, whose versions may be int8 deltas): a replay of their seeded draws gets the
    #: 8-bit tolerance at least, whatever precision they claim (``train.draw_check``).
    lossy_weights: bool = False

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.pad_token_id < 0:
            raise ValueError(f"invalid derived settings: {self}")
        if self.max_logprob_gap is not None and self.max_logprob_gap <= 0:
            raise ValueError(f"max_logprob_gap must be positive or None, not {self.max_logprob_gap}")
