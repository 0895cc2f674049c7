"""The learner: owns the policy model and turns scored rollout groups into GRPO gradients.

Owned here: ``Learner`` (its settings: ``train.config``'s ``GRPOConfig`` and ``DerivedSettings``), which builds
the batch, runs forward/backward over micro-batches with gradient accumulation and clips the gradient
norm; with ``sampling_check`` it also scores each completion's tokens as samples of the policy from the
same logits and leaves the unlikely ones out (``guard.sampling_check``). Micro-batches are bounded by rows,
by padded tokens and by a memory budget that ``memory`` turns into tokens from the model's config; a transformers model computes logits only for the positions that
predict completion tokens (``logits_to_keep``), not for the whole prompt. Called by the trainer peer with groups drawn from ``buffer.ReplayBuffer``. Must not import hivemind
or know about the network: the optimizer (a plain torch optimizer or ``hivemind.Optimizer``) is owned by
the caller, which either calls ``optimizer.step()`` itself after ``compute_gradients`` or hands it to
``step``. Works with any module whose ``model(input_ids, attention_mask=...)`` returns ``.logits``
(a transformers causal LM) or a logits tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch

from echo_p2p.guard.sampling_check import (
    CompletionScore,
    SamplingCheckConfig,
    completion_scores,
    p_values,
)
from echo_p2p.train.batching import Batch, build_batch, split_micro_batches
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.draw_check import BatchReplay, DrawCheck, Replay
from echo_p2p.train.forward import forward_logits, forward_rows, rounded_weights
from echo_p2p.train.grpo import grpo_loss, token_logprobs
from echo_p2p.train.memory import memory_token_limit
from echo_p2p.train.past_weights import PastWeights
from echo_p2p.train.repeat_check import BatchRepeats
from echo_p2p.train.scored import ScoredGroup


def _positions_to_keep(mb: Batch) -> int:
    """Logit positions that predict completion tokens: from the one before the earliest completion token
    of the micro-batch to the end (position ``t - 1`` predicts token ``t``)."""
    width = mb.input_ids.shape[1]
    has_completion = mb.completion_mask.bool().any(dim=1)
    if not bool(has_completion.any()):
        return 1
    first = int(mb.completion_mask[has_completion].argmax(dim=1).min())
    return width - first + 1


class Learner:
    """Owns ``model`` (and an optional frozen ``ref_model`` for the KL term) and computes GRPO gradients.

    ``compute_gradients`` leaves the accumulated, clipped gradient in ``model``'s ``.grad`` and does not
    step; ``step`` does both with a given optimizer. The model's train/eval mode is left as it is: use a
    model without dropout (or in eval mode), otherwise the ratios against the behaviour log-probs are noisy.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: GRPOConfig,
        ref_model: torch.nn.Module | None = None,
        derived: DerivedSettings | None = None,
        sampling_check: SamplingCheckConfig | None = None,
    ) -> None:
        if config.kl_beta > 0 and ref_model is None:
            raise ValueError("kl_beta > 0 needs a ref_model")
        self.model = model
        self.config = config
        #: what the loss takes from the run and the peer (sampling, padding, precision, log-prob gap)
        self.derived = derived or DerivedSettings()
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
        self.max_tokens_per_micro_batch = self.token_limit(model, config)
        #: per group of the last ``compute_gradients``: the mean |log-prob gap| per token between the
        #: sampler's behaviour log-probs and this policy, over the group's tokens (``_check_behaviour``)
        self.last_group_gaps: list[float] = []
        #: a few sequences of the last batch and their log-probs before its update (``measure_drift``)
        self._probe: tuple[Any, ...] | None = None
        #: whether each completion is a sample of the policy (``guard.sampling_check``); None: not tested
        self.sampling_check = (
            sampling_check if sampling_check is not None and sampling_check.enabled else None
        )
        self._pit_rng = torch.Generator().manual_seed(secrets.randbits(63))
        #: per group of the last ``compute_gradients``: its completions' scores (empty when not tested)
        self.last_sample_scores: list[list[CompletionScore]] = []
        #: per group of the last ``compute_gradients``: the log of its duplicate e-value (None: not tested)
        self.last_group_repeats: list[float | None] = []
        #: the order a group's completions are taken in by the duplicate test
        self._repeat_order = random.Random(secrets.randbits(64))
        #: the weights of the last versions trained, to score stale groups under the version they claim
        #: (``SamplingCheckConfig.stale_versions``); None when the check is off
        self.past = (
            PastWeights(model, self.sampling_check.stale_versions, self.sampling_check.stale_versions_mb)
            if self.sampling_check is not None
            else None
        )
        #: replays seeded groups' draws (``train.draw_check``); None when the check is off
        self.draws = (
            DrawCheck(self.sampling_check, self.derived)
            if self.sampling_check is not None and self.sampling_check.seed_check_share > 0
            else None
        )
        #: per group of the last ``compute_gradients``: the replay of its seeded draws (``Replay.missed``: its
        #: completions that are not the draws of its seed; None: none replayed)
        self.last_group_draw_misses: list[Replay | None] = []

    @staticmethod
    def token_limit(model: torch.nn.Module, config: GRPOConfig) -> int | None:
        """Padded tokens per micro-batch: the smaller of ``max_tokens_per_micro_batch`` and what
        ``micro_batch_memory_mb`` allows for ``model`` (``memory.memory_token_limit`` of its config);
        None when neither is set. A model without a config (a plain module) gets no memory-derived limit."""
        limits = [config.max_tokens_per_micro_batch]
        model_config = getattr(model, "config", None)
        if config.micro_batch_memory_mb is not None and getattr(model_config, "vocab_size", None):
            limits.append(memory_token_limit(model_config, config.micro_batch_memory_mb))
        given = [limit for limit in limits if limit is not None]
        return min(given) if given else None

    def policy_weights(self) -> contextlib.AbstractContextManager[None]:
        """``rounded_weights`` of the model at ``policy_precision``: the weights the loss sees."""
        return rounded_weights(self.model, self.derived.policy_precision)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def build_batch(self, groups: Sequence[ScoredGroup]) -> Batch:
        cfg = self.config
        return build_batch(
            groups, pad_token_id=self.derived.pad_token_id, scale_rewards=cfg.scale_rewards, eps=cfg.adv_eps
        )

    def compute_gradients(
        self,
        groups: Sequence[ScoredGroup],
        zero_grad: bool = True,
        gap_allowance: Sequence[float | None] | None = None,
        current_version: int | None = None,
    ) -> dict[str, float]:
        """Accumulate the GRPO gradient of ``groups`` into the model's ``.grad`` and clip its norm.

        Each micro-batch loss is divided by the full batch's normaliser (its completion-token count for
        ``token_mean``, its sequence count for ``seq_mean``), so the accumulated gradient equals the
        gradient of the loss over the whole batch at once. ``zero_grad=False`` adds to existing gradients
        (e.g. ``hivemind.Optimizer`` with ``reuse_grad_buffers=True``, which must own the zeroing).
        Returns stats: ``loss``, ``grad_norm`` (before clipping), reward and advantage summaries and the
        token-weighted means of ``grpo_loss``'s stats. A non-finite loss or gradient norm leaves zero gradients
        (every ``.grad`` zeroed) and ``nonfinite`` = 1: the caller must not step. ``excluded_sequences``:
        completions left out for their log-prob gap; ``excluded_not_sampled``: for not looking sampled
        (``sampling_check``, with the same allowance; their scores are in ``last_sample_scores``).

        ``gap_allowance`` (one per group): how far the policy moved since the group was sampled
        (``guard.drift``), added to ``max_logprob_gap`` for its completions; None for a group: unknown, none
        of its completions is left out.

        ``current_version``: the policy version being trained (the rows' staleness is measured from it), for
        ``proximal="previous_version"``; None: the proximal policy is this one.
        """
        cfg, run = self.config, self.derived
        t0 = time.perf_counter()
        if zero_grad:
            self.model.zero_grad(set_to_none=True)
        batch = self.build_batch(groups)
        micro = split_micro_batches(batch, cfg.micro_batch_size, self.max_tokens_per_micro_batch)
        normalizer = float(max(batch.num_tokens if cfg.loss_agg == "token_mean" else batch.num_sequences, 1))
        device = self.device

        total_loss = 0.0
        parts: list[dict[str, float]] = []
        gaps: dict[int, tuple[float, float]] = {}  # group index -> (sum of |log-prob gaps|, tokens)
        excluded = 0  # completions left out of the loss for their log-prob gap
        allowance = _allowance_tensor(gap_allowance, len(groups))
        self._probe = None
        group_scores: list[list[CompletionScore]] = [[] for _ in groups]
        not_sampled = 0  # completions left out of the loss as unlikely samples of the policy
        if self.past is not None:
            self.past.record(current_version)
        check = self.sampling_check
        evidence = BatchRepeats(
            check,
            groups,
            micro,
            gap_allowance,
            current_version,
            self.past,
            run,
            self._repeat_order,
        )
        repeats = evidence.evidence
        replay = self._draw_replay(groups, micro, current_version, set(evidence.ahead))
        self._score_ahead(groups, evidence, replay)
        draw_misses = replay.misses if replay is not None else [None] * len(groups)
        bound = math.log(check.duplicate_exclude_e) if check is not None else 0.0

        def left_out() -> tuple[torch.Tensor, torch.Tensor]:
            """Groups whose completions repeat far more than samples would, and groups one of whose completions
            is not the draw of its seed (and do not repeat): left out whole (their advantages were normalised
            with those completions in). Complete for a group once its micro-batch's forward pass is done."""
            repeat = torch.tensor([r is not None and r >= bound for r in repeats], dtype=torch.bool)
            undrawn = torch.tensor([bool(m and m.missed) for m in draw_misses], dtype=torch.bool) & ~repeat
            return repeat, undrawn

        repeat_groups, undrawn_groups = left_out()
        dropped_groups = repeat_groups | undrawn_groups
        repeated = 0  # completions left out of the loss with their group for its repeats
        not_drawn = 0  # completions left out with their group for a completion that is not its seed's draw
        with self.policy_weights():
            for mb in micro:
                mb = mb.to(device)
                keep = _positions_to_keep(mb)
                logits = forward_logits(self.model, mb.input_ids, mb.attention_mask, keep)
                logp = token_logprobs(logits, mb.input_ids, run.temperature, run.top_k, run.top_p)
                scores = self._score_samples(logits, mb)
                replayed = replay is not None and replay.from_logits(mb, logits)
                if evidence.from_logprobs(mb, logp) or replayed:
                    repeat_groups, undrawn_groups = left_out()
                    dropped_groups = repeat_groups | undrawn_groups
                del logits
                if self._probe is None:
                    self._probe = self._take_probe(mb, logp, keep)
                completion_mask = self._check_behaviour(logp, mb, gaps, allowance)
                excluded += int((mb.completion_mask.sum(1) > completion_mask.sum(1)).sum())
                if scores is not None:
                    for index, score in zip(mb.group_index.tolist(), scores, strict=True):
                        group_scores[index].append(score)
                    completion_mask, dropped = self._exclude_unsampled(completion_mask, mb, scores, allowance)
                    not_sampled += dropped
                if bool(dropped_groups.any()):
                    rows = mb.group_index.cpu()
                    live = (completion_mask.sum(1) > 0).cpu()
                    repeated += int((repeat_groups[rows] & live).sum())
                    not_drawn += int((undrawn_groups[rows] & live).sum())
                    gone = dropped_groups[rows].to(completion_mask.device)
                    completion_mask = completion_mask * (~gone).to(completion_mask.dtype).unsqueeze(1)
                proximal = self._proximal(logp, mb, current_version)
                ref_logp = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_logits = forward_logits(self.ref_model, mb.input_ids, mb.attention_mask, keep)
                        ref_logp = token_logprobs(
                            ref_logits, mb.input_ids, run.temperature, run.top_k, run.top_p
                        )
                        del ref_logits
                loss, mb_stats = grpo_loss(
                    logp,
                    mb.behaviour_logprobs,
                    mb.advantages,
                    completion_mask,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    tis_cap=cfg.tis_cap,
                    ratio_cap=cfg.ratio_cap,
                    ref_logprobs=ref_logp,
                    kl_beta=cfg.kl_beta,
                    agg=cfg.loss_agg,
                    normalizer=normalizer,
                    objective=cfg.objective,
                    proximal_logprobs=proximal,
                    behaviour_cap=cfg.behaviour_cap,
                    behaviour_weight=cfg.behaviour_weight,
                )
                if loss.requires_grad:
                    loss.backward()
                total_loss += float(loss.detach())
                parts.append(mb_stats)

        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = 0.0
        nonfinite = not math.isfinite(total_loss)
        if params and not nonfinite:
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            nonfinite = not math.isfinite(grad_norm)
        if nonfinite:
            # never hand NaN/inf to an optimizer: this batch's gradient is dropped (and, when gradients are
            # accumulated across calls, the running sum it poisoned with it)
            for p in params:
                p.grad.zero_()

        stats = _combine(parts)
        stats.update(
            loss=total_loss,
            grad_norm=grad_norm,
            num_groups=float(len(groups)),
            num_micro_batches=float(len(micro)),
            max_micro_batch_tokens=float(max((m.input_ids.numel() for m in micro), default=0)),
            reward_mean=float(batch.rewards.mean()) if batch.num_sequences else 0.0,
            reward_std=float(batch.rewards.std(unbiased=False)) if batch.num_sequences else 0.0,
            frac_zero_adv_groups=_frac_zero_adv_groups(batch, len(groups)),
            compute_s=time.perf_counter() - t0,
            nonfinite=float(nonfinite),
            excluded_sequences=float(excluded),
            excluded_not_sampled=float(not_sampled),
            excluded_repeated=float(repeated),
            excluded_not_drawn=float(not_drawn),
        )
        self.last_sample_scores = group_scores if self.sampling_check is not None else []
        self.last_group_repeats = repeats
        self.last_group_draw_misses = draw_misses
        self.last_group_gaps = [
            g / max(n, 1.0) for g, n in (gaps.get(i, (0.0, 0.0)) for i in range(len(groups)))
        ]
        stats["logprob_gap_max"] = max(self.last_group_gaps, default=0.0)
        return stats

    def _score_samples(self, logits: torch.Tensor, mb: Batch) -> list[CompletionScore] | None:
        """Each row's completion tokens against the sampling distribution (``guard.sampling_check``), from the
        logits of the loss; None when the check is off."""
        if self.sampling_check is None:
            return None
        return completion_scores(
            logits, mb.input_ids, mb.completion_mask, self.derived.temperature, self._pit_rng
        )

    def exact_scores(self, scored: ScoredGroup, current_version: int | None) -> list[CompletionScore] | None:
        """``scored``'s completion scores under the kept weights of the version it claims (each
        ``CompletionScore.exact``: the policy's drift since then has nothing to forgive), or None when the
        group is not stale or that version's weights are not kept (too old, or a model too large to keep
        versions of: ``SamplingCheckConfig.stale_versions``). A forward pass without gradient; the sender
        guard asks for it only where the tail test would strike a stale group
        (``SampleDetector.observe_group``)."""
        version = scored.policy_version
        if (
            self.past is None
            or current_version is None
            or version >= current_version
            or version not in self.past
        ):
            return None
        out: list[CompletionScore] = []
        model = self.past.model_at(version)
        batch = self.build_batch([scored])
        with torch.no_grad(), rounded_weights(model, self.derived.policy_precision):
            for mb in split_micro_batches(
                batch, self.config.micro_batch_size, self.max_tokens_per_micro_batch
            ):
                mb = mb.to(self.device)
                logits = forward_logits(model, mb.input_ids, mb.attention_mask, _positions_to_keep(mb))
                scores = completion_scores(
                    logits, mb.input_ids, mb.completion_mask, self.derived.temperature, self._pit_rng
                )
                del logits
                out += [dataclasses.replace(score, exact=True) for score in scores]
        return out

    def _draw_replay(
        self,
        groups: Sequence[ScoredGroup],
        micro: list[Batch],
        current_version: int | None,
        passes: set[int | None],
    ) -> BatchReplay | None:
        """The replay of the groups' seeded draws (``train.draw_check``), under the weights of the version each
        claims: kept ones, or the policy's own (from the loss's logits) for the version being trained.
        ``passes``: the weights the duplicate test scores rows under ahead of the loss (None: the policy's)."""
        if self.draws is None:
            return None

        def at_hand(version: int) -> bool:
            held = self.past is not None and version in self.past
            return current_version is None or version == current_version or held

        # the versions those passes hold: a kept version's, or the one being trained for the policy's
        free = frozenset(current_version if key is None else key for key in passes) - {None}
        return BatchReplay(self.draws, groups, micro, current_version, at_hand, free)

    def _score_ahead(
        self, groups: Sequence[ScoredGroup], evidence: BatchRepeats, replay: BatchReplay | None
    ) -> None:
        """The rows the duplicate test and the replay of seeded draws score ahead of the loss, one pass per
        weights for both (``forward.forward_rows``): the policy's, or a version's kept weights. The replay's
        seconds take its rows' share of each pass."""
        draws_ahead = replay.ahead if replay is not None else {}
        for key in sorted(set(evidence.ahead) | set(draws_ahead), key=lambda k: -1 if k is None else k):
            repeat_rows, draw_rows = evidence.ahead.get(key, []), draws_ahead.get(key, [])
            assert key is None or self.past is not None  # a version's rows: only where its weights are kept
            model = self.model if key is None else self.past.model_at(key)
            readers = [evidence.reader(repeat_rows, 0)]
            if replay is not None:
                readers.append(replay.check.reader(groups, draw_rows, len(repeat_rows), replay.misses))
            started = time.perf_counter()
            forward_rows(
                model,
                [(groups[g].group.prompt_token_ids, ids) for g, ids in repeat_rows]
                + DrawCheck.sequences(groups, draw_rows),
                self.derived.pad_token_id,
                self.derived.policy_precision,
                readers,
            )
            if replay is not None and draw_rows:
                share = len(draw_rows) / (len(draw_rows) + len(repeat_rows))
                replay.check.seconds += (time.perf_counter() - started) * share
        evidence.finish_ahead()

    def _exclude_unsampled(
        self, mask: torch.Tensor, mb: Batch, scores: list[CompletionScore], allowance: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """``mask`` with the rows whose score's p-value, forgiven ``drift_allowance`` times their group's
        ``allowance`` (the policy's drift since its version) per token, is below ``exclude_p_value`` zeroed,
        and how many (a group whose allowance is unknown keeps all)."""
        assert self.sampling_check is not None
        rows = mb.group_index.cpu()
        factor = self.sampling_check.drift_allowance
        given = [0.0] * len(scores) if allowance is None else (allowance[rows] * factor).tolist()
        known = [math.isfinite(a) for a in given]
        floor = self.sampling_check.exclude_p_value
        pvals = p_values(scores, [a if ok else 0.0 for a, ok in zip(given, known, strict=True)])
        keep = [not ok or p >= floor for p, ok in zip(pvals, known, strict=True)]
        if all(keep):
            return mask, 0
        return mask * torch.tensor(keep, dtype=mask.dtype, device=mask.device).unsqueeze(1), keep.count(False)

    def _proximal(self, logp: torch.Tensor, mb: Batch, current_version: int | None) -> torch.Tensor | None:
        """The proximal log-probs of ``proximal="previous_version"``: for a row sampled ``k >= 1`` versions
        ago, ``behaviour + (k - 1) / k * (logp - behaviour)`` (detached; k = 1: the sampler's own, as PPO), for
        an on-policy row (k = 0) ``logp`` itself. None (this policy) otherwise."""
        cfg = self.config
        if cfg.objective != "decoupled" or cfg.proximal != "previous_version" or current_version is None:
            return None
        with torch.no_grad():
            k = (current_version - mb.policy_versions.to(logp.device)).clamp(min=0).to(logp.dtype)
            alpha = torch.where(k >= 1, (k - 1) / k.clamp(min=1), torch.ones_like(k)).unsqueeze(1)
            behaviour = mb.behaviour_logprobs.to(logp.dtype)
            return behaviour + alpha * (logp.detach() - behaviour)

    def _check_behaviour(
        self,
        logp: torch.Tensor,
        mb: Batch,
        gaps: dict[int, tuple[float, float]],
        allowance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Score the sampler's behaviour log-probs against this policy's: per group, the sum of absolute
        gaps and the token count (``last_group_gaps`` is their ratio, a mean over every token of the group);
        a completion whose own mean gap is above ``max_logprob_gap`` plus its group's ``allowance`` (inf:
        unknown) is left out of the loss (the returned completion mask has it zeroed)."""
        mask = mb.completion_mask
        with torch.no_grad():
            counts = mask.sum(dim=1)
            sums = ((logp.detach() - mb.behaviour_logprobs.to(logp.dtype)).abs() * mask).sum(dim=1)
            for index, total, n in zip(mb.group_index.tolist(), sums.tolist(), counts.tolist(), strict=True):
                before = gaps.get(index, (0.0, 0.0))
                gaps[index] = (before[0] + total, before[1] + n)
            limit = self.derived.max_logprob_gap
            if limit is None:
                return mask
            bound = limit if allowance is None else limit + allowance[mb.group_index.cpu()].to(sums.device)
            keep = (sums <= bound * counts.clamp(min=1)).to(mask.dtype)
        return mask * keep.unsqueeze(1)

    def _take_probe(self, mb: Batch, logp: torch.Tensor, keep: int) -> tuple[Any, ...] | None:
        """Up to ``drift_probe_sequences`` rows of ``mb`` spread over it (several groups), with their
        log-probs before the update, for ``measure_drift``; copies, since a view would keep the whole
        micro-batch alive. None when the probe is off."""
        k = self.config.drift_probe_sequences
        if k <= 0:
            return None
        rows = torch.arange(mb.input_ids.shape[0], device=mb.input_ids.device)
        rows = rows[:: max(1, len(rows) // k)][:k]
        return (
            mb.input_ids[rows],
            mb.attention_mask[rows],
            mb.completion_mask[rows],
            logp.detach()[rows],
            keep,
        )

    def measure_drift(self) -> float | None:
        """How far the last ``compute_gradients`` batch's update moved the policy: the mean |log-prob change|
        per completion token of its first ``drift_probe_sequences`` sequences, re-scored now (one forward
        pass, no gradient). Call once the update is applied; None when nothing was kept to measure."""
        probe, self._probe = self._probe, None
        if probe is None:
            return None
        input_ids, attention_mask, completion_mask, before, keep = probe
        tokens = float(completion_mask.sum())
        if tokens <= 0:
            return None
        with torch.no_grad(), self.policy_weights():
            logits = forward_logits(self.model, input_ids, attention_mask, keep)
            after = token_logprobs(
                logits, input_ids, self.derived.temperature, self.derived.top_k, self.derived.top_p
            )
            del logits
        change = float(((after - before).abs() * completion_mask).sum()) / tokens
        return change if math.isfinite(change) else None

    def step(
        self,
        groups: Sequence[ScoredGroup],
        optimizer: torch.optim.Optimizer | Any,
        current_version: int | None = None,
        **step_kwargs: Any,
    ) -> dict[str, float]:
        """``compute_gradients`` then ``optimizer.step(**step_kwargs)`` (e.g. ``batch_size=`` for
        ``hivemind.Optimizer``), unless the gradient is non-finite (then no step). Gradients are zeroed at the
        start of the next ``compute_gradients``."""
        stats = self.compute_gradients(groups, current_version=current_version)
        if not stats["nonfinite"]:
            optimizer.step(**step_kwargs)
        return stats


def _allowance_tensor(allowance: Sequence[float | None] | None, num_groups: int) -> torch.Tensor | None:
    """Per-group allowances as a tensor (None -> inf: a group whose allowance is unknown keeps all)."""
    if allowance is None:
        return None
    if len(allowance) != num_groups:
        raise ValueError(f"gap_allowance has {len(allowance)} entries for {num_groups} groups")
    return torch.tensor([math.inf if a is None else float(a) for a in allowance], dtype=torch.float32)


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Merge per-micro-batch stats: token-weighted means, ``*_seq`` sequence-weighted, maxima, sums."""
    if not parts:
        return {"num_tokens": 0.0, "num_sequences": 0.0}
    tokens = sum(p["num_tokens"] for p in parts)
    seqs = sum(p["num_sequences"] for p in parts)
    out = {"num_tokens": tokens, "num_sequences": seqs}
    for key in parts[0]:
        if key in out:
            continue
        if key.endswith("_max"):
            out[key] = max(p[key] for p in parts)
        elif key.endswith("_seq"):
            out[key] = sum(p[key] * p["num_sequences"] for p in parts) / max(seqs, 1.0)
        else:
            out[key] = sum(p[key] * p["num_tokens"] for p in parts) / max(tokens, 1.0)
    return out


def _frac_zero_adv_groups(batch: Batch, num_groups: int) -> float:
    """Fraction of groups whose rewards were all equal (zero advantage: no policy-gradient signal)."""
    if num_groups == 0:
        return 0.0
    nonzero = torch.zeros(num_groups).index_add_(0, batch.group_index, (batch.seq_advantages != 0).float())
    return float((nonzero == 0).float().mean())
