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


# ---------------------------------------------------------------- several reward functions (lesson 10b, GDPO)
def _gdpo_oracle(table, K, weights, floor=1e-4):
    """GDPO written out in float64 NumPy: each column normalised in its group, summed, then one batch scale."""
    import numpy as np
    R = np.asarray(table, dtype=float).reshape(-1, K, table.shape[1])
    mean, std = R.mean(1, keepdims=True), R.std(1, ddof=1, keepdims=True)
    per = np.where(std == 0, 0.0, (R - mean) / (std + floor)).reshape(-1, table.shape[1])
    s = per @ np.asarray(weights, dtype=float)
    return np.zeros_like(s) if np.all(s == s[0]) else (s - s.mean()) / (s.std(ddof=1) + floor)


@pytest.mark.parametrize("seed", range(4))
def test_multi_objective_advantages_against_their_closed_forms(seed):
    import numpy as np
    from rlcourse.losses import multi_objective_advantages
    gen = torch.Generator().manual_seed(seed)
    K, F = 4, 3
    table = torch.randint(0, 3, (6 * K, F), generator=gen).double() * torch.tensor([1.0, 10.0, 0.5], dtype=torch.float64)
    table[:K, 1] = 7.0                                          # one function constant in the first group
    weights = torch.rand(F, generator=gen, dtype=torch.float64) * 2
    for scale in ("group", "batch", "none"):
        summed = multi_objective_advantages(table, K, weights, scale_rewards=scale)
        assert torch.allclose(summed, group_advantages(table @ weights, K, scale), atol=1e-12)
    got = multi_objective_advantages(table, K, weights, multi_objective_aggregation="normalize_then_sum")
    assert np.allclose(got.numpy(), _gdpo_oracle(table.numpy(), K, weights.numpy()), atol=1e-10)
    # each function's scale is normalised away (up to the floor); the weights are not
    rescaled = multi_objective_advantages(table * torch.tensor([3.0, 0.01, 50.0], dtype=torch.float64), K, weights,
                                          multi_objective_aggregation="normalize_then_sum")
    assert float((rescaled - got).abs().max()) < 1e-2
    reweighted = multi_objective_advantages(table, K, weights * torch.tensor([1.0, 5.0, 1.0], dtype=torch.float64),
                                            multi_objective_aggregation="normalize_then_sum")
    assert float((reweighted - got).abs().max()) > 0.1
    # scale_rewards is not read on the GDPO path (TRL 1.16 ignores it too)
    assert torch.equal(got, multi_objective_advantages(table, K, weights, multi_objective_aggregation="normalize_then_sum",
                                                       scale_rewards="none"))


def test_gdpo_keeps_combinations_apart_that_the_sum_merges():
    """Two 0/1 rewards: (1, 0) and (0, 1) sum to the same value; normalised first they do not (GDPO's Figure 2)."""
    from rlcourse.losses import multi_objective_advantages
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    summed = multi_objective_advantages(table, 4)
    decoupled = multi_objective_advantages(table, 4, multi_objective_aggregation="normalize_then_sum")
    assert summed[0] == summed[1] and decoupled[0] != decoupled[1]
    assert len(set(summed.tolist())) == 2 and len(set(decoupled.tolist())) == 3
    # a function constant in every group adds exactly nothing; all functions constant: exactly 0
    with_constant = multi_objective_advantages(torch.cat([table, torch.full((4, 1), 0.3)], 1), 4,
                                               multi_objective_aggregation="normalize_then_sum")
    assert torch.equal(with_constant, decoupled)
    assert torch.equal(multi_objective_advantages(torch.full((8, 2), 0.7), 4, multi_objective_aggregation="normalize_then_sum"),
                       torch.zeros(8))


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.ones(8), 4), {}, r"rewards_per_func must be a \(B, F\) table"),
    ((torch.ones(8, 0), 4), {}, r"rewards_per_func must be a \(B, F\) table"),
    ((torch.ones(8, 2), 4, [1.0]), {}, "reward_weights must hold one finite weight"),
    ((torch.ones(8, 2), 4, [1.0, float("nan")]), {}, "reward_weights must hold one finite weight"),
    ((torch.ones(8, 2), 4), {"multi_objective_aggregation": "sum"}, "multi_objective_aggregation must be one of"),
    ((torch.ones(9, 2), 4), {"multi_objective_aggregation": "normalize_then_sum"}, "not a multiple of num_generations"),
    ((torch.tensor([[1.0, float("inf")]] * 4), 4), {"multi_objective_aggregation": "normalize_then_sum"}, "finite"),
])
def test_multi_objective_advantages_refuse_bad_input(args, kwargs, match):
    from rlcourse.losses import multi_objective_advantages
    with pytest.raises(ValueError, match=match):
        multi_objective_advantages(*args, **kwargs)
