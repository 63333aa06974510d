"""Checks for lesson 06 (PPO): the clipped policy loss, the clipped value loss, the adaptive KL penalty.

The policy-loss cases are PPO's clip table (ratios 0.5, 1 and 1.5 against advantages of both
signs) plus inputs that separate the usual mistakes: max instead of min, clipping the advantage
instead of the ratio, ``min(r, clip(r)) * A``, a missing minus sign, a ratio of probabilities
(``exp(logp) / exp(old)``) that is 0/0 for log-probabilities near -800, and ratios far outside the
clip range (0.05, 5, 20), where dual-clip variants and one-sided clips differ from PPO's objective.
Gradients are checked too (0 exactly where the clipped branch is selected), on a result that must
really hang off ``logprobs``; thresholds are hit exactly; inputs are the caller's own tensors.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse import losses
from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references)

__all__ = ["check_ppo_clip_loss", "check_clipped_value_loss", "check_adaptive_kl_beta", "check_update_kl"]

_CLIP_HINT = ("loss = -mean(min(ratio * A, clamp(ratio, 1 - clip_coef, 1 + clip_coef) * A)) with "
              "ratio = exp(logprobs - old_logprobs): the min of the two *products*, the clip on the ratio "
              "(never on A, and on both sides: no extra bound for very large ratios), and a minus sign "
              "because optimisers minimise")


def _f64(x):
    return torch.as_tensor(x, dtype=torch.float64)


@references("rlcourse.losses:ppo_clip_loss", "rlcourse.losses.policy_gradient:ppo_clip_loss",
            "rlcourse.losses.policy_gradient:ppo_clip_objective")
def check_ppo_clip_loss(fn) -> None:
    """``fn(logprobs, old_logprobs, advantages, clip_coef) -> loss`` (a scalar to minimise, with grad)."""
    __tracebackhide__ = True
    name = "check_ppo_clip_loss"
    ratios = np.array([0.5, 1.0, 1.5] * 4)
    advs = np.repeat([-5.0, -1.0, 1.0, 5.0], 3)
    far = np.array([0.05, 0.05, 5.0, 5.0, 20.0, 20.0])
    gen = torch.Generator().manual_seed(60)
    cases = [("PPO's clip table (eps=0.2), one entry per (r, A)", np.log(ratios), np.zeros(12), advs, 0.2),
             ("ratios inside the clip range", np.log([0.9, 1.1, 1.05]), np.zeros(3), np.array([2.0, -1.0, 0.5]), 0.2),
             ("a bad action made more likely (A < 0, r > 1 + eps): not clipped",
              np.log([1.6]), np.zeros(1), np.array([-2.0]), 0.2),
             ("a good action made less likely (A > 0, r < 1 - eps): not clipped",
              np.log([0.4]), np.zeros(1), np.array([3.0]), 0.2),
             ("a wider clip range (eps=0.3)", np.log([0.6, 1.4, 1.2]), np.zeros(3), np.array([-1.0, 1.0, 1.0]), 0.3),
             ("ratios far outside the clip range (0.05, 5, 20; dual-clip regions)", np.log(far), np.zeros(6),
              np.array([1.0, -1.0, 1.0, -1.0, 1.0, -2.0]), 0.2),
             ("very unlikely actions (log-probs near -800)", np.array([-799.7, -800.4]), np.array([-800.0, -800.0]),
              np.array([1.0, -1.0]), 0.2),
             ("integer advantages", np.log([0.7, 1.3, 1.0]), np.zeros(3), np.array([2, -3, 1]), 0.2)]
    cases += [(f"random batch #{i}", (torch.randn(16, generator=gen) * 0.4 - 1).numpy(),
               (torch.randn(16, generator=gen) * 0.4 - 1).numpy(), torch.randn(16, generator=gen).numpy() * 2, 0.2)
              for i in range(3)]
    for case, logp, old, adv, eps in cases:
        logp_t = _f64(logp).clone().requires_grad_(True)
        old_t = _f64(old)
        adv_t = torch.as_tensor(adv)                  # integer advantages stay integer: the learner must cope
        got = call_unmutated(name, case, fn, logp_t, old_t, adv_t, eps)
        want = losses.ppo_clip_loss(logp_t.detach(), old_t, adv_t.double(), clip_coef=eps)
        shown = f"{case}: ratio={np.round(np.exp(np.asarray(logp) - np.asarray(old)), 3).tolist()}, A={np.asarray(adv).round(3).tolist()}"
        assert_close(name, shown, want, got.detach() if hasattr(got, "detach") else got, hint=_CLIP_HINT)
        (grad,) = gradient_flowing(name, case, got, [logp_t],
                                   "compute with torch operations on logprobs (no .item(), no NumPy, no "
                                   "torch.tensor(...) around a value)")
        ref_logp = logp_t.detach().clone().requires_grad_(True)
        (want_grad,) = torch.autograd.grad(losses.ppo_clip_loss(ref_logp, old_t, adv_t.double(), clip_coef=eps), ref_logp)
        assert_close(name, f"{shown}: the gradient with respect to logprobs", want_grad, grad,
                     hint="the gradient must be 0 where the clipped branch is selected and -ratio*A/N elsewhere; "
                          "use torch.clamp and torch.minimum so autograd sees the clip")
    passed(name, len(cases))


@references("rlcourse.losses:value_loss", "rlcourse.losses.policy_gradient:value_loss")
def check_clipped_value_loss(fn) -> None:
    """``fn(values, returns, old_values, clip_coef) -> 1/2 mean(max((V-R)^2, (V_old + clip(V-V_old) - R)^2))``."""
    __tracebackhide__ = True
    name = "check_clipped_value_loss"
    gen = torch.Generator().manual_seed(61)
    cases = [("no movement since collection", [1.0, 2.0], [1.5, 1.0], [1.0, 2.0], 0.2),
             ("a value that moved past the clip towards its target", [3.0], [5.0], [1.0], 0.2),
             ("a value that moved past the clip away from its target", [3.0], [0.0], [1.0], 0.2),
             ("moves inside the clip range", [1.1, 0.95], [2.0, -1.0], [1.0, 1.0], 0.2),
             ("a larger clip_coef", [2.0, -1.0, 0.4], [0.0, 1.0, 0.5], [1.0, 0.0, 0.0], 0.5),
             ("moves of exactly clip_coef", [1.5, 0.5, 2.25], [3.0, -1.0, 2.0], [1.0, 1.0, 1.75], 0.5)]
    cases += [(f"random batch #{i}", torch.randn(10, generator=gen).tolist(), torch.randn(10, generator=gen).tolist(),
               torch.randn(10, generator=gen).tolist(), 0.2) for i in range(3)]
    for case, v, R, old, c in cases:
        label = f"{case}: values={np.round(v, 3).tolist()}, returns={np.round(R, 3).tolist()}, " \
                f"old_values={np.round(old, 3).tolist()}, clip_coef={c}"
        v_t = _f64(v).clone().requires_grad_(True)
        R_t, old_t = _f64(R), _f64(old)
        got = call_unmutated(name, label, fn, v_t, R_t, old_t, c)
        want = losses.value_loss(v_t.detach(), R_t, old_t, clip_coef=c)
        assert_close(name, label, want, got.detach() if hasattr(got, "detach") else got,
                     hint="V_clipped = old_values + clamp(values - old_values, -c, c); loss = 0.5 * mean(max("
                          "(values - returns)^2, (V_clipped - returns)^2)): the max, the pessimistic choice")
        (grad,) = gradient_flowing(name, label, got, [v_t])
        ref_v = v_t.detach().clone().requires_grad_(True)
        (want_grad,) = torch.autograd.grad(losses.value_loss(ref_v, R_t, old_t, clip_coef=c), ref_v)
        assert_close(name, f"{label}: the gradient with respect to values", want_grad, grad,
                     hint="use torch.clamp and torch.maximum so the gradient is 0 through the clipped branch")
    passed(name, len(cases))


def _beta_rule(beta, kl, target, threshold: float, factor: float) -> float:
    """The adaptive-KL update with other constants (a wrong answer's): ``beta / factor`` if
    ``kl < target / threshold``, ``beta * factor`` if ``kl > target * threshold``, else ``beta``."""
    if kl < target / threshold:
        return beta / factor
    if kl > target * threshold:
        return beta * factor
    return beta


@references("rlcourse.losses:adaptive_kl_beta", "rlcourse.losses.policy_gradient:adaptive_kl_beta")
def check_adaptive_kl_beta(fn) -> None:
    """``fn(beta, kl, kl_target) -> new beta``: halve below target/1.5, double above target*1.5."""
    __tracebackhide__ = True
    name = "check_adaptive_kl_beta"
    cases = [(1.0, 0.001, 0.01), (1.0, 0.0066, 0.01), (1.0, 0.0067, 0.01), (1.0, 0.01, 0.01), (0.3, 0.0149, 0.01),
             (0.3, 0.0151, 0.01), (2.0, 0.5, 0.01), (0.05, 0.0, 0.02), (4.0, 0.031, 0.02),
             (1.0, 0.02 / 1.5, 0.02), (1.0, 0.02 * 1.5, 0.02), (0.5, 0.05 / 1.5, 0.05), (0.5, 0.05 * 1.5, 0.05),
             (1, 0, 1), (3, 2, 1)]
    for beta, kl, target in cases:
        label = f"beta={beta!r}, kl={kl!r}, kl_target={target!r}"
        if kl in (target / 1.5, target * 1.5) and kl:
            label += " (exactly on a threshold: the rule's inequalities are strict)"
        got = fn(beta, kl, target)
        want = losses.adaptive_kl_beta(beta, kl, target)
        fail_if_mistake(name, label, want, got, _beta_rule(beta, kl, target, 2.0, 2.0),
                        "that uses thresholds kl_target / 2 and 2 * kl_target; Schulman et al. 2017 "
                        "(arXiv:1707.06347, section 4) halve beta below kl_target / 1.5 and double it above "
                        "1.5 * kl_target")
        fail_if_mistake(name, label, want, got, _beta_rule(beta, kl, target, 1.5, 1.5),
                        "that multiplies/divides beta by 1.5; the thresholds are kl_target / 1.5 and "
                        "1.5 * kl_target, but the update halves or doubles beta (Schulman et al. 2017, "
                        "arXiv:1707.06347)")
        assert_close(name, label, want, got,
                     hint="if kl < kl_target / 1.5: beta / 2; elif kl > kl_target * 1.5: beta * 2; else unchanged "
                          "(strict inequalities; a KL above target means the penalty was too weak)")
    passed(name, len(cases))


def ppo_toy_batch(seed: int = 0):
    """A fixed batch for the experiment: logits of 8 states x 4 actions, 256 (state, action, advantage)."""
    gen = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(8, 4, generator=gen, dtype=torch.float64) * 0.5
    states = torch.randint(0, 8, (256,), generator=gen)
    probs = torch.softmax(old_logits[states], -1)
    actions = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    advantages = torch.randn(256, generator=gen, dtype=torch.float64)
    return old_logits, states, actions, advantages


def _update_kl_reference(old_logits, states, actions, advantages, clip_coef, epochs, lr):
    theta = old_logits.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    old_logp = torch.log_softmax(old_logits, -1)[states, actions]
    for _ in range(epochs):
        logp = torch.log_softmax(theta, -1)[states, actions]
        loss = losses.ppo_clip_loss(logp, old_logp, advantages, clip_coef=clip_coef)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        p_old, logp_new = torch.log_softmax(old_logits, -1), torch.log_softmax(theta, -1)
        kl = (p_old.exp() * (p_old - logp_new)).sum(-1)
    return float(kl[states].mean())


@references("rlcourse.classic.ppo:ppo_update", "rlcourse.classic.ppo:train_ppo")
def check_update_kl(fn) -> None:
    """``fn(old_logits, states, actions, advantages, clip_coef, epochs, lr) -> kl``: the ablation.

    The experiment: starting from ``old_logits``, take ``epochs`` Adam steps (learning rate ``lr``) on
    your PPO loss over the whole batch, then measure ``KL(pi_old || pi_new)`` averaged over the batch's
    states. With clipping (0.2) the update must stay much closer to the old policy than without
    (clip_coef = 1e9, the plain surrogate), and both numbers must agree with the same procedure run
    by the reference.
    """
    __tracebackhide__ = True
    name = "check_update_kl"
    batch = ppo_toy_batch(0)
    measured = {}
    for clip_coef in (0.2, 1e9):
        case = f"the toy batch (8 states, 4 actions, 256 samples), clip_coef={clip_coef:g}, 30 epochs, lr=0.1"
        got = call_unmutated(name, case, fn, *batch, clip_coef, 30, 0.1)
        want = _update_kl_reference(*batch, clip_coef, 30, 0.1)
        assert_close(name, case, want, got, rtol=0.02, atol=1e-6,
                     hint="theta = old_logits.clone().requires_grad_(True); Adam([theta], lr); each epoch: logp = "
                          "log_softmax(theta)[states, actions], loss = ppo_clip_loss(logp, old_logp, advantages, "
                          "clip_coef), step; then KL = sum_a p_old (log p_old - log p_new), averaged over states[i]")
        measured[clip_coef] = float(got)
    if not measured[0.2] < 0.5 * measured[1e9]:
        fail(name, "clipped against unclipped", f"KL with clipping < half of {measured[1e9]:.4f}", measured[0.2],
             "with clipping the gradient of a sample stops once its ratio leaves [1 - eps, 1 + eps]")
    passed(name, 3)
