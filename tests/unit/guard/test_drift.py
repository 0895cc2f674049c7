"""The trainer's measure of its own policy's movement (``guard.drift``, ``Learner.measure_drift``)."""

from __future__ import annotations

import math

import pytest
import torch

from echo_p2p.guard.drift import PolicyDrift
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.learner import Learner


def test_since_sums_the_measured_spans_and_knows_what_it_does_not_know():
    drift = PolicyDrift(max_spans=3)
    drift.record(3, 4, 0.1)
    drift.record(4, 5, 0.2)
    drift.record(5, 8, 1.0)  # a catch-up over three versions, measured as one span
    assert drift.since(5, 5) == 0.0 and drift.since(9, 5) == 0.0  # nothing moved (or a newer group)
    assert drift.since(3, 4) == pytest.approx(0.1)
    assert drift.since(3, 8) == pytest.approx(1.3)
    assert drift.since(6, 8) == pytest.approx(1.0)  # inside a span: the whole span (an upper bound)
    assert drift.since(2, 4) is None  # before the first measurement
    assert drift.since(3, 9) is None  # past the last
    drift.record(8, 9, None)  # not measured: a hole
    drift.record(9, 10, 0.1)
    assert drift.since(4, 10) is None and drift.since(9, 10) == pytest.approx(0.1)
    assert drift.since(3, 4) is None  # the oldest span was forgotten (max_spans)
    drift.record(4, 5, math.nan)  # a reload went back over 4..5: what was measured there is replaced
    assert drift.since(4, 8) is None
    drift.reset()
    assert drift.since(9, 10) is None


def test_measure_drift_is_the_mean_change_of_the_probes_logprobs(tiny_model, random_groups):
    model = tiny_model()
    groups = random_groups(num_groups=3, seed=3)
    learner = Learner(model, GRPOConfig(drift_probe_sequences=4, max_grad_norm=None, micro_batch_size=None))
    learner.compute_gradients(groups)
    assert learner.measure_drift() == pytest.approx(0.0, abs=1e-6)  # no update: no movement
    assert learner.measure_drift() is None  # measured once per batch
    learner.compute_gradients(groups)
    with torch.no_grad():
        before = [p.detach().clone() for p in model.parameters()]
        torch.optim.SGD(model.parameters(), lr=5.0).step()
    moved = learner.measure_drift()
    assert moved is not None and moved > 0.01
    # the same number, computed independently: the first probe rows' log-probs before and after
    with torch.no_grad():
        after = [p.detach().clone() for p in model.parameters()]
        batch = learner.build_batch(groups)
        rows = torch.arange(batch.input_ids.shape[0])[:: batch.input_ids.shape[0] // 4][:4]
        from echo_p2p.train.grpo import token_logprobs

        def logp():
            logits = model(batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits
            return token_logprobs(logits, batch.input_ids[rows], 1.0)

        new = logp()
        for p, b in zip(model.parameters(), before, strict=True):
            p.copy_(b)
        old = logp()
        for p, a in zip(model.parameters(), after, strict=True):
            p.copy_(a)
    mask = batch.completion_mask[rows]
    expected = float(((new - old).abs() * mask).sum() / mask.sum())
    assert moved == pytest.approx(expected, rel=1e-4, abs=1e-5)
    off = Learner(model, GRPOConfig(drift_probe_sequences=0))
    off.compute_gradients(groups)
    assert off.measure_drift() is None


def test_the_allowance_keeps_a_stale_groups_completions_in_the_loss(tiny_model, random_groups):
    model = tiny_model()
    groups = random_groups(num_groups=2, seed=11)
    for completion in groups[1].group.completions:
        completion.logprobs[:] = [-30.0] * len(completion.logprobs)
    learner = Learner(model, GRPOConfig(), derived=DerivedSettings(max_logprob_gap=4.0))
    assert learner.compute_gradients(groups)["excluded_sequences"] == len(groups[1].group.completions)
    # the policy moved by 40 nats per token since group 1 was sampled: its gap is the policy's, not a lie
    assert learner.compute_gradients(groups, gap_allowance=[0.0, 40.0])["excluded_sequences"] == 0
    # unknown movement: nothing is left out
    assert learner.compute_gradients(groups, gap_allowance=[0.0, None])["excluded_sequences"] == 0
    with pytest.raises(ValueError):
        learner.compute_gradients(groups, gap_allowance=[0.0])
