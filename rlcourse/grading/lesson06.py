"""Checks for lesson 06 (PPO): the clipped policy loss, the clipped value loss, the adaptive KL penalty.

The policy-loss cases are syllabus 004's clip table plus inputs that separate the usual mistakes:
max instead of min, clipping the advantage instead of the ratio, ``min(r, clip(r)) * A``, a
missing minus sign, and a ratio of probabilities (``exp(logp) / exp(old)``) that is 0/0 for
log-probabilities near -800. The gradient is checked too: it must be 0 exactly where the clipped
branch is selected.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse import losses
from rlcourse.grading._core import assert_close, fail, passed

__all__ = ["check_ppo_clip_loss", "check_clipped_value_loss", "check_adaptive_kl_beta"]

_CLIP_HINT = ("loss = -mean(min(ratio * A, clamp(ratio, 1 - clip_coef, 1 + clip_coef) * A)) with "
              "ratio = exp(logprobs - old_logprobs): the min of the two *products*, the clip on the ratio "
              "(never on A), and a minus sign because optimisers minimise")


def _f64(x):
    return torch.as_tensor(x, dtype=torch.float64)


def check_ppo_clip_loss(fn) -> None:
    """``fn(logprobs, old_logprobs, advantages, clip_coef) -> loss`` (a scalar to minimise, with grad)."""
    name = "check_ppo_clip_loss"
    ratios = np.array([0.5, 1.0, 1.5] * 4)
    advs = np.repeat([-5.0, -1.0, 1.0, 5.0], 3)
    gen = torch.Generator().manual_seed(60)
    cases = [("syllabus 004's clip table (eps=0.2), one entry per (r, A)", np.log(ratios), np.zeros(12), advs, 0.2),
             ("ratios inside the clip range", np.log([0.9, 1.1, 1.05]), np.zeros(3), np.array([2.0, -1.0, 0.5]), 0.2),
             ("a bad action made more likely (A < 0, r > 1 + eps): not clipped",
              np.log([1.6]), np.zeros(1), np.array([-2.0]), 0.2),
             ("a good action made less likely (A > 0, r < 1 - eps): not clipped",
              np.log([0.4]), np.zeros(1), np.array([3.0]), 0.2),
             ("a wider clip range (eps=0.3)", np.log([0.6, 1.4, 1.2]), np.zeros(3), np.array([-1.0, 1.0, 1.0]), 0.3),
             ("very unlikely actions (log-probs near -800)", np.array([-799.7, -800.4]), np.array([-800.0, -800.0]),
              np.array([1.0, -1.0]), 0.2)]
    cases += [(f"random batch #{i}", (torch.randn(16, generator=gen) * 0.4 - 1).numpy(),
               (torch.randn(16, generator=gen) * 0.4 - 1).numpy(), torch.randn(16, generator=gen).numpy() * 2, 0.2)
              for i in range(3)]
    for case, logp, old, adv, eps in cases:
        logp_t = _f64(logp).clone().requires_grad_(True)
        old_t, adv_t = _f64(old), _f64(adv)
        got = fn(logp_t, old_t, adv_t, eps)
        want = losses.ppo_clip_loss(logp_t.detach(), old_t, adv_t, clip_coef=eps)
        shown = f"{case}: ratio={np.round(np.exp(np.asarray(logp) - np.asarray(old)), 3).tolist()}, A={np.asarray(adv).round(3).tolist()}"
        assert_close(name, shown, want, got.detach() if hasattr(got, "detach") else got, hint=_CLIP_HINT)
        if not (hasattr(got, "requires_grad") and got.requires_grad):
            fail(name, case, "a scalar tensor connected to logprobs (requires_grad=True)", got,
                 "compute with torch operations on logprobs (no .item(), no NumPy)")
        (grad,) = torch.autograd.grad(got, logp_t)
        ref_logp = logp_t.detach().clone().requires_grad_(True)
        (want_grad,) = torch.autograd.grad(losses.ppo_clip_loss(ref_logp, old_t, adv_t, clip_coef=eps), ref_logp)
        assert_close(name, f"{shown}: the gradient with respect to logprobs", want_grad, grad,
                     hint="the gradient must be 0 where the clipped branch is selected and -ratio*A/N elsewhere; "
                          "use torch.clamp and torch.minimum so autograd sees the clip")
    passed(name, len(cases))


def check_clipped_value_loss(fn) -> None:
    """``fn(values, returns, old_values, clip_coef) -> 1/2 mean(max((V-R)^2, (V_old + clip(V-V_old) - R)^2))``."""
    name = "check_clipped_value_loss"
    gen = torch.Generator().manual_seed(61)
    cases = [("no movement since collection", [1.0, 2.0], [1.5, 1.0], [1.0, 2.0], 0.2),
             ("a value that moved past the clip towards its target", [3.0], [5.0], [1.0], 0.2),
             ("a value that moved past the clip away from its target", [3.0], [0.0], [1.0], 0.2),
             ("moves inside the clip range", [1.1, 0.95], [2.0, -1.0], [1.0, 1.0], 0.2),
             ("a larger clip_coef", [2.0, -1.0, 0.4], [0.0, 1.0, 0.5], [1.0, 0.0, 0.0], 0.5)]
    cases += [(f"random batch #{i}", torch.randn(10, generator=gen).tolist(), torch.randn(10, generator=gen).tolist(),
               torch.randn(10, generator=gen).tolist(), 0.2) for i in range(3)]
    for case, v, R, old, c in cases:
        v_t = _f64(v).clone().requires_grad_(True)
        got = fn(v_t, _f64(R), _f64(old), c)
        want = losses.value_loss(v_t.detach(), _f64(R), _f64(old), clip_coef=c)
        assert_close(name, f"{case}: values={v}, returns={R}, old_values={old}, clip_coef={c}", want,
                     got.detach() if hasattr(got, "detach") else got,
                     hint="V_clipped = old_values + clamp(values - old_values, -c, c); loss = 0.5 * mean(max("
                          "(values - returns)^2, (V_clipped - returns)^2)): the max, the pessimistic choice")
    passed(name, len(cases))


def check_adaptive_kl_beta(fn) -> None:
    """``fn(beta, kl, kl_target) -> new beta``: halve below target/1.5, double above target*1.5."""
    name = "check_adaptive_kl_beta"
    cases = [(1.0, 0.001, 0.01), (1.0, 0.0066, 0.01), (1.0, 0.0067, 0.01), (1.0, 0.01, 0.01), (0.3, 0.0149, 0.01),
             (0.3, 0.0151, 0.01), (2.0, 0.5, 0.01), (0.05, 0.0, 0.02), (4.0, 0.031, 0.02)]
    for beta, kl, target in cases:
        got = fn(beta, kl, target)
        want = losses.adaptive_kl_beta(beta, kl, target)
        assert_close(name, f"beta={beta}, kl={kl}, kl_target={target}", want, got,
                     hint="if kl < kl_target / 1.5: beta / 2; elif kl > kl_target * 1.5: beta * 2; else unchanged "
                          "(a KL above target means the penalty was too weak)")
    passed(name, len(cases))
