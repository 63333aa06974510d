"""The conventions of verl and OpenRLHF that rlcourse's losses can be set to (lesson 13's table).

Each setting is checked against numbers worked out by hand, not against the code it tests. The
defaults are TRL 1.16's and are checked against TRL itself in tests/test_trl_parity_grpo.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.losses import aggregate_loss, group_advantages, per_token_loss, ppo_clip_objective
from rlcourse.returns import whiten


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_abs_a():
    ratio = torch.tensor([5.0, 2.0, 0.5, 5.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    plain = ppo_clip_objective(ratio, adv, 0.2)
    dual = ppo_clip_objective(ratio, adv, 0.2, dual_clip=3.0)
    # by hand: min(rA, clip(r, 0.8, 1.2) A) = -5, -2, -0.8, 1.2; then max(., 3A) where A < 0
    assert plain.tolist() == pytest.approx([-5.0, -2.0, -0.8, 1.2])
    assert dual.tolist() == pytest.approx([-3.0, -2.0, -0.8, 1.2])
    (grad,) = torch.autograd.grad(dual.sum(), ratio)
    assert grad.tolist() == pytest.approx([0.0, -1.0, 0.0, 0.0])     # capped and clipped tokens do not learn
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_objective(ratio, adv, 0.2, dual_clip=1.0)


def test_dual_clip_in_per_token_loss_and_refused_where_there_is_no_clip():
    logp = torch.log(torch.tensor([[4.0, 1.0]], dtype=torch.float64))   # old = 0: ratios 4 and 1
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss = per_token_loss(logp, old, torch.tensor([-0.5], dtype=torch.float64), mask, "grpo", dual_clip=3.0)
    assert loss[0].tolist() == pytest.approx([1.5, 0.5])             # 3 * |A| instead of 4 * |A|
    with pytest.raises(ValueError, match="dual_clip"):
        per_token_loss(logp, old, torch.tensor([-0.5]), mask, "cispo", dual_clip=3.0)


def test_cispo_two_sided_relative_weights_against_absolute_upper_cap():
    ratios = torch.tensor([[0.5, 1.0, 3.0]], dtype=torch.float64)
    logp = torch.log(ratios).requires_grad_(True)                         # old = 0, so w = exp(logp)
    old, mask, adv = torch.zeros_like(ratios), torch.ones_like(ratios), torch.tensor([2.0], dtype=torch.float64)
    for clip, eps_high, weights in (("upper", 5.0, [0.5, 1.0, 3.0]), ("two_sided", 0.28, [0.8, 1.0, 1.28])):
        loss = per_token_loss(logp, old, adv, mask, "cispo", epsilon=0.2, epsilon_high=eps_high, cispo_clip=clip)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert grad[0].tolist() == pytest.approx([-2.0 * w for w in weights])   # d/dlogp of -sg(w) A logp
    with pytest.raises(ValueError, match="cispo_clip"):
        per_token_loss(logp, old, adv, mask, "cispo", cispo_clip="relative")


def test_kl_bound_clamps_each_tokens_k3_and_stops_its_gradient():
    logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-16.0, -1.5]], dtype=torch.float64)               # log(ref / pi) = -15 and -0.5
    zeros = torch.zeros(1, dtype=torch.float64)
    k3 = [math.exp(-15) - 1 + 15, math.exp(-0.5) - 1 + 0.5]                # 14.0000003, 0.1065
    kwargs = dict(loss_type="dapo", beta=1.0, ref_logprobs=ref, use_bias_correction_kl=False)
    free = per_token_loss(logp, logp.detach(), zeros, torch.ones_like(logp), **kwargs)
    bounded = per_token_loss(logp, logp.detach(), zeros, torch.ones_like(logp), kl_bound=10.0, **kwargs)
    assert free[0].tolist() == pytest.approx(k3)
    assert bounded[0].tolist() == pytest.approx([10.0, k3[1]])
    (grad,) = torch.autograd.grad(bounded.sum(), logp)
    # d k3 / d logp = 1 - ref/pi where not clamped
    assert grad[0].tolist() == pytest.approx([0.0, 1.0 - math.exp(-0.5)])


def test_drop_empty_and_divide_by_batch_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # sequence means 1.5 and 3 (the third completion is empty)
    assert aggregate_loss(per_token, mask, "grpo").item() == pytest.approx((1.5 + 3.0) / 3)
    assert aggregate_loss(per_token, mask, "grpo", drop_empty=True).item() == pytest.approx((1.5 + 3.0) / 2)
    assert aggregate_loss(per_token, mask, "sapo", drop_empty=True).item() == pytest.approx((1.5 + 3.0) / 2)
    # token sum 6 over max_completion_length 3, with and without 1/B (B = 3)
    assert aggregate_loss(per_token, mask, "dr_grpo", 3).item() == pytest.approx(6.0 / 9)
    assert aggregate_loss(per_token, mask, "dr_grpo", 3, divide_by_batch=False).item() == pytest.approx(6.0 / 3)
    # nothing changes where the convention has nothing to act on
    full = torch.ones_like(mask)
    assert aggregate_loss(per_token, full, "grpo", drop_empty=True) == aggregate_loss(per_token, full, "grpo")


def test_whiten_with_bessels_correction_equals_numpy_ddof_1():
    x = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    expected = (x - x.mean()) / (x.std(ddof=1) + 1e-8)
    assert np.allclose(whiten(torch.tensor(x), unbiased=True).numpy(), expected, rtol=1e-12, atol=0)
    assert np.allclose(whiten(torch.tensor(x)).numpy(), (x - x.mean()) / (x.std() + 1e-8), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="two"):
        whiten(torch.tensor([1.0, 2.0]), mask=torch.tensor([1, 0]), unbiased=True)


def test_equal_float32_rewards_get_order_one_advantages_without_the_exact_zero():
    rewards = torch.full((8,), 0.3, dtype=torch.float32)
    assert torch.equal(group_advantages(rewards, 8, std_floor=1e-9), torch.zeros(8))
    plain = group_advantages(rewards, 8, std_floor=1e-9, zero_equal_groups=False)
    assert torch.isfinite(plain).all() and plain.abs().min() > 0.5      # O(1), from rounding alone
    small = group_advantages(rewards, 8, std_floor=1e-4, zero_equal_groups=False)
    assert small.abs().max() < 1e-3
    # with rewards that differ, the switch changes nothing
    varied = torch.tensor([0.0, 1.0, 1.0, 0.5])
    assert torch.equal(group_advantages(varied, 4, zero_equal_groups=False), group_advantages(varied, 4))


def test_singleton_groups_zero_or_the_raw_reward():
    r = torch.tensor([0.7, -0.2, 1.0], dtype=torch.float64)
    assert torch.equal(group_advantages(r, 1), torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(group_advantages(r, 1, std_floor=1e-6, singleton="reward"), r / (1 + 1e-6))
    assert torch.equal(group_advantages(r, 1, scale_rewards="none", singleton="reward"), r)
    # groups of more than one completion ignore the setting
    assert torch.equal(group_advantages(r[:2], 2, singleton="reward"), group_advantages(r[:2], 2))
    with pytest.raises(ValueError, match="singleton"):
        group_advantages(r, 1, singleton="nan")
