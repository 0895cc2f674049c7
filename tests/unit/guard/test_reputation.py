"""Senders' reputation: strikes from behaviour log-prob gaps, bans, shared bans, the learner's gap check."""

from __future__ import annotations

import pytest
import torch

from echo_p2p.guard.reputation import Reputation, ReputationConfig
from echo_p2p.guard.sender_guard import SenderGuard
from echo_p2p.guard.trust import RunTrust, TrustedTrainers
from echo_p2p.net.records import Ban, BanRecord
from echo_p2p.train.buffer import ReplayBuffer
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.learner import Learner

T1 = "QmQAbD1EUxToUawWUKjh1doo9iC83FjbPVdhye9gwMeo2v"
T2 = "QmNMa1sxAWQsRdGFBa2Kyaxx8bZYuJPPtV4xgKh1Bi8bFp"


def test_strikes_within_the_window_ban_a_sender_for_a_while():
    rep = Reputation(ReputationConfig(max_logprob_gap=2.0, strikes=3, window=100, ban_seconds=50))
    assert not rep.record("liar", 5.0, now=0) and not rep.record("liar", 0.1, now=1)
    assert not rep.record("liar", 5.0, now=2)
    assert rep.record("liar", 5.0, now=3)  # the third strike
    assert rep.is_banned("liar", now=10) and not rep.is_banned("liar", now=60)
    assert rep.sender_stats("liar") == (4, 3)
    # strikes older than the window do not count
    for t in (0, 200, 400):
        assert not rep.record("slow", 5.0, now=t)
    assert not rep.is_banned("slow", now=400)
    assert not rep.record("honest", 1.9, now=0) and rep.sender_stats("honest") == (1, 0)


def test_the_odd_strike_among_honest_groups_bans_no_one_but_mostly_strikes_do():
    rep = Reputation(ReputationConfig(max_logprob_gap=2.0, strikes=3, ban_fraction=0.5, recent_groups=20))
    # an honest sampler: an update moved a few of its groups' rare tokens by more than the policy moved
    gaps = [0.05] * 17 + [3.0, 0.1, 3.5, 0.02, 2.8, 0.1, 0.1, 4.0]
    assert not any(rep.record("honest", g, now=i) for i, g in enumerate(gaps))
    assert rep.sender_stats("honest") == (25, 4) and not rep.is_banned("honest", now=30)
    # a liar that tells the truth on every other group still has strikes on half of them
    assert [rep.record("half", g, now=i) for i, g in enumerate([0.0, 9.0] * 3)] == [False] * 5 + [True]
    # the allowance for the policy's own movement raises the bound by as much
    assert not any(rep.record("stale", 5.0, allowance=3.5, now=i) for i in range(10))
    assert rep.sender_stats("stale") == (10, 0)
    assert rep.record("stale", 5.0, allowance=2.9, now=11) is False and rep.sender_stats("stale") == (11, 1)


def test_an_exact_tests_alarms_ban_at_the_needed_count_whatever_the_clean_history():
    rep = Reputation(ReputationConfig(strikes=3, ban_fraction=0.5, recent_judgements=20, window=100))
    for t in range(20):  # a clean history would outweigh strikes for the other checks' rule
        assert not rep.judged("editor", False, "not_sampled", now=t)
    assert not rep.alarmed("editor", 2, "repeated", now=20)
    assert rep.alarmed("editor", 2, "repeated", now=21) and rep.is_banned("editor", now=22)
    assert rep.bans(now=22)["editor"][1] == "repeated"
    assert not rep.alarmed("editor", 2, "repeated", now=23)  # banned already: not a new ban
    # alarms older than the window do not count; each sender counts its own
    assert not rep.alarmed("slow", 2, "repeated", now=0) and not rep.alarmed("other", 2, "repeated", now=150)
    assert not rep.alarmed("slow", 2, "repeated", now=150) and not rep.is_banned("slow", now=151)
    assert rep.alarmed("once", 1, "repeated", now=0)


def test_guard_judges_only_groups_whose_allowance_is_known():
    guard = SenderGuard(ReputationConfig(strikes=1, ban_fraction=0.01), T1)
    guard.drift.record(1, 2, 0.5)
    groups = [scored("old", 1), scored("old", 2)]
    groups[0].group.policy_version = 1
    groups[1].group.policy_version = 0  # sampled before this trainer measured anything: unknown
    assert guard.allowances(groups, 2) == [0.5, None]
    assert guard.judge(groups[1:], [30.0], [None]) == [] and guard.stats()["groups_unjudged"] == 1
    assert guard.judge(groups[:1], [2.4], [0.5]) == []  # within 2 + 0.5
    assert guard.judge(groups[:1], [2.6], [0.5]) == ["old"]


def test_shared_bans_are_capped_and_expire():
    rep = Reputation(ReputationConfig(ban_seconds=100))
    assert rep.ban("x", until=1e12, reason="logprob_gap", now=0)  # capped at ban_seconds
    assert rep.bans(now=0)["x"][0] == 100
    assert not rep.ban("y", until=-1, reason="old", now=0)
    assert not rep.is_banned("x", now=101)


class FakeDirectory:
    def __init__(self, records=()):
        self.records = list(records)
        self.stored = []

    def announce_bans(self, record, ttl):
        self.stored.append(record)
        return True

    def ban_records(self):
        return [type("E", (), {"record": r})() for r in self.records]


def scored(sender: str, prompt: int):
    from echo_p2p.rollout import Completion, RolloutGroup
    from echo_p2p.train.scored import ScoredGroup

    group = RolloutGroup(
        task="t",
        prompt_id=prompt,
        prompt_token_ids=[1],
        completions=[Completion(token_ids=[2], logprobs=[-1.0], claimed_reward=0.0)],
        policy_version=0,
        sampler_peer_id=sender,
    )
    return ScoredGroup(group, [0.0])


def test_guard_bans_drops_the_senders_groups_publishes_and_adopts_only_trusted_bans():
    buffer = ReplayBuffer(16, 4)
    for i in range(3):
        buffer.add(scored("liar", i))
    buffer.add(scored("honest", 9))
    trust = RunTrust(fixed=TrustedTrainers.from_keys([T1, T2]))
    guard = SenderGuard(ReputationConfig(strikes=2), T1, buffer, trust)
    groups = [scored("liar", 10), scored("liar", 11), scored("honest", 12)]
    assert guard.judge(groups, [30.0, 25.0, 0.2], [0.0, 0.0, 0.0]) == ["liar"]
    assert guard.is_banned("liar") and not guard.is_banned("honest")
    assert buffer.held_by("liar") == 0 and buffer.held_by("honest") == 1 and len(buffer) == 1

    directory = FakeDirectory(
        [
            BanRecord(peer_id=T2, bans=[Ban(peer_id="sybil", until=1e12, reason="logprob_gap")]),
            BanRecord(peer_id="QmStranger", bans=[Ban(peer_id="honest", until=1e12)]),  # not a trainer
        ]
    )
    guard.share(directory, ttl=30)
    assert [b.peer_id for b in directory.stored[0].bans] == ["liar"]
    assert guard.is_banned("sybil") and not guard.is_banned("honest")
    assert guard.stats()["bans_adopted"] == 1
    guard.share(directory, ttl=30)
    assert len(directory.stored) == 2  # "sybil" was added to this trainer's own bans: published again
    # a run that declares no trainers shares no bans: anyone could ban an honest peer
    open_guard = SenderGuard(ReputationConfig(), T1, None, RunTrust())
    open_guard.share(FakeDirectory([BanRecord(peer_id=T2, bans=[Ban(peer_id="honest", until=1e12)])]), 30)
    assert not open_guard.is_banned("honest")


def test_learner_leaves_out_completions_whose_behaviour_logprobs_are_made_up(tiny_model, random_groups):
    model = tiny_model()
    groups = random_groups(num_groups=3, seed=7)
    learner = Learner(model, GRPOConfig(max_grad_norm=None), derived=DerivedSettings(max_logprob_gap=10.0))
    stats = learner.compute_gradients(groups)
    honest_gaps = list(learner.last_group_gaps)  # random log-probs of -0.5..-4: a few nats off, kept
    assert len(honest_gaps) == 3 and all(0 < g < 10 for g in honest_gaps) and stats["excluded_sequences"] == 0
    for completion in groups[1].group.completions:
        completion.logprobs[:] = [-30.0] * len(completion.logprobs)  # a liar's log-probs
    stats = learner.compute_gradients(groups)
    assert learner.last_group_gaps[1] > 20 and stats["excluded_sequences"] == len(groups[1].group.completions)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the gradient equals that of the batch without the liar's completions
    reference = Learner(model, GRPOConfig(max_grad_norm=None))
    reference.compute_gradients([groups[0], groups[2]])
    n_all = sum(len(c.token_ids) for g in groups for c in g.group.completions)
    n_kept = sum(len(c.token_ids) for g in (groups[0], groups[2]) for c in g.group.completions)
    for name, p in model.named_parameters():
        if p.grad is not None and name in grads:
            torch.testing.assert_close(grads[name], p.grad * n_kept / n_all, atol=1e-5, rtol=1e-3)
    with pytest.raises(ValueError):
        DerivedSettings(max_logprob_gap=0)
