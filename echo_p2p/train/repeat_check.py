"""The duplicate test's evidence per group: do its completions repeat far more than samples would?

A sampler's completions repeat within a group as often as the policy makes them likely; an editor who sends
one wanted completion several times, or a copier, repeats them beyond that. Per group, the log of an
e-value (``guard.sampling_check.duplicate_log_e``: its completions in a random order, each repeat betting on
its probability raised by the precision, drift and staleness slacks of ``SamplingCheckConfig``) says how
far. Only completions that repeat within their group need their probability (a fresh completion's factor is
``1 - bet`` whatever its probability): the sequence log-probability of one copy of each, under the sampling
distribution (the loss's ``token_logprobs``), of the weights of the version the group claims when the learner
kept them (then with the precision slack only), else of the policy with the drift and staleness slacks.

Where those log-probabilities come from: a group scored under the policy whose rows all lie in one
micro-batch takes them from that micro-batch's loss (``BatchRepeats.from_logprobs``: the same weights and
distribution, no forward of its own); the others (kept weights of an older version, or rows split between
micro-batches: a group left out of the loss is left out whole, so its evidence must be complete before the
first part's backward) from a forward pass without gradient before the loss (``sequence_logprobs``).

Owned here: ``BatchRepeats``, ``sequence_logprobs``. Called by ``train.learner``. Must not import hivemind.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from echo_p2p.guard.sampling_check import duplicate_log_e
from echo_p2p.train.batching import groups_in_one_micro_batch
from echo_p2p.train.forward import forward_logits, rounded_weights
from echo_p2p.train.grpo import token_logprobs

if TYPE_CHECKING:  # pragma: no cover
    from echo_p2p.guard.sampling_check import SamplingCheckConfig
    from echo_p2p.train.batching import Batch
    from echo_p2p.train.config import DerivedSettings
    from echo_p2p.train.past_weights import PastWeights
    from echo_p2p.train.scored import ScoredGroup

Row = tuple[int, tuple[int, ...]]  # (group index, a completion's token ids)


class BatchRepeats:
    """The duplicate evidence of one batch's groups, made while the learner computes its loss.

    ``evidence``: per group, the log of its duplicate e-value, or None when not tested (the check or its
    duplicate test off, or the group's allowance unknown); complete for every group once ``from_logprobs``
    has seen every micro-batch (a group without repeats, or scored ahead, is complete at construction)."""

    def __init__(
        self,
        check: SamplingCheckConfig | None,
        groups: Sequence[ScoredGroup],
        micro: Sequence[Batch],
        allowance: Sequence[float | None] | None,
        current_version: int | None,
        past: PastWeights | None,
        model: torch.nn.Module,
        derived: DerivedSettings,
        order: random.Random,
    ) -> None:
        self.check, self.groups, self.allowance, self.current_version = (
            check,
            groups,
            allowance,
            current_version,
        )
        self.past, self.order = past, order
        self.evidence: list[float | None] = [None] * len(groups)
        self.in_loss: set[int] = set()
        self._logprob: dict[Row, float] = {}
        self._row0 = 0  # the batch row of the next micro-batch's first
        if check is None or check.duplicate_bet <= 0:
            return
        judged = [allowance is None or allowance[i] is not None for i in range(len(groups))]
        repeated: dict[int, list[tuple[int, ...]]] = {}
        for index, scored in enumerate(groups):
            if judged[index]:
                seen: dict[tuple[int, ...], int] = {}
                for comp in scored.group.completions:
                    ids = tuple(comp.token_ids)
                    seen[ids] = seen.get(ids, 0) + 1
                if any(n > 1 for n in seen.values()):
                    repeated[index] = [ids for ids, n in seen.items() if n > 1]
        self.in_loss = {g for g in groups_in_one_micro_batch(micro) & set(repeated) if self._kept(g) is None}
        ahead = [(g, ids) for g, rows in repeated.items() if g not in self.in_loss for ids in rows]
        for version in {self._kept(g) for g, _ in ahead}:
            rows = [row for row in ahead if self._kept(row[0]) == version]
            weights = model if version is None or past is None else past.model_at(version)
            self._logprob.update(zip(rows, sequence_logprobs(weights, groups, rows, derived), strict=True))
        self._repeated = repeated
        self.starts = [0]  # each group's first row in the batch (rows: groups in order, then completions)
        for scored in groups:
            self.starts.append(self.starts[-1] + len(scored.group.completions))
        for index in range(len(groups)):
            if judged[index] and index not in self.in_loss:
                self.evidence[index] = self._evidence(index)

    def _kept(self, index: int) -> int | None:
        """The version whose kept weights score this group's repeats; None: the policy's."""
        version = self.groups[index].policy_version
        stale = self.current_version is not None and version < self.current_version
        return version if stale and self.past is not None and version in self.past else None

    def _evidence(self, index: int) -> float:
        check, scored = self.check, self.groups[index]
        assert check is not None
        comps = [tuple(c.token_ids) for c in scored.group.completions]
        drift = 0.0 if self.allowance is None else float(self.allowance[index] or 0.0)
        behind = 0 if self.current_version is None else max(0, self.current_version - scored.policy_version)
        if self._kept(index) is not None:
            drift, behind = 0.0, 0  # scored under the very version it claims
        order = list(range(len(comps)))
        self.order.shuffle(order)
        return duplicate_log_e(
            comps,
            [self._logprob.get((index, ids), 0.0) for ids in comps],
            check.duplicate_bet,
            check.precision_slack + check.drift_allowance * drift + check.stale_slack * behind,
            order,
        )

    def from_logprobs(self, mb: Batch, logp: torch.Tensor) -> bool:
        """Complete the evidence of the groups scored in the loss whose rows ``mb`` (the next micro-batch)
        holds, from its ``logp`` (``token_logprobs`` of the policy, aligned with its ``input_ids``); True when
        any was."""
        row0, self._row0 = self._row0, self._row0 + mb.num_sequences
        done = False
        if not self.in_loss:
            return done
        sums = (logp.detach().float() * mb.completion_mask.to(logp.device)).sum(1).tolist()
        here = [g for g in dict.fromkeys(mb.group_index.tolist()) if g in self.in_loss]
        for g in here:
            comps = self.groups[g].group.completions
            for ids in self._repeated[g]:
                k = next(k for k, c in enumerate(comps) if tuple(c.token_ids) == ids)
                self._logprob[(g, ids)] = sums[self.starts[g] + k - row0]
            self.evidence[g] = self._evidence(g)
            done = True
        return done


def sequence_logprobs(
    model: torch.nn.Module,
    groups: Sequence[ScoredGroup],
    rows: list[Row],
    derived: DerivedSettings,
    chunk: int = 64,
) -> list[float]:
    """Log-probability of each (group index, completion) in ``rows`` after its group's prompt, under the
    sampling distribution (the loss's ``token_logprobs``) of ``model`` at the policy's precision, without
    gradient."""
    pad, out = derived.pad_token_id, []
    device = next(model.parameters()).device
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        seqs = [(list(groups[i].group.prompt_token_ids), list(ids)) for i, ids in part]
        width = max(len(p) + len(c) for p, c in seqs)
        input_ids = torch.tensor([p + c + [pad] * (width - len(p) - len(c)) for p, c in seqs])
        mask = torch.zeros_like(input_ids)
        completion = torch.zeros(input_ids.shape, dtype=torch.float32)
        for row, (p, c) in enumerate(seqs):
            mask[row, : len(p) + len(c)] = 1
            completion[row, len(p) : len(p) + len(c)] = 1
        with torch.no_grad(), rounded_weights(model, derived.policy_precision):
            input_ids, mask = input_ids.to(device), mask.to(device)
            logits = forward_logits(model, input_ids, mask)
            logp = token_logprobs(logits, input_ids, derived.temperature, derived.top_k, derived.top_p)
            del logits
        out += (logp.float().cpu() * completion).sum(1).tolist()
    return out
