"""learner.py: gradient accumulation equals the full batch, masks, KL at the reference, on-policy ratios."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.train.config import DerivedSettings, GRPOConfig, OptimizerConfig
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_micro_batch_accumulation_equals_full_batch(tiny_model, random_groups, agg) -> None:
    model = tiny_model()
    groups = random_groups(num_groups=4, group_size=3, seed=1)
    base = dict(loss_agg=agg, max_grad_norm=None, tis_cap=2.0)
    full = Learner(model, GRPOConfig(micro_batch_size=None, **base)).compute_gradients(groups)
    g_full = _grads(model)
    assert full["num_micro_batches"] == 1
    for extra in (
        dict(micro_batch_size=1),
        dict(micro_batch_size=5),
        dict(micro_batch_size=None, max_tokens_per_micro_batch=20),
    ):
        stats = Learner(model, GRPOConfig(**base, **extra)).compute_gradients(groups)
        assert stats["num_micro_batches"] > 1
        assert stats["loss"] == pytest.approx(full["loss"], abs=1e-5)
        assert stats["ratio_mean"] == pytest.approx(full["ratio_mean"], abs=1e-5)
        _assert_same_grads(_grads(model), g_full)


def test_padding_contents_do_not_change_loss_or_gradient(tiny_model, random_groups) -> None:
    model = tiny_model()
    groups = random_groups(num_groups=2, group_size=3, seed=2)
    learner = Learner(model, GRPOConfig(micro_batch_size=None, max_grad_norm=None))
    batch = learner.build_batch(groups)
    assert (batch.attention_mask == 0).any()

    def loss_and_grads(input_ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        from echo_p2p.train.grpo import grpo_loss, token_logprobs

        model.zero_grad(set_to_none=True)
        logits = model(input_ids, attention_mask=batch.attention_mask).logits
        loss, _ = grpo_loss(
            token_logprobs(logits, input_ids),
            batch.behaviour_logprobs,
            batch.advantages,
            batch.completion_mask,
        )
        loss.backward()
        return loss.item(), _grads(model)

    loss_a, g_a = loss_and_grads(batch.input_ids)
    noisy = torch.where(
        batch.attention_mask.bool(), batch.input_ids, torch.randint_like(batch.input_ids, 2, 16)
    )
    assert not torch.equal(noisy, batch.input_ids)
    loss_b, g_b = loss_and_grads(noisy)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    _assert_same_grads(g_a, g_b)


def test_kl_term_is_zero_when_policy_equals_reference(tiny_model, random_groups) -> None:
    model = tiny_model()
    groups = random_groups(seed=3)
    Learner(model, GRPOConfig(max_grad_norm=None)).compute_gradients(groups)
    g_plain = _grads(model)
    stats = Learner(
        model, GRPOConfig(kl_beta=0.5, max_grad_norm=None), ref_model=copy.deepcopy(model)
    ).compute_gradients(groups)
    assert stats["kl"] == pytest.approx(0.0, abs=1e-7)
    _assert_same_grads(_grads(model), g_plain, atol=1e-6)
    with pytest.raises(ValueError):
        Learner(model, GRPOConfig(kl_beta=0.1))


@torch.no_grad()
def _sample_group(
    model: torch.nn.Module, prompt: list[int], group_size: int, new_tokens: int, temperature: float, gen
) -> RolloutGroup:
    ids = torch.tensor([prompt] * group_size)
    lps = []
    for _ in range(new_tokens):
        logp = torch.log_softmax(model(ids).logits[:, -1].float() / temperature, -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        lps.append(logp.gather(1, tok))
        ids = torch.cat([ids, tok], 1)
    lp = torch.cat(lps, 1)
    comps = [
        Completion(token_ids=ids[i, len(prompt) :].tolist(), logprobs=lp[i].tolist(), claimed_reward=0.0)
        for i in range(group_size)
    ]
    return RolloutGroup(task="t", prompt_id=0, prompt_token_ids=prompt, completions=comps, policy_version=0)


def test_on_policy_rollouts_have_ratio_one(tiny_model) -> None:
    """Behaviour log-probs from an unpadded sampler line up with the learner's padded recomputation."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    temperature = 0.7
    groups = []
    for k, prompt in enumerate([[3, 4], [5, 6, 7, 8], [9]]):
        grp = _sample_group(model, prompt, group_size=4, new_tokens=2 + k, temperature=temperature, gen=gen)
        groups.append(ScoredGroup(grp, [float(i % 2) for i in range(4)]))
    stats = Learner(
        model, GRPOConfig(micro_batch_size=5), derived=DerivedSettings(temperature=temperature)
    ).compute_gradients(groups)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert abs(stats["behaviour_kl"]) < 1e-4
    assert stats["clip_frac"] == 0.0
    # a mismatched temperature shows up as off-policy
    stats = Learner(model, GRPOConfig()).compute_gradients(groups)
    assert abs(stats["ratio_mean"] - 1.0) > 1e-3


def test_step_updates_weights_and_zero_grad_false_accumulates(tiny_model, random_groups) -> None:
    model = tiny_model()
    groups = random_groups(seed=4)
    learner = Learner(model, GRPOConfig(max_grad_norm=None))
    learner.compute_gradients(groups)
    g1 = _grads(model)
    learner.compute_gradients(groups, zero_grad=False)
    _assert_same_grads(_grads(model), {k: 2 * v for k, v in g1.items()})

    before = [p.detach().clone() for p in model.parameters()]
    opt = OptimizerConfig(lr=1e-3).adamw(model.parameters())
    stats = learner.step(groups, opt)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    for key in (
        "loss",
        "grad_norm",
        "reward_mean",
        "clip_frac",
        "ratio_mean",
        "num_tokens",
        "frac_zero_adv_groups",
    ):
        assert key in stats


def test_grad_norm_is_clipped(tiny_model, random_groups) -> None:
    model = tiny_model()
    stats = Learner(model, GRPOConfig(max_grad_norm=1e-3)).compute_gradients(random_groups(seed=5))
    assert stats["grad_norm"] > 1e-3
    total = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    assert total.item() == pytest.approx(1e-3, rel=1e-3)


def test_zero_advantage_groups_are_reported(tiny_model, scored_group) -> None:
    groups = [scored_group([3], [[4], [5]], [1.0, 1.0]), scored_group([3], [[4], [5]], [0.0, 1.0])]
    stats = Learner(tiny_model(), GRPOConfig()).compute_gradients(groups)
    assert stats["frac_zero_adv_groups"] == 0.5
    assert stats["reward_mean"] == 0.75


class _AllLogits(torch.nn.Module):
    """The same model without a ``logits_to_keep`` argument: the learner gets every position's logits."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids, attention_mask=attention_mask, use_cache=False).logits


def test_logits_only_where_completions_are_predicted_give_the_same_gradient(tiny_model, scored_group) -> None:
    model = tiny_model()
    groups = [
        scored_group([2, 3, 4, 5, 6], [[7, 8], [9], [10, 11, 12]], [1.0, 0.0, 0.5]),
        scored_group([3, 4, 5, 6], [[7], [8, 9, 10, 11], [12, 13]], [0.0, 1.0, 0.0]),
    ]
    widths: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    cfg = GRPOConfig(max_grad_norm=None, micro_batch_size=None)
    kept = Learner(model, cfg).compute_gradients(groups)
    hook.remove()
    g_kept = _grads(model)
    assert widths == [8 - 4 + 1]  # rows of width 8, earliest completion token at 4: positions 3..7
    every = Learner(_AllLogits(model), cfg).compute_gradients(groups)
    assert every["loss"] == pytest.approx(kept["loss"], abs=1e-6)
    _assert_same_grads({f"inner.{k}": v for k, v in g_kept.items()}, _grads(_AllLogits(model)))


def test_policy_precision_computes_the_receivers_policy_and_updates_the_fp32_master(tiny_model) -> None:
    """policy_precision='bf16': the loss is that of the weights rounded to bf16 (what inference peers of a
    bf16 stream hold), so their rollouts are on-policy for it; the gradient is the one of that rounded model,
    applied to the untouched fp32 master weights."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    served = copy.deepcopy(model)  # an inference peer's copy: the trainer's weights cast to bf16
    with torch.no_grad():
        for p in served.parameters():
            p.copy_(p.to(torch.bfloat16))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), served.parameters(), strict=True))
    groups = []
    for k, prompt in enumerate([[3, 4], [5, 6, 7]]):
        grp = _sample_group(served, prompt, group_size=4, new_tokens=3 + k, temperature=1.0, gen=gen)
        groups.append(ScoredGroup(grp, [float(i % 2) for i in range(4)]))
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = dict(micro_batch_size=3, max_grad_norm=None)

    stats = Learner(
        model, GRPOConfig(**cfg), derived=DerivedSettings(policy_precision="bf16")
    ).compute_gradients(groups)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and stats["clip_frac"] == 0.0
    assert all(torch.equal(p, master[n]) for n, p in model.named_parameters())  # master put back exactly
    grads = _grads(model)
    Learner(served, GRPOConfig(**cfg)).compute_gradients(groups)  # the rounded model's own gradient
    _assert_same_grads(grads, _grads(served), atol=0)

    fp32 = Learner(model, GRPOConfig(**cfg)).compute_gradients(groups)  # the master's policy is another one
    assert abs(fp32["ratio_mean"] - 1.0) > 1e-5


def test_a_non_finite_gradient_is_dropped_and_never_stepped(tiny_model, random_groups) -> None:
    """A batch whose loss is not finite leaves zero gradients, says so, and ``step`` does not move a weight."""
    model = tiny_model()
    groups = random_groups(seed=6)
    # the ppo objective without its cap: the one way left for a behaviour log-prob to make it non-finite
    learner = Learner(model, GRPOConfig(ratio_cap=None, objective="ppo"))
    # a stranger's behaviour log-prob that no sampler can produce; uncapped, the loss goes inf/NaN
    groups[0].group.completions[0].logprobs[0] = -1e30
    before = [p.detach().clone() for p in model.parameters()]
    opt = OptimizerConfig(lr=1e-2).adamw(model.parameters())
    stats = learner.step(groups, opt)
    assert stats["nonfinite"] == 1.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # the default ratio cap keeps the same batch finite: it trains
    stats = Learner(model, GRPOConfig()).step(groups, opt)
    assert stats["nonfinite"] == 0.0 and math.isfinite(stats["loss"])
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_previous_version_proximal_is_ppo_one_version_stale_and_interpolates_beyond(
    tiny_model, random_groups
) -> None:
    """``proximal="previous_version"``: a group 1 version stale is trained exactly as under ``ppo`` (the
    proximal policy is its sampler's); a group k versions stale is clipped against the interpolation
    ``behaviour + (k-1)/k (logp - behaviour)``, i.e. its ratio per version."""
    model = tiny_model()
    groups = random_groups(num_groups=3, group_size=3, seed=4)  # sampled at version 0
    prev = dict(objective="decoupled", proximal="previous_version", max_grad_norm=None, ratio_cap=None)
    ppo = Learner(model, GRPOConfig(objective="ppo", max_grad_norm=None, ratio_cap=None)).compute_gradients(
        groups
    )
    g_ppo = _grads(model)
    one_stale = Learner(model, GRPOConfig(**prev)).compute_gradients(groups, current_version=1)
    assert one_stale["loss"] == pytest.approx(ppo["loss"], abs=1e-6)
    _assert_same_grads(_grads(model), g_ppo)
    # without a current version (or on-policy) the proximal policy is this one: decoupled's default
    current = Learner(
        model, GRPOConfig(objective="decoupled", proximal="current", max_grad_norm=None)
    ).compute_gradients(groups)
    g_current = _grads(model)
    for version in (None, 0):
        stats = Learner(model, GRPOConfig(**prev)).compute_gradients(groups, current_version=version)
        assert stats["loss"] == pytest.approx(current["loss"], abs=1e-6)
        _assert_same_grads(_grads(model), g_current)
    # 4 versions stale: by hand, from the learner's own log-probs
    learner = Learner(model, GRPOConfig(**prev, micro_batch_size=None))
    stats = learner.compute_gradients(groups, current_version=4)
    from echo_p2p.train.grpo import grpo_loss, token_logprobs

    batch = learner.build_batch(groups)
    with torch.no_grad():
        logp = token_logprobs(
            model(batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
    behaviour = batch.behaviour_logprobs
    expected, _ = grpo_loss(
        logp, behaviour, batch.advantages, batch.completion_mask,
        objective="decoupled", proximal_logprobs=behaviour + 0.75 * (logp - behaviour),
    )  # fmt: skip
    assert stats["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert stats["loss"] != pytest.approx(current["loss"], abs=1e-4)
