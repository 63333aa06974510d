"""The optimum of the KL-regularised objective, in closed form.

For one prompt, a reference distribution ``pi_ref`` over answers and a reward ``r``,

    max_pi  E_{y~pi}[r(y)] - beta KL(pi || pi_ref)

is maximised by tilting the reference towards high reward (Ziebart 2010; Korbak et al. 2022,
"RL with KL penalties is better viewed as Bayesian inference", arXiv 2205.11275):

    pi*(y) = pi_ref(y) exp(r(y) / beta) / Z,        Z = sum_y pi_ref(y) exp(r(y) / beta).

It is the target of PPO-RLHF's KL-shaped reward (lesson 08), the policy behind DPO's loss
(lesson 11) and the frontier that reward over-optimisation is measured against (lesson 08b).
Computed in log space: ``exp(r / beta)`` alone overflows float64 once ``r / beta`` passes ~709.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["kl_regularised_optimum"]


def kl_regularised_optimum(ref_logprobs, rewards, kl_coef: float, dim: int = -1) -> torch.Tensor:
    """``log pi*(y) = log pi_ref(y) + r(y) / kl_coef - log Z`` along ``dim`` (any leading shape).

    ``ref_logprobs`` are log-probabilities (``-inf`` for answers the reference never writes: they
    keep probability 0), ``rewards`` the same shape, ``kl_coef`` the ``beta > 0`` of the objective.
    """
    ref_logprobs, rewards = torch.as_tensor(ref_logprobs), torch.as_tensor(rewards)
    if ref_logprobs.shape != rewards.shape:
        raise ValueError(f"ref_logprobs and rewards must have the same shape, got {tuple(ref_logprobs.shape)} "
                         f"and {tuple(rewards.shape)}")
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, numbers.Real) or not (math.isfinite(kl_coef) and kl_coef > 0):
        raise ValueError(f"kl_coef must be a finite number > 0, got {kl_coef!r}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite (a NaN or infinite reward has no optimum)")
    tilted = ref_logprobs + rewards / kl_coef
    return tilted - torch.logsumexp(tilted, dim=dim, keepdim=True)
