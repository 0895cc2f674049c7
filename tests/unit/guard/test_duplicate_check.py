"""The duplicate test of ``guard.sampling_check``: samples repeat each other at the rate the policy sets, an
editor's or a copier's completions repeat far more often; its e-value is exact, and the guard acts on it."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from echo_p2p.guard.reputation import ReputationConfig
from echo_p2p.guard.sampling_check import SampleDetector, SamplingCheckConfig, duplicate_log_e
from echo_p2p.guard.sender_guard import SenderGuard
from echo_p2p.ml.engine import SamplingParams
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.grpo import token_logprobs
from echo_p2p.train.learner import Learner
from tests.unit.guard.test_sampling_check import PROMPT, Bigram, groups_of, sample

#: a policy over whole completions: a few likely ones and a long tail, as a learned policy's answers
COMPLETIONS = [(1,), (2, 3), (4,), (5, 6, 7), (8,)]
PROBS = [0.55, 0.25, 0.15, 0.049, 0.001]


def test_an_honest_groups_e_value_has_expectation_exactly_one():
    """Every group of 3 from the distribution, weighted by its probability, in every fixed order: E[e] = 1
    (no slack), below 1 with slack; the bet changes how the mass is spread, not the mean."""
    logprobs = {c: math.log(p) for c, p in zip(COMPLETIONS, PROBS, strict=True)}
    for bet, order in itertools.product((0.05, 0.5, 0.9), ([0, 1, 2], [2, 0, 1])):
        mean = mean_slack = 0.0
        for group in itertools.product(range(len(COMPLETIONS)), repeat=3):
            weight = math.prod(PROBS[i] for i in group)
            comps = [COMPLETIONS[i] for i in group]
            lps = [logprobs[c] for c in comps]
            mean += weight * math.exp(duplicate_log_e(comps, lps, bet, 0.0, order))
            mean_slack += weight * math.exp(duplicate_log_e(comps, lps, bet, 0.1, order))
        assert abs(mean - 1.0) < 1e-12, (bet, order, mean)
        assert mean_slack < 1.0
    # what a repeat is worth: an unlikely one is strong evidence, a likely one almost none
    assert duplicate_log_e([(9,), (9,)], [math.log(1e-4)] * 2, 0.05, 0.0) > math.log(400)
    assert abs(duplicate_log_e([(1,), (1,)], [math.log(0.99)] * 2, 0.05, 0.0)) < 0.01
    assert duplicate_log_e([(1,), (2,)], [0.0, 0.0], 0.05, 0.0) == pytest.approx(math.log(0.95))
    assert duplicate_log_e([(1,), (1,)], [0.0] * 2, 0.0, 0.0) == 0.0  # bet 0: no test


def test_honest_groups_never_alarm_and_a_copier_does_within_a_few_groups():
    """16-completion groups drawn from the distribution (many repeats of the likely answers): 1,000 groups
    move no detector to its threshold (and the mean e-value is ~1); a sender that sends a 1-in-1,000
    completion in 8 copies among 8 samples alarms within two groups."""
    rng = random.Random(0)
    detector = SampleDetector(SamplingCheckConfig())
    honest_e = []
    for _ in range(1000):
        comps = rng.choices(COMPLETIONS, PROBS, k=16)
        lps = [math.log(PROBS[COMPLETIONS.index(c)]) for c in comps]
        log_e = duplicate_log_e(comps, lps, 0.05, 0.0, list(range(16)))
        honest_e.append(math.exp(log_e))
        assert not detector.observe_repeats("honest", log_e)
    assert abs(sum(honest_e) / len(honest_e) - 1.0) < 0.15
    assert detector.repeat_level("honest") < 0.5 * detector.threshold
    for tries in range(1, 4):  # noqa: B007 (read after the loop)
        comps = rng.choices(COMPLETIONS, PROBS, k=8) + [(8,)] * 8
        lps = [math.log(PROBS[COMPLETIONS.index(c)]) for c in comps]
        order = rng.sample(range(16), 16)
        if detector.observe_repeats("copier", duplicate_log_e(comps, lps, 0.05, 0.0, order)):
            break
    assert tries <= 2 and detector.duplicate_alarms == 1


def test_the_learner_leaves_a_copiers_groups_out_and_the_guard_bans_it():
    """Through the trainer's own path: a sender whose groups hold one honest sample sent 6 times passes the
    tail test (each copy is a sample) but not the duplicate test: the learner scores the repeated completion
    under the sampling distribution (top-p included), leaves each such group out of the loss whole (its
    e-value above ``duplicate_exclude_e``), and the guard strikes the copier once per step and bans it at its
    second duplicate alarm (``duplicate_ban_alarms``), with no clean share to wait for; honest groups of the
    same policy are kept and never struck."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    model = Bigram(3, sharpness=3.0)
    derived = DerivedSettings(temperature=1.0, top_p=0.9)
    check = SamplingCheckConfig()
    learner = Learner(model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=check)
    guard = SenderGuard(ReputationConfig(), "me", sampling=check)
    for step in range(4):
        ids = sample(model, 32, 6, params, 10 + step, one_prompt=True)
        copied = ids[16:].clone()
        copied[2:8] = copied[2]  # one honest sample, sent 6 times in each of its two groups
        copied[10:16] = copied[10]
        batch = groups_of(ids[:16], "honest") + groups_of(copied, "copier")
        stats = learner.compute_gradients(batch)
        honest, copier = learner.last_group_repeats[:2], learner.last_group_repeats[2:]
        assert all(e is not None and e < 0 for e in honest) and min(copier) > math.log(1e6), (honest, copier)
        assert (
            stats["excluded_repeated"] == 16 and stats["excluded_not_sampled"] == 0
        )  # the tail test is blind
        banned = guard.judge_samples(batch, learner.last_sample_scores, [0.0] * 4, learner.last_group_repeats)
        assert guard.stats()["duplicate_strikes"] == step + 1
        if step < check.duplicate_ban_alarms - 1:
            assert banned == []
        if banned:
            break
    assert banned == ["copier"] and step == 1 and not guard.is_banned("honest")
    assert guard.reputation.bans()["copier"][1] == "repeated"
    assert guard.reputation.judgement_stats("honest") == (2, 0)
    assert guard.reputation.judgement_stats("copier") == (2, 2)
    # the repeated completion's probability is the loss's: the honest sample's own log-probs under top-p
    with torch.no_grad():
        logp = token_logprobs(model(copied[2:3]), copied[2:3], 1.0, 0, 0.9)[0, PROMPT:].sum()
    kept = SamplingCheckConfig(duplicate_exclude_e=1e300)  # nothing left out: the e-value alone
    exact = Learner(model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=kept)
    exact.compute_gradients(groups_of(copied[:8], "copier"))
    # 6 copies of one completion among 8 (the two others distinct): whatever the order, the e-value lies
    # between those of the copies coming first and last
    p = math.exp(float(logp) + kept.precision_slack * 6)
    bet = kept.duplicate_bet
    first = sum(math.log(1 - bet + bet * (k / k) / p) for k in range(1, 6)) + 2 * math.log(1 - bet)
    last = sum(math.log(1 - bet + bet * (k / (k + 2)) / p) for k in range(1, 6)) + 2 * math.log(1 - bet)
    assert last - 1e-6 <= exact.last_group_repeats[0] <= first + 1e-6, (last, exact.last_group_repeats, first)
    # left out whole at ``duplicate_exclude_e``: below the least e-value any order gives, kept above the most
    for threshold, left_out in ((math.exp(last) * 0.99, 8), (math.exp(first) * 1.01, 0)):
        check = SamplingCheckConfig(duplicate_exclude_e=threshold)
        at = Learner(model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=check)
        assert at.compute_gradients(groups_of(copied[:8], "copier"))["excluded_repeated"] == left_out, (
            threshold
        )
    # the test off: the same groups are kept and pass
    off = Learner(
        model,
        GRPOConfig(max_grad_norm=None),
        derived=derived,
        sampling_check=SamplingCheckConfig(duplicate_bet=0),
    )
    assert off.compute_gradients(batch)["excluded_repeated"] == 0 and off.last_group_repeats == [None] * 4
    quiet = SenderGuard(ReputationConfig(), "me", sampling=check)
    for _ in range(3):
        assert quiet.judge_samples(batch, off.last_sample_scores, [0.0] * 4, off.last_group_repeats) == []


def test_repeats_scored_under_the_policy_take_their_probability_from_the_losss_own_forward_pass():
    """A group scored under the policy whose rows one micro-batch holds costs the duplicate test no forward
    pass of its own, and gets the e-value a forward of its own gives; a group split between micro-batches is
    scored ahead, by a forward pass of its repeated completions."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    model = Bigram(3, sharpness=3.0)
    derived = DerivedSettings(temperature=1.0, top_p=0.9)
    ids = sample(model, 16, 6, params, 40, one_prompt=True)
    ids[10:16] = ids[10]  # the second group: one sample sent 6 times
    batch = groups_of(ids, "s")
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    found = {}
    try:
        for micro_batch_size, forwards in ((None, [16]), (12, [12, 1, 4])):
            calls.clear()
            kept = SamplingCheckConfig(duplicate_exclude_e=1e300)  # the e-value alone
            config = GRPOConfig(max_grad_norm=None, micro_batch_size=micro_batch_size)
            learner = Learner(model, config, derived=derived, sampling_check=kept)
            learner._repeat_order.seed(5)  # the same order of completions in both
            learner.compute_gradients(batch)
            model.zero_grad(set_to_none=True)
            # rows 0-11 and 12-15: the copier's group straddles both, one forward of its repeated completion
            assert sorted(calls) == sorted(forwards), (micro_batch_size, calls)
            found[micro_batch_size] = learner.last_group_repeats
    finally:
        hook.remove()
    assert found[None][1] > math.log(1e3) and found[None][0] < 0
    assert found[None] == pytest.approx(found[12], abs=1e-5)


def test_a_stale_groups_repeats_are_scored_under_the_version_it_claims():
    """The learner keeps the weights of the versions it trained and scores a stale group's repeats under the
    version the group claims: a copier's groups tagged with version 0 are left out at version 1 although the
    policy now finds its copied completion almost certain (scored under the policy, with the staleness
    slack, they would pass: what an editor claiming older versions got before)."""
    params = SamplingParams(temperature=1.0)
    derived = DerivedSettings(temperature=1.0)
    ids = sample(Bigram(3, sharpness=3.0), 8, 6, params, 21, one_prompt=True)
    ids[2:8] = ids[2]  # one sample sent 6 times (version 0's)
    copier = groups_of(ids, "copier")

    def learner_after_update(check: SamplingCheckConfig) -> Learner:
        model = Bigram(3, sharpness=3.0)
        learner = Learner(model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=check)
        learner.compute_gradients(copier, current_version=0)  # version 0's weights: kept
        with torch.no_grad():  # version 1: the copied completion is now the policy's own
            row = ids[2]
            for t in range(PROMPT, row.shape[0]):
                model.table[row[t - 1], row[t]] += 30.0
        return learner

    kept = learner_after_update(SamplingCheckConfig())
    stats = kept.compute_gradients(copier, current_version=1)
    # the whole group is left out: its 6 copies at least (the 2 others may be out already for their gaps)
    assert stats["excluded_repeated"] >= 6 and kept.last_group_repeats[0] > math.log(1e6)
    assert kept.model.table.requires_grad and kept.model.table.grad is not None  # the live model trained
    none = learner_after_update(SamplingCheckConfig(stale_versions=0))
    stats = none.compute_gradients(copier, current_version=1)
    assert stats["excluded_repeated"] == 0 and none.last_group_repeats[0] < 1.0
    # a model too large for the budget keeps nothing either
    small = learner_after_update(SamplingCheckConfig(stale_versions_mb=1e-6))
    assert small.compute_gradients(copier, current_version=1)["excluded_repeated"] == 0
