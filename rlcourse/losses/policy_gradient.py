"""Policy-gradient losses as pure functions on torch tensors.

Shapes: a batch holds N sequences (episodes, or completions of a language model) of T steps,
padded to the same length. ``logprobs[i, t] = log pi_theta(a_t | s_t)`` of the action actually
taken, ``mask[i, t] = 1`` on real steps and 0 on padding.

Every loss here is a *surrogate*: a scalar whose gradient is the estimator we want. Its value is
not the objective and is not worth plotting; its gradient is what matters.

The policy-gradient theorem (lesson 02) says

    grad J(theta) = E_tau[ sum_t Psi_t * grad log pi_theta(a_t | s_t) ]

for several choices of the weight ``Psi_t`` (Schulman et al., 2016, "High-Dimensional Continuous
Control Using Generalized Advantage Estimation", arXiv 1506.02438, section 2). The ``psi_*``
helpers build them from rewards; :func:`reinforce_loss` turns any of them into a loss.

Masks mean "not there": a masked entry may hold anything (nan, inf, garbage) and still neither
changes a loss nor reaches a gradient, because every loss replaces masked entries by 0 with
``torch.where`` *before* any arithmetic (multiplying by the mask afterwards would turn a nan into
nan and an inf into nan). Log-ratios are clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (see
:mod:`rlcourse.kl`) before they are exponentiated, so no loss overflows.
"""
from __future__ import annotations

import math

import torch

from rlcourse.kl import LOG_RATIO_BOUND, as_mask, entropy, kl_k3
from rlcourse.returns import check_finite, discount_weights, episode_returns, reward_to_go

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


def check_logprobs_mask(logprobs: torch.Tensor, mask) -> torch.Tensor:
    """Validate ``(N, T)`` float log-probs and their 0/1 mask; return the mask as bool (all True when None).

    The one input check of every token-level loss in :mod:`rlcourse.losses`.
    """
    if not isinstance(logprobs, torch.Tensor) or logprobs.ndim != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a torch tensor of shape (N, T) holding floats, got "
                         f"{getattr(logprobs, 'shape', type(logprobs).__name__)}")
    if logprobs.shape[0] == 0 or logprobs.shape[1] == 0:
        raise ValueError(f"logprobs must hold at least one sequence of at least one step, "
                         f"got shape {tuple(logprobs.shape)}")
    m = as_mask(mask, logprobs)
    return torch.ones_like(logprobs, dtype=torch.bool) if m is None else m


def _real(name: str, x: torch.Tensor, m: torch.Tensor | None, check=torch.isfinite) -> torch.Tensor:
    """``x`` with masked entries replaced by 0; a nan (or, by default, inf) in a real entry is an error."""
    check_finite(name, x, m, check)
    return x if m is None else torch.where(m, x, 0.0)


def _not_nan(x):
    return ~torch.isnan(x)


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
    m = check_logprobs_mask(logprobs, mask)
    psi = torch.as_tensor(psi, dtype=logprobs.dtype, device=logprobs.device).detach()
    N, T = logprobs.shape
    if psi.ndim == 1 or psi.ndim > 2 or (psi.ndim == 2 and (psi.shape[0] not in (1, N) or psi.shape[1] not in (1, T))):
        # A (N,) vector would broadcast along time, not along sequences: ambiguous when N == T.
        raise ValueError(f"psi must be a number, (N, 1) = ({N}, 1) for one weight per sequence, or "
                         f"(N, T) = ({N}, {T}) for one per step; got {tuple(psi.shape)}"
                         + (" (use psi[:, None] for one weight per sequence)" if psi.ndim == 1 else ""))
    psi = _real("psi", torch.broadcast_to(psi, logprobs.shape), m)
    weighted = _real("logprobs", logprobs, m, check=_not_nan) * psi
    return -weighted.sum() / N


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
    new policy can be estimated from episodes of the old one (importance sampling); the
    product over T steps is why its variance explodes with the horizon. It is a weight, not a
    loss: it is not clamped, and a sum of log-ratios past ~709 (float64) honestly overflows to inf.
    """
    m = check_logprobs_mask(logprobs, mask)
    if not isinstance(old_logprobs, torch.Tensor) or old_logprobs.shape != logprobs.shape:
        raise ValueError(f"old_logprobs must be a tensor of the shape of logprobs {tuple(logprobs.shape)}, "
                         f"got {getattr(old_logprobs, 'shape', type(old_logprobs).__name__)}")
    diff = _real("logprobs", logprobs, m) - _real("old_logprobs", old_logprobs, m)
    return torch.exp(diff.sum(dim=1))


# ---------------------------------------------------------------------------------- PPO and its relatives
# Lessons 05-06 (and the language-model PPO of lesson 08). Inputs are per-step (or per-token)
# tensors of one shape: ``logprobs`` under the policy being optimised (with grad), ``old_logprobs``
# under the policy that collected the data (no grad), ``advantages`` (no grad). Losses average
# over the valid entries: ``sum(mask * x) / sum(mask)`` (a "token mean"; all entries when
# ``mask`` is None). Sequence-level aggregations (GRPO, Dr. GRPO...) can reuse the per-entry
# :func:`ppo_clip_objective` and average it their own way.
def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(mask * x) / sum(mask)`` over the real entries, or ``x.mean()`` when ``mask`` is None.

    Masked entries are dropped with ``torch.where``, so a nan or inf there changes neither the
    mean nor its gradient (``x * mask`` would give nan: ``inf * 0 = nan``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch tensor, got {type(x).__name__}")
    m = as_mask(mask, x)
    count = x.numel() if m is None else int(m.sum())
    if count == 0:
        raise ValueError("nothing to average: the values are empty or the mask selects no entries")
    if m is None:
        return x.mean()
    return torch.where(m, x, 0.0).sum() / count


def _same_shape(**tensors):
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"these tensors must have one shape, got {shapes}")


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``r_t(theta) = pi_theta(a_t|s_t) / pi_old(a_t|s_t) = exp(log pi_theta - log pi_old)``.

    Taken as the exponential of a *difference of log-probabilities*: dividing probabilities
    underflows for long sequences and unlikely tokens (0/0), and the difference is exactly 0 when
    nothing has changed yet, so the ratio starts at exactly 1. ``old_logprobs`` is detached.
    The log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` first (ratios within
    ``[2e-9, 4.9e8]``): past ``exp(88.7)`` float32 overflows to inf and the gradient to nan.
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    log_ratio = logprobs - old_logprobs.detach()
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo_clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_coef: float = 0.2,
                       clip_coef_high: float | None = None, dual_clip: float | None = None) -> torch.Tensor:
    """The per-entry clipped surrogate (to be *maximised*) of PPO (Schulman et al., 2017):

    ``L^CLIP_t = min( r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t )``

    with ``eps_low = clip_coef`` and ``eps_high = clip_coef_high`` (default: ``clip_coef``; DAPO's
    "clip-higher" sets it larger so unlikely tokens can grow). The min makes it a pessimistic
    bound on the unclipped ``r_t A_t``: once the ratio has moved past ``1 + eps`` for ``A > 0`` (or
    below ``1 - eps`` for ``A < 0``) the clipped branch is chosen, it is constant in theta, and the
    gradient is 0; moves that make the objective *worse* are never clipped. Note it is not
    ``min(r, clip(r)) A``: for ``A < 0`` the min of the products picks the *larger* ratio.

    That last case is unbounded: for ``A < 0`` the objective ``r A`` falls without limit as ``r``
    grows. ``dual_clip = c`` (dual-clip PPO, Ye et al., 2020, arXiv 1912.09729; verl applies it by
    default with ``actor.clip_ratio_c = 3.0``, OpenRLHF with ``--actor.dual_clip``) bounds it:

    ``L^DUAL_t = max( L^CLIP_t, c A_t )`` where ``A_t < 0``, ``L^CLIP_t`` elsewhere,

    so a token's loss is capped at ``c |A_t|`` and its gradient is 0 once ``r_t > c``. ``None`` (the
    default, TRL's and PPO's) leaves the objective unbounded; ``c`` must be > 1.
    """
    if clip_coef < 0 or (clip_coef_high is not None and clip_coef_high < 0):
        raise ValueError(f"clip_coef and clip_coef_high must be >= 0, got {clip_coef!r}, {clip_coef_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap c |A| on negative advantages), got {dual_clip!r}")
    _same_shape(ratio=ratio, advantages=advantages)
    high = clip_coef if clip_coef_high is None else clip_coef_high
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_coef, 1.0 + high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is None:
        return objective
    return torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor | None = None, clip_coef: float = 0.2,
                  clip_coef_high: float | None = None, dual_clip: float | None = None) -> torch.Tensor:
    """The PPO policy loss ``-masked_mean(L^CLIP)`` (see :func:`ppo_clip_objective`, also for ``dual_clip``).

    ``loss = - sum_t mask_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) / sum_t mask_t``

    Any shape works (``(B,)`` transitions for CartPole, ``(N, T)`` tokens for a language model);
    the mean is over all valid entries together (token mean). A clipped entry contributes exactly
    zero gradient; masked entries contribute nothing whatever they hold.
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    m = as_mask(mask, logprobs)
    logprobs = _real("logprobs", logprobs, m, check=_not_nan)
    old_logprobs = _real("old_logprobs", old_logprobs, m)
    advantages = _real("advantages", advantages, m)
    ratio = importance_ratio(logprobs, old_logprobs)
    return -masked_mean(ppo_clip_objective(ratio, advantages, clip_coef, clip_coef_high, dual_clip), m)


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
    m = as_mask(mask, logprobs)
    logprobs, old_logprobs = _real("logprobs", logprobs, m), _real("old_logprobs", old_logprobs, m)
    ratio = importance_ratio(logprobs, old_logprobs)
    high = clip_coef if clip_coef_high is None else clip_coef_high
    outside = ((ratio < 1.0 - clip_coef) | (ratio > 1.0 + high)).to(ratio.dtype)
    # (r - 1) - log r with r = pi_theta / pi_old, sampled from pi_old: k3 of KL(pi_old || pi_theta).
    out = {"approx_kl": float(masked_mean(kl_k3(old_logprobs, logprobs), m)),
           "clip_fraction": float(masked_mean(outside, m))}
    if advantages is not None:
        a = _real("advantages", advantages.detach(), m)
        frozen = (((ratio > 1.0 + high) & (a > 0)) | ((ratio < 1.0 - clip_coef) & (a < 0))).to(ratio.dtype)
        out["clipped_fraction_active"] = float(masked_mean(frozen, m))
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
    m = as_mask(mask, values)
    values = _real("values", values, m, check=_not_nan)
    returns = _real("returns", returns.detach(), m)
    unclipped = (values - returns) ** 2
    if clip_coef is None:
        return 0.5 * masked_mean(unclipped, m)
    if old_values is None:
        raise ValueError("old_values is required when clip_coef is given (the clip is around them)")
    if clip_coef < 0:
        raise ValueError(f"clip_coef must be >= 0, got {clip_coef!r}")
    _same_shape(values=values, old_values=old_values)
    old_values = _real("old_values", old_values.detach(), m)
    clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
    return 0.5 * masked_mean(torch.maximum(unclipped, (clipped - returns) ** 2), m)


def entropy_bonus(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean entropy of categorical policies given their logits over the last dimension.

    ``H(pi(.|s)) = - sum_a pi(a|s) log pi(a|s)``, averaged over the valid entries. Trainers
    *subtract* ``ent_coef * H`` from the loss: a bonus for staying random a little longer, so the
    policy does not collapse onto its first lucky action. Logits of ``-inf`` (actions that are not
    allowed) count 0, as ``0 log 0 = 0`` (:func:`rlcourse.kl.entropy`); masked positions may hold
    anything.
    """
    if not isinstance(logits, torch.Tensor) or logits.ndim == 0:
        raise ValueError(f"logits must be a torch tensor with an action dimension last, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    m = as_mask(mask, logits[..., 0])
    if m is not None:
        logits = torch.where(m[..., None], logits, 0.0)
    return masked_mean(entropy(torch.log_softmax(logits, dim=-1), mask=m), m)


def ppo_penalty_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     kl: torch.Tensor, beta: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """PPO's other variant: the unclipped surrogate with a KL penalty (to be minimised).

    ``loss = - mean( r_t A_t ) + beta * mean( KL_t )``

    ``kl`` holds a per-entry KL (exact per state, or a sample estimate) between ``pi_old`` and
    ``pi_theta``, with grad; ``beta`` is adapted between updates by :func:`adaptive_kl_beta`.
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, kl=kl)
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    m = as_mask(mask, logprobs)
    logprobs = _real("logprobs", logprobs, m, check=_not_nan)
    old_logprobs, advantages = _real("old_logprobs", old_logprobs, m), _real("advantages", advantages.detach(), m)
    surrogate = importance_ratio(logprobs, old_logprobs) * advantages
    return -masked_mean(surrogate, m) + beta * masked_mean(_real("kl", kl, m), m)


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
    if not math.isfinite(kl):
        raise ValueError(f"kl must be a finite number, got {kl!r}: a nan KL means the update itself went wrong")
    if kl < kl_target / tolerance:
        return beta / factor
    if kl > kl_target * tolerance:
        return beta * factor
    return beta
