"""PPO-clip, the value loss, the entropy bonus and PPO-penalty against hand-computed values."""
import numpy as np
import pytest
import torch

import rlcourse  # noqa: F401
from rlcourse import losses

# The clip table, worked out by hand: min(r A, clip(r, 0.8, 1.2) A) for eps = 0.2.
RATIOS = [0.5, 1.0, 1.5]
CLIP_TABLE = {-5: [-4.0, -5.0, -7.5], -1: [-0.8, -1.0, -1.5], 1: [0.5, 1.0, 1.2], 5: [2.5, 5.0, 6.0]}


def test_clip_table_matches_hand_computed_values():
    r = torch.tensor(RATIOS, dtype=torch.float64).repeat(4)
    A = torch.tensor([a for a in CLIP_TABLE for _ in RATIOS], dtype=torch.float64)
    got = losses.ppo_clip_objective(r, A, clip_coef=0.2)
    want = torch.tensor([v for a in CLIP_TABLE for v in CLIP_TABLE[a]], dtype=torch.float64)
    assert torch.equal(got, want)


def test_min_of_products_is_not_min_ratio_times_advantage():
    r, A = torch.tensor([1.5]), torch.tensor([-5.0])
    naive = torch.minimum(r, r.clamp(0.8, 1.2)) * A  # -6.0
    assert losses.ppo_clip_objective(r, A).item() == -7.5 and naive.item() == -6.0


@pytest.mark.parametrize("ratio, adv, learns", [
    (1.5, 1.0, False),   # A > 0 and r > 1 + eps: clipped, nothing to gain
    (0.5, 1.0, True),    # A > 0 and r < 1 - eps: the unclipped branch, push r up
    (0.5, -1.0, False),  # A < 0 and r < 1 - eps: clipped
    (1.5, -1.0, True),   # A < 0 and r > 1 + eps: unclipped, push r down
    (1.1, 1.0, True), (0.9, -1.0, True),
])
def test_gradient_is_zero_exactly_in_the_clipped_regions(ratio, adv, learns):
    logp = torch.tensor([np.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss = losses.ppo_clip_loss(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64))
    loss.backward()
    expected = -adv * ratio if learns else 0.0  # d(-r A)/d log pi = -r A
    assert logp.grad.item() == pytest.approx(expected)


def test_asymmetric_clip_higher():
    r, A = torch.tensor([1.25, 1.4, 0.7]), torch.tensor([1.0, 1.0, -1.0])
    got = losses.ppo_clip_objective(r, A, clip_coef=0.2, clip_coef_high=0.28)
    torch.testing.assert_close(got, torch.tensor([1.25, 1.28, -0.8]))


def test_ratio_from_log_probs_survives_tiny_probabilities():
    logp, old = torch.tensor([-800.0]), torch.tensor([-800.5])
    assert torch.isfinite(losses.importance_ratio(logp, old)).all()
    assert losses.importance_ratio(logp, old).item() == pytest.approx(np.exp(0.5))
    assert torch.isnan(logp.exp() / old.exp()).all()  # the naive ratio is 0/0


def test_clip_loss_mask_is_a_token_mean_and_old_logprobs_get_no_grad():
    logp = torch.tensor([[0.1, -0.3, 9.0], [0.0, 0.2, 0.05]], requires_grad=True)
    old = torch.zeros(2, 3, requires_grad=True)
    A = torch.tensor([[1.0, -2.0, 100.0], [0.5, 1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = losses.ppo_clip_loss(logp, old, A, mask=mask)
    r = logp.detach().exp()
    per = torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
    assert loss.item() == pytest.approx(-(per * mask).sum().item() / 5)
    loss.backward()
    assert old.grad is None and logp.grad[0, 2] == 0


def test_diagnostics():
    logp = torch.log(torch.tensor([1.0, 1.3, 0.7, 1.1]))
    d = losses.ppo_diagnostics(logp, torch.zeros(4), torch.tensor([1.0, 1.0, 1.0, -1.0]))
    assert d["clip_fraction"] == pytest.approx(0.5)
    assert d["clipped_fraction_active"] == pytest.approx(0.25)  # only r=1.3 with A>0
    r = np.array([1.0, 1.3, 0.7, 1.1])
    assert d["approx_kl"] == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-6)


def test_value_loss_plain_and_clipped_by_hand():
    v, R, old = torch.tensor([1.0, 3.0, -1.0]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 2.5, -1.0])
    assert losses.value_loss(v, R).item() == pytest.approx(0.5 * (1 + 9 + 4) / 3)
    # clipped values: 0 + clip(1, -.2, .2) = 0.2 ; 2.5 + clip(0.5) = 2.7 ; -1 + 0 = -1
    want = 0.5 * (max(1, (0.2 - 2) ** 2) + max(9, 2.7 ** 2) + max(4, 4)) / 3
    assert losses.value_loss(v, R, old, clip_coef=0.2).item() == pytest.approx(want)
    with pytest.raises(ValueError, match="old_values"):
        losses.value_loss(v, R, clip_coef=0.2)


def test_entropy_bonus_matches_torch_distributions():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    want = torch.distributions.Categorical(logits=logits).entropy().mean()
    torch.testing.assert_close(losses.entropy_bonus(logits), want)
    mask = torch.tensor([1, 0, 1, 1, 0])
    want_m = torch.distributions.Categorical(logits=logits).entropy()[mask.bool()].mean()
    torch.testing.assert_close(losses.entropy_bonus(logits, mask), want_m)


def test_ppo_penalty_loss_and_adaptive_beta():
    logp = torch.log(torch.tensor([1.2, 0.5]))
    A, kl = torch.tensor([1.0, -2.0]), torch.tensor([0.1, 0.3])
    got = losses.ppo_penalty_loss(logp, torch.zeros(2), A, kl, beta=2.0)
    assert got.item() == pytest.approx(-(1.2 - 1.0) / 2 + 2.0 * 0.2)
    assert losses.adaptive_kl_beta(1.0, kl=0.001, kl_target=0.01) == 0.5
    assert losses.adaptive_kl_beta(1.0, kl=0.02, kl_target=0.01) == 2.0
    assert losses.adaptive_kl_beta(1.0, kl=0.012, kl_target=0.01) == 1.0
    with pytest.raises(ValueError, match="beta"):
        losses.adaptive_kl_beta(0.0, 0.1, 0.01)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="one shape"):
        losses.ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="clip_coef"):
        losses.ppo_clip_objective(torch.ones(2), torch.ones(2), clip_coef=-0.1)
