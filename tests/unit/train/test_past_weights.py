"""A learner keeps the weights of its last versions, within a memory budget, and scores under them with a
copy of its model: the live model is never written."""

from __future__ import annotations

import torch

from echo_p2p.train.past_weights import PastWeights


def test_the_last_versions_are_kept_and_scored_under_a_copy_within_the_budget():
    model = torch.nn.Linear(4, 4, bias=False)  # 64 bytes of weights
    past = PastWeights(model, keep=2, budget_mb=1.0)
    for version in range(5):
        with torch.no_grad():
            model.weight.fill_(float(version))
        past.record(version)
        past.record(version)  # kept once: a second step at the same version keeps the first copy
    assert [v in past for v in range(5)] == [False, False, True, True, True]  # the current one and 2 before
    scorer = past.model_at(3)
    assert scorer is not model and torch.all(scorer.weight == 3.0) and not scorer.weight.requires_grad
    assert torch.all(model.weight == 4.0)  # the live model as it was
    assert past.model_at(2) is scorer and torch.all(scorer.weight == 2.0)  # one copy, refilled
    past.clear()
    assert not any(v in past for v in range(5))
    # a model whose copies (keep + 2 of them) do not fit keeps nothing; keep 0 keeps nothing
    tight = PastWeights(model, keep=2, budget_mb=4 * 64 / 2**20 - 1e-9)
    tight.record(7)
    assert 7 not in tight and not tight.fits()
    assert PastWeights(model, keep=2, budget_mb=4 * 64 / 2**20).fits()
    none = PastWeights(model, keep=0, budget_mb=1.0)
    none.record(1)
    assert 1 not in none
