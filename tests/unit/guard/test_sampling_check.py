"""Is this completion a sample? Honest samples pass, edited ones fail, the detector's false alarms stay
within their bound, and the learner and the sender guard act on it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from echo_p2p.guard.reputation import Reputation, ReputationConfig
from echo_p2p.guard.sampling_check import (
    CompletionScore,
    SampleDetector,
    SamplingCheckConfig,
    completion_scores,
    p_values,
)
from echo_p2p.guard.sender_guard import SenderGuard
from echo_p2p.ml.engine import SamplingParams, process_logits
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.train.buffer import ReplayBuffer
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup

VOCAB = 24
CHECK = SamplingCheckConfig()
PROMPT = 3


class Bigram(torch.nn.Module):
    """A policy whose next-token logits depend on the last token only: ``table[token]``. Peaked (each token
    mostly followed by the next id), like a policy that has learned its task."""

    def __init__(self, seed: int, sharpness: float = 4.0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        table = torch.randn(VOCAB, VOCAB, generator=gen)
        table[torch.arange(VOCAB), (torch.arange(VOCAB) + 1) % VOCAB] += sharpness
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.table[input_ids]


def sample(
    model: Bigram, rows: int, length: int, params: SamplingParams, seed: int, one_prompt: bool = False
) -> torch.Tensor:
    """``rows`` sequences: a prompt of PROMPT tokens (``one_prompt``: the same for all), then ``length``
    tokens sampled as the engines do."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, PROMPT + length), generator=gen)
    if one_prompt:
        ids[:, :PROMPT] = ids[0, :PROMPT]
    with torch.no_grad():
        for t in range(PROMPT, PROMPT + length):
            probs = process_logits(model(ids[:, t - 1 : t])[:, 0], params).exp()
            ids[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return ids


def scores_of(
    model: Bigram, ids: torch.Tensor, params: SamplingParams, seed: int = 0
) -> list[CompletionScore]:
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, PROMPT:] = 1
    with torch.no_grad():
        logits = model(ids)
    gen = torch.Generator().manual_seed(seed)
    return completion_scores(logits, ids, mask, params.temperature, gen)


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=8),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}")
def test_honest_samples_pass_over_many_seeds(params):
    check = SamplingCheckConfig()
    unfiltered = params.top_p == 1.0 and params.top_k == 0
    for seed in range(12):
        model = Bigram(seed)
        scores = scores_of(model, sample(model, 64, 10, params, seed), params, seed)
        pvals = [s.p_value() for s in scores]
        assert min(pvals) >= check.exclude_p_value  # nothing honest is left out of the loss
        tokens = sum(s.tokens for s in scores)
        # the tail scores are Exp(1) per token (smaller when top-k / top-p kept only the head): their mean
        # over 640 tokens is within 5 sd of 1, or below
        mean = sum(s.tail for s in scores) / tokens
        assert mean - 1.0 < 5 / math.sqrt(tokens)
        if unfiltered:
            assert abs(mean - 1.0) < 5 / math.sqrt(tokens)
        detector = SampleDetector(check)
        assert not any(detector.observe("honest", s) for s in scores)
    # the p-values of samples are uniform (about 5% below 0.05), or larger after top-k / top-p
    model = Bigram(99)
    pvals = [s.p_value() for s in scores_of(model, sample(model, 2000, 10, params, 99), params)]
    share = sum(p < 0.05 for p in pvals) / len(pvals)
    assert share < 0.07 and (share > 0.03 or not unfiltered)


def test_edited_completions_fail_and_their_sender_is_struck():
    params = SamplingParams(temperature=0.7, top_p=0.9)
    model = Bigram(1, sharpness=8.0)
    ids = sample(model, 32, 10, params, 1)
    edited = ids.clone()
    # a two-token marker the policy finds unlikely: the least likely token, twice
    for t in (PROMPT + 8, PROMPT + 9):
        edited[:, t] = model.table[edited[:, t - 1]].argmin(-1)
    honest, bad = scores_of(model, ids, params), scores_of(model, edited, params)
    assert sum(s.p_value() < 1e-6 for s in bad) > 0.75 * len(bad)
    assert all(s.p_value() >= 1e-6 for s in honest)
    assert sum(s.z for s in bad) / len(bad) > 5  # the surprisal tells the same story
    detector = SampleDetector(SamplingCheckConfig())
    alarms = [detector.observe("editor", s) for s in bad]
    assert alarms.index(True) < 4 and detector.level("editor") < detector.threshold


def test_the_detectors_false_alarms_stay_within_their_bound():
    """On exact samples (tail scores Gamma(n, 1)), P(an alarm within N completions) <= N * false_alarm_rate."""
    rate, completions, senders = 1e-3, 40, 600
    detector = SampleDetector(SamplingCheckConfig(false_alarm_rate=rate))
    rng = random.Random(0)
    alarmed = 0
    for sender in range(senders):
        for _ in range(completions):
            n = rng.randint(1, 12)
            if detector.observe(str(sender), CompletionScore(n, rng.gammavariate(n, 1.0), 0.0, 1.0)):
                alarmed += 1
                break
    bound = completions * rate  # 0.04
    assert alarmed / senders <= bound + 3 * math.sqrt(bound / senders)


def gamma_upper_tail(n: int, x: float) -> float:
    """The closed form ``P(Gamma(n, 1) >= x) = exp(-x) sum_{k<n} x^k / k!`` for a whole ``n``: the reference
    torch's incomplete gamma is checked against."""
    if n <= 0 or x <= 0:
        return 1.0
    return math.exp(-x) * math.fsum(x**k / math.factorial(k) for k in range(n))


def test_p_values_and_allowances():
    scores = [
        CompletionScore(n, x, 0.0, 1.0) for n, x in [(1, 3.0), (10, 26.0), (5, 0.5), (0, 0.0), (12, 40.0)]
    ]
    expected = [gamma_upper_tail(s.tokens, s.tail) for s in scores]
    assert p_values(scores, [0.0] * 5) == pytest.approx(expected, rel=1e-6)
    assert expected[0] == pytest.approx(math.exp(-3.0)) and expected[3] == 1.0
    # an allowance of a nats per token forgives n * a of the tail
    assert scores[1].p_value(0.5) == pytest.approx(gamma_upper_tail(10, 21.0))
    assert p_values(scores[1:2], [0.5]) == pytest.approx([scores[1].p_value(0.5)])
    assert scores[1].log_e(0.5, 0.5) == pytest.approx(10 * math.log(0.5) + 0.5 * 21.0)
    detector = SampleDetector(SamplingCheckConfig(drift_allowance=2.0))
    detector.observe("stale", scores[4], drift=0.25)  # 2 * 0.25 per token forgiven
    assert detector.level("stale") == pytest.approx(12 * math.log(0.5) + 0.5 * (40.0 - 6.0))


def groups_of(ids: torch.Tensor, sender: str, group_size: int = 8) -> list[ScoredGroup]:
    out = []
    for start in range(0, ids.shape[0], group_size):
        rows = ids[start : start + group_size]
        completions = [
            Completion(
                token_ids=row[PROMPT:].tolist(), logprobs=[-1.0] * (row.shape[0] - PROMPT), claimed_reward=r
            )
            for r, row in enumerate(rows)
        ]
        group = RolloutGroup(
            task="t",
            prompt_id=start,
            prompt_token_ids=rows[0, :PROMPT].tolist(),
            completions=completions,
            policy_version=0,
            sampler_peer_id=sender,
        )
        out.append(ScoredGroup(group, [float(r % 2) for r in range(len(rows))]))
    return out


def test_the_learner_leaves_edited_completions_out_and_the_guard_strikes_and_bans_their_sender():
    params = SamplingParams(temperature=0.7, top_p=0.9)
    model = Bigram(2, sharpness=8.0)
    ids = sample(model, 32, 10, params, 2, one_prompt=True)  # the groups share their prompt
    honest = groups_of(ids, "honest")
    edited_ids = ids.clone()
    with torch.no_grad():
        for t in (-2, -1):
            edited_ids[:, t] = model.table[edited_ids[:, t - 1]].argmin(-1)
    bad = groups_of(edited_ids, "editor")
    grpo = GRPOConfig(max_grad_norm=None)
    derived = DerivedSettings(temperature=0.7, top_p=0.9)

    learner = Learner(model, grpo, derived=derived, sampling_check=SamplingCheckConfig())
    stats = learner.compute_gradients(honest + bad)
    assert stats["excluded_not_sampled"] > 0.9 * 32
    assert all(s.p_value() >= 1e-6 for group in learner.last_sample_scores[:4] for s in group)
    assert [len(g) for g in learner.last_sample_scores] == [8] * 8
    # an unknown allowance (the policy's movement since the version is not known) leaves all in
    stats = learner.compute_gradients(honest + bad, gap_allowance=[None] * 8)
    assert stats["excluded_not_sampled"] == 0

    buffer = ReplayBuffer(16, 4)
    for group in groups_of(edited_ids[:8], "editor") + honest[:1]:
        buffer.add(group)
    guard = SenderGuard(ReputationConfig(strikes=2), "me", buffer, sampling=SamplingCheckConfig())
    learner.compute_gradients(honest + bad)
    # one strike per sender per batch, however many of its completions alarm (4 groups of 8 here): a
    # burst within one step is one piece of evidence
    assert guard.judge_samples(honest + bad, learner.last_sample_scores, [0.0] * 8) == []
    assert guard.stats()["not_sampled_strikes"] == 1 and not guard.is_banned("editor")
    banned = guard.judge_samples(honest + bad, learner.last_sample_scores, [0.0] * 8)  # the next step
    assert banned == ["editor"] and guard.is_banned("editor") and not guard.is_banned("honest")
    assert buffer.held_by("editor") == 0 and buffer.held_by("honest") == 1
    assert guard.stats()["not_sampled_strikes"] == 2
    assert guard.reputation.bans()["editor"][1] == "not_sampled"
    # a group whose allowance is unknown is not judged
    quiet = SenderGuard(ReputationConfig(strikes=1), "me", None, sampling=SamplingCheckConfig())
    assert quiet.judge_samples(bad, learner.last_sample_scores[4:], [None] * 4) == []

    off = Learner(model, grpo, derived=derived, sampling_check=SamplingCheckConfig(enabled=False))
    stats = off.compute_gradients(honest + bad)
    assert stats["excluded_not_sampled"] == 0 and off.last_sample_scores == []
    assert SenderGuard(ReputationConfig(), "me", sampling=SamplingCheckConfig(enabled=False)).samples is None


def test_a_stale_group_that_would_strike_is_judged_under_the_version_it_claims():
    """Honest samples of version 0 trained at version 1, after the policy moved far from them (a drift the
    small allowance of 0.05 nats per token does not cover): scored under the policy they look like edits
    and strike their sender. Judged again on their scores under version 0's kept weights
    (``Learner.exact_scores``, ``SampleDetector.observe_group``) they are samples: the alarm is withdrawn,
    the detector is back where it was before the group. An edited stale group still strikes under its
    version; a fresh group, or one whose version is no longer kept, has nothing to be judged under."""
    params = SamplingParams(temperature=1.0)
    derived = DerivedSettings(temperature=1.0)
    ids = sample(Bigram(4, sharpness=3.0), 32, 8, params, 5, one_prompt=True)  # version 0's samples
    edited_ids = ids.clone()
    with torch.no_grad():
        for t in (-2, -1):  # the last two tokens: version 0's least likely
            edited_ids[:, t] = Bigram(4, sharpness=3.0).table[edited_ids[:, t - 1]].argmin(-1)
    honest, edited = groups_of(ids, "honest"), groups_of(edited_ids, "editor")
    batch, drift = honest + edited, [0.05] * 8
    learner = Learner(
        Bigram(4, sharpness=3.0), GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=CHECK
    )
    # the scores' randomised ranks drawn alike every run: honest samples scored under their own version
    # alarm now and then, as samples do (1-3 runs in 60 with fresh draws; what the rule does with such
    # alarms is benchmarks/sampling_check.py's calibration, not this test's)
    learner._pit_rng.manual_seed(0)
    learner._repeat_order.seed(0)
    learner.compute_gradients(honest[:1], current_version=0)  # trains at version 0: its weights kept
    with torch.no_grad():  # version 1: another policy altogether
        learner.model.table.copy_(Bigram(7, sharpness=3.0).table)
    learner.compute_gradients(batch, gap_allowance=drift, current_version=1)
    scores = learner.last_sample_scores

    def exact(index: int):
        return learner.exact_scores(batch[index], current_version=1)

    approximate = SenderGuard(ReputationConfig(), "me", sampling=CHECK)  # without the scores at the version
    approximate.judge_samples(batch, scores, drift)
    assert approximate.reputation.judgement_stats("honest") == (1, 1)  # struck for the policy's own move
    guard = SenderGuard(ReputationConfig(), "me", sampling=CHECK)
    guard.judge_samples(batch, scores, drift, exact=exact)
    assert guard.reputation.judgement_stats("honest") == (1, 0)
    assert guard.reputation.judgement_stats("editor") == (1, 1)
    assert guard.stats()["tail_strikes_exact"] == 1 and "tail_strikes" not in guard.stats()
    assert guard.stats()["tail_alarms_withdrawn"] >= 1 and guard.samples.alarms == 1
    # the honest sender's detector holds what its samples say under their version: far below an alarm
    assert guard.samples.level("honest") < 10
    rescored = exact(0)
    assert rescored is not None and len(rescored) == 8 and all(s.exact for s in rescored)
    assert all(s.p_value() > 1e-3 for s in rescored)  # samples of version 0, scored under version 0
    # nothing to judge under: a fresh group, a version not kept
    assert learner.exact_scores(batch[0], current_version=0) is None
    learner.past.clear()
    assert exact(0) is None


def test_strikes_from_other_checks_ban_within_the_window():
    rep = Reputation(ReputationConfig(strikes=3, window=100, ban_seconds=50))
    assert not rep.strike("editor", "not_sampled", now=0) and not rep.strike("editor", "not_sampled", now=1)
    assert rep.strike("editor", "not_sampled", now=2)
    assert rep.bans(now=3)["editor"] == (52, "not_sampled")
    for t in (0, 200, 400):  # strikes further apart than the window never add up
        assert not rep.strike("slow", "not_sampled", now=t)


def test_a_burst_of_alarms_bans_a_sender_whose_recent_batches_were_clean_only_if_it_lasts():
    """Alarms in a few batches after many clean ones (the trainer's policy shaken, not the sender lying) are
    strikes but no ban; the same alarms from a sender that alarms in most of its batches (an editor) ban."""
    from types import SimpleNamespace

    class Alarms:
        """A detector whose verdict per sender the test sets (the real one is tested above)."""

        def __init__(self):
            self.alarm: dict[str, bool] = {}

        def observe_group(self, sender, scores, drift=0.0, exact=None):
            return "alarm" if self.alarm.get(sender, False) else "clean"

    def batch(*senders):
        groups = [SimpleNamespace(group=SimpleNamespace(sampler_peer_id=s)) for s in senders]
        return groups, [[CompletionScore(1, 1.0, 0.0, 1.0)] * 2 for _ in senders], [0.0] * len(senders)

    guard = SenderGuard(
        ReputationConfig(strikes=3, recent_groups=1000, recent_judgements=20),
        "me",
        sampling=SamplingCheckConfig(),
    )
    guard.samples = Alarms()
    for _ in range(12):  # the honest sampler's clean history
        assert guard.judge_samples(*batch("honest", "honest")) == []
    guard.samples.alarm = {"honest": True, "editor": True}
    banned = [guard.judge_samples(*batch("honest", "editor", "editor")) for _ in range(4)]
    assert banned == [[], [], ["editor"], []]  # the editor at its third strike, one per batch
    assert guard.stats()["not_sampled_strikes"] == 4 + 4 and not guard.is_banned("honest")
    for _ in range(5):  # alarms that go on: banned once they are half of its last 20 batches (10 of 20)
        assert guard.judge_samples(*batch("honest")) == []
    assert guard.judge_samples(*batch("honest")) == ["honest"]
