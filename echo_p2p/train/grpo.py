"""GRPO maths: group-normalised advantages, per-token log-probs and the clipped policy loss.

Owned here: pure functions, no state, no model, no optimizer. ``batching`` calls ``group_advantages``;
``learner`` calls ``token_logprobs`` and ``grpo_loss``. Must not import hivemind, must not call
``backward()`` or touch an optimizer (the learner owns the backward pass and the caller owns the step).

Conventions (shared with ``batching``): every per-token tensor is ``[B, L]`` and aligned with
``input_ids``: position ``t`` holds the quantity of token ``input_ids[:, t]`` (its log-prob given the
tokens before it, its advantage, whether it is a completion token). Position 0 therefore never carries a
completion token. ``mask`` is 1 on completion tokens only (prompt and padding are 0).

The objective, per completion token ``t`` of sequence ``i`` with advantage ``A_i``::

    r_t      = exp(logp_t - behaviour_logp_t)            # current policy / the policy that sampled it
    obj_t    = min(r_t * A_i, clip(r_t, 1 - clip_low, 1 + clip_high) * A_i)
    loss_t   = -obj_t + kl_beta * k3_t                   # k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

The ratio is taken against the behaviour log-probs that came with the rollout (PPO-style decoupling of
the sampler from the learner). With ``tis_cap = c`` the ratio is additionally truncated *on top of* the
clip: ``r_t`` is replaced by a value ``min(r_t, c)`` whose gradient is ``min(r_t, c) * grad(logp_t)`` (a
detached truncation factor); it bounds the one branch the clip leaves open, ``A < 0`` with a large ratio.

``objective="decoupled"`` (decoupled PPO, as in AReaL, arXiv 2505.24298) separates the two roles that
``r_t`` plays above: the *trust region* is taken against a proximal policy (the trainer's own policy before
this update, ``proximal_logprobs``; by default this very policy, detached, which is exact for a learner
that takes one optimizer step per batch), and the *off-policy correction* is a detached per-token weight
from the proximal policy to the sampler's::

    r_t   = exp(logp_t - prox_t)                          # 1 in value when prox is this policy
    w_t   = cap(exp(prox_t - behaviour_logp_t))           # detached
    obj_t = w_t * min(r_t * A_i, clip(r_t, 1 - clip_low, 1 + clip_high) * A_i)

``behaviour_weight`` says how ``w_t`` is bounded by ``behaviour_cap``: ``"truncate"`` (min(w, cap)),
``"mask"`` (0 above the cap: AReaL's choice) or ``"off"`` (w = 1: the sampler's log-probs are not used,
the batch is treated as on-policy). Under ``"ppo"`` a token sampled by a quantised or stale sampler whose
ratio left the clip range teaches nothing (its gradient is cut); under ``"decoupled"`` it still teaches,
weighted by how likely the trainer's policy finds it (``benchmarks/objectives.py`` measures both).

Loss aggregation (``agg``):
- ``"token_mean"`` (default, DAPO): sum of token losses over the batch / number of completion tokens in
  the batch. Every token weighs the same, so long completions are not under-weighted.
- ``"seq_mean"`` (original GRPO): mean over each completion's tokens, then mean over completions.
For gradient accumulation, pass ``normalizer`` = the count of the *full* batch (tokens for
``token_mean``, sequences for ``seq_mean``): the micro-batch losses then sum to the full-batch loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from echo_p2p.train.config import BehaviourWeight, LossAggregation, Objective


def group_advantages(rewards: Sequence[float], scale_rewards: bool = True, eps: float = 1e-6) -> list[float]:
    """Advantages of one group: ``(r - mean) / (std + eps)``, or ``r - mean`` when ``scale_rewards`` is False.

    ``std`` is the population standard deviation of the group (``ddof=0``): a group of rewards ``[0, 1]``
    gets advantages ``[-1, 1]`` (up to ``eps``). ``scale_rewards=False`` is the Dr. GRPO variant (no
    per-group std scaling, which otherwise up-weights groups whose rewards barely differ). A group whose
    rewards are all equal gets exact zeros (no NaN): it carries no learning signal.
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = math.fsum(rewards) / n
    centred = [float(r) - mean for r in rewards]
    if max(abs(c) for c in centred) <= 1e-12 * max(1.0, abs(mean)):
        return [0.0] * n
    if not scale_rewards:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / n)
    return [c / (std + eps) for c in centred]


#: Rows of logits handled at once by ``token_logprobs``' forward and backward: bounds their float32
#: temporaries to about ``_CHUNK_ELEMENTS`` elements (16 MiB) whatever the batch; a small vocabulary
#: (the tiny model) takes its whole batch in one chunk.
_CHUNK_ELEMENTS = 1 << 22


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Log-prob of each token of ``input_ids`` under the sampling distribution of the position before:
    ``softmax(filter(logits / temperature))``, where ``filter`` keeps the ``top_k`` largest values (0: all),
    then the smallest set of the most likely ones whose probability reaches ``top_p`` (1: all), as the
    engines sample (``ml.engine.process_logits``).

    :param logits: ``[B, K, V]`` causal-LM logits of the **last** ``K`` positions of ``input_ids``
        (``K = L``: all of them, the usual case; a model called with ``logits_to_keep=K`` gives fewer).
        ``logits[:, j]`` is position ``L - K + j``, which predicts token ``L - K + j + 1``.
    :param input_ids: ``[B, L]``
    :param temperature: must equal the sampling temperature, since the behaviour log-probs were computed
        on ``softmax(logits / temperature)``; otherwise every ratio is off even for on-policy data.
    :param top_k: must equal the sampling top-k (0 = off), and ``top_p`` the sampling top-p (1 = off), for
        the same reason: with top-p 0.7 and the full softmax, on-policy ratios averaged 0.71 and half the
        tokens were clipped. The token itself is always kept in the set, so that a token the sampler kept
        but the trainer's (slightly different, or newer) logits would not gets a finite log-prob.
    :returns: ``[B, L]`` float32, aligned with ``input_ids``; column 0 (no previous position) and the
        columns that no given logits predict (``t <= L - K``) are 0.

    Computed in float32 as ``logit[token] - logsumexp(logits)``, by chunks of rows, with a hand-written
    backward (``(onehot - softmax) / temperature``): the only full-vocabulary tensors alive are the
    logits themselves (kept for the backward) and, during the backward, their gradient. Autograd through
    ``logsumexp`` and ``gather`` held up to four logits-sized tensors at once.
    With a filter, the kept set is taken as fixed (it is piecewise constant in the logits): the gradient
    flows through the kept logits only. Other logits processors (repetition penalty, ...) are not
    supported: rollouts say how they were sampled and the trainer refuses other settings.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (greedy decoding has no log-probs to learn from)")
    batch, length = input_ids.shape
    kept = logits.shape[1]
    if logits.dim() != 3 or logits.shape[0] != batch or not 1 <= kept <= length:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not cover the last positions of {batch}x{length} ids"
        )
    # Position j of ``logits`` predicts token L - K + j + 1; the last position predicts nothing (its
    # target is a placeholder whose log-prob is dropped, so its gradient is 0).
    targets = torch.zeros((batch, kept), dtype=torch.long, device=input_ids.device)
    targets[:, :-1] = input_ids[:, length - kept + 1 :]
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {top_k}, {top_p}")
    logp = _TokenLogProbs.apply(logits, targets, float(temperature), int(top_k), float(top_p))[:, :-1]
    return torch.nn.functional.pad(logp, (length - kept + 1, 0), value=0.0)


class _TokenLogProbs(torch.autograd.Function):
    """``log_softmax(filter(logits / T))`` at ``targets``, chunked over rows; saves the logits, the
    log-normaliser and, with a filter, each row's cut-off (the smallest value kept)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)  # a view for a contiguous model output
        flat_targets = targets.reshape(-1, 1)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        out = torch.empty_like(lse)
        filtering = 0 < top_k < vocab or top_p < 1.0
        cut = torch.empty_like(lse) if filtering else lse.new_empty(0)
        for rows in _row_chunks(flat.shape[0], vocab):
            scaled = _scaled(flat[rows], temperature)
            if filtering:
                cut[rows] = _cutoff(scaled, top_k, top_p)
                scaled = _filtered(scaled, cut[rows], flat_targets[rows])
            lse[rows] = torch.logsumexp(scaled, dim=-1)
            out[rows] = scaled.gather(1, flat_targets[rows]).squeeze(1) - lse[rows]
        ctx.save_for_backward(logits, targets, lse, cut)
        ctx.temperature, ctx.filtering = temperature, filtering
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        logits, targets, lse, cut = ctx.saved_tensors
        temperature = ctx.temperature
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        flat_targets = targets.reshape(-1, 1)
        g = grad_out.reshape(-1, 1).to(torch.float32)
        grad = torch.empty(flat.shape, dtype=logits.dtype, device=logits.device)
        in_place = grad.dtype == torch.float32
        for rows in _row_chunks(flat.shape[0], vocab):
            # d logp / d logits = (onehot(target) - softmax(filter(logits / T))) / T, times the incoming
            # gradient; a filtered-out logit has probability 0 (exp(-inf)) and gets no gradient
            chunk = grad[rows] if in_place else torch.empty(flat[rows].shape, device=grad.device)
            scaled = _scaled(flat[rows], temperature)
            if ctx.filtering:
                scaled = _filtered(scaled, cut[rows], flat_targets[rows])
            torch.sub(scaled, lse[rows].unsqueeze(1), out=chunk)
            chunk.exp_().mul_(-g[rows])
            chunk.scatter_add_(1, flat_targets[rows], g[rows])
            if temperature != 1.0:
                chunk.div_(temperature)
            if not in_place:
                grad[rows] = chunk
        return grad.view(logits.shape), None, None, None, None


def _cutoff(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Per row of ``scaled`` [n, V], the smallest value the filter keeps: the ``top_k``-th largest (0: all),
    then among those the last of the most likely ones whose mass before it is below ``top_p``."""
    if 0 < top_k < scaled.shape[-1]:
        ranked = torch.topk(scaled, top_k, dim=-1).values  # sorted, largest first
    else:
        ranked = torch.sort(scaled, dim=-1, descending=True).values
    if top_p >= 1.0:
        return ranked[:, -1]
    probs = torch.softmax(ranked, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # of the strictly more likely ones: 0 for the top value
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
    return ranked.gather(1, kept - 1).squeeze(1)


def _filtered(scaled: torch.Tensor, cut: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``scaled`` with the values below each row's ``cut`` at -inf, except each row's target."""
    keep = scaled >= cut.unsqueeze(1)
    keep.scatter_(1, targets, True)
    return scaled.masked_fill(~keep, float("-inf"))


def _row_chunks(num_rows: int, vocab: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """``chunk / temperature`` in float32 (no copy when it already is float32 and T = 1)."""
    chunk = chunk.float()
    return chunk / temperature if temperature != 1.0 else chunk


#: The ratio reported in the stats saturates at e^30 (a report of a poisoned log-prob stays finite JSON).
_STATS_LOG_RATIO_MAX = 30.0


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tis_cap: float | None = None,
    ratio_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    agg: LossAggregation = "token_mean",
    normalizer: float | None = None,
    objective: Objective = "ppo",
    proximal_logprobs: torch.Tensor | None = None,
    behaviour_cap: float = 2.0,
    behaviour_weight: BehaviourWeight = "truncate",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO loss over one (micro-)batch; see the module docstring for the formulas.

    :param logprobs: ``[B, L]`` current-policy log-probs (with grad), from ``token_logprobs``
    :param behaviour_logprobs: ``[B, L]`` log-probs reported by the sampler; ignored where ``mask`` is 0
    :param advantages: ``[B, L]`` (per token) or ``[B]`` (per sequence, broadcast over tokens)
    :param mask: ``[B, L]`` 1 on completion tokens, 0 on prompt and padding
    :param tis_cap: optional truncation of the ratio on top of the clip (async mode), e.g. 2.0
    :param ratio_cap: hard bound on the ratio that enters the objective (dual clip): above it a token's
        loss is ``ratio_cap * |A|`` and its gradient 0, so no behaviour log-prob a sampler reports can make
        the loss or the gradient unbounded (a stranger's -1e30 made them NaN). None: unbounded.
    :param ref_logprobs: ``[B, L]`` reference-policy log-probs, needed when ``kl_beta > 0``
    :param agg: ``"token_mean"`` or ``"seq_mean"``
    :param normalizer: divide by this instead of this batch's token count (``token_mean``) or sequence
        count (``seq_mean``); pass the full batch's count when accumulating micro-batches
    :param objective: ``"ppo"`` (clip against the behaviour log-probs) or ``"decoupled"`` (clip against
        the proximal policy, behaviour mismatch as a capped detached weight); see the module docstring
    :param proximal_logprobs: ``[B, L]`` the proximal policy's log-probs (``"decoupled"``); None: this
        policy's, detached (one optimizer step per batch)
    :param behaviour_cap: bound of the behaviour weight (``"decoupled"``), > 0
    :param behaviour_weight: ``"truncate"``, ``"mask"`` or ``"off"`` (``"decoupled"``)
    :returns: ``(loss, stats)``; stats are means over this batch's completion tokens (``*_seq`` ones over
        sequences), with ``num_tokens`` and ``num_sequences`` to weight them when combining micro-batches.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError("clip_low and clip_high must be >= 0")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError("tis_cap must be > 0")
    if ratio_cap is not None and ratio_cap <= 1.0 + clip_high:
        raise ValueError("ratio_cap must be > 1 + clip_high")
    if kl_beta != 0.0 and ref_logprobs is None:
        raise ValueError("kl_beta != 0 needs ref_logprobs")
    if agg not in ("token_mean", "seq_mean"):
        raise ValueError(f"unknown loss aggregation {agg!r}")
    if objective not in ("ppo", "decoupled") or behaviour_weight not in ("truncate", "mask", "off"):
        raise ValueError(f"unknown objective {objective!r} / behaviour weight {behaviour_weight!r}")
    if behaviour_cap <= 0:
        raise ValueError("behaviour_cap must be > 0")
    maskb = mask.bool()
    maskf = maskb.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    advantages = advantages.to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    # Masked positions get log-ratio 0 (ratio 1) so that garbage there can never make inf/NaN.
    log_ratio = torch.where(maskb, logprobs - behaviour_logprobs.to(logprobs.dtype), zero)
    ratio = torch.exp(log_ratio.clamp(max=_STATS_LOG_RATIO_MAX))  # for the stats only: finite
    weight = log_weight = None
    if objective == "decoupled":
        # the trust region against the proximal policy, the sampler's mismatch as a detached weight
        prox = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.to(logprobs.dtype)
        log_ratio_objective = torch.where(maskb, logprobs - prox, zero)
        log_weight = torch.where(maskb, prox - behaviour_logprobs.to(logprobs.dtype), zero).detach()
        truncated = torch.exp(log_weight.clamp(max=math.log(behaviour_cap)))
        if behaviour_weight == "off":
            weight = torch.ones_like(log_weight)
        elif behaviour_weight == "truncate":
            weight = truncated
        else:  # "mask": AReaL's choice, a token above the cap is left out
            weight = torch.where(log_weight <= math.log(behaviour_cap), truncated, zero)
    else:
        log_ratio_objective = log_ratio
    # the ratio the objective sees: hard-bounded first (value and gradient stop at ratio_cap), under
    # "decoupled" too, whose proximal policy may be interpolated from a lying sampler's log-probs
    log_ratio_used = (
        log_ratio_objective.clamp(max=math.log(ratio_cap)) if ratio_cap is not None else log_ratio_objective
    )
    if tis_cap is not None and objective == "ppo":
        # value min(r, cap), gradient min(r, cap) * grad(logp): a detached truncation factor
        excess = (log_ratio_used - math.log(tis_cap)).clamp(min=0.0).detach()
        ratio_used = torch.exp(log_ratio_used - excess)
    else:
        ratio_used = torch.exp(log_ratio_used)
    clipped = ratio_used.clamp(1.0 - clip_low, 1.0 + clip_high)
    obj = torch.minimum(ratio_used * advantages, clipped * advantages)
    if weight is not None:
        obj = weight * obj
    token_loss = -obj

    kl = None
    if ref_logprobs is not None:
        d = torch.where(maskb, ref_logprobs.to(logprobs.dtype) - logprobs, zero)
        kl = torch.exp(d) - d - 1.0  # k3 estimator of KL(pi || ref): >= 0, unbiased, 0 when pi == ref
        if kl_beta != 0.0:
            token_loss = token_loss + kl_beta * kl

    token_loss = token_loss * maskf
    tokens_per_seq = maskf.sum(dim=1)
    num_tokens = float(tokens_per_seq.sum())
    num_seqs = logprobs.shape[0]
    if agg == "token_mean":
        total = token_loss.sum()
        default_norm = max(num_tokens, 1.0)
    else:
        total = (token_loss.sum(dim=1) / tokens_per_seq.clamp(min=1.0)).sum()
        default_norm = max(float(num_seqs), 1.0)
    loss = total / (normalizer if normalizer is not None else default_norm)

    with torch.no_grad():
        denom = max(num_tokens, 1.0)

        def tmean(x: torch.Tensor) -> float:
            return float((x * maskf).sum() / denom)

        clipped_high = (ratio_used > 1.0 + clip_high) & (advantages > 0)
        clipped_low = (ratio_used < 1.0 - clip_low) & (advantages < 0)
        stats: dict[str, float] = {
            "num_tokens": num_tokens,
            "num_sequences": float(num_seqs),
            "clip_frac": tmean((clipped_high | clipped_low).to(maskf.dtype)),
            "clip_frac_high": tmean(clipped_high.to(maskf.dtype)),
            "clip_frac_low": tmean(clipped_low.to(maskf.dtype)),
            "ratio_mean": tmean(ratio),
            # how far the sampler is from this policy, whatever the objective: tokens whose ratio to the
            # behaviour log-prob lies outside the clip range
            "behaviour_outside_clip_frac": tmean(
                ((ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low)).to(maskf.dtype)
            ),
            "ratio_max": float(torch.where(maskb, ratio, zero).max()) if num_tokens else 1.0,
            # k1 estimate of KL(behaviour || current) on the sampled tokens: how off-policy the batch is
            "behaviour_kl": tmean(-log_ratio),
            "advantage_mean": tmean(advantages),
            "advantage_abs_mean": tmean(advantages.abs()),
            "completion_len_mean_seq": float(tokens_per_seq.mean()) if num_seqs else 0.0,
        }
        if tis_cap is not None:
            stats["tis_capped_frac"] = tmean((ratio > tis_cap).to(maskf.dtype))
        if weight is not None and log_weight is not None:
            stats["behaviour_capped_frac"] = tmean((log_weight > math.log(behaviour_cap)).to(maskf.dtype))
            stats["behaviour_weight_mean"] = tmean(weight)
        if ratio_cap is not None:
            stats["ratio_capped_frac"] = tmean((log_ratio_objective > math.log(ratio_cap)).to(maskf.dtype))
        if kl is not None:
            stats["kl"] = tmean(kl)
    return loss, stats
