"""DPO-family losses against hand-written formulas, finite differences and their defining properties."""
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.losses import (DPO_LOSS_TYPES as LOSS_TYPES, chosen_nll_loss, dpo_hinge_loss, dpo_implicit_reward,
                             dpo_logratio_margin, dpo_sigmoid_loss, ipo_loss, preference_loss,
                             robust_dpo_loss, conservative_dpo_loss)


def _logps(seed, n=6, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    return [-scale * torch.rand(n, generator=gen, dtype=torch.float64) for _ in range(4)]


def test_sigmoid_loss_is_bradley_terry_nll_of_the_implicit_rewards():
    cw, cl, rw, rl = _logps(0)
    beta = 0.3
    got = dpo_sigmoid_loss(cw, cl, rw, rl, beta)
    for i in range(len(cw)):
        r_w, r_l = beta * (cw[i] - rw[i]), beta * (cl[i] - rl[i])
        p = 1 / (1 + math.exp(-(float(r_w) - float(r_l))))
        assert float(got[i]) == pytest.approx(-math.log(p), rel=1e-12)


def test_policy_equal_to_reference_gives_log_two_and_zero_rewards():
    cw, cl, _, _ = _logps(1)
    assert torch.allclose(dpo_sigmoid_loss(cw, cl, cw, cl, 0.1), torch.full_like(cw, math.log(2)))
    assert torch.equal(dpo_implicit_reward(cw, cw, 0.1), torch.zeros_like(cw))
    assert torch.allclose(ipo_loss(cw, cl, cw, cl, 0.25), torch.full_like(cw, 4.0))     # (0 - 1/(2*0.25))^2
    assert torch.allclose(dpo_hinge_loss(cw, cl, cw, cl, 0.1), torch.ones_like(cw))


def test_sigmoid_gradient_has_the_papers_form():
    """d loss / d log pi(y_w) = -beta * sigmoid(-beta h) and the opposite for y_l."""
    cw, cl, rw, rl = _logps(2)
    cw.requires_grad_(True)
    cl.requires_grad_(True)
    beta = 0.7
    dpo_sigmoid_loss(cw, cl, rw, rl, beta).sum().backward()
    h = (cw - rw) - (cl - rl)
    weight = beta * torch.sigmoid(-beta * h.detach())
    assert torch.allclose(cw.grad, -weight)
    assert torch.allclose(cl.grad, weight)


@pytest.mark.parametrize("name", ["sigmoid", "hinge", "ipo", "robust"])
def test_gradients_match_finite_differences(name):
    cw, cl, rw, rl = _logps(3)
    cw.requires_grad_(True)
    cl.requires_grad_(True)
    fn = {"sigmoid": lambda a, b: dpo_sigmoid_loss(a, b, rw, rl, 0.4),
          "hinge": lambda a, b: dpo_hinge_loss(a, b, rw, rl, 0.4),
          "ipo": lambda a, b: ipo_loss(a, b, rw, rl, 0.4, torch.tensor([1, 2, 3, 4, 5, 6]), torch.full((6,), 3)),
          "robust": lambda a, b: robust_dpo_loss(a, b, rw, rl, 0.4, 0.2)}[name]
    assert torch.autograd.gradcheck(fn, (cw, cl))


def test_ipo_is_minimised_at_its_target_margin():
    beta = 0.2
    rw, rl = torch.tensor([-3.0, -1.0], dtype=torch.float64), torch.tensor([-2.0, -4.0], dtype=torch.float64)
    target = 1 / (2 * beta)
    cl = rl.clone()
    cw = rw + target                   # h = target exactly
    assert torch.allclose(ipo_loss(cw, cl, rw, rl, beta), torch.zeros(2, dtype=torch.float64))
    assert (ipo_loss(cw + 1.0, cl, rw, rl, beta) > 0).all()   # past the target costs, unlike DPO


def test_ipo_with_lengths_averages_each_log_ratio_per_token():
    cw, cl, rw, rl = _logps(4, n=3)
    lw, ll = torch.tensor([2, 5, 1]), torch.tensor([4, 1, 3])
    h = (cw - rw) / lw - (cl - rl) / ll
    assert torch.allclose(ipo_loss(cw, cl, rw, rl, 0.5, lw, ll), (h - 1.0) ** 2)
    # a zero length counts as one (no division by zero)
    assert torch.isfinite(ipo_loss(cw, cl, rw, rl, 0.5, torch.zeros(3), torch.zeros(3))).all()


def test_robust_loss_is_unbiased_under_label_flips():
    """(1 - e) L(h) + e L(-h) = DPO's clean loss: flipping labels with rate e, in expectation."""
    cw, cl, rw, rl = _logps(5)
    beta, e = 0.5, 0.3
    kept = robust_dpo_loss(cw, cl, rw, rl, beta, e)
    flipped = robust_dpo_loss(cl, cw, rl, rw, beta, e)
    assert torch.allclose((1 - e) * kept + e * flipped, dpo_sigmoid_loss(cw, cl, rw, rl, beta))
    assert torch.allclose(robust_dpo_loss(cw, cl, rw, rl, beta, 0.0), dpo_sigmoid_loss(cw, cl, rw, rl, beta))


def test_conservative_loss_has_a_finite_minimiser_where_robust_has_none():
    """cDPO is the cross-entropy against the soft label 1 - e: its minimiser is beta h = log((1 - e) / e), in closed
    form; robust DPO's slope never vanishes (d/dh = -beta [e / (1 - 2e) + sigmoid(-beta h)], by hand)."""
    beta, e = 0.5, 0.2
    zero = torch.zeros(401, dtype=torch.float64)
    h = torch.linspace(-10, 20, 401, dtype=torch.float64).requires_grad_(True)
    conservative = conservative_dpo_loss(h, zero, zero, zero, beta, e)
    best = float(h.detach()[conservative.argmin()])
    assert abs(best - torch.log(torch.tensor((1 - e) / e)).item() / beta) < 30 / 400
    (slope,) = torch.autograd.grad(robust_dpo_loss(h, zero, zero, zero, beta, e).sum(), h)
    by_hand = -beta * (e / (1 - 2 * e) + torch.sigmoid(-beta * h.detach()))
    assert torch.allclose(slope, by_hand) and (slope < -beta * e / (1 - 2 * e) + 1e-12).all()
    # the soft-label cross-entropy, written out, and e = 0 is DPO
    cw, cl, rw, rl = _logps(5)
    p = torch.sigmoid(beta * ((cw - rw) - (cl - rl)))
    assert torch.allclose(conservative_dpo_loss(cw, cl, rw, rl, beta, e), -(1 - e) * p.log() - e * (1 - p).log())
    assert torch.allclose(conservative_dpo_loss(cw, cl, rw, rl, beta, 0.0), dpo_sigmoid_loss(cw, cl, rw, rl, beta))
    with pytest.raises(ValueError, match="label_smoothing"):
        conservative_dpo_loss(cw, cl, rw, rl, beta, 0.5)


def test_hinge_stops_past_the_margin():
    rw = rl = torch.zeros(3, dtype=torch.float64)
    cl = torch.zeros(3, dtype=torch.float64)
    cw = torch.tensor([0.5, 2.0, 10.0], dtype=torch.float64)   # h = cw; margin 1 / beta = 2
    assert torch.allclose(dpo_hinge_loss(cw, cl, rw, rl, 0.5), torch.tensor([0.75, 0.0, 0.0], dtype=torch.float64))


def test_extreme_margins_stay_finite():
    big = torch.tensor([1e4, -1e4], dtype=torch.float32)
    zero = torch.zeros(2)
    loss = dpo_sigmoid_loss(big, zero, zero, zero, 1.0)
    assert torch.isfinite(loss).all()
    assert loss[0] == 0 and loss[1] == pytest.approx(1e4)


def test_nll_term_ignores_padding_whatever_it_holds():
    tok = torch.tensor([[-1.0, -2.0, 99.0], [-3.0, 77.0, 55.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert chosen_nll_loss(tok, mask).item() == pytest.approx(2.0)   # (1 + 2 + 3) / 3 tokens
    with pytest.raises(ValueError, match="no entries"):
        chosen_nll_loss(tok, torch.zeros_like(mask))


def test_preference_loss_sums_weighted_means():
    cw, cl, rw, rl = _logps(6)
    tok = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(6, 4, dtype=torch.long)
    got = preference_loss(cw, cl, rw, rl, beta=0.2, loss_type=["sigmoid", "hinge", "sft"],
                          loss_weights=[0.5, 2.0, 3.0], chosen_token_logps=tok, chosen_mask=mask)
    want = (0.5 * dpo_sigmoid_loss(cw, cl, rw, rl, 0.2).mean() + 2.0 * dpo_hinge_loss(cw, cl, rw, rl, 0.2).mean()
            + 3.0 * chosen_nll_loss(tok, mask))
    assert torch.allclose(got, want)
    assert set(LOSS_TYPES) == {"sigmoid", "hinge", "ipo", "robust", "sft", "sigmoid_norm"}


def test_margin_is_the_difference_of_log_ratios():
    cw, cl, rw, rl = _logps(7)
    assert torch.allclose(dpo_logratio_margin(cw, cl, rw, rl), (cw - rw) - (cl - rl))


@pytest.mark.parametrize("call, error, match", [
    (lambda a: dpo_sigmoid_loss(a, a, a, a, 0.0), ValueError, "beta"),
    (lambda a: dpo_sigmoid_loss(a, a, a, a, -1), ValueError, "beta"),
    (lambda a: dpo_sigmoid_loss(a, a[:2], a, a, 0.1), ValueError, "one shape"),
    (lambda a: dpo_sigmoid_loss(a[None], a[None], a[None], a[None], 0.1), ValueError, "1-D"),
    (lambda a: dpo_sigmoid_loss(a.long(), a, a, a, 0.1), TypeError, "floating"),
    (lambda a: robust_dpo_loss(a, a, a, a, 0.1, 0.5), ValueError, "label_smoothing"),
    (lambda a: ipo_loss(a, a, a, a, 0.1, torch.ones(3), None), ValueError, "together"),
    (lambda a: ipo_loss(a, a, a, a, 0.1, torch.ones(2), torch.ones(2)), ValueError, "chosen_lengths"),
    (lambda a: preference_loss(a, a, a, a, beta=0.1, loss_type="kto"), ValueError, "loss_type"),
    (lambda a: preference_loss(a, a, a, a, beta=0.1, loss_type=["sigmoid"], loss_weights=[1, 2]), ValueError, "loss_weights"),
    (lambda a: preference_loss(a, a, a, a, beta=0.1, loss_type="sft"), ValueError, "sft"),
    (lambda a: chosen_nll_loss(a, torch.ones(3)), ValueError, "per-token"),
])
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.tensor([-1.0, -2.0, -3.0]))
