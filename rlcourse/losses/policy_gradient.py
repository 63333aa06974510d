"""Policy-gradient losses as pure functions on torch tensors.

Shapes: a batch holds N sequences (episodes, or completions of a language model) of T steps,
padded to the same length. ``logprobs[i, t] = log pi_theta(a_t | s_t)`` of the action actually
taken, ``mask[i, t] = 1`` on real steps and 0 on padding.

Every loss here is a *surrogate*: a scalar whose gradient is the estimator we want. Its value is
not the objective and is not worth plotting; its gradient is what matters.

The policy-gradient theorem (lesson 02) says

    grad J(theta) = E_tau[ sum_t Psi_t * grad log pi_theta(a_t | s_t) ]

for several choices of the weight ``Psi_t`` (syllabus 001, section 3). The ``psi_*`` helpers build
them from rewards; :func:`reinforce_loss` turns any of them into a loss.
"""
from __future__ import annotations

import torch

from rlcourse.returns import discount_weights, episode_returns, reward_to_go

__all__ = [
    "reinforce_loss",
    "psi_total_return",
    "psi_reward_to_go",
    "psi_reward_to_go_minus_baseline",
    "trajectory_importance_weight",
    "masked_mean",
    "importance_ratio",
    "ppo_clip_objective",
    "ppo_clip_loss",
    "ppo_diagnostics",
    "value_loss",
    "entropy_bonus",
    "ppo_penalty_loss",
    "adaptive_kl_beta",
]


def _check_logprobs_mask(logprobs: torch.Tensor, mask):
    if not isinstance(logprobs, torch.Tensor) or logprobs.ndim != 2:
        raise ValueError(f"logprobs must be a torch tensor of shape (N, T), got "
                         f"{getattr(logprobs, 'shape', type(logprobs).__name__)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != logprobs.shape:
            raise ValueError(f"mask must be a tensor of the shape of logprobs {tuple(logprobs.shape)}, "
                             f"got {getattr(mask, 'shape', type(mask).__name__)}")


def reinforce_loss(logprobs: torch.Tensor, psi, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The REINFORCE surrogate: minimising it ascends the policy-gradient estimate.

    ``L(theta) = -(1/N) sum_i sum_t mask[i, t] * logprobs[i, t] * stopgrad(psi[i, t])``

    so that ``-grad L = (1/N) sum_i sum_t mask * Psi * grad log pi(a_t | s_t)``, the Monte-Carlo
    policy gradient. Details that matter:

    * the minus sign: optimisers minimise, we want to *increase* J;
    * ``psi`` is detached: it is a weight (a return, an advantage), not something to differentiate.
      Were it not, a learned baseline or a reward model inside it would be pushed by this loss;
    * the sum runs over time and the mean over sequences (divide by N, not by the number of
      tokens): each episode's estimate is ``sum_t``, and we average N independent episodes.

    Args:
        logprobs: ``(N, T)`` log-probabilities of the actions taken (with grad).
        psi: weights broadcastable to ``(N, T)``: e.g. ``(N, 1)`` for one weight per sequence
            (``R(tau)``, an outcome reward), ``(N, T)`` for per-step reward-to-go or advantages.
        mask: ``(N, T)`` of 0/1 or bool; ``None`` means every step is real.
    """
    _check_logprobs_mask(logprobs, mask)
    psi = torch.as_tensor(psi, dtype=logprobs.dtype, device=logprobs.device)
    try:
        psi = torch.broadcast_to(psi, logprobs.shape)
    except RuntimeError:
        raise ValueError(f"psi must be broadcastable to logprobs' shape {tuple(logprobs.shape)}, "
                         f"got {tuple(psi.shape)}") from None
    weighted = logprobs * psi.detach()
    if mask is not None:
        weighted = weighted * mask.to(logprobs.dtype)
    return -weighted.sum() / logprobs.shape[0]


# ---------------------------------------------------------------------------------- the weights Psi_t
def psi_total_return(rewards: torch.Tensor, gamma: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``Psi_t = R(tau) = sum_k gamma^k r_k``: the whole episode's return weighs every step.

    The direct result of the log-derivative trick on trajectories. Unbiased, but each action is
    credited with rewards that came *before* it too, which only adds noise. Returns ``(N, 1)``.
    """
    return episode_returns(rewards, gamma, mask=mask)[:, None]


def psi_reward_to_go(rewards: torch.Tensor, gamma: float, mask: torch.Tensor | None = None,
                     time_discount: bool = False) -> torch.Tensor:
    """``Psi_t = G_t = sum_{k >= t} gamma^{k-t} r_k``: only rewards at or after step t (causality).

    An action cannot change the past, so the rewards before t are dropped from its weight: same
    expectation, lower variance. With ``time_discount=True`` each step also gets ``gamma^t``
    (``Psi_t = gamma^t G_t``), which makes it an unbiased estimate of the gradient of the
    *discounted* objective ``J = E[sum_t gamma^t r_t]``. The common implementation leaves that
    factor out: it then weighs late states as much as early ones, is a biased estimate of
    ``grad J`` and in general not the gradient of any objective (Nota & Thomas, 2020), yet works
    well in practice. Lesson 02 measures the difference. Returns ``(N, T)``.
    """
    G = reward_to_go(rewards, gamma, mask=mask)
    if time_discount:
        G = G * discount_weights(_mask_or_ones(rewards, mask), gamma).to(G.dtype)
    return G


def psi_reward_to_go_minus_baseline(rewards: torch.Tensor, baseline, gamma: float,
                                    mask: torch.Tensor | None = None,
                                    time_discount: bool = False) -> torch.Tensor:
    """``Psi_t = G_t - b(s_t)``: reward-to-go minus a baseline that does not depend on the action.

    Unbiased because ``E_{a ~ pi(.|s)}[grad log pi(a|s)] = grad sum_a pi(a|s) = grad 1 = 0``, so
    ``E[b(s_t) grad log pi(a_t|s_t)] = 0`` for any ``b`` that is not a function of ``a_t`` (or of
    anything chosen after it). A good ``b`` (close to ``V(s_t)``) makes ``Psi`` small and centred,
    which cuts the variance. ``baseline`` broadcasts to ``(N, T)`` (a scalar, ``(N, 1)``, or
    ``(N, T)`` values ``V(s_t)``) and is detached. ``time_discount`` as in :func:`psi_reward_to_go`.
    Returns ``(N, T)``, 0 on padding.
    """
    G = reward_to_go(rewards, gamma, mask=mask)
    b = torch.as_tensor(baseline, dtype=G.dtype, device=G.device).detach()
    try:
        psi = G - torch.broadcast_to(b, G.shape)
    except RuntimeError:
        raise ValueError(f"baseline must be broadcastable to rewards' shape {tuple(G.shape)}, "
                         f"got {tuple(b.shape)}") from None
    weights = discount_weights(_mask_or_ones(rewards, mask), gamma if time_discount else 1.0)
    return psi * weights.to(psi.dtype)


def _mask_or_ones(rewards: torch.Tensor, mask):
    return torch.ones_like(rewards, dtype=torch.float32) if mask is None else mask


def trajectory_importance_weight(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """``rho(tau) = pi_new(tau) / pi_old(tau) = prod_t pi_new(a_t|s_t) / pi_old(a_t|s_t)``, one per row: ``(N,)``.

    The transition probabilities cancel in the ratio (both policies face the same environment),
    so only the policies' log-probabilities are needed. Computed as
    ``exp(sum_t mask * (logprobs - old_logprobs))``: a sum of logs, not a product of ratios,
    which would underflow or overflow on long sequences. With ``rho`` an expectation under the
    new policy can be estimated from episodes of the old one (syllabus 001, eq. 27-29); the
    product over T steps is why its variance explodes with the horizon.
    """
    _check_logprobs_mask(logprobs, mask)
    if not isinstance(old_logprobs, torch.Tensor) or old_logprobs.shape != logprobs.shape:
        raise ValueError(f"old_logprobs must be a tensor of the shape of logprobs {tuple(logprobs.shape)}, "
                         f"got {getattr(old_logprobs, 'shape', type(old_logprobs).__name__)}")
    diff = logprobs - old_logprobs
    if mask is not None:
        diff = diff * mask.to(diff.dtype)
    return torch.exp(diff.sum(dim=1))


# ---------------------------------------------------------------------------------- PPO and its relatives
# Lessons 05-06 (and the language-model PPO of lesson 08). Inputs are per-step (or per-token)
# tensors of one shape: ``logprobs`` under the policy being optimised (with grad), ``old_logprobs``
# under the policy that collected the data (no grad), ``advantages`` (no grad). Losses average
# over the valid entries: ``sum(mask * x) / sum(mask)`` (a "token mean"; all entries when
# ``mask`` is None). Sequence-level aggregations (GRPO, Dr. GRPO...) can reuse the per-entry
# :func:`ppo_clip_objective` and average it their own way.
def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(mask * x) / sum(mask)``, or ``x.mean()`` when ``mask`` is None."""
    if mask is None:
        return x.mean()
    if mask.shape != x.shape:
        raise ValueError(f"mask must have the shape of the values {tuple(x.shape)}, got {tuple(mask.shape)}")
    m = mask.to(x.dtype)
    count = m.sum()
    if float(count) == 0:
        raise ValueError("mask selects no entries: the mean of an empty set is undefined")
    return (x * m).sum() / count


def _same_shape(**tensors):
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must have one shape, got {shapes}")


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``r_t(theta) = pi_theta(a_t|s_t) / pi_old(a_t|s_t) = exp(log pi_theta - log pi_old)``.

    Taken as the exponential of a *difference of log-probabilities*: dividing probabilities
    underflows for long sequences and unlikely tokens (0/0), and the difference is exactly 0 when
    nothing has changed yet, so the ratio starts at exactly 1. ``old_logprobs`` is detached.
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    return torch.exp(logprobs - old_logprobs.detach())


def ppo_clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_coef: float = 0.2,
                       clip_coef_high: float | None = None) -> torch.Tensor:
    """The per-entry clipped surrogate (to be *maximised*) of PPO (Schulman et al., 2017):

    ``L^CLIP_t = min( r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t )``

    with ``eps_low = clip_coef`` and ``eps_high = clip_coef_high`` (default: ``clip_coef``; DAPO's
    "clip-higher" sets it larger so unlikely tokens can grow). The min makes it a pessimistic
    bound on the unclipped ``r_t A_t``: once the ratio has moved past ``1 + eps`` for ``A > 0`` (or
    below ``1 - eps`` for ``A < 0``) the clipped branch is chosen, it is constant in theta, and the
    gradient is 0; moves that make the objective *worse* are never clipped. Note it is not
    ``min(r, clip(r)) A``: for ``A < 0`` the min of the products picks the *larger* ratio.
    """
    if clip_coef < 0 or (clip_coef_high is not None and clip_coef_high < 0):
        raise ValueError(f"clip_coef and clip_coef_high must be >= 0, got {clip_coef!r}, {clip_coef_high!r}")
    _same_shape(ratio=ratio, advantages=advantages)
    high = clip_coef if clip_coef_high is None else clip_coef_high
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_coef, 1.0 + high) * advantages
    return torch.minimum(unclipped, clipped)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor | None = None, clip_coef: float = 0.2,
                  clip_coef_high: float | None = None) -> torch.Tensor:
    """The PPO policy loss ``-masked_mean(L^CLIP)`` (see :func:`ppo_clip_objective`).

    ``loss = - sum_t mask_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) / sum_t mask_t``

    Any shape works (``(B,)`` transitions for CartPole, ``(N, T)`` tokens for a language model);
    the mean is over all valid entries together (token mean).
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    ratio = importance_ratio(logprobs, old_logprobs)
    return -masked_mean(ppo_clip_objective(ratio, advantages, clip_coef, clip_coef_high), mask)


@torch.no_grad()
def ppo_diagnostics(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, clip_coef: float = 0.2,
                    clip_coef_high: float | None = None) -> dict:
    """What to watch during PPO updates (as CleanRL logs them), as Python floats.

    * ``approx_kl``: ``mean((r - 1) - log r)``, the k3 estimator of ``KL(pi_old || pi_theta)``
      from the collected samples (unbiased, always >= 0);
    * ``clip_fraction``: the share of entries outside ``[1 - eps_low, 1 + eps_high]``;
    * ``clipped_fraction_active`` (when ``advantages`` is given): the share where the clipped
      branch is selected *and* its gradient is zero, i.e. the entries that no longer learn.
    """
    log_ratio = (logprobs - old_logprobs).detach()
    ratio = log_ratio.exp()
    high = clip_coef if clip_coef_high is None else clip_coef_high
    outside = ((ratio < 1.0 - clip_coef) | (ratio > 1.0 + high)).to(ratio.dtype)
    out = {"approx_kl": float(masked_mean((ratio - 1.0) - log_ratio, mask)),
           "clip_fraction": float(masked_mean(outside, mask))}
    if advantages is not None:
        a = advantages.detach()
        frozen = (((ratio > 1.0 + high) & (a > 0)) | ((ratio < 1.0 - clip_coef) & (a < 0))).to(ratio.dtype)
        out["clipped_fraction_active"] = float(masked_mean(frozen, mask))
    return out


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor | None = None,
               clip_coef: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The critic's loss, a halved mean squared error, optionally clipped as in PPO's code.

    ``L^V = 1/2 mean( (V(s_t) - R_t)^2 )``

    With ``clip_coef`` (and ``old_values``, the values at collection time) the new value may move
    at most ``clip_coef`` from the old one before the loss stops rewarding the move, pessimistic
    like the policy clip:

    ``L^V = 1/2 mean( max( (V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2 ) )``

    (an implementation detail of OpenAI's baselines; CleanRL keeps it, and finds it does not help
    much). ``returns`` (the targets, e.g. ``A + V_old``) are detached.
    """
    _same_shape(values=values, returns=returns)
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if clip_coef is None:
        return 0.5 * masked_mean(unclipped, mask)
    if old_values is None:
        raise ValueError("old_values is required when clip_coef is given (the clip is around them)")
    if clip_coef < 0:
        raise ValueError(f"clip_coef must be >= 0, got {clip_coef!r}")
    _same_shape(values=values, old_values=old_values)
    old_values = old_values.detach()
    clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
    return 0.5 * masked_mean(torch.maximum(unclipped, (clipped - returns) ** 2), mask)


def entropy_bonus(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean entropy of categorical policies given their logits over the last dimension.

    ``H(pi(.|s)) = - sum_a pi(a|s) log pi(a|s)``, averaged over the valid entries. Trainers
    *subtract* ``ent_coef * H`` from the loss: a bonus for staying random a little longer, so the
    policy does not collapse onto its first lucky action.
    """
    logp = torch.log_softmax(logits, dim=-1)
    return masked_mean(-(logp.exp() * logp).sum(-1), mask)


def ppo_penalty_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     kl: torch.Tensor, beta: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """PPO's other variant: the unclipped surrogate with a KL penalty (to be minimised).

    ``loss = - mean( r_t A_t ) + beta * mean( KL_t )``

    ``kl`` holds a per-entry KL (exact per state, or a sample estimate) between ``pi_old`` and
    ``pi_theta``, with grad; ``beta`` is adapted between updates by :func:`adaptive_kl_beta`.
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, kl=kl)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    surrogate = importance_ratio(logprobs, old_logprobs) * advantages.detach()
    return -masked_mean(surrogate, mask) + beta * masked_mean(kl, mask)


def adaptive_kl_beta(beta: float, kl: float, kl_target: float, factor: float = 2.0,
                     tolerance: float = 1.5) -> float:
    """The adaptive penalty coefficient of PPO-penalty (Schulman et al., 2017, section 4):

    ``beta <- beta / factor`` if ``KL < kl_target / tolerance``;
    ``beta <- beta * factor`` if ``KL > kl_target * tolerance``; else unchanged.

    The paper's values are ``factor = 2``, ``tolerance = 1.5``: a step that overshot the target KL
    makes the next penalty stronger, one that barely moved makes it weaker.
    """
    if beta <= 0 or kl_target <= 0 or factor <= 1 or tolerance < 1:
        raise ValueError(f"expected beta > 0, kl_target > 0, factor > 1, tolerance >= 1; got "
                         f"beta={beta!r}, kl_target={kl_target!r}, factor={factor!r}, tolerance={tolerance!r}")
    kl = float(kl)
    if kl < kl_target / tolerance:
        return beta / factor
    if kl > kl_target * tolerance:
        return beta * factor
    return beta
