"""batching.py: the right-padded layout, per-token alignment and the micro-batch split."""

from __future__ import annotations

import pytest
import torch

from echo_p2p.train.batching import build_batch, split_micro_batches


def test_layout_is_right_padded_and_aligned(scored_group) -> None:
    g = scored_group([5, 6], [[7, 8, 1], [9]], [1.0, 0.0], version=3, logprobs=[[-0.1, -0.2, -0.3], [-0.4]])
    h = scored_group([4], [[2, 3]], [0.5], version=4, logprobs=[[-0.5, -0.6]])
    b = build_batch([g, h], pad_token_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 1], [5, 6, 9, 0, 0], [4, 2, 3, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert b.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0]]
    torch.testing.assert_close(
        b.behaviour_logprobs,
        torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0, 0], [0, -0.5, -0.6, 0, 0]]),
    )
    torch.testing.assert_close(b.seq_advantages, torch.tensor([1.0, -1.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.advantages, b.seq_advantages[:, None] * b.completion_mask)
    assert b.rewards.tolist() == [1.0, 0.0, 0.5]
    assert b.policy_versions.tolist() == [3, 3, 4]
    assert b.group_index.tolist() == [0, 0, 1]
    assert b.num_sequences == 3 and b.num_tokens == 6


def test_dr_grpo_advantages_are_not_scaled(scored_group) -> None:
    g = scored_group([5], [[7], [8], [9], [10]], [0.0, 0.0, 0.0, 2.0])
    b = build_batch([g], scale_rewards=False)
    assert b.seq_advantages.tolist() == [-0.5, -0.5, -0.5, 1.5]


def test_empty_completion_and_bad_records(scored_group) -> None:
    b = build_batch([scored_group([5, 6], [[], [7]], [0.0, 1.0])])
    assert b.completion_mask.tolist() == [[0, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match="empty prompt"):
        build_batch([scored_group([], [[7]], [1.0])])
    with pytest.raises(ValueError, match="logprobs"):
        build_batch([scored_group([5], [[7, 8]], [1.0], logprobs=[[-1.0]])])
    with pytest.raises(ValueError):
        scored_group([5], [[7], [8]], [1.0])  # one reward for two completions
    with pytest.raises(ValueError):
        scored_group([5], [[7]], [float("nan")])


def test_split_by_count_keeps_order_and_trims_width(random_groups) -> None:
    b = build_batch(random_groups(num_groups=3, group_size=3))
    parts = split_micro_batches(b, micro_batch_size=4)
    assert [p.num_sequences for p in parts] == [4, 4, 1]
    assert torch.equal(torch.cat([p.rewards for p in parts]), b.rewards)
    for p in parts:
        assert p.input_ids.shape[1] == int(p.attention_mask.sum(1).max())
    assert sum(p.num_tokens for p in parts) == b.num_tokens
    assert split_micro_batches(b)[0].num_sequences == b.num_sequences


def test_split_by_token_budget(scored_group) -> None:
    g = scored_group([5], [[6] * 2, [6] * 2, [6] * 9, [6] * 2, [6] * 2, [6] * 2], [0.0, 1.0, 0, 1, 0, 1])
    b = build_batch([g])  # row lengths 3, 3, 10, 3, 3, 3
    parts = split_micro_batches(b, max_tokens=8)
    assert [p.num_sequences for p in parts] == [2, 1, 2, 1]  # the 10-token row is alone
    for p in parts[:1] + parts[2:]:
        assert p.input_ids.numel() <= 8
    parts = split_micro_batches(b, micro_batch_size=1, max_tokens=100)
    assert len(parts) == 6
