"""KL divergence between a policy and a reference, exactly and from samples.

RL for language models keeps the trained policy ``pi_theta`` close to a reference ``pi_ref``
(usually the SFT model) by penalising

    KL(pi_theta || pi_ref) = E_{x ~ pi_theta} [ log pi_theta(x) - log pi_ref(x) ].

Over one next-token distribution the sum over the vocabulary is cheap (:func:`exact_kl`). Over
whole completions it is not: the number of sequences grows as ``V^T``. Trainers therefore
estimate it from the tokens they sampled, with one number per token. With

    r = pi_ref(x) / pi_theta(x),    x ~ pi_theta,

John Schulman's three estimators ("Approximating KL divergence", 2020) are

    k1 = -log r                 unbiased, high variance, often negative
    k2 = 1/2 (log r)^2          biased, low variance, always >= 0
    k3 = (r - 1) - log r        unbiased, lower variance than k1 when pi_ref is close, always >= 0

Every function takes log-probabilities, never probabilities: ``logp = log pi_theta(x)`` and
``logq = log pi_ref(x)`` for the sampled tokens (any shape, the same for both), or full
log-distributions over the last dimension for :func:`exact_kl` and :func:`entropy`.
The estimators return one value per token, in the inputs' shape, clamped to ``[-bound, bound]``
when a ``bound`` is given (verl's and OpenRLHF's convention, :data:`ESTIMATE_BOUND`); :func:`exact_kl` and
:func:`entropy` drop the vocabulary dimension. Every function takes an optional ``mask`` (the
shape of its result): masked entries come back as exactly 0 whatever the inputs held there, and
never leak into the gradient. Averaging or summing over a completion mask is the
trainer's choice, not the estimator's. :func:`expected_loss_gradient` gives, exactly, the gradient
an estimator puts in a loss in expectation over the sampled token.
"""
from __future__ import annotations

import torch

__all__ = ["kl_k1", "kl_k2", "kl_k3", "exact_kl", "entropy", "expected_loss_gradient", "KL_ESTIMATORS",
           "LOSS_ESTIMATORS", "LOG_RATIO_BOUND", "ESTIMATE_BOUND", "as_mask"]

# A log-ratio between two policies is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] wherever it is
# exponentiated: exp(20) = 4.9e8 is already far beyond any ratio an update should see, while
# exp(89) overflows float32 to inf, and inf * 0 = nan would poison a whole batch, gradient
# included. Beyond the bound the exponential is flat, so its gradient is 0. TRL 1.16 clamps no
# log-ratio: inside the bound the two agree exactly. verl's k3 ("low_var_kl" in
# verl/trainer/ppo/core_algos.py, kl_penalty_forward) clamps its log-ratio to [-20, 20] as well,
# on both sides and before the "- log r" term too; kl_k3 clamps only the exponential's argument,
# and only above (below, r - 1 tends to -1 and stays finite). Without an estimate bound the two
# therefore differ where |log r| > 20: below, verl's k3 is flat at exp(-20) + 19 (gradient 0) where
# ours keeps growing as -1 - log r; above, ours is expm1(20) - log r, verl's expm1(20) - 20.
LOG_RATIO_BOUND = 20.0

# Two conventions for the *estimate*, read in their sources (verl at b178a3c, OpenRLHF at 3c3be62):
# * verl clamps k3 (kl_loss_type / kl_penalty "low_var_kl" or "k3") to [-10, 10] after the
#   log-ratio clamp above; its k1 ("kl"), k2 ("mse") and "abs" are not clamped;
# * OpenRLHF (openrlhf/models/utils.py, compute_approx_kl) clamps every estimator, k1, k2 and k3,
#   to [-10, 10], and clamps no log-ratio.
# Pass ``bound=ESTIMATE_BOUND`` to an estimator to follow them; the default (no bound) is TRL's.
# With it, kl_k3 equals verl's low_var_kl everywhere (beyond |log r| = 20 both give 10) and
# kl_k1 / kl_k2 / kl_k3 equal OpenRLHF's k1 / k2 / k3 (tests/test_maths_holes.py restates both
# rules). A clamped token contributes no gradient, so a token whose estimate exceeds 10 nats stops
# being pulled back toward the reference: the bound trades the penalty's strength on outliers for
# stability.
ESTIMATE_BOUND = 10.0


def as_mask(mask, like: torch.Tensor, name: str = "mask", shape_of: str | None = None) -> torch.Tensor | None:
    """``mask`` (0/1 or bool; tensor, array or list) as a bool tensor on ``like``'s device; None stays None.

    The package's one check of a mask or flag array (losses, returns, KL estimators, log-probs):
    it must have ``like``'s shape (broadcasting a mask would silently mean something else) and hold
    only 0 and 1 (a 2, a 0.5 or a NaN is an error, never a weight). ``name`` and ``shape_of`` (what
    ``like`` is, e.g. ``"rewards"``) only word the error.
    """
    if mask is None:
        return None
    try:
        m = torch.as_tensor(mask, device=like.device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a tensor, array or list of 0/1, got {type(mask).__name__}") from None
    if tuple(m.shape) != tuple(like.shape):
        what = f"the shape of {shape_of} " if shape_of else "shape "
        raise ValueError(f"{name} must have {what}{tuple(like.shape)}, got {tuple(m.shape)}")
    if m.dtype != torch.bool:
        if not ((m == 0) | (m == 1)).all():
            raise ValueError(f"{name} must hold only 0/1 or booleans")
        m = m.bool()
    return m


def _pair(logp, logq, mask=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Both arguments as floating tensors of one shape (broadcasting would hide a bug), and the mask.

    Masked entries are replaced by 0 *before* any arithmetic, so whatever they held (nan, inf)
    reaches neither the result nor, through the backward pass, the gradient.
    """
    logp, logq = torch.as_tensor(logp), torch.as_tensor(logq)
    if logp.shape != logq.shape:
        raise ValueError(f"logp and logq must have the same shape (one log-prob per sampled token), "
                         f"got logp {tuple(logp.shape)} and logq {tuple(logq.shape)}")
    if not (logp.is_floating_point() and logq.is_floating_point()):
        raise TypeError(f"logp and logq must be floating-point log-probabilities, "
                        f"got dtypes {logp.dtype} and {logq.dtype}")
    m = as_mask(mask, logp)
    if m is not None:
        logp, logq = torch.where(m, logp, 0.0), torch.where(m, logq, 0.0)
    return logp, logq, m


def _masked(value: torch.Tensor, m, bound: float | None = None) -> torch.Tensor:
    """``value`` with masked entries 0, clamped to ``[-bound, bound]`` when a bound is given."""
    if bound is not None:
        if not bound > 0:
            raise ValueError(f"bound must be a positive number of nats (verl and OpenRLHF use "
                             f"ESTIMATE_BOUND = 10) or None, got {bound!r}")
        value = torch.clamp(value, -bound, bound)
    return value if m is None else torch.where(m, value, 0.0)


def kl_k1(logp, logq, mask=None, bound: float | None = None) -> torch.Tensor:
    """``k1 = -log r = log pi_theta(x) - log pi_ref(x)``, with ``x ~ pi_theta``.

    Unbiased: ``E_{x~pi_theta}[k1] = KL(pi_theta || pi_ref)`` by the definition of KL.
    Variance: ``Var[log r]``, which does not shrink relative to the KL as the two policies get
    close; many samples are negative even though the KL never is. This is the
    log-ratio that PPO-RLHF subtracts from the reward at each token.
    """
    logp, logq, m = _pair(logp, logq, mask)
    return _masked(logp - logq, m, bound)


def kl_k2(logp, logq, mask=None, bound: float | None = None) -> torch.Tensor:
    """``k2 = 1/2 (log r)^2``, with ``r = pi_ref(x) / pi_theta(x)`` and ``x ~ pi_theta``.

    Biased: ``E[k2] = 1/2 E[(log r)^2]``, which agrees with the KL only to second order in
    ``log r`` (both are ``1/2 E[(log r)^2] + O(E|log r|^3)``), so the bias grows as the policies
    drift apart. Low variance, and never negative.
    """
    logp, logq, m = _pair(logp, logq, mask)
    return _masked(0.5 * (logq - logp) ** 2, m, bound)


def kl_k3(logp, logq, mask=None, bound: float | None = None) -> torch.Tensor:
    """``k3 = (r - 1) - log r``, with ``r = pi_ref(x) / pi_theta(x)`` and ``x ~ pi_theta``.

    Unbiased: ``E_{x~pi_theta}[r] = sum_x pi_ref(x) = 1``, so the added ``r - 1`` is a control
    variate with mean zero and ``E[k3] = E[-log r] = KL``. (That needs ``pi_ref`` to put no mass
    where ``pi_theta`` puts none; softmax policies always satisfy it. Otherwise ``E[k3]`` falls
    short of the KL by the missing mass.)
    Never negative, since ``log r <= r - 1``. Its variance is far below k1's when the policies are
    close (``r - 1 ~ log r`` cancels the first-order noise) but grows fast when ``r`` can be large.
    GRPO puts this estimator in its loss, where ``E[grad k3]`` is ``grad KL(pi_ref || pi_theta)``
    (TRL multiplies it by the importance ratio to get ``grad KL(pi_theta || pi_ref)`` back). A right
    estimate of the value is not a right penalty in a reward: there the expected gradient is
    ``E[k3 grad log pi_theta] = grad KL(pi_theta || pi_ref) - grad KL(pi_ref || pi_theta)``; put
    :func:`kl_k1` in a reward (lesson 07b measures both).

    ``expm1`` computes ``r - 1`` without cancellation when ``r`` is close to 1. ``log r`` is
    clamped at ``LOG_RATIO_BOUND`` above before the exponential (never below: there ``r - 1``
    tends to -1 and stays finite), so the value and its gradient stay finite.
    """
    logp, logq, m = _pair(logp, logq, mask)
    log_r = logq - logp
    return _masked(torch.expm1(torch.clamp(log_r, max=LOG_RATIO_BOUND)) - log_r, m, bound)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def _log_distribution(name: str, logp_full, dim: int) -> torch.Tensor:
    logp_full = torch.as_tensor(logp_full)
    if not logp_full.is_floating_point():
        raise TypeError(f"{name} must be floating-point log-probabilities, got dtype {logp_full.dtype}")
    if logp_full.ndim == 0:
        raise ValueError(f"{name} must have a vocabulary dimension, got a scalar")
    total = logp_full.exp().sum(dim)
    tol = 1e-2 if logp_full.dtype in (torch.float16, torch.bfloat16) else 1e-3
    if total.numel() and not torch.allclose(total, torch.ones_like(total), atol=tol):
        raise ValueError(f"{name} must hold log-probabilities whose exp sums to 1 along dim={dim}; "
                         f"got sums between {total.min().item():.4g} and {total.max().item():.4g}. "
                         f"Were these logits? Apply torch.log_softmax(logits, dim={dim}) first.")
    return logp_full


def _mask_distributions(logp_full, mask, dim: int):
    """Replace masked positions' distributions by the uniform one (they may hold anything)."""
    logp_full = torch.as_tensor(logp_full)
    if mask is None:
        return logp_full, None
    if logp_full.ndim == 0:
        raise ValueError("logp_full must have a vocabulary dimension, got a scalar")
    m = as_mask(mask, logp_full.select(dim, 0))
    uniform = torch.full_like(logp_full, -float(torch.log(torch.tensor(float(logp_full.shape[dim])))))
    return torch.where(m.unsqueeze(dim % logp_full.ndim), logp_full, uniform), m


def exact_kl(logp_full, logq_full, dim: int = -1, mask=None) -> torch.Tensor:
    """``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` over the vocabulary dimension ``dim``.

    ``logp_full`` and ``logq_full`` are full log-distributions (e.g. ``log_softmax`` of the
    logits at each position), of one shape ``(..., V)``; the result has that shape without
    ``dim``. Terms with ``p(v) = 0`` count 0 (the limit of ``p log p``); a ``q(v) = 0`` where
    ``p(v) > 0`` gives ``+inf``, as it should.
    """
    logp_full, m = _mask_distributions(logp_full, mask, dim)
    logq_full, _ = _mask_distributions(logq_full, mask, dim)
    logp_full = _log_distribution("logp_full", logp_full, dim)
    logq_full = _log_distribution("logq_full", logq_full, dim)
    if logp_full.shape != logq_full.shape:
        raise ValueError(f"logp_full and logq_full must have the same shape, "
                         f"got {tuple(logp_full.shape)} and {tuple(logq_full.shape)}")
    p = logp_full.exp()
    # Zero the log-ratio where p = 0 *before* multiplying: 0 * (-inf) would be nan in the
    # forward pass, and in the backward pass even when torch.where hides it.
    log_ratio = torch.where(p > 0, logp_full - logq_full, torch.zeros_like(p))
    return _masked((p * log_ratio).sum(dim), m)


def entropy(logp_full, dim: int = -1, mask=None) -> torch.Tensor:
    """``H(p) = -sum_v p(v) log p(v)`` over the vocabulary dimension ``dim`` (in nats).

    Zero for a deterministic policy, ``log V`` for the uniform one. For a policy it measures how
    much exploration is left: RL on a verifiable reward tends to drive it down.
    """
    logp_full, m = _mask_distributions(logp_full, mask, dim)
    logp_full = _log_distribution("logp_full", logp_full, dim)
    p = logp_full.exp()
    return _masked(-(p * torch.where(p > 0, logp_full, torch.zeros_like(p))).sum(dim), m)   # 0 log 0 = 0


# The estimators whose expected gradient in a loss expected_loss_gradient computes: the three above,
# and k3 weighted by the importance ratio rho = pi_theta / mu (TRL's use_bias_correction_kl).
LOSS_ESTIMATORS = ("k1", "k2", "k3", "rho_k3")


def expected_loss_gradient(logp_full, logq_full, estimator: str, sampler_logp_full=None) -> torch.Tensor:
    """The gradient that a KL estimator put in a loss follows, in expectation over the sampled token:

        g = E_{v ~ mu}[ d k(v) / d z ] = sum_v mu(v) d k(v) / d z,    pi = softmax(z),

    exactly, over the whole vocabulary (the last dimension). The sampled token ``v`` is a constant
    and so is the sampler ``mu``: ``mu = exp(sampler_logp_full)``, or the policy itself, frozen at
    sampling time, when ``sampler_logp_full`` is None. With ``r = pi_ref(v) / pi(v)`` and
    ``rho = pi(v) / mu(v)``, and ``d log pi(v) / d z = e_v - pi``:

    ============  ==========================  =====================================================
    estimator     k(v)                        d k(v) / d log pi(v)
    ============  ==========================  =====================================================
    ``"k1"``      ``-log r``                  ``1``
    ``"k2"``      ``(log r)^2 / 2``           ``log(pi / pi_ref)``
    ``"k3"``      ``(r - 1) - log r``         ``1 - r``
    ``"rho_k3"``  ``rho * ((r - 1) - log r)`` ``rho * (k3 + 1 - r) = rho * log(pi / pi_ref)``
    ============  ==========================  =====================================================

    so ``g = c - pi * sum_v c(v)`` with ``c(v) = mu(v) * d k(v) / d log pi(v)``. On-policy
    (``mu = pi``) this is 0 for k1, ``grad KL(pi || pi_ref)`` for k2, ``grad KL(pi_ref || pi)`` (the
    *forward* KL) for k3; for ``rho_k3``, ``mu * rho = pi`` makes it ``grad KL(pi || pi_ref)`` from any
    sampler whose support covers pi's (TRL 1.16's default in GRPO's loss; the ratio's value is 1
    on-policy, its gradient is what matters). Lesson 07b measures these.

    Args:
        logp_full: ``(..., V)`` log-probabilities of the policy ``pi`` (``log_softmax`` of its logits).
        logq_full: ``(..., V)`` log-probabilities of the reference ``pi_ref``.
        estimator: one of :data:`LOSS_ESTIMATORS`.
        sampler_logp_full: ``(..., V)`` log-probabilities of the sampler ``mu``, or None for ``mu = pi``.

    Returns:
        ``(..., V)``: the expected gradient with respect to the policy's logits, without a graph.
    """
    if estimator not in LOSS_ESTIMATORS:
        raise ValueError(f"estimator must be one of {LOSS_ESTIMATORS}, got {estimator!r}")
    logp = _log_distribution("logp_full", torch.as_tensor(logp_full).detach(), -1)
    logq = _log_distribution("logq_full", torch.as_tensor(logq_full).detach(), -1)
    logmu = logp if sampler_logp_full is None else _log_distribution(
        "sampler_logp_full", torch.as_tensor(sampler_logp_full).detach(), -1)
    if not logp.shape == logq.shape == logmu.shape:
        raise ValueError(f"logp_full, logq_full and sampler_logp_full must have one shape (..., V), got "
                         f"{tuple(logp.shape)}, {tuple(logq.shape)} and {tuple(logmu.shape)}")
    log_pi_over_ref = logp - logq
    if estimator == "k1":
        c = logmu.exp()
    elif estimator == "k2":
        c = logmu.exp() * log_pi_over_ref
    elif estimator == "k3":
        c = logmu.exp() - torch.exp(logmu - log_pi_over_ref)            # mu (1 - r), r computed in logs
    else:
        c = logp.exp() * log_pi_over_ref                                # mu * rho * log(pi / pi_ref), mu * rho = pi
    return c - logp.exp() * c.sum(-1, keepdim=True)
