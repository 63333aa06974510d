"""The GRPO family's pure functions against closed forms and brute force (TRL parity is in
test_trl_parity_grpo.py)."""
import pytest

import rlcourse  # noqa: F401
import torch

from rlcourse.losses import (GRPO_LOSS_TYPES as LOSS_TYPES, aggregate_loss, batch_mean_advantages, clip_fractions,
                             group_advantages, importance_weights, leave_one_out_advantages,
                             moving_average_baseline, per_token_loss)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.3, 0.1 + 0.2, 6e4, -7.25])
def test_equal_groups_get_exactly_zero_advantage(dtype, value):
    rewards = torch.full((16,), value, dtype=dtype)
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(rewards, 16, scale), torch.zeros(16, dtype=dtype))
    assert torch.equal(leave_one_out_advantages(rewards, 8), torch.zeros(16, dtype=dtype))


def test_integer_rewards_are_accepted():
    adv = group_advantages(torch.tensor([0, 1, 1, 0]), 4)
    assert adv.is_floating_point() and torch.allclose(adv, torch.tensor([-0.5, 0.5, 0.5, -0.5]) / (0.57735027 + 1e-4))


def test_group_advantage_closed_form_and_std_floor():
    r = torch.tensor([1.0, 2.0, 4.0, 5.0, 0.0, 0.0, 0.0, 3.0])
    adv = group_advantages(r, 4)
    for g in range(2):
        x = r[4 * g:4 * g + 4]
        assert torch.allclose(adv[4 * g:4 * g + 4], (x - x.mean()) / (x.std() + 1e-4))
    # float leftovers: std ~1e-8; without a floor the advantages are of order 1, with it tiny
    near = torch.full((16,), 0.3)
    near[0] = torch.nextafter(near[0], torch.tensor(1.0))    # one rounding step apart
    assert near.std() > 0
    assert group_advantages(near, 16, std_floor=0.0).abs().max() > 0.5
    assert group_advantages(near, 16).abs().max() < 1e-3


def test_leave_one_out_and_batch_mean_closed_forms():
    r = torch.randn(12, generator=torch.Generator().manual_seed(0))
    loo = leave_one_out_advantages(r, 4).view(3, 4)
    g = r.view(3, 4)
    for i in range(4):
        others = torch.cat([g[:, :i], g[:, i + 1:]], 1).mean(1)
        assert torch.allclose(loo[:, i], g[:, i] - others, atol=1e-6)
    assert torch.allclose(loo, 4 / 3 * (g - g.mean(1, keepdim=True)), atol=1e-6)
    assert torch.allclose(batch_mean_advantages(r), r - r.mean())
    assert moving_average_baseline(None, r) == pytest.approx(float(r.mean()))
    assert moving_average_baseline(1.0, torch.zeros(3), decay=0.9) == pytest.approx(0.9)


@pytest.mark.parametrize("bad", [dict(rewards=torch.zeros(2, 3)), dict(rewards=torch.tensor([0.0, float("nan")])),
                                 dict(num_generations=3), dict(num_generations=0), dict(scale_rewards="max"),
                                 dict(std_floor=-1.0)])
def test_group_advantages_reject_bad_input(bad):
    kw = dict(rewards=torch.zeros(4), num_generations=2) | bad
    with pytest.raises(ValueError):
        group_advantages(**kw)


def _tokens(seed=0, B=4, T=5):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=gen)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=gen)
    mask = (torch.arange(T)[None] < torch.tensor([5, 3, 1, 4])[:, None]).long()
    return logp, old, mask, torch.randn(B, generator=gen)


def test_sequence_ratio_is_the_geometric_mean_of_token_ratios():
    logp, old, mask, _ = _tokens()
    tok = importance_weights(logp, old, mask, "token")
    seq = importance_weights(logp, old, mask, "sequence")
    for i in range(4):
        n = int(mask[i].sum())
        assert torch.allclose(seq[i, 0], tok[i, :n].prod() ** (1 / n))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_padding_never_changes_the_loss(loss_type, level):
    logp, old, mask, adv = _tokens()
    junk_logp = torch.where(mask.bool(), logp, torch.full_like(logp, 50.0))
    junk_old = torch.where(mask.bool(), old, torch.full_like(old, -80.0))
    a = aggregate_loss(per_token_loss(logp, old, adv, mask, loss_type, importance_sampling_level=level), mask,
                       loss_type, 5)
    b = aggregate_loss(per_token_loss(junk_logp, junk_old, adv, mask, loss_type, importance_sampling_level=level),
                       mask, loss_type, 5)
    assert torch.isfinite(a) and torch.allclose(a, b)


def test_aggregations_closed_forms():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(x, mask, "grpo") == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(x, mask, "dapo") == pytest.approx(10.0 / 4)
    assert aggregate_loss(x, mask, "bnpo") == pytest.approx(10.0 / 4)
    assert aggregate_loss(x, mask, "dr_grpo", max_completion_length=5) == pytest.approx(10.0 / 10)
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(x, mask, "dr_grpo")


def test_on_policy_gradient_is_reinforce():
    logp, _, mask, adv = _tokens()
    loss = aggregate_loss(per_token_loss(logp, logp.detach(), adv, mask, "dapo"), mask, "dapo")
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, -adv[:, None] * mask / mask.sum())


def test_cispo_keeps_gradients_of_clipped_tokens_and_clip_fractions():
    logp, old, mask, adv = _tokens()
    adv = adv.abs()
    clip = aggregate_loss(per_token_loss(logp, old, adv, mask, "dapo", epsilon=0.01), mask, "dapo")
    cispo = aggregate_loss(per_token_loss(logp, old, adv, mask, "cispo", epsilon_high=1.01), mask, "cispo")
    (g_clip,) = torch.autograd.grad(clip, logp)
    (g_cispo,) = torch.autograd.grad(cispo, logp)
    assert int(((g_clip == 0) & mask.bool()).sum()) > 0
    assert bool((g_cispo[mask.bool()] != 0).all())
    ratio = importance_weights(logp, old, mask)
    fr = clip_fractions(ratio, adv, mask, 0.2)
    assert fr["clip_ratio/low_mean"] == 0.0
    assert fr["clip_ratio/high_mean"] == pytest.approx(float(((ratio > 1.2) * mask).sum() / mask.sum()))
