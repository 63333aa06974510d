"""Losses and KL estimators under padding, nan, inf and extreme log-ratios, against per-token loops.

A masked entry may hold anything; the loss and the gradient of every real entry must not change,
and masked entries must receive exactly zero gradient.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import kl, losses

SETTINGS = settings(max_examples=40, deadline=None)
JUNK = (float("nan"), float("inf"), -float("inf"), -120.0, 3e38)


@st.composite
def token_batches(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    N, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    layout = draw(st.sampled_from(["holes", "left", "right"]))
    lengths = rng.integers(1, T + 1, size=N)
    cols = np.arange(T)[None, :]
    mask = {"holes": rng.random((N, T)) < 0.6, "left": cols >= T - lengths[:, None],
            "right": cols < lengths[:, None]}[layout]
    mask[0, rng.integers(T)] = True  # at least one real entry
    return {"logp": rng.normal(-2.0, 1.0, (N, T)), "old": rng.normal(-2.0, 1.0, (N, T)),
            "adv": rng.normal(size=(N, T)), "mask": mask, "junk": JUNK[draw(st.integers(0, len(JUNK) - 1))],
            "values": rng.normal(size=(N, T)), "targets": rng.normal(size=(N, T))}


def with_junk(x, mask, junk):
    return torch.tensor(np.where(mask, x, junk))


def losses_of(b, fill):
    """Every masked loss on the batch, with masked entries replaced by ``fill``; returns values and grads."""
    m = torch.tensor(b["mask"])
    out = {}
    for name, make in {
        "ppo_clip": lambda lp: losses.ppo_clip_loss(lp, with_junk(b["old"], b["mask"], fill),
                                                    with_junk(b["adv"], b["mask"], fill), m, 0.2, 0.28),
        "reinforce": lambda lp: losses.reinforce_loss(lp, with_junk(b["adv"], b["mask"], fill), m),
        "penalty": lambda lp: losses.ppo_penalty_loss(lp, with_junk(b["old"], b["mask"], fill),
                                                      with_junk(b["adv"], b["mask"], fill),
                                                      kl.kl_k3(lp, with_junk(b["old"], b["mask"], fill), m), 0.5, m),
        "value": lambda v: losses.value_loss(v, with_junk(b["targets"], b["mask"], fill),
                                             with_junk(b["values"], b["mask"], fill), 0.2, m),
        "masked_mean": lambda lp: losses.masked_mean(lp * 2.0, m),
        "k1": lambda lp: kl.kl_k1(lp, with_junk(b["old"], b["mask"], fill), m).sum(),
        "k2": lambda lp: kl.kl_k2(lp, with_junk(b["old"], b["mask"], fill), m).sum(),
        "k3": lambda lp: kl.kl_k3(lp, with_junk(b["old"], b["mask"], fill), m).sum(),
    }.items():
        source = b["values"] if name == "value" else b["logp"]
        x = with_junk(source, b["mask"], fill).requires_grad_(True)
        loss = make(x)
        loss.backward()
        out[name] = (loss.detach(), x.grad.clone())
    return out


@SETTINGS
@given(token_batches())
def test_masked_entries_change_neither_loss_nor_gradient(b):
    clean, dirty = losses_of(b, 0.0), losses_of(b, b["junk"])
    hole = torch.tensor(~b["mask"])
    for name, (value, grad) in clean.items():
        assert torch.isfinite(value), name
        assert torch.equal(value, dirty[name][0]), name
        assert torch.equal(grad, dirty[name][1]), name
        assert (dirty[name][1][hole] == 0).all(), name


def clip_loss_by_loop(logp, old, adv, mask, eps_low, eps_high):
    """The PPO-clip loss token by token in plain Python floats: the definition."""
    total, count = 0.0, 0
    for lp, o, a, real in zip(logp.ravel(), old.ravel(), adv.ravel(), mask.ravel()):
        if not real:
            continue
        ratio = math.exp(lp - o)
        clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
        total += min(ratio * a, clipped * a)
        count += 1
    return -total / count


@SETTINGS
@given(token_batches())
def test_ppo_clip_loss_matches_a_per_token_loop(b):
    got = losses.ppo_clip_loss(torch.tensor(b["logp"]), torch.tensor(b["old"]), torch.tensor(b["adv"]),
                               torch.tensor(b["mask"]), 0.2, 0.28)
    want = clip_loss_by_loop(b["logp"], b["old"], b["adv"], b["mask"], 0.2, 0.28)
    assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("log_ratio", [-1e3, -100.0, -30.0, 30.0, 88.8, 100.0, 1e3])
@pytest.mark.parametrize("adv", [-1.0, 0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_give_finite_losses_and_gradients(log_ratio, adv, dtype):
    logp = torch.tensor([log_ratio - 5.0, -1.0], dtype=dtype, requires_grad=True)
    old = torch.tensor([-5.0, -1.0], dtype=dtype)
    a = torch.tensor([adv, 1.0], dtype=dtype)
    for loss in (losses.ppo_clip_loss(logp, old, a), losses.ppo_penalty_loss(logp, old, a, kl.kl_k3(logp, old), 0.1),
                 kl.kl_k3(logp, old).sum()):
        g, = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), (loss, g)
    diag = losses.ppo_diagnostics(logp, old, a)
    assert all(math.isfinite(v) for v in diag.values())


@pytest.mark.parametrize("log_ratio,adv", [(0.5, 1.0), (100.0, 1.0), (-0.5, -1.0), (-100.0, -1.0)])
def test_a_clipped_token_gets_exactly_zero_gradient(log_ratio, adv):
    logp = torch.tensor([log_ratio], requires_grad=True)
    loss = losses.ppo_clip_loss(logp, torch.zeros(1), torch.tensor([adv]), clip_coef=0.2)
    loss.backward()
    assert logp.grad.item() == 0.0


def test_a_huge_ratio_with_zero_advantage_is_zero_not_nan():
    logp = torch.tensor([200.0, 0.0], requires_grad=True)
    loss = losses.ppo_clip_loss(logp, torch.zeros(2), torch.tensor([0.0, 1.0]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.5) and torch.isfinite(logp.grad).all()


def test_entropy_with_minus_inf_logits_is_finite_and_right():
    logits = torch.tensor([[0.0, 0.0, -float("inf")], [1.0, -float("inf"), -float("inf")]], requires_grad=True)
    h = losses.entropy_bonus(logits)
    h.backward()
    assert h.item() == pytest.approx(math.log(2) / 2)  # log 2 for the first row, 0 for the second
    assert torch.isfinite(logits.grad).all()
    # and a fully masked row of garbage does not count
    junk = torch.tensor([[0.0, 0.0, -float("inf")], [float("nan")] * 3])
    assert losses.entropy_bonus(junk, mask=torch.tensor([1, 0])).item() == pytest.approx(math.log(2))


def test_exact_kl_and_entropy_ignore_masked_positions():
    p = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), -1)
    m = torch.tensor([1, 0, 1])
    dirty_p, dirty_q = p.clone(), q.clone()
    dirty_p[1], dirty_q[1] = float("nan"), 7.0  # not even distributions
    assert torch.equal(kl.exact_kl(dirty_p, dirty_q, mask=m), kl.exact_kl(p, q) * m)
    assert torch.equal(kl.entropy(dirty_p, mask=m), kl.entropy(p) * m)


def test_reinforce_psi_of_shape_n_is_refused_when_it_would_be_misread():
    logp = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"psi\[:, None\]"):
        losses.reinforce_loss(logp, torch.tensor([1.0, 2.0, 3.0]))
    # the unambiguous spelling works and weighs rows
    loss = losses.reinforce_loss(logp.requires_grad_(True), torch.tensor([[1.0], [2.0], [3.0]]))
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), -np.array([[1.0] * 3, [2.0] * 3, [3.0] * 3]) / 3)
