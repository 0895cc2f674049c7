"""grpo.py: advantages, log-probs, the clipped objective and the KL term against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from echo_p2p.train.grpo import group_advantages, grpo_loss, token_logprobs


def test_advantages_match_hand_computed() -> None:
    std = math.sqrt(1.25)
    expected = [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std]
    assert group_advantages([1, 2, 3, 4], eps=0.0) == pytest.approx(expected, abs=1e-12)
    assert group_advantages([0.0, 1.0]) == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert group_advantages([1, 2, 3, 4], scale_rewards=False) == pytest.approx([-1.5, -0.5, 0.5, 1.5])


def test_all_equal_rewards_give_exact_zero_advantages() -> None:
    for rewards in ([0.7, 0.7, 0.7, 0.7], [0.0, 0.0], [1.0], [0.1] * 16):
        for scale in (True, False):
            adv = group_advantages(rewards, scale_rewards=scale)
            assert adv == [0.0] * len(rewards)
            assert not any(math.isnan(a) for a in adv)
    assert group_advantages([]) == []


def test_token_logprobs_align_with_input_ids_and_use_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    for temp in (1.0, 0.7):
        out = token_logprobs(logits, ids, temperature=temp)
        ref = torch.log_softmax(logits / temp, dim=-1)
        assert out.shape == ids.shape
        assert torch.all(out[:, 0] == 0)
        for t in range(1, 5):
            expected = ref[torch.arange(2), t - 1, ids[:, t]]
            torch.testing.assert_close(out[:, t], expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        token_logprobs(logits, ids, temperature=0.0)


def _reference_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Plain autograd: full log-softmax, gather (what ``token_logprobs`` must equal)."""
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    chosen = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(chosen, (1, 0), value=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_gradient_equals_autograd_through_log_softmax(monkeypatch, temperature) -> None:
    """The hand-written backward is exact, also when the rows are split into several chunks."""
    import echo_p2p.train.grpo as grpo

    monkeypatch.setattr(grpo, "_CHUNK_ELEMENTS", 3 * 11)  # 3 rows per chunk: 4 chunks for 2 x 5 rows
    torch.manual_seed(1)
    logits = (3 * torch.randn(2, 5, 11)).requires_grad_(True)
    ids = torch.randint(0, 11, (2, 5))
    weights = torch.randn(2, 5)
    out = token_logprobs(logits, ids, temperature)
    (out * weights).sum().backward()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = _reference_logprobs(ref_logits, ids, temperature)
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-6, rtol=1e-6)  # float32 vs float64
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-6, rtol=0)


def test_token_logprobs_of_the_last_positions_only() -> None:
    """Logits of the last K positions (a model called with logits_to_keep=K) give the same log-probs
    where they reach, and 0 before; bf16 logits are computed in float32 and get a bf16 gradient."""
    torch.manual_seed(2)
    logits = torch.randn(3, 6, 9)
    ids = torch.randint(0, 9, (3, 6))
    full = token_logprobs(logits, ids)
    for keep in (1, 2, 4, 6):
        part = token_logprobs(logits[:, -keep:], ids)
        assert part.shape == ids.shape
        covered = 6 - keep + 1  # first column predicted by the kept logits
        torch.testing.assert_close(part[:, covered:], full[:, covered:], atol=0, rtol=0)
        assert torch.all(part[:, :covered] == 0)
    with pytest.raises(ValueError):
        token_logprobs(torch.randn(3, 7, 9), ids)  # more positions than tokens
    half = logits.bfloat16().requires_grad_(True)
    out = token_logprobs(half, ids)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad).all()


# One row, position 0 is the prompt; five completion tokens cover every branch of the clip.
_RATIOS = [1.0, 1.1, 1.5, 0.5, 1.5, 0.5]
_ADV = [0.0, 1.0, 1.0, -1.0, -1.0, 2.0]
#  t1 r=1.1 A=+1: inside the clip      obj  1.1  d obj/d logp = r*A = 1.1
#  t2 r=1.5 A=+1: clipped high         obj  1.2  grad 0
#  t3 r=0.5 A=-1: clipped low          obj -0.8  grad 0
#  t4 r=1.5 A=-1: unclipped branch     obj -1.5  grad -1.5
#  t5 r=0.5 A=+2: unclipped branch     obj  1.0  grad 1.0


def _tiny_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -1.2, -0.3, -2.5]])
    logp = (behaviour + torch.log(torch.tensor([_RATIOS]))).requires_grad_(True)
    mask = torch.tensor([[0.0, 1, 1, 1, 1, 1]])
    return logp, behaviour, torch.tensor([_ADV]), mask


def test_clipped_objective_matches_hand_computed() -> None:
    logp, behaviour, adv, mask = _tiny_case()
    loss, stats = grpo_loss(logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-(1.1 + 1.2 - 0.8 - 1.5 + 1.0) / 5, abs=1e-6)
    loss.backward()
    expected_grad = torch.tensor([[0.0, -1.1, 0.0, 0.0, 1.5, -1.0]]) / 5
    torch.testing.assert_close(logp.grad, expected_grad, atol=1e-6, rtol=0)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["clip_frac_high"] == pytest.approx(1 / 5)
    assert stats["clip_frac_low"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx(sum(_RATIOS[1:]) / 5, abs=1e-6)
    assert stats["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert stats["num_tokens"] == 5


def test_truncated_ratio_caps_value_and_gradient_on_top_of_clip() -> None:
    logp, behaviour, adv, mask = _tiny_case()
    loss, stats = grpo_loss(logp, behaviour, adv, mask, tis_cap=1.3)
    # t4 now uses min(1.5, 1.3): obj -1.3, grad -1.3; t2 stays clipped at 1.2
    assert loss.item() == pytest.approx(-(1.1 + 1.2 - 0.8 - 1.3 + 1.0) / 5, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, -1.1, 0.0, 0.0, 1.3, -1.0]]) / 5, atol=1e-6, rtol=0
    )
    assert stats["tis_capped_frac"] == pytest.approx(2 / 5)


def test_huge_negative_advantage_ratio_stays_finite_with_cap() -> None:
    behaviour = torch.tensor([[0.0, -30.0]])
    logp = torch.tensor([[0.0, -0.01]], requires_grad=True)  # ratio ~ e^30
    loss, _ = grpo_loss(logp, behaviour, torch.tensor([-1.0]), torch.tensor([[0.0, 1.0]]), tis_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.0, abs=1e-4)
    assert logp.grad[0, 1].item() == pytest.approx(2.0, abs=1e-4)


def test_seq_mean_aggregation_and_normalizer() -> None:
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -1.2], [-1.0, -0.3, -2.5, 0.0]])
    ratios = torch.tensor([[1.0, 1.1, 1.5, 0.5], [1.0, 1.5, 0.5, 1.0]])
    logp = behaviour + torch.log(ratios)
    adv = torch.tensor([1.0, -1.0])  # per sequence
    mask = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 0, 0]])  # row 2: one completion token, then padding
    # row 1: (1.1 + 1.2 + min(0.5, 0.8)=0.5) / 3 ; row 2: min(-1.5, -1.2) = -1.5
    loss, _ = grpo_loss(logp, behaviour, adv, mask, agg="seq_mean")
    expected = -((1.1 + 1.2 + 0.5) / 3 + (-1.5)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss_n, _ = grpo_loss(logp, behaviour, adv, mask, agg="seq_mean", normalizer=8.0)
    assert loss_n.item() == pytest.approx(expected * 2 / 8, abs=1e-6)
    loss_t, _ = grpo_loss(logp, behaviour, adv, mask, agg="token_mean")
    assert loss_t.item() == pytest.approx(-(1.1 + 1.2 + 0.5 - 1.5) / 4, abs=1e-6)


def test_masked_positions_never_change_loss_or_gradient() -> None:
    torch.manual_seed(0)
    base_logp = -torch.rand(3, 6) * 3
    behaviour = -torch.rand(3, 6) * 3
    adv = torch.randn(3, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.float32)
    ref = -torch.rand(3, 6) * 3

    def run(logp_v, behaviour_v, adv_v, ref_v):
        logp = logp_v.clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, behaviour_v, adv_v, mask, ref_logprobs=ref_v, kl_beta=0.1, tis_cap=3.0)
        loss.backward()
        return loss.detach(), logp.grad

    loss_a, grad_a = run(base_logp, behaviour, adv, ref)
    off = mask == 0
    garbage = torch.where(off, torch.full_like(behaviour, 1e4), behaviour)
    neg_garbage = torch.where(off, torch.full_like(behaviour, -1e4), behaviour)
    for b in (garbage, neg_garbage):
        loss_b, grad_b = run(
            torch.where(off, torch.full_like(base_logp, -50.0), base_logp),
            b,
            torch.where(off, torch.full_like(adv, 123.0), adv),
            torch.where(off, torch.full_like(ref, 40.0), ref),
        )
        assert torch.isfinite(loss_b)
        torch.testing.assert_close(loss_b, loss_a)
        torch.testing.assert_close(grad_b[~off], grad_a[~off])
        assert torch.all(grad_b[off] == 0)


def test_k3_kl_is_zero_for_identical_policies_and_hand_computed_otherwise() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.zeros(1)
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, ref_logprobs=logp.detach().clone(), kl_beta=0.5)
    assert stats["kl"] == 0.0
    loss.backward()
    assert torch.all(logp.grad == 0)
    ref = torch.tensor([[0.0, -0.5, -2.0]])  # d = ref - logp = 0.5 on token 1, 0 on token 2
    _, stats = grpo_loss(logp.detach(), logp.detach(), adv, mask, ref_logprobs=ref, kl_beta=0.5)
    assert stats["kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 2, abs=1e-6)


@pytest.mark.parametrize("objective", ["ppo", "decoupled"])
def test_kl_penalty_adds_beta_k3_per_token_to_the_loss_and_its_gradient(objective) -> None:
    """TRL's ``beta`` with the k3 estimator, per completion token: loss_t = -A r_t + beta (e^d - d - 1),
    d = ref - logp; on-policy (r = 1 in value), token_mean over the 3 completion tokens. Hand-computed:
    d = (0.5, -0.2, 0.0) on the completion tokens, k3 = (e^0.5 - 1.5, e^-0.2 - 0.8, 0);
    d loss / d logp_t = (-A + beta (1 - e^d)) / 3."""
    beta = 0.1
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    ref = torch.tensor([[9.0, -0.5, -2.2, -0.5, -1.0]])  # position 0 and the padding at 4 are masked
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5])
    loss, stats = grpo_loss(
        logp, logp.detach(), adv, mask, ref_logprobs=ref, kl_beta=beta, objective=objective
    )
    k3 = [math.exp(0.5) - 1.5, math.exp(-0.2) - 0.8, 0.0]
    assert stats["kl"] == pytest.approx(sum(k3) / 3, abs=1e-6)
    assert loss.item() == pytest.approx((-0.5 * 3 + beta * sum(k3)) / 3, abs=1e-6)
    loss.backward()
    expected = [0.0] + [(-0.5 + beta * (1 - math.exp(d))) / 3 for d in (0.5, -0.2, 0.0)] + [0.0]
    torch.testing.assert_close(logp.grad[0], torch.tensor(expected), atol=1e-6, rtol=0)
    # beta = 0 with a reference: the KL is reported, not in the loss
    loss0, stats0 = grpo_loss(logp.detach(), logp.detach(), adv, mask, ref_logprobs=ref, kl_beta=0.0)
    assert stats0["kl"] == pytest.approx(stats["kl"]) and loss0.item() == pytest.approx(-0.5, abs=1e-6)


def test_kl_beta_without_reference_is_an_error() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 2), kl_beta=0.1)


def test_ratio_cap_bounds_loss_and_gradient_whatever_the_behaviour_logprob() -> None:
    """A behaviour log-prob of -1e30 (finite, <= 0) made the loss NaN; with the dual-clip cap the token adds
    ratio_cap * |A| to the loss and no gradient, and the stats stay finite."""
    for adv in (-1.0, 1.0, 0.0):
        behaviour = torch.tensor([[0.0, -1e30, -0.5]])
        logp = torch.tensor([[0.0, -0.7, -0.5]], requires_grad=True)
        mask = torch.tensor([[0.0, 1.0, 1.0]])
        loss, stats = grpo_loss(logp, behaviour, torch.tensor([adv]), mask, ratio_cap=10.0)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
        # token 1: ratio capped at 10 -> -min(10 A, 1.2 A) (A<0: 10, A>0: -1.2); token 2: ratio 1 -> -A
        token1 = 10.0 if adv < 0 else -1.2 * adv
        assert loss.item() == pytest.approx((token1 - adv) / 2, abs=1e-5)
        assert logp.grad[0, 1].item() == 0.0
        assert all(math.isfinite(v) for v in stats.values())
        assert stats["ratio_capped_frac"] == pytest.approx(0.5)
    # without the cap the same batch is not finite: the cap is what bounds it
    behaviour = torch.tensor([[0.0, -1e30]])
    loss, _ = grpo_loss(torch.zeros(1, 2), behaviour, torch.tensor([0.0]), torch.tensor([[0.0, 1.0]]))
    assert not math.isfinite(loss.item())
    with pytest.raises(ValueError):
        grpo_loss(
            torch.zeros(1, 2), behaviour, torch.tensor([0.0]), torch.tensor([[0.0, 1.0]]), ratio_cap=1.1
        )


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(4, 1.0, 1.0), (0, 0.7, 1.0), (6, 0.8, 0.7), (1, 0.5, 1.0)]
)
def test_filtered_token_logprobs_match_the_engines_distribution_and_autograd(
    monkeypatch, top_k, top_p, temperature
) -> None:
    """With top-k / top-p the log-probs are those of the distribution the engines sample from
    (``process_logits``); the hand-written backward equals autograd through the masked log-softmax; a
    target outside the kept set stays in it (finite log-prob) instead of -inf."""
    import echo_p2p.train.grpo as grpo
    from echo_p2p.ml.engine import SamplingParams, process_logits

    monkeypatch.setattr(grpo, "_CHUNK_ELEMENTS", 3 * 11)  # several chunks
    torch.manual_seed(3)
    logits = (3 * torch.randn(2, 6, 11)).requires_grad_(True)
    ids = torch.randint(0, 11, (2, 6))
    weights = torch.randn(2, 6)
    out = token_logprobs(logits, ids, temperature, top_k, top_p)
    (out * weights).sum().backward()

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    engine = process_logits(logits.detach()[:, :-1], params)  # [2, 5, 11], -inf outside the kept set
    kept = torch.isfinite(engine)
    kept.scatter_(-1, ids[:, 1:].unsqueeze(-1), True)  # the target is always kept
    ref_logits = logits.detach().double().requires_grad_(True)
    masked = (ref_logits[:, :-1] / temperature).masked_fill(~kept, float("-inf"))
    ref = torch.log_softmax(masked, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    (torch.nn.functional.pad(ref, (1, 0)) * weights.double()).sum().backward()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1:].double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-5, rtol=0)
    inside = torch.isfinite(engine.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1))
    assert inside.any()  # where the engine could sample the token, it is exactly the engine's log-prob
    torch.testing.assert_close(
        out[:, 1:][inside], engine.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[inside], atol=1e-5, rtol=0
    )


# ----------------------------------------------------------------------------------- decoupled objective
# The same tokens as ``_tiny_case`` (ratios to the behaviour log-probs 1.1, 1.5, 0.5, 1.5, 0.5; advantages
# 1, 1, -1, -1, 2). Under "decoupled" the clip is taken against this policy (ratio 1 in value), so every
# token's gradient is its behaviour weight w = cap(ratio) times A: none is cut by the clip.


def _decoupled_grad(weights: list[float], **kwargs) -> tuple[float, torch.Tensor, dict[str, float]]:
    logp, behaviour, adv, mask = _tiny_case()
    loss, stats = grpo_loss(logp, behaviour, adv, mask, objective="decoupled", **kwargs)
    loss.backward()
    expected = -torch.tensor([[0.0] + [w * a for w, a in zip(weights, _ADV[1:], strict=True)]]) / 5
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=0)
    return loss.item(), logp.grad, stats


def test_decoupled_weights_every_token_by_its_truncated_behaviour_ratio() -> None:
    truncated = [min(r, 1.3) for r in _RATIOS[1:]]
    loss, _, stats = _decoupled_grad(truncated, behaviour_cap=1.3)
    assert loss == pytest.approx(-sum(w * a for w, a in zip(truncated, _ADV[1:], strict=True)) / 5, abs=1e-6)
    assert stats["clip_frac"] == 0.0  # the clip is against this policy: nothing is cut
    assert stats["behaviour_outside_clip_frac"] == pytest.approx(4 / 5)  # 1.5, 0.5, 1.5, 0.5 vs [0.8, 1.2]
    assert stats["behaviour_capped_frac"] == pytest.approx(2 / 5)
    assert stats["behaviour_weight_mean"] == pytest.approx(sum(truncated) / 5, abs=1e-6)
    # the ppo objective on the same tokens cuts two of them (t2: r 1.5 A>0, t3: r 0.5 A<0)
    logp, behaviour, adv, mask = _tiny_case()
    ppo_loss, _ = grpo_loss(logp, behaviour, adv, mask)
    ppo_loss.backward()
    assert int((logp.grad[0, 1:] == 0).sum()) == 2


def test_decoupled_mask_leaves_out_tokens_above_the_cap_and_off_ignores_the_sampler() -> None:
    masked = [r if r <= 1.3 else 0.0 for r in _RATIOS[1:]]
    _decoupled_grad(masked, behaviour_cap=1.3, behaviour_weight="mask")
    _, _, stats = _decoupled_grad([1.0] * 5, behaviour_weight="off")
    assert stats["behaviour_weight_mean"] == 1.0


def test_decoupled_equals_ppo_on_policy() -> None:
    """Sampler == trainer: both objectives give the same loss and gradient (plain policy gradient)."""
    torch.manual_seed(3)
    behaviour = -torch.rand(3, 6) * 3
    adv, mask = torch.randn(3), (torch.rand(3, 6) > 0.3).float()
    grads = []
    for objective in ("ppo", "decoupled"):
        logp = behaviour.clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, behaviour, adv, mask, objective=objective)
        loss.backward()
        grads.append((loss.item(), logp.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-6, rtol=0)


def test_decoupled_clips_against_a_given_proximal_policy() -> None:
    """With the proximal log-probs of an earlier step, the clip works as PPO's against them."""
    proximal = torch.tensor([[0.0, -1.0, -1.0]])
    logp = (proximal + torch.log(torch.tensor([[1.0, 1.5, 1.1]]))).requires_grad_(True)
    behaviour = proximal.clone()  # the sampler was the proximal policy: weight 1
    loss, stats = grpo_loss(
        logp, behaviour, torch.tensor([1.0]), torch.tensor([[0.0, 1.0, 1.0]]),
        objective="decoupled", proximal_logprobs=proximal,
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(-(1.2 + 1.1) / 2, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -1.1 / 2]]), atol=1e-6, rtol=0)
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_decoupled_loss_is_bounded_whatever_the_behaviour_logprob() -> None:
    for adv in (-1.0, 1.0):
        behaviour = torch.tensor([[0.0, -1e30, 0.0]])
        logp = torch.tensor([[0.0, -0.7, -50.0]], requires_grad=True)
        loss, stats = grpo_loss(
            logp, behaviour, torch.tensor([adv]), torch.tensor([[0.0, 1.0, 1.0]]), objective="decoupled"
        )
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
        assert abs(loss.item()) <= 2.0 * abs(adv)  # the weight is at most the cap (2)
        assert all(math.isfinite(v) for v in stats.values())
    with pytest.raises(ValueError):
        grpo_loss(
            logp, behaviour, torch.tensor([1.0]), torch.ones(1, 3), objective="decoupled", behaviour_cap=0
        )


def test_decoupled_proximal_interpolated_from_a_lying_sampler_stays_bounded() -> None:
    """The ``previous_version`` proximal policy is interpolated from the sampler's log-probs: a -1e30 there
    gives a huge ratio to it, which the dual-clip cap bounds as under ``ppo``."""
    behaviour = torch.tensor([[0.0, -1e30]])
    for adv in (-1.0, 1.0):
        logp = torch.tensor([[0.0, -0.7]], requires_grad=True)
        proximal = behaviour + 0.75 * (logp.detach() - behaviour)
        loss, stats = grpo_loss(
            logp, behaviour, torch.tensor([adv]), torch.tensor([[0.0, 1.0]]),
            objective="decoupled", proximal_logprobs=proximal, ratio_cap=10.0,
        )  # fmt: skip
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
        assert abs(loss.item()) <= 2.0 * 10.0  # weight <= behaviour_cap, ratio <= ratio_cap
        assert stats["ratio_capped_frac"] == 1.0
