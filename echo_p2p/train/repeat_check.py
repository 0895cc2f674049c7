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
first part's backward) from a forward pass without gradient before the loss: ``BatchRepeats.ahead`` names
those rows per weights, and the learner reads them (``BatchRepeats.reader``) in the same passes as the rows the
replay of seeded draws scores ahead under the same weights (``train.draw_check``; one pass per version for both).

Owned here: ``BatchRepeats``. Called by ``train.learner``. Must not import hivemind.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from echo_p2p.guard.sampling_check import duplicate_log_e
from echo_p2p.train.batching import groups_in_one_micro_batch
from echo_p2p.train.grpo import token_logprobs

if TYPE_CHECKING:  # pragma: no cover
    from echo_p2p.guard.sampling_check import SamplingCheckConfig
    from echo_p2p.train.batching import Batch
    from echo_p2p.train.config import DerivedSettings
    from echo_p2p.train.forward import RowsReader
    from echo_p2p.train.past_weights import PastWeights
    from echo_p2p.train.scored import ScoredGroup

Row = tuple[int, tuple[int, ...]]  # (group index, a completion's token ids)


class BatchRepeats:
    """The duplicate evidence of one batch's groups, made while the learner computes its loss.

    ``evidence``: per group, the log of its duplicate e-value, or None when not tested (the check or its
    duplicate test off, or the group's allowance unknown); complete for every group once ``from_logprobs``
    has seen every micro-batch (a group not scored in the loss is complete once ``finish_ahead`` is called)."""

    def __init__(
        self,
        check: SamplingCheckConfig | None,
        groups: Sequence[ScoredGroup],
        micro: Sequence[Batch],
        allowance: Sequence[float | None] | None,
        current_version: int | None,
        past: PastWeights | None,
        derived: DerivedSettings,
        order: random.Random,
    ) -> None:
        self.check, self.groups, self.allowance, self.current_version = (
            check,
            groups,
            allowance,
            current_version,
        )
        self.past, self.order, self.derived = past, order, derived
        self.evidence: list[float | None] = [None] * len(groups)
        self.in_loss: set[int] = set()
        self._logprob: dict[Row, float] = {}
        self._row0 = 0  # the batch row of the next micro-batch's first
        #: the rows scored ahead of the loss, per weights (None: the policy's; a version: the weights kept for
        #: it): read by ``reader`` from the learner's passes, then ``finish_ahead``
        self.ahead: dict[int | None, list[Row]] = {}
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
        for g, rows in repeated.items():
            if g not in self.in_loss:
                self.ahead.setdefault(self._kept(g), []).extend((g, ids) for ids in rows)
        self._repeated = repeated
        self._judged = judged
        self.starts = [0]  # each group's first row in the batch (rows: groups in order, then completions)
        for scored in groups:
            self.starts.append(self.starts[-1] + len(scored.group.completions))

    def finish_ahead(self) -> None:
        """The evidence of every group not scored in the loss, once ``reader`` has read the rows of
        ``ahead``."""
        if self.check is None or self.check.duplicate_bet <= 0:
            return
        for index in range(len(self.groups)):
            if self._judged[index] and index not in self.in_loss:
                self.evidence[index] = self._evidence(index)

    def reader(self, rows: list[Row], first: int) -> RowsReader:
        """A ``forward.forward_rows`` reader that takes the sequence log-probability of ``rows`` (rows
        ``first`` on of the pass) under the sampling distribution (the loss's ``token_logprobs``)."""
        derived = self.derived

        def read(start: int, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
            lo, hi = max(first, start), min(first + len(rows), start + int(input_ids.shape[0]))
            if lo >= hi:
                return
            local = torch.arange(lo - start, hi - start, device=logits.device)
            logp = token_logprobs(
                logits[local], input_ids[local], derived.temperature, derived.top_k, derived.top_p
            )
            mask = torch.zeros(logp.shape, dtype=torch.float32)
            for r, (g, ids) in enumerate(rows[lo - first : hi - first]):
                prompt = len(self.groups[g].group.prompt_token_ids)
                mask[r, prompt : prompt + len(ids)] = 1
            sums = (logp.float().cpu() * mask).sum(1).tolist()
            self._logprob.update(zip(rows[lo - first : hi - first], sums, strict=True))

        return read

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
