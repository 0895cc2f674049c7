"""Replays of seeded draws (``train.draw_check``) through the trainer's own path: honest groups drawn by the
engine replay clean; an edited completion, a completion moved out of its place among its seed's draws and a
group replayed under a far policy do not; the learner leaves such groups out of the loss whole and the
guard bans their sender, at once for a miss no precision explains, from the first step of a run."""

from __future__ import annotations

import copy

import pytest
import torch

from echo_p2p.guard.reputation import ReputationConfig
from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
from echo_p2p.guard.sampling_check import SamplingCheckConfig
from echo_p2p.guard.sender_guard import SenderGuard
from echo_p2p.ml.engine import SamplingParams, TransformersEngine
from echo_p2p.ml.models import ModelSpec, load_policy
from echo_p2p.rollout import Completion, RolloutGroup, Sampling
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.config import DerivedSettings, GRPOConfig
from echo_p2p.train.draw_check import DrawCheck, Replay
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.weights.config import EncodingConfig

G = 8


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return load_policy(ModelSpec(preset="tiny", seed=0))


def drawn_groups(model, tokenizer, sender: str, count: int, seed: int, version: int = 0) -> list[ScoredGroup]:
    """``count`` groups of G completions drawn by the engine from seeded streams, rewards varied."""
    engine = TransformersEngine(model, tokenizer)
    prompts = [tokenizer(f"{i % 9 + 1}b=")["input_ids"] for i in range(count)]
    samples = engine.sample(prompts, G, SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed))
    out = []
    for prompt, group in zip(prompts, samples, strict=True):
        comps = [Completion(token_ids=s.token_ids, logprobs=s.logprobs, claimed_reward=0.0) for s in group]
        record = RolloutGroup(
            task="count",
            prompt_id=0,
            prompt_token_ids=prompt,
            completions=comps,
            policy_version=version,
            sampler_peer_id=sender,
            sampling=Sampling(temperature=1.0, engine="transformers", precision="float32"),
            sampling_seed=group[0].seed,
        )
        out.append(ScoredGroup(record, [float(k % 2) for k in range(G)]))
    return out


def edited(scored: ScoredGroup, marker: list[int]) -> ScoredGroup:
    """Completion 0 of the group turned into its first token + ``marker`` (true log-probs don't matter here:
    the replay reads tokens only)."""
    comps = list(scored.group.completions)
    ids = list(comps[0].token_ids[:1]) + marker
    comps[0] = Completion(token_ids=ids, logprobs=[-1.0] * len(ids), claimed_reward=0.0)
    return ScoredGroup(scored.group.model_copy(update={"completions": comps}), scored.rewards)


def test_honest_draws_replay_clean_and_edits_moves_and_other_versions_do_not(policy):
    model, tokenizer = policy
    check = DrawCheck(SamplingCheckConfig(), DerivedSettings(pad_token_id=tokenizer.pad_token_id))
    honest = drawn_groups(model, tokenizer, "honest", 6, seed=1)
    picks = check.pick(honest)
    assert picks == [list(range(G))] * 6  # probation: every completion replayed
    clean = check.misses(honest, picks, lambda v: model)
    assert [r.missed for r in clean] == [0] * 6 and check.replayed == 6 * G
    assert max(r.worst for r in clean) == 0.0 and {r.tolerance for r in clean} == {0.01}  # float32's
    marker = tokenizer.convert_tokens_to_ids(list("zz")) + [tokenizer.eos_token_id]
    edit = edited(honest[0], marker)
    comps = list(honest[1].group.completions)
    distinct = next(k for k in range(1, G) if comps[k].token_ids != comps[0].token_ids)
    comps[0], comps[distinct] = comps[distinct], comps[0]  # two draws sent in each other's place
    moved = ScoredGroup(honest[1].group.model_copy(update={"completions": comps}), honest[1].rewards)
    unseeded = ScoredGroup(honest[2].group.model_copy(update={"sampling_seed": ""}), honest[2].rewards)
    got = check.misses([edit, moved, unseeded], [list(range(G))] * 3, lambda v: model)
    assert got[0].missed >= 1 and got[1].missed >= 2 and got[2] is None, got  # no seed: nothing to replay
    assert got[0].gross and got[1].gross  # far beyond what a precision explains
    # draws replayed under a policy far from the sampler's (a group that claims a version whose weights
    # differ much) miss; a version whose weights are not at hand is not replayed at all
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_output_embeddings().weight.mul_(50.0)
    assert sum(r.missed for r in check.misses(honest[:3], picks[:3], lambda v: other)) >= 12
    # the tolerance is the one the claimed precision needs
    bf16 = honest[3].group.sampling.model_copy(update={"precision": "bfloat16"})
    claimed = ScoredGroup(honest[3].group.model_copy(update={"sampling": bf16}), honest[3].rewards)
    assert check.tolerance(claimed) == 0.1 and check.tolerance(unseeded) == 0.01
    # samplers that got the weights through a lossy 8-bit encoding (the default ``auto`` may send int8
    # deltas) get the 8-bit tolerance whatever precision they claim
    assert not EncodingConfig().lossless and EncodingConfig(encoding="patch").lossless
    lossy = DrawCheck(SamplingCheckConfig(), DerivedSettings(lossy_weights=True))
    assert lossy.tolerance(unseeded) == 0.1 and lossy.tolerance(claimed) == 0.1
    assert check.misses(honest[:2], picks[:2], lambda v: None) == [None, None] and check.unchecked == 2


def test_after_its_probation_a_sender_has_a_share_of_its_completions_replayed(policy):
    model, tokenizer = policy
    config = SamplingCheckConfig(seed_probation=2, seed_check_share=0.25)
    check = DrawCheck(config, DerivedSettings(), seed=3)
    groups = drawn_groups(model, tokenizer, "a", 40, seed=2)
    picks = check.pick(groups)
    assert picks[:2] == [list(range(G))] * 2
    later = sum(len(p) for p in picks[2:])
    assert 0.12 * 38 * G <= later <= 0.40 * 38 * G, later
    # each sender has its own probation; no replay at share 0
    assert check.pick(drawn_groups(model, tokenizer, "b", 1, seed=4)) == [list(range(G))]
    off = DrawCheck(SamplingCheckConfig(seed_check_share=0.0), DerivedSettings())
    assert off.pick(groups[:3]) == [[], [], []]


def test_groups_that_need_a_pass_of_their_own_are_picked_at_one_version_per_batch(policy):
    """After probation, groups whose replay needs a forward pass of its own (stale ones) are picked at a version
    drawn per batch, at a share raised to match: one pass per batch, yet every completion, a rare version's
    too, is replayed with probability ``seed_check_share``. Versions a probation group brings to a pass anyway
    keep the plain share."""
    model, tokenizer = policy
    config = SamplingCheckConfig(seed_probation=1, seed_check_share=0.1)
    check = DrawCheck(config, DerivedSettings(), seed=5)
    base = drawn_groups(model, tokenizer, "a", 1, seed=6)[0]

    def at(version: int, sender: str) -> ScoredGroup:
        return ScoredGroup(
            base.group.model_copy(update={"policy_version": version, "sampler_peer_id": sender}), base.rewards
        )

    check.pick([at(0, "a")])  # a's probation over
    # a batch: 6 groups at version 10 (trained in the loss), 5 at 9, 3 at 8, 1 at 7 (a rare one)
    batch = [at(10, "a")] * 6 + [at(9, "a")] * 5 + [at(8, "a")] * 3 + [at(7, "a")]
    own = lambda g: batch[g].policy_version != 10  # noqa: E731
    picked = {v: 0 for v in (7, 8, 9, 10)}
    versions_replayed = []
    rounds = 600
    for _ in range(rounds):
        picks = check.pick(batch, own)
        stale = {batch[g].policy_version for g, p in enumerate(picks) if p and own(g)}
        versions_replayed.append(len(stale))
        for g, p in enumerate(picks):
            picked[batch[g].policy_version] += len(p)
    assert max(versions_replayed) == 1  # 3 candidate versions <= 1 / share: one pass a batch at most
    counts = {7: 1, 8: 3, 9: 5, 10: 6}
    for version, groups in counts.items():
        rate = picked[version] / (rounds * groups * G)
        assert 0.07 <= rate <= 0.13, (version, rate)  # the share, whatever the version's size
    # a sender on probation brings its version to a pass: that version's other groups get the plain share,
    # the focus is drawn among the rest
    fresh = [at(8, "new")] + batch[6:]
    picks = check.pick(fresh, lambda g: True)
    assert picks[0] == list(range(G))
    # with more candidate versions than 1 / share, enough are drawn to keep the share
    many = DrawCheck(SamplingCheckConfig(seed_probation=0, seed_check_share=0.25), DerivedSettings(), seed=7)
    spread = [at(v, "a") for v in range(10)]
    passes = {len({v for v, p in enumerate(many.pick(spread, lambda g: True)) if p}) for _ in range(50)}
    assert max(passes) <= 3 and 3 in passes


def test_the_learner_leaves_an_editors_groups_out_and_the_guard_bans_it(policy):
    """From the first step: the editor's group is left out of the loss whole, and a miss no precision explains
    bans at once; honest groups are kept and never struck."""
    model, tokenizer = policy
    config = SamplingCheckConfig()
    derived = DerivedSettings(pad_token_id=tokenizer.pad_token_id)
    learner = Learner(model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=config)
    guard = SenderGuard(ReputationConfig(), "me", sampling=config)
    marker = tokenizer.convert_tokens_to_ids(list("zz")) + [tokenizer.eos_token_id]
    honest = drawn_groups(model, tokenizer, "honest", 3, seed=10)
    editor = [edited(g, marker) for g in drawn_groups(model, tokenizer, "editor", 1, seed=20)]
    batch = honest + editor
    stats = learner.compute_gradients(batch, current_version=0)
    model.zero_grad(set_to_none=True)
    misses = learner.last_group_draw_misses
    assert [r.missed for r in misses[:3]] == [0, 0, 0] and misses[3].missed >= 1 and misses[3].gross
    assert stats["excluded_not_drawn"] == G and stats["excluded_repeated"] == 0
    banned = guard.judge_samples(
        batch, learner.last_sample_scores, [0.0] * len(batch), learner.last_group_repeats, draw_misses=misses
    )
    assert banned == ["editor"] and guard.reputation.bans()["editor"][1] == "not_drawn"
    assert guard.stats()["draw_strikes"] == 1
    assert not guard.is_banned("honest") and guard.reputation.judgement_stats("honest")[1] == 0


def test_groups_at_the_trained_version_are_replayed_from_the_losss_own_logits(policy):
    """No forward pass of its own for a group at the version being trained that one micro-batch holds: its
    replay reads the loss's logits and finds what a replay of its own finds. A group split between micro-batches
    (left out whole, so checked before the first part's backward) and one at another version are replayed
    ahead, by forward passes of their own."""
    model, tokenizer = policy
    derived = DerivedSettings(pad_token_id=tokenizer.pad_token_id)
    marker = tokenizer.convert_tokens_to_ids(list("zz")) + [tokenizer.eos_token_id]
    honest = drawn_groups(model, tokenizer, "honest", 3, seed=30, version=4)
    editor = [edited(g, marker) for g in drawn_groups(model, tokenizer, "editor", 1, seed=31, version=4)]
    batch = honest + editor
    alone = DrawCheck(SamplingCheckConfig(), derived).misses(batch, [list(range(G))] * 4, lambda v: model)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape[0]))
    try:
        for micro_batch_size, passes in ((None, [4 * G]), (12, [G, 12, 12, G])):
            forwards.clear()
            config = GRPOConfig(max_grad_norm=None, micro_batch_size=micro_batch_size)
            learner = Learner(model, config, derived=derived, sampling_check=SamplingCheckConfig())
            stats = learner.compute_gradients(batch, current_version=4)
            model.zero_grad(set_to_none=True)
            # the whole batch in one micro-batch: its loss's forward only; rows 0-11, 12-23, 24-31: the second
            # group straddles two and is replayed ahead (a forward of its G rows), the others in the loss
            assert sorted(forwards) == sorted(passes), (micro_batch_size, forwards)
            got = learner.last_group_draw_misses
            assert [r.missed for r in got] == [r.missed for r in alone] and got[3].gross
            assert [r.worst for r in got] == pytest.approx([r.worst for r in alone], abs=1e-6)
            assert stats["excluded_not_drawn"] == G and learner.draws.replayed == 4 * G
        # a group at an older version than the one trained is replayed under the weights kept for it: not at
        # hand here, so unchecked, and no forward beyond the loss's
        forwards.clear()
        learner = Learner(
            model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=SamplingCheckConfig()
        )
        learner.compute_gradients(batch, current_version=5)
        model.zero_grad(set_to_none=True)
        assert forwards == [4 * G] and learner.last_group_draw_misses == [None] * 4
        assert learner.draws.unchecked == 4
    finally:
        hook.remove()


def test_the_duplicate_test_and_the_replay_share_one_pass_per_stale_version(policy):
    """Rows both checks score ahead of the loss under a version's kept weights go through one forward pass:
    here a batch at version 4 trained at version 5, its picked completions (all: probation) and a group's
    repeated completion; what each check finds is what it finds alone."""
    model, tokenizer = policy
    derived = DerivedSettings(pad_token_id=tokenizer.pad_token_id)
    batch = drawn_groups(model, tokenizer, "s", 4, seed=40, version=4)
    comps = list(batch[1].group.completions)
    comps[1] = comps[0]  # a completion sent twice: a repeat, and not the draw of its seed at index 1
    batch[1] = ScoredGroup(batch[1].group.model_copy(update={"completions": comps}), batch[1].rewards)
    alone = DrawCheck(SamplingCheckConfig(), derived).misses(batch, [list(range(G))] * 4, lambda v: model)
    learner = Learner(
        model, GRPOConfig(max_grad_norm=None), derived=derived, sampling_check=SamplingCheckConfig()
    )
    learner.past.record(4)
    forwards = []
    scorer = learner.past.model_at(
        4
    )  # the copy that holds kept weights (made before the hook: no copy of it)
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape[0]))
    scorer_hook = scorer.register_forward_pre_hook(lambda module, args: forwards.append(-args[0].shape[0]))
    try:
        learner.compute_gradients(batch, current_version=5)
    finally:
        hook.remove()
        scorer_hook.remove()
    model.zero_grad(set_to_none=True)
    # one pass under version 4's weights: its repeated completion (1 row) and the 4 x G picked ones
    assert sorted(forwards) == [-(1 + 4 * G), 4 * G], forwards
    got = learner.last_group_draw_misses
    assert [r.missed for r in got] == [r.missed for r in alone] and got[1].missed >= 1
    assert learner.last_group_repeats[1] is not None and learner.last_group_repeats[0] is not None


def test_a_near_miss_is_a_strike_and_its_second_within_the_window_a_ban():
    """A miss within twice its tolerance (a sampler whose precision is worse than it claims could make one) is
    a strike and leaves the group out; the sender is banned at its ``seed_ban_alarms``-th (2)."""
    near = Replay(missed=1, worst=0.015, tolerance=0.01)
    assert not near.gross and Replay(1, 0.021, 0.01).gross and not Replay(0, 0.0, 0.01).gross
    config = SamplingCheckConfig()
    guard = SenderGuard(ReputationConfig(), "me", sampling=config)
    group = ScoredGroup(
        RolloutGroup(
            task="count",
            prompt_id=0,
            prompt_token_ids=[3],
            completions=[Completion(token_ids=[4], logprobs=[-1.0], claimed_reward=0.0)] * 2,
            policy_version=0,
            sampler_peer_id="s",
        ),
        [0.0, 1.0],
    )
    assert guard.judge_samples([group], [[]], [0.0], [None], draw_misses=[near]) == []
    assert guard.judge_samples([group], [[]], [0.0], [None], draw_misses=[None]) == []  # not replayed
    assert guard.judge_samples([group], [[]], [0.0], [None], draw_misses=[near]) == ["s"]
    assert guard.stats()["draw_strikes"] == 2 and guard.reputation.bans()["s"][1] == "not_drawn"


def test_misses_under_weights_not_known_to_be_the_samplers_strike_nobody():
    """A trainer whose round came back partial, or that stepped alone while another trainer published, holds
    other weights under the same version: honest draws miss them (a chaos soak banned every sampler that
    way). Misses at versions whose weights are not known to be the samplers' are counted and strike nobody,
    however gross; the same misses under known weights ban."""
    gross = Replay(missed=1, worst=0.2, tolerance=0.01)
    config = SamplingCheckConfig()
    guard = SenderGuard(ReputationConfig(), "me", sampling=config)
    groups = [
        ScoredGroup(
            RolloutGroup(
                task="count",
                prompt_id=0,
                prompt_token_ids=[3],
                completions=[Completion(token_ids=[4], logprobs=[-1.0], claimed_reward=0.0)] * 2,
                policy_version=version,
                sampler_peer_id=sender,
            ),
            [0.0, 1.0],
        )
        for version, sender in ((7, "a"), (7, "b"), (8, "c"))
    ]
    known = lambda group: group.policy_version == 8  # noqa: E731  version 7's weights are not the samplers'
    for _ in range(3):
        banned = guard.judge_samples(
            groups[:2], [[], []], [0.0, 0.0], [None, None], draw_misses=[gross, gross], known=known
        )
        assert banned == []
    assert guard.stats()["draw_misses_unknown"] == 6 and guard.stats().get("draw_strikes", 0) == 0
    assert guard.reputation.bans() == {}
    assert guard.judge_samples(groups[2:], [[]], [0.0], [None], draw_misses=[gross], known=known) == ["c"]


def test_a_run_that_checks_seeded_draws_refuses_an_unseeded_group(policy):
    model, tokenizer = policy
    task = build_task("count", {})
    prompt_id = 3
    prompt = tokenizer(task.prompt(prompt_id))["input_ids"]
    engine = TransformersEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=task.max_new_tokens, seed=1)
    (samples,) = engine.sample([prompt], G, params)
    group = RolloutGroup(
        task=task.name,
        prompt_id=prompt_id,
        prompt_token_ids=prompt,
        completions=[
            Completion(token_ids=s.token_ids, logprobs=s.logprobs, claimed_reward=task.score(prompt_id, text))
            for s, text in zip(samples, tokenizer.batch_decode([s.token_ids for s in samples]), strict=True)
        ],
        policy_version=0,
        sampling_seed=samples[0].seed,
    )
    strict = IngestValidator(
        {task.name: task}, tokenizer, IngestConfig(vocab_size=len(tokenizer), group_size=G, require_seed=True)
    )
    unseeded = group.model_copy(update={"sampling_seed": ""})
    verdict = strict.validate(unseeded, 0)
    assert not isinstance(verdict, ScoredGroup) and verdict.reason.value == "sampling_mismatch", verdict
    assert "seed" in verdict.detail
    seeded = strict.validate(group, 0)
    assert isinstance(seeded, ScoredGroup) or seeded.reason.value != "sampling_mismatch", seeded
    # the record refuses a malformed seed at parse
    with pytest.raises(ValueError, match="sampling_seed"):
        RolloutGroup.from_bytes(group.model_copy(update={"sampling_seed": "x" * 32}).to_bytes())
