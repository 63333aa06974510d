"""The exact mean and variance of an off-policy gradient estimator, on an enumerable policy (lesson 10c).

The trainer's policy ``pi`` is an :class:`~rlcourse.measure.exact_gradient.EnumerablePolicy`; the sampler
``mu`` is the same tabular softmax with other logits (a perturbed or rounded copy). One completion
``y ~ mu`` per prompt gives the estimate

    g(y) = A(y) sum_t w_t(y) grad log pi(y_t | x, y_<t),        A(y) = R(y) - b,

with ``w_t = 1`` (uncorrected), TRL's sampler weight ``pi_old / mu`` in one of its four modes
(:func:`rlcourse.losses.off_policy.sampler_importance_weights`), or DeepSeek-V3.2's sequence mask
(:func:`rlcourse.losses.off_policy.off_policy_sequence_mask`). Because every completion can be
listed, its expectation and variance under ``mu`` are finite sums, not estimates:

    E_mu[g] = sum_y mu(y) g(y),        Var = sum_y mu(y) ||g(y)||^2 - ||E_mu[g]||^2,

and its bias is measured against the true on-policy gradient ``grad J = sum_y pi(y) R(y) grad log pi(y)``.
Here ``pi_old = pi`` (the first update on a batch: the trainer's policy is the one being differentiated).

Facts the tests check: with ``mu = pi`` every estimator is unbiased; the untruncated sequence weight
``pi(y) / mu(y)`` is unbiased for any ``mu``; the untruncated token weight is unbiased when a
completion is one token long and biased beyond (the prefix ``y_<t`` was still drawn from ``mu``).
"""
from __future__ import annotations

import torch

from rlcourse.measure.exact_gradient import EnumerablePolicy

__all__ = ["token_scores", "exact_off_policy_gradient", "perturbed_logits"]


def token_scores(policy: EnumerablePolicy) -> torch.Tensor:
    """``grad_theta log pi(y_t | x, y_<t)`` of every token of every completion: ``(P, C, max_len, D)``, 0 after the end."""
    now = policy.logits.detach()
    jac = torch.autograd.functional.jacobian(lambda th: policy.token_logprobs(th), now)
    return jac.reshape(policy.n_prompts, policy.n_completions, policy.max_len, -1)


def perturbed_logits(policy: EnumerablePolicy, scale: float, seed: int = 0) -> torch.Tensor:
    """A sampler's logits: the policy's plus Gaussian noise of standard deviation ``scale`` (seeded)."""
    if not scale >= 0:
        raise ValueError(f"scale must be a number >= 0, got {scale!r}")
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(policy.logits.shape, generator=gen, dtype=policy.logits.dtype)
    return policy.logits.detach() + scale * noise


def exact_off_policy_gradient(policy: EnumerablePolicy, sampler_logits: torch.Tensor, rewards,
                              weight_fn=None, baseline: torch.Tensor | None = None) -> dict:
    """The exact mean and variance of the one-completion-per-prompt estimate ``g`` (module docstring).

    ``sampler_logits`` has ``policy.logits``' shape. ``rewards`` is ``(n_prompts, n_completions)``.
    ``weight_fn(old_logprobs, sampler_logprobs, mask, advantages)`` receives one prompt's per-token
    log-probs under ``pi`` and ``mu`` and the mask, each ``(C, max_len)``, and the advantages ``(C,)``,
    and returns the weights, ``(C, max_len)`` (token level) or ``(C, 1)`` (sequence level); ``None``
    is the uncorrected estimator (every weight 1). ``baseline`` ``(n_prompts,)`` defaults to each
    prompt's exact mean reward under ``pi``.

    Returns ``mean`` (D,), ``exact`` (the on-policy gradient, D,), ``bias`` ``||mean - exact||``,
    ``variance`` (the trace of one estimate's covariance; a batch of n completions per prompt has
    ``variance / n``) and ``kl`` (``KL(mu || pi)`` over whole completions, mean over prompts).
    """
    if sampler_logits.shape != policy.logits.shape:
        raise ValueError(f"sampler_logits must have the policy's logits shape {tuple(policy.logits.shape)}, "
                         f"got {tuple(sampler_logits.shape)}")
    rewards = policy._rewards(rewards).detach()
    with torch.no_grad():
        old = policy.token_logprobs()                                     # (P, C, L)
        mu = policy.token_logprobs(sampler_logits.detach().to(policy.logits.dtype))
        pi_logp, mu_logp = old.sum(-1), mu.sum(-1)                         # (P, C)
        pi_probs, mu_probs = pi_logp.exp(), mu_logp.exp()
    b = (pi_probs * rewards).sum(1) if baseline is None else torch.as_tensor(baseline, dtype=rewards.dtype)
    if b.shape != (policy.n_prompts,):
        raise ValueError(f"baseline must have shape (n_prompts,) = ({policy.n_prompts},), got {tuple(b.shape)}")
    scores = token_scores(policy)                                          # (P, C, L, D)
    mask = policy.mask
    means, variances = [], []
    for p in range(policy.n_prompts):
        adv = rewards[p] - b[p]
        if weight_fn is None:
            w = torch.ones(policy.n_completions, 1, dtype=old.dtype)
        else:
            w = torch.as_tensor(weight_fn(old[p], mu[p], mask, adv), dtype=old.dtype)
            if w.shape not in ((policy.n_completions, policy.max_len), (policy.n_completions, 1)):
                raise ValueError(f"weight_fn must return (C, max_len) or (C, 1) weights, got {tuple(w.shape)}")
        w = w * mask.to(old.dtype)                                         # padding tokens carry no score anyway
        g = adv[:, None] * (w[:, :, None] * scores[p]).sum(1)              # (C, D): one estimate per completion
        mean = (mu_probs[p][:, None] * g).sum(0)
        means.append(mean)
        variances.append(float((mu_probs[p] * (g ** 2).sum(1)).sum() - mean @ mean))
    mean = torch.stack(means).mean(0)
    exact = policy.flat_grad(policy.objective(rewards)).detach()
    kl = float((mu_probs * (mu_logp - pi_logp)).sum(1).mean())
    return {"mean": mean, "exact": exact, "bias": float((mean - exact).norm()),
            "variance": sum(variances) / policy.n_prompts ** 2, "kl": kl}
