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
    *discounted* objective ``J = E[sum_t gamma^t r_t]``; the common implementation leaves that
    factor out (and so follows a slightly different, undiscounted-state-weighting direction).
    Returns ``(N, T)``.
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
