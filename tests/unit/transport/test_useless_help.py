"""Useless help: valid groups that teach nothing (every completion re-scored the same, or completions already
received in another order or under another version) and groups pushed beyond a sender's grant never reach a
batch; the real validator, buffer, pacer and ingest servicer, fed hand-made groups of the ``count`` task."""

from __future__ import annotations

import uuid

import pytest

from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
from echo_p2p.ml.tokenizer import build_char_tokenizer, encode_prompts
from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.buffer import ReplayBuffer
from echo_p2p.train.pacing import Pacer, PacingConfig
from echo_p2p.transport.rollouts.config import IngestServerConfig
from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer

G = 4
VERSION = 3
TOK = build_char_tokenizer()
TASK = build_task("count")
#: prompt ids of the training split (held-out ones are refused before anything else)
TRAIN = [p for p in range(TASK.num_prompts) if not TASK.is_held_out(p)]


def group(k: int, texts: list[str], version: int = VERSION) -> RolloutGroup:
    """A group for the ``k``-th training prompt."""
    prompt_id = TRAIN[k % len(TRAIN)]
    prompt = encode_prompts(TOK, [TASK.prompt(prompt_id)], use_chat_template=False)[0]
    completions = []
    for text in texts:
        ids = encode_prompts(TOK, [text], use_chat_template=False)[0] + [TOK.eos_token_id]
        completions.append(
            Completion(token_ids=ids, logprobs=[-0.2] * len(ids), claimed_reward=TASK.score(prompt_id, text))
        )
    return RolloutGroup(
        task="count",
        prompt_id=prompt_id,
        prompt_token_ids=prompt,
        completions=completions,
        policy_version=version,
    )


def right(k: int) -> RolloutGroup:
    """What an honest sampler whose policy is always right sends: G right answers (zero reward variance)."""
    return group(k, [TASK.target(TRAIN[k % len(TRAIN)])] * G)


def mixed_texts(k: int) -> list[str]:
    target = TASK.target(TRAIN[k % len(TRAIN)])
    return [target, target + "c", target, "d" * (1 + k // len(TRAIN))]  # distinct for every k


def mixed(k: int) -> RolloutGroup:
    return group(k, mixed_texts(k))


def payloads(groups: list[RolloutGroup]) -> list[rollouts_pb2.RolloutPayload]:
    return [rollouts_pb2.RolloutPayload(rollout_id=g.rollout_id, group=g.to_bytes()) for g in groups]


def make_servicer(
    pacer: Pacer | None = None, capacity: int = 64
) -> tuple[RolloutIngestServicer, ReplayBuffer]:
    validator = IngestValidator(
        {"count": TASK}, TOK, IngestConfig(vocab_size=len(TOK), group_size=G, max_staleness=2)
    )
    buffer = ReplayBuffer(capacity=capacity, max_staleness=2)
    servicer = RolloutIngestServicer(
        lambda g: validator.validate(g, VERSION),
        buffer,
        IngestServerConfig(received_reward_window=8),
        current_version=lambda: VERSION,
        pacer=pacer,
    )
    return servicer, buffer


def reasons(acks) -> list[str]:
    return [a.reason or "accepted" for a in acks]


def test_zero_variance_and_replayed_groups_never_reach_a_batch_from_one_key_or_many():
    servicer, buffer = make_servicer()
    try:
        honest = mixed(7)
        # one Sybil key per group: the refusal is by content, not by sender
        useless = [right(p) for p in (5, 6, 8)]
        shuffled = honest.model_copy(deep=True)
        shuffled.rollout_id = uuid.uuid4().hex
        shuffled.completions.reverse()  # the same completions in another order
        relabelled = honest.model_copy(deep=True)
        relabelled.rollout_id = uuid.uuid4().hex
        relabelled.policy_version = VERSION - 1  # ... or claimed for another version
        assert reasons(servicer._process("honest", payloads([honest]))) == ["accepted"]
        verdicts = [
            reasons(servicer._process(f"sybil-{i}", payloads([g])))[0]
            for i, g in enumerate([*useless, shuffled, relabelled])
        ]
        assert verdicts == ["no_signal"] * 3 + ["duplicate_content"] * 2
        batch = buffer.take(64, VERSION)
        assert [g.rollout_id for g in batch] == [honest.rollout_id]  # nothing useless reached the batch
        assert servicer.stats()["rejected"]["no_signal"] == 3
        assert servicer.sender_stats("sybil-0").rejected["no_signal"] == 1
    finally:
        servicer.shutdown()


def test_an_honest_always_right_sampler_is_dropped_not_struck_and_its_reward_is_counted():
    servicer, buffer = make_servicer()
    try:
        acks = servicer._process("honest", payloads([right(5), right(6), mixed(7)]))
        assert reasons(acks) == ["no_signal", "no_signal", "accepted"]
        # refused with a reason that is not an offence: not retried, logged quietly by the sender, and the
        # sender goes on being served; only the useful group takes a buffer slot
        assert all(a.status == rollouts_pb2.GroupAck.REJECTED for a in acks[:2])
        assert len(buffer) == 1 and servicer.sender_stats("honest").accepted == 1
        # the same all-right group again (a policy that always answers the same) is a duplicate whose
        # remembered reward still counts: received_reward_mean is over every group received
        again = right(5)
        assert reasons(servicer._process("honest", payloads([again]))) == ["duplicate_content"]
        mixed_mean = sum(TASK.score(TRAIN[7 % len(TRAIN)], t) for t in mixed_texts(7)) / G
        expected = (1.0 + 1.0 + mixed_mean + 1.0) / 4
        assert servicer.received_reward_mean() == pytest.approx(expected)
        assert servicer.stats()["received_reward_mean"] == pytest.approx(expected, abs=1e-4)
        # while the trainer's batch sees only the mixed group's reward
        assert sum(buffer.take(8, VERSION)[0].rewards) / G == pytest.approx(mixed_mean)
    finally:
        servicer.shutdown()


def test_received_reward_mean_is_over_the_last_window_of_groups():
    servicer, _ = make_servicer()
    try:
        assert servicer.received_reward_mean() is None
        servicer._process("honest", payloads([group(p, ["d"] * G) for p in range(1, 5)]))  # reward 0 each
        servicer._process("honest", payloads([right(p) for p in range(5, 13)]))  # window 8: only these
        assert servicer.received_reward_mean() == pytest.approx(1.0)
    finally:
        servicer.shutdown()


def test_a_sender_pushing_without_grants_cannot_fill_the_buffer_over_granted_senders():
    config = PacingConfig(newcomer_grant=2, grant_seconds=30)
    pacer = Pacer(config, batch_groups=8, max_staleness=2)  # target D = 16
    servicer, buffer = make_servicer(pacer)
    try:
        granted = pacer.grant("honest", usable=0, proven=True)
        assert granted == 16
        # a key that never asked: two groups of its allowance, then refused (retryable: not_granted)
        flood = [mixed(p) for p in range(1, 11)]
        verdicts = reasons(servicer._process("flooder", payloads(flood)))
        assert verdicts == ["accepted"] * 2 + ["not_granted"] * 8
        # many keys that never asked share half the target in all
        sybils = [reasons(servicer._process(f"sybil-{p}", payloads([mixed(p)])))[0] for p in range(11, 31)]
        assert sybils.count("accepted") == 16 // 2 - 2
        # the granted sender delivers its whole grant, useless groups charged against it like useful ones
        honest = [right(31), *[mixed(p) for p in range(32, 47)]]
        verdicts = reasons(servicer._process("honest", payloads(honest)))
        assert verdicts == ["no_signal"] + ["accepted"] * 15
        assert reasons(servicer._process("honest", payloads([mixed(47)]))) == ["not_granted"]  # grant used up
        assert buffer.held_by("honest") == 15 and buffer.held_by("flooder") == 2
        assert pacer.stats()["not_granted"] == 8 + 14 + 1
    finally:
        servicer.shutdown()
