"""SimPO, ORPO, KTO, R-DPO and online-DPO pairs against closed forms, finite differences and brute force;
their exact minimisers on the categorical bandit against the closed forms derived for them.

TRL's own code is the oracle in ``tests/test_trl_parity_beyond_dpo.py``; here the oracles are hand-worked
numbers, the formulas written out directly in float64, ``torch.autograd.gradcheck`` and enumeration.
"""
import itertools
import math

import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from rlcourse.measure.categorical_bandit import CategoricalBandit
from rlcourse.losses import (average_logps, dpo_sigmoid_loss, kto_loss, kto_reference_point, online_dpo_pairs,
                             orpo_log_odds_ratio, orpo_loss, preference_objective, rdpo_loss, simpo_loss)
from rlcourse.measure.preference_optima import (expected_preference_loss, labelled_pairs, minimise_expected_loss,
                                        simpo_optimum)
from rlcourse.regularised_optimum import kl_regularised_optimum


def _f64(*values):
    return torch.tensor(values, dtype=torch.float64)


# --- SimPO ------------------------------------------------------------------------------------------

def test_simpo_by_hand():
    w, l = _f64(-1.0, -2.0), _f64(-1.5, -0.5)
    z = 2.0 * (w - l) - 0.5                                   # beta (avg_w - avg_l) - gamma
    expected = torch.log1p(torch.exp(-z))
    torch.testing.assert_close(simpo_loss(w, l, 2.0, 0.5), expected, atol=1e-12, rtol=0)
    assert float(simpo_loss(_f64(-1.0), _f64(-1.0), 1.0, 0.0)) == pytest.approx(math.log(2))


def test_simpo_label_smoothing_mixes_the_flipped_label():
    w, l = _f64(-0.3, -2.0), _f64(-1.1, -0.2)
    eps = 0.2
    flipped = simpo_loss(l, w, 1.5, -0.7)        # the flipped label: -log s(-z) with z = beta(w - l) - gamma
    mixed = simpo_loss(w, l, 1.5, 0.7, label_smoothing=eps)
    torch.testing.assert_close(mixed, (1 - eps) * simpo_loss(w, l, 1.5, 0.7) + eps * flipped, atol=1e-12, rtol=0)


def test_simpo_and_orpo_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(0)
    w = (-3 * torch.rand(5, generator=gen, dtype=torch.float64) - 0.01).requires_grad_(True)
    l = (-3 * torch.rand(5, generator=gen, dtype=torch.float64) - 0.01).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: simpo_loss(a, b, 2.0, 0.5), (w, l))
    assert torch.autograd.gradcheck(lambda a, b: orpo_loss(a, b, 0.3), (w, l))


def test_average_logps_by_hand():
    tok = _f64(-1.0, -2.0, -3.0).repeat(2, 1)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(average_logps(tok, mask), _f64(-1.5, 0.0))     # an empty row counts as 1 token
    with pytest.raises(ValueError, match="one shape"):
        average_logps(tok, mask[:, :2])


# --- ORPO -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("w, l", [(-0.7, -2.3), (-1e-9, -5.0), (-40.0, -1e-3), (-0.69, -0.70)])
def test_orpo_log_odds_ratio_against_the_formula_and_stays_finite(w, l):
    """log odds(y) = log p - log(1 - p), p = exp(avg log-prob): exact in high precision, finite at the edges."""
    def log_odds(v):
        p = np.exp(np.longdouble(v))
        return float(np.log(p) - np.log1p(-p))
    got = float(orpo_log_odds_ratio(_f64(w), _f64(l)))
    assert math.isfinite(got)
    assert got == pytest.approx(log_odds(w) - log_odds(l), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_gradient_stays_finite_where_p_rounds_to_1(dtype):
    """A per-token average log-prob of -1e-8 (float32) or -1e-20 (float64): exp rounds to 1, the loss and
    its gradient stay finite (the unselected branch of log(1 - exp) must not leak a NaN)."""
    tiny = -1e-8 if dtype == torch.float32 else -1e-20
    w = torch.tensor([-2.0, tiny], dtype=dtype, requires_grad=True)
    l = torch.tensor([tiny, -1.0], dtype=dtype, requires_grad=True)
    loss = orpo_loss(w, l, 0.5)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(w.grad).all() and torch.isfinite(l.grad).all()
    # d/dl of -0.5 log sigmoid(log odds(w) - log odds(l)) near l = 0 is 0.5 sigmoid(-z) / (1 - p): huge, finite
    assert l.grad[0] > 1e6


def test_orpo_loss_is_beta_times_the_odds_ratio_log_loss():
    w, l = _f64(-0.5, -1.0), _f64(-1.5, -0.3)
    expected = -0.25 * F.logsigmoid(orpo_log_odds_ratio(w, l))
    torch.testing.assert_close(orpo_loss(w, l, 0.25), expected)


def _orpo_closed_form(w: float, l: float, beta: float) -> tuple[float, float, float]:
    """ORPO's term in float64 without log-odds: ``beta log(1 + odds(y_l) / odds(y_w))``, ``1 / odds(y) = e^-x - 1``,
    so the loss is ``beta (log(u + v) - log v)`` with ``u = expm1(-w)``, ``v = expm1(-l)``; and its two derivatives."""
    u, v = math.expm1(-w), math.expm1(-l)
    return (beta * math.log1p(u / v), -beta * math.exp(-w) / (u + v),
            beta * math.exp(-l) * (1 / v - 1 / (u + v)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("w", [0.0, -1e-40, -1e-12, -3e-8, -1e-4, -0.5, -0.75, -4.0])
@pytest.mark.parametrize("l", [-0.05, -1.0, -6.0])
def test_orpo_loss_and_gradient_match_the_closed_form_up_to_a_certain_chosen_answer(dtype, w, l):
    """A chosen answer the policy is certain of (average log-prob exactly 0: float32's log-softmax returns 0.0
    once the token leads by ~20 nats) has infinite odds; the loss is 0 and its gradient -beta odds(y_l), finite.
    Value and gradient against the closed form at the same (rounded) inputs."""
    beta = 0.5
    wt = torch.tensor([w], dtype=dtype, requires_grad=True)
    lt = torch.tensor([l], dtype=dtype, requires_grad=True)
    loss = orpo_loss(wt, lt, beta)
    loss.sum().backward()
    value, dw, dl = _orpo_closed_form(float(wt.detach()), float(lt.detach()), beta)
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    assert float(loss.detach()) == pytest.approx(value, rel=rtol, abs=1e-30)
    assert float(wt.grad) == pytest.approx(dw, rel=rtol, abs=1e-30)
    assert float(lt.grad) == pytest.approx(dl, rel=rtol, abs=1e-12)


def test_orpo_objective_on_a_certain_chosen_answer_keeps_the_weights_finite():
    """Every chosen token at log-prob 0.0 (float32): the objective's gradient reaches the token log-probs finite,
    so a clipped optimiser step cannot turn the weights into NaN."""
    chosen = torch.zeros(2, 3, requires_grad=True)
    rejected = torch.tensor([[-0.5, -2.0, 0.0], [-1.0, -0.1, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = preference_objective(chosen, rejected, mask, mask, torch.zeros(2), torch.zeros(2), beta=0.3,
                                loss_type="orpo")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    assert float(chosen.grad.abs().sum()) > 0


# --- KTO --------------------------------------------------------------------------------------------

def test_kto_by_hand():
    w, rw = _f64(-2.0), _f64(-3.0)          # desirable: log-ratio +1
    l, rl = _f64(-4.0, -1.0), _f64(-3.0, -1.5)   # undesirable: log-ratios -1, +0.5
    z0, beta = 0.25, 2.0
    got = kto_loss(w, l, rw, rl, z0, beta, desirable_weight=1.5, undesirable_weight=0.5)
    sig = lambda v: 1 / (1 + math.exp(-v))      # noqa: E731
    expected = [1.5 * (1 - sig(2 * (1 - 0.25))), 0.5 * (1 - sig(2 * (0.25 + 1))), 0.5 * (1 - sig(2 * (0.25 - 0.5)))]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_kto_reference_point_carries_no_gradient():
    kl = torch.tensor([-1.0, 0.5], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    z0 = kto_reference_point(kl, _f64(-2.0, -2.0))
    assert float(z0) == pytest.approx(1.75) and not z0.requires_grad
    kto_loss(w, _f64(-2.0), _f64(-1.5), _f64(-2.5), z0, 1.0).sum().backward()
    assert kl.grad is None and w.grad is not None


def test_kto_gradient_with_z0_held_fixed_matches_finite_differences():
    w = torch.tensor([-1.0, -3.0], dtype=torch.float64, requires_grad=True)
    l = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    fixed = lambda a, b: kto_loss(a, b, _f64(-1.4, -2.0), _f64(-2.5), 0.3, 0.7, 1.0, 1.33)   # noqa: E731
    assert torch.autograd.gradcheck(fixed, (w, l))


# --- R-DPO ------------------------------------------------------------------------------------------

def test_rdpo_by_hand_and_alpha_zero_is_dpo():
    cw, cl, rw, rl = _f64(-3.0, -1.0), _f64(-2.0, -4.0), _f64(-3.5, -1.2), _f64(-1.8, -3.0)
    lw, ll = torch.tensor([5, 2]), torch.tensor([2, 6])
    h = (cw - rw) - (cl - rl)
    torch.testing.assert_close(rdpo_loss(cw, cl, rw, rl, lw, ll, 0.5, 0.2),
                               -F.logsigmoid(0.5 * h + 0.2 * (lw - ll).double()), atol=1e-12, rtol=0)
    torch.testing.assert_close(rdpo_loss(cw, cl, rw, rl, lw, ll, 0.5, 0.0), dpo_sigmoid_loss(cw, cl, rw, rl, 0.5))
    with pytest.raises(ValueError, match="chosen_lengths"):
        rdpo_loss(cw, cl, rw, rl, lw[:1], ll, 0.5, 0.2)


# --- online DPO's pairs -----------------------------------------------------------------------------

def _pairs_by_enumeration(scores, groups):
    """Each group with two distinct scores: (first index of its maximum, first index of its minimum)."""
    out = []
    for g in sorted(set(groups)):
        members = [i for i, gi in enumerate(groups) if gi == g]
        values = [scores[i] for i in members]
        if len(members) < 2 or len(set(values)) == 1:
            continue
        out.append((members[values.index(max(values))], members[values.index(min(values))]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_online_pairs_against_enumeration(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 25))
    groups = rng.integers(0, 7, size=n).tolist()                 # ragged, unordered groups, some of one
    scores = rng.integers(0, 3, size=n).astype(float).tolist()   # many ties, some all-equal groups
    chosen, rejected = online_dpo_pairs(torch.tensor(scores), torch.tensor(groups))
    assert chosen.dtype == torch.long and rejected.dtype == torch.long
    assert list(zip(chosen.tolist(), rejected.tolist())) == _pairs_by_enumeration(scores, groups)


def test_online_pairs_edge_cases():
    none = online_dpo_pairs(torch.tensor([1.0, 1.0, 0.5]), torch.tensor([0, 0, 1]))
    assert none[0].numel() == 0 and none[1].numel() == 0                        # all equal, and a group of one
    c, r = online_dpo_pairs(torch.tensor([0.0, 2.0, 2.0, 1.0]), torch.tensor([3, 3, 3, 3]))
    assert (c.tolist(), r.tolist()) == ([1], [0])                                # ties at the top: the first
    with pytest.raises(ValueError, match="1-D of one shape"):
        online_dpo_pairs(torch.zeros(3), torch.zeros(2))


# --- the objective a trainer minimises --------------------------------------------------------------

def _token_batch(seed, B=4, T=5):
    gen = torch.Generator().manual_seed(seed)
    ct, rt = (-2 * torch.rand(B, T, generator=gen, dtype=torch.float64) for _ in range(2))
    cm = torch.ones(B, T, dtype=torch.long)
    rm = torch.ones(B, T, dtype=torch.long)
    cm[0, 3:] = 0
    rm[1, 1:] = 0
    ref = (-8 * torch.rand(B, generator=gen, dtype=torch.float64), -8 * torch.rand(B, generator=gen, dtype=torch.float64))
    return ct * cm, rt * rm, cm, rm, *ref


def test_objective_dispatches_each_loss_to_its_function():
    ct, rt, cm, rm, rw, rl = _token_batch(0)
    cw, cl = ct.sum(-1), rt.sum(-1)
    aw, al = average_logps(ct, cm), average_logps(rt, rm)
    obj = lambda **kw: float(preference_objective(ct, rt, cm, rm, rw, rl, beta=0.4, **kw))   # noqa: E731
    assert obj(loss_type="simpo", simpo_gamma=0.3) == pytest.approx(float(simpo_loss(aw, al, 0.4, 0.3).mean()))
    nll = -float((ct * cm).sum() / cm.sum())
    assert obj(loss_type="orpo") == pytest.approx(nll + float(orpo_loss(aw, al, 0.4).mean()))
    assert obj(loss_type="sigmoid", rdpo_alpha=0.1) == pytest.approx(
        float(rdpo_loss(cw, cl, rw, rl, cm.sum(-1), rm.sum(-1), 0.4, 0.1).mean()))
    kl, ref_kl = _f64(-3.0, -1.0), _f64(-4.0, -2.5)
    z0 = kto_reference_point(kl, ref_kl)
    assert obj(loss_type="kto", kl_logps=kl, ref_kl_logps=ref_kl) == pytest.approx(
        float(kto_loss(cw, cl, rw, rl, z0, 0.4).mean()))
    own = kto_reference_point(torch.cat([cw, cl]), torch.cat([rw, rl]))
    assert obj(loss_type="kto") == pytest.approx(float(kto_loss(cw, cl, rw, rl, own, 0.4).mean()))
    assert obj(loss_type=["simpo", "sigmoid"], loss_weights=[2.0, 0.5], simpo_gamma=0.0) == pytest.approx(
        2 * obj(loss_type="simpo", simpo_gamma=0.0) + 0.5 * obj(loss_type="sigmoid"))
    with pytest.raises(ValueError, match="together"):
        obj(loss_type="kto", kl_logps=kl)
    with pytest.raises(ValueError, match="loss_type"):
        obj(loss_type="dpo")


def test_reference_free_losses_ignore_the_reference():
    ct, rt, cm, rm, rw, rl = _token_batch(1)
    for kind in ("simpo", "orpo"):
        a = preference_objective(ct, rt, cm, rm, rw, rl, beta=0.5, loss_type=kind)
        b = preference_objective(ct, rt, cm, rm, rw + 7.0, rl - 3.0, beta=0.5, loss_type=kind)
        assert float(a) == float(b)


# --- exact minimisers on the categorical bandit -----------------------------------------------------

@pytest.fixture(scope="module")
def bandit():
    return CategoricalBandit.random(n_prompts=3, n_answers=5, reward_scale=1.5, seed=0)


LENGTHS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])


def test_labelled_pairs_are_the_limit_of_sample_pairs(bandit):
    d = labelled_pairs(bandit)
    assert float(d["weight"].sum()) == pytest.approx(1.0)
    drawn = bandit.sample_pairs(200_000, rng=0)
    counts = torch.zeros(3, 5, 5, dtype=torch.float64)
    counts.index_put_((drawn["prompt"], drawn["chosen"], drawn["rejected"]), torch.ones(200_000, dtype=torch.float64),
                      accumulate=True)
    freq = counts[d["prompt"], d["chosen"], d["rejected"]] / 200_000
    sd = (d["weight"] * (1 - d["weight"]) / 200_000).sqrt()
    assert float(((freq - d["weight"]).abs() / sd).max()) < 5          # every cell within 5 standard errors


def test_dpo_and_rdpo_minimisers_are_the_kl_regularised_optima(bandit):
    """DPO on raters of utility u lands on pi*(u); R-DPO with alpha lands on pi*(u - alpha |y|)."""
    beta, bias = 0.5, 0.4
    u = bandit.reward + bias * LENGTHS
    dpo = minimise_expected_loss(bandit, lambda lp: expected_preference_loss(lp, bandit, "sigmoid", beta, LENGTHS, u))
    rdpo = minimise_expected_loss(bandit, lambda lp: expected_preference_loss(lp, bandit, "rdpo", beta, LENGTHS, u,
                                                                               rdpo_alpha=bias))
    torch.testing.assert_close(dpo["logprobs"], kl_regularised_optimum(bandit.ref_logprobs, u, beta), atol=1e-5, rtol=0)
    torch.testing.assert_close(rdpo["logprobs"], bandit.optimal_logprobs(beta), atol=1e-5, rtol=0)


def test_simpo_minimiser_is_its_closed_form(bandit):
    beta = 0.5
    found = minimise_expected_loss(bandit, lambda lp: expected_preference_loss(lp, bandit, "simpo", beta, LENGTHS))
    closed = simpo_optimum(bandit.reward, LENGTHS, beta)
    torch.testing.assert_close(found["logprobs"], closed, atol=1e-4, rtol=0)
    torch.testing.assert_close(closed.exp().sum(-1), torch.ones(3, dtype=torch.float64))
    ratio = closed / LENGTHS - bandit.reward / beta                 # log pi / |y| - u / beta: one constant per prompt
    assert float((ratio - ratio[:, :1]).abs().max()) < 1e-9


def test_simpo_optimum_for_equal_lengths_is_a_softmax_of_the_reward(bandit):
    """All lengths 1: log pi = u / beta + c, the KL-regularised optimum of a *uniform* reference."""
    uniform = torch.full_like(bandit.ref_logprobs, -math.log(5))
    torch.testing.assert_close(simpo_optimum(bandit.reward, torch.ones(5), 0.7),
                               kl_regularised_optimum(uniform, bandit.reward, 0.7), atol=1e-10, rtol=0)


def test_simpo_optimum_when_every_utility_is_below_minus_beta():
    """Utilities all below -beta put the bracket's first lower end above 0; it must still be lowered (old code
    doubled a positive end upwards forever). An alarm turns a hang into a failure within seconds."""
    import signal

    def hung(signum, frame):
        raise TimeoutError("simpo_optimum did not return within 20 s")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        # five answers a little below -beta: at c = -(max u / beta + 1) their terms still sum above 1
        utility = torch.tensor([[-3.0, -3.2, -3.1, -2.9, -3.0], [-40.0, -41.0, -39.5, -40.2, -40.0]], dtype=torch.float64)
        lengths = torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0], dtype=torch.float64)
        logp = simpo_optimum(utility, lengths, 1.0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, dtype=torch.float64))
    ratio = logp / lengths - utility                # log pi / |y| - u / beta: one constant per prompt
    assert float((ratio - ratio[:, :1]).abs().max()) < 1e-9


def test_objective_lost_is_beta_times_the_kl_to_the_optimum(bandit):
    """J(pi*) - J(pi) = beta KL(pi || pi*) for any pi: the yardstick the lesson reports."""
    beta = 0.5
    gen = torch.Generator().manual_seed(1)
    other = torch.log_softmax(torch.randn(3, 5, generator=gen, dtype=torch.float64), -1)
    optimal = bandit.optimal_logprobs(beta)
    gap = bandit.objective(optimal, beta) - bandit.objective(other, beta)
    torch.testing.assert_close(gap, beta * bandit.kl(other, optimal))


def test_expected_kto_holds_its_reference_point_fixed(bandit):
    """No gradient through z0: the gradient equals the one with z0 frozen at its current value."""
    beta = 0.5
    logits = (bandit.ref_logprobs + 0.5).clone().requires_grad_(True)
    lp = torch.log_softmax(logits, -1)
    (g,) = torch.autograd.grad(expected_preference_loss(lp, bandit, "kto", beta), logits)
    assert float(g.abs().max()) > 1e-4
    eps = 1e-6
    for i, j in itertools.product(range(3), range(5)):
        bump = torch.zeros(3, 5, dtype=torch.float64)
        bump[i, j] = eps
        # the loss with the policy's log-ratios moved but z0 left where it was: move the policy only inside kto_loss
        moved = torch.log_softmax(logits.detach() + bump, -1)
        fixed_z0 = _kto_at(bandit, moved, torch.log_softmax(logits.detach(), -1), beta)
        base = _kto_at(bandit, torch.log_softmax(logits.detach(), -1), torch.log_softmax(logits.detach(), -1), beta)
        assert float(g[i, j]) == pytest.approx(float((fixed_z0 - base) / eps), abs=1e-5)


def _kto_at(bandit, logp, logp_for_z0, beta):
    """Expected KTO loss of ``logp`` with the reference point measured at ``logp_for_z0``."""
    d = labelled_pairs(bandit)
    x, a, b, w = d["prompt"], d["chosen"], d["rejected"], d["weight"]
    ref = bandit.ref_logprobs
    held = torch.zeros_like(ref).index_put_((x, a), w / 2, accumulate=True).index_put_((x, b), w / 2, accumulate=True)
    law = held.sum(0) / held.sum()
    z0 = max(0.0, float((law * (logp_for_z0 - ref)).sum(-1).mean()))
    per = kto_loss(logp[x, a], logp[x, b], ref[x, a], ref[x, b], z0, beta)
    return (torch.cat([w, w]) * per).sum() / 2


def test_expected_loss_rejects_unknown_losses_and_bad_lengths(bandit):
    with pytest.raises(ValueError, match="loss_type"):
        expected_preference_loss(bandit.ref_logprobs, bandit, "cpo", 0.5)
    with pytest.raises(ValueError, match="lengths"):
        expected_preference_loss(bandit.ref_logprobs, bandit, "simpo", 0.5, lengths=torch.zeros(5))


def test_bad_inputs_name_the_argument():
    one = _f64(-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        simpo_loss(one, one, 1.0, 0.5, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(one, one, 0.0, 0.5)
    with pytest.raises(ValueError, match="desirable_weight"):
        kto_loss(one, one, one, one, 0.0, 1.0, desirable_weight=-1.0)
    with pytest.raises(ValueError, match="finite"):
        online_dpo_pairs(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="alpha"):
        rdpo_loss(one, one, one, one, torch.ones(1), torch.ones(1), 1.0, float("nan"))
    with pytest.raises(ValueError, match="lengths must be > 0"):
        simpo_optimum(torch.zeros(1, 2), torch.tensor([1.0, 0.0]), 1.0)
