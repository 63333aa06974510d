"""The Bradley-Terry loss of a reward model, and the metrics a reward trainer logs (lesson 08).

A reward model ``r_phi(x, y)`` gives one number per (prompt, completion). Human (or simulated)
raters only say which of two completions they prefer. The Bradley-Terry model links the two:

    P(y_w preferred to y_l | x) = sigmoid(r(x, y_w) - r(x, y_l)),

so the maximum-likelihood reward model minimises the negative log-likelihood of the observed
choices (Christiano et al. 2017; Stiennon et al. 2020, arXiv 2009.01325; Ouyang et al. 2022,
arXiv 2203.02155):

    L(phi) = -mean_i log sigmoid(r_w,i - r_l,i - m_i).

Only *differences* of rewards enter, so a constant can be added to every reward without changing
the loss: the scale of a reward model is learned, its offset is arbitrary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bradley_terry_loss", "reward_model_metrics"]


def _check_pair(chosen, rejected):
    for name, x in (("rewards_chosen", chosen), ("rewards_rejected", rejected)):
        if not isinstance(x, torch.Tensor) or x.ndim != 1 or x.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor (one reward per pair), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    if chosen.shape != rejected.shape:
        raise ValueError(f"rewards_chosen and rewards_rejected must have one shape, got "
                         f"{tuple(chosen.shape)} and {tuple(rejected.shape)}")


def bradley_terry_loss(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor,
                       margin: torch.Tensor | float | None = None) -> torch.Tensor:
    """``-mean_i log sigmoid(r_chosen,i - r_rejected,i - margin_i)``: the reward model's loss.

    ``margin`` (a float or one value per pair, Llama 2's "margin" term, Touvron et al. 2023,
    arXiv 2307.09288) asks the chosen reward to win by at least that much before the loss stops
    pushing; ``None`` or 0 is plain Bradley-Terry. ``F.logsigmoid`` is used rather than
    ``log(sigmoid(.))``, which underflows to ``-inf`` for a large negative difference.
    Its gradient with respect to ``r_chosen,i`` is ``sigmoid(-(d_i - m_i)) / N``: pairs the model
    already ranks confidently contribute almost nothing.
    """
    _check_pair(rewards_chosen, rewards_rejected)
    diff = rewards_chosen - rewards_rejected
    if margin is not None:
        margin = torch.as_tensor(margin, dtype=diff.dtype, device=diff.device)
        if margin.ndim not in (0, 1) or (margin.ndim == 1 and margin.shape != diff.shape):
            raise ValueError(f"margin must be a float or one value per pair {tuple(diff.shape)}, "
                             f"got shape {tuple(margin.shape)}")
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


@torch.no_grad()
def reward_model_metrics(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor) -> dict:
    """What TRL's ``RewardTrainer`` logs, under its names, as Python floats.

    * ``accuracy``: share of pairs with ``r_chosen > r_rejected`` (a tie counts as wrong);
    * ``margin``: mean of ``r_chosen - r_rejected``;
    * ``min_reward`` / ``mean_reward`` / ``max_reward`` over both columns together.
    """
    _check_pair(rewards_chosen, rewards_rejected)
    both = torch.cat([rewards_chosen, rewards_rejected])
    return {"accuracy": float((rewards_chosen > rewards_rejected).float().mean()),
            "margin": float((rewards_chosen - rewards_rejected).mean()),
            "min_reward": float(both.min()), "mean_reward": float(both.mean()),
            "max_reward": float(both.max())}
