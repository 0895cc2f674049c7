"""Scored rollout groups -> padded training tensors, and their split into micro-batches.

Owned here: the ``Batch`` layout that ``grpo.grpo_loss`` and ``learner.Learner`` consume, the per-group
advantage computation (via ``grpo.group_advantages``) and the micro-batch split. Called by the learner
(and tests). Must not import hivemind, run a model or validate untrusted input (the trainer validated
token ranges and lengths before the groups reached the buffer).

Layout: one row per completion, ``prompt + completion``, **right-padded**. Right padding keeps every real
token at position ``0..n-1`` (what the sampler used, since it computes positions from its own attention
mask), so a causal LM needs no explicit ``position_ids``, and real tokens never attend to padding. It also
lets a micro-batch drop its trailing all-padding columns. Every per-token tensor is ``[B, L]`` and aligned
with ``input_ids``: position ``t`` holds data about token ``input_ids[:, t]`` (see ``grpo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from echo_p2p.train.grpo import group_advantages
from echo_p2p.train.scored import ScoredGroup


@dataclass
class Batch:
    """Padded tensors of ``B`` completions (rows) of length ``L``."""

    input_ids: torch.Tensor  # [B, L] long: prompt + completion, then pad_token_id
    attention_mask: torch.Tensor  # [B, L] long: 1 on prompt and completion tokens
    completion_mask: torch.Tensor  # [B, L] float: 1 on completion tokens only
    behaviour_logprobs: torch.Tensor  # [B, L] float: sampler's log-prob of each completion token, else 0
    advantages: torch.Tensor  # [B, L] float: the row's advantage on completion tokens, else 0
    seq_advantages: torch.Tensor  # [B] float: one advantage per completion
    rewards: torch.Tensor  # [B] float: trusted reward of each completion
    policy_versions: torch.Tensor  # [B] long: version that sampled each completion
    group_index: torch.Tensor  # [B] long: index of the row's group in the list given to build_batch

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Completion tokens (the tokens the loss is taken over)."""
        return int(self.completion_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select(self, rows: slice | torch.Tensor) -> Batch:
        """A sub-batch of the given rows, with trailing all-padding columns removed."""
        sub = {f.name: getattr(self, f.name)[rows] for f in fields(self)}
        width = int(sub["attention_mask"].sum(dim=1).max()) if sub["attention_mask"].shape[0] else 0
        for name in ("input_ids", "attention_mask", "completion_mask", "behaviour_logprobs", "advantages"):
            sub[name] = sub[name][:, :width]
        return Batch(**sub)


def build_batch(
    groups: Sequence[ScoredGroup], pad_token_id: int = 0, scale_rewards: bool = True, eps: float = 1e-6
) -> Batch:
    """Flatten scored groups into one right-padded batch; advantages are computed per group.

    Row order is group order, then completion order. Raises ``ValueError`` on an empty prompt (its first
    completion token would have no logits to learn from) or a log-prob list whose length differs from
    its token list.
    """
    ids: list[list[int]] = []
    prompt_lens: list[int] = []
    behaviour: list[list[float]] = []
    seq_adv: list[float] = []
    rewards: list[float] = []
    versions: list[int] = []
    group_idx: list[int] = []
    for gi, scored in enumerate(groups):
        group = scored.group
        prompt = list(group.prompt_token_ids)
        if not prompt:
            raise ValueError(f"group {group.rollout_id}: empty prompt")
        for comp, adv, reward in zip(
            group.completions,
            group_advantages(scored.rewards, scale_rewards, eps),
            scored.rewards,
            strict=True,
        ):
            if len(comp.logprobs) != len(comp.token_ids):
                raise ValueError(
                    f"group {group.rollout_id}: {len(comp.logprobs)} logprobs for "
                    f"{len(comp.token_ids)} tokens"
                )
            ids.append(prompt + list(comp.token_ids))
            prompt_lens.append(len(prompt))
            behaviour.append(list(comp.logprobs))
            seq_adv.append(adv)
            rewards.append(reward)
            versions.append(group.policy_version)
            group_idx.append(gi)

    n = len(ids)
    width = max((len(x) for x in ids), default=0)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.float32)
    behaviour_logprobs = torch.zeros((n, width), dtype=torch.float32)
    advantages = torch.zeros((n, width), dtype=torch.float32)
    for i, (row, p) in enumerate(zip(ids, prompt_lens, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
        completion_mask[i, p : len(row)] = 1.0
        if len(row) > p:
            behaviour_logprobs[i, p : len(row)] = torch.tensor(behaviour[i], dtype=torch.float32)
        advantages[i, p : len(row)] = seq_adv[i]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        seq_advantages=torch.tensor(seq_adv, dtype=torch.float32),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        policy_versions=torch.tensor(versions, dtype=torch.long),
        group_index=torch.tensor(group_idx, dtype=torch.long),
    )


def split_micro_batches(
    batch: Batch, micro_batch_size: int | None = None, max_tokens: int | None = None
) -> list[Batch]:
    """Split rows, in order, into micro-batches of at most ``micro_batch_size`` rows and at most
    ``max_tokens`` padded tokens (rows x the micro-batch's own width: what the forward pass costs).

    Either limit may be None; with both None the batch is returned whole. A single row longer than
    ``max_tokens`` forms a micro-batch of its own. Each micro-batch is trimmed to its own width.
    """
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    n = batch.num_sequences
    if n == 0:
        return []
    lengths = batch.attention_mask.sum(dim=1).tolist()
    bounds: list[tuple[int, int]] = []
    start, width = 0, 0
    for i, length in enumerate(lengths):
        rows = i - start
        new_width = max(width, int(length))
        too_many = micro_batch_size is not None and rows + 1 > micro_batch_size
        too_big = max_tokens is not None and (rows + 1) * new_width > max_tokens
        if rows > 0 and (too_many or too_big):
            bounds.append((start, i))
            start, new_width = i, int(length)
        width = new_width
    bounds.append((start, n))
    return [batch.select(slice(a, b)) for a, b in bounds]


def groups_in_one_micro_batch(micro: Sequence[Batch]) -> set[int]:
    """The groups (``group_index``) whose rows all lie in one of ``micro``: a check that leaves a group out
    of the loss whole can decide from that micro-batch's own forward pass, before its backward."""
    where: dict[int, int] = {}
    split: set[int] = set()
    for m, mb in enumerate(micro):
        for g in set(mb.group_index.tolist()):
            if where.setdefault(g, m) != m:
                split.add(g)
    return set(where) - split
