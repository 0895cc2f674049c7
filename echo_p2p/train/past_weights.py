"""The weights of the last versions a learner trained, to score a stale group under the version it claims.

A sampler that sampled a group at version ``v`` drew from ``v``'s policy; the trainer holds a newer one.
Scored under the trainer's policy, the group needs slack for how far the policy moved since ``v``, and an
editor that claims old versions hides in that slack. Scored under ``v``'s own weights it needs none: the
duplicate test scores a stale group's repeats there and the tail test re-judges there a stale group it would
strike (``guard.sampling_check``). ``PastWeights`` keeps a copy of the weights of each version the learner
trains at, the last ``keep`` + 1 of them, when they and a scoring copy of the model fit in ``budget_mb``
(the tiny model does; SmolLM2 does not at the default 256 MiB, and its stale groups get the slacks).

Owned here: ``PastWeights``. The live model is never written (hivemind's averagers may read its parameters
meanwhile): a deep copy of it, made once, takes the kept weights to score.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch


class PastWeights:
    """Copies of ``model``'s weights at the last versions kept (see the module doc)."""

    def __init__(self, model: torch.nn.Module, keep: int, budget_mb: float) -> None:
        self.model = model
        self.keep = keep
        self.budget_mb = budget_mb
        # the model's size never changes: what a copy takes is counted once, not at every version recorded
        self._copy_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._scorer: torch.nn.Module | None = None  # the copy that holds a kept version to score

    def fits(self) -> bool:
        """Whether the current version, ``keep`` past ones and the scoring copy fit in the budget."""
        return self.keep > 0 and self._copy_bytes * (self.keep + 2) <= self.budget_mb * 2**20

    def record(self, version: int | None) -> None:
        """Keep a copy of the model's weights now as ``version``'s (the oldest go past ``keep`` + 1); nothing
        when it does not fit, or ``version`` is None or kept already."""
        if version is None or version in self._versions or not self.fits():
            return
        with torch.no_grad():
            self._versions[version] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        while len(self._versions) > self.keep + 1:
            self._versions.popitem(last=False)

    def __contains__(self, version: object) -> bool:
        return version in self._versions

    def clear(self) -> None:
        """Forget every kept version (the trainer reloaded an older state: the versions after it are trained
        again, to other weights)."""
        self._versions.clear()

    def model_at(self, version: int) -> torch.nn.Module:
        """The scoring copy of the model holding the kept weights of ``version`` (which must be kept)."""
        if self._scorer is None:
            self._scorer = copy.deepcopy(self.model).requires_grad_(False)
        with torch.no_grad():
            for name, param in self._scorer.named_parameters():
                param.copy_(self._versions[version][name])
        return self._scorer
