"""Returns and their relatives, as pure functions.

The discounted return of a reward sequence ``r_0, r_1, ..., r_{T-1}`` is

    G_0 = sum_{t=0}^{T-1} gamma^t r_t = r_0 + gamma r_1 + gamma^2 r_2 + ...
"""
from __future__ import annotations

import numpy as np


def discounted_return(rewards, gamma: float) -> float:
    """``G_0 = sum_t gamma^t r_t`` for one episode's rewards (a 1-D sequence)."""
    rewards = np.asarray(rewards, dtype=float)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be a 1-D sequence, got shape {rewards.shape}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    return float(np.sum(gamma ** np.arange(len(rewards)) * rewards))


# ---------------------------------------------------------------------------------- batches of episodes
# Batched versions work on ``(N, T)`` arrays: N rows (episodes, or rollouts of a vectorised env),
# T time steps. Two masks describe where episodes end:
#
# * ``dones[i, t] = 1`` when step t was the last step of an episode; the return does not flow
#   back across it, so one row may hold several episodes one after another;
# * ``mask[i, t] = 0`` on padding (steps after a shorter episode ended): they carry no reward and
#   get a return of 0.
#
# Every function accepts NumPy arrays or torch tensors and returns the same kind, so one code path
# serves CartPole and the language models of later lessons.
def _validate_batch(rewards, gamma, dones, mask):
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape (N, T), got {tuple(rewards.shape)}")
    for name, value in (("dones", dones), ("mask", mask)):
        if value is not None and tuple(value.shape) != tuple(rewards.shape):
            raise ValueError(f"{name} must have the shape of rewards {tuple(rewards.shape)}, "
                             f"got {tuple(value.shape)}")


def _as_float(x, like):
    """``x`` (a mask of bools or 0/1) as floats of the same library and dtype as ``like``."""
    if hasattr(like, "detach"):
        return x.to(like.dtype)
    return np.asarray(x, dtype=like.dtype)


def _float_rewards(rewards):
    if hasattr(rewards, "detach"):
        return rewards if rewards.is_floating_point() else rewards.float()
    return np.asarray(rewards, dtype=float)


def reward_to_go(rewards, gamma: float, dones=None, mask=None):
    """Discounted reward-to-go of every step: ``G_t = sum_{k >= t} gamma^{k-t} r_k``, within its episode.

    Computed backwards with the recursion ``G_t = r_t + gamma (1 - done_t) G_{t+1}`` (and
    ``G_T = 0``), so the work is O(N T). ``dones`` cuts the sum at the end of each episode;
    ``mask`` zeroes padded steps (their rewards are ignored). Returns an ``(N, T)`` array or
    tensor (not connected to any autograd graph the rewards belong to: returns are targets).
    """
    rewards = _float_rewards(rewards)
    _validate_batch(rewards, gamma, dones, mask)
    if hasattr(rewards, "detach"):
        rewards = rewards.detach()
    if mask is not None:
        rewards = rewards * _as_float(mask, rewards)
    keep = 1.0 - _as_float(dones, rewards) if dones is not None else None
    G = rewards * 0.0
    running = rewards[:, 0] * 0.0
    for t in range(rewards.shape[1] - 1, -1, -1):
        if keep is not None:
            running = running * keep[:, t]
        running = rewards[:, t] + gamma * running
        G[:, t] = running
    if mask is not None:
        G = G * _as_float(mask, G)
    return G


def episode_returns(rewards, gamma: float, mask=None):
    """The discounted return ``G_0 = sum_t gamma^t r_t`` of each row (one episode per row): shape ``(N,)``."""
    return reward_to_go(rewards, gamma, mask=mask)[:, 0]


def discount_weights(mask, gamma: float):
    """``gamma^t`` at every step of a batch ``(N, T)``, 0 on padding.

    With ``gamma < 1`` the objective ``E[sum_t gamma^t r_t]`` values a decision at time t at only
    ``gamma^t``, so an unbiased estimate of its gradient weighs step t by ``gamma^t``.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape (N, T), got {tuple(mask.shape)}")
    if hasattr(mask, "detach"):
        import torch

        powers = gamma ** torch.arange(mask.shape[1], dtype=torch.float64, device=mask.device)
        return powers.to(torch.get_default_dtype())[None, :] * mask.to(torch.get_default_dtype())
    return gamma ** np.arange(mask.shape[1], dtype=float)[None, :] * np.asarray(mask, dtype=float)


def whiten(values, mask=None, shift_mean: bool = True, eps: float = 1e-8):
    """Standardise values over the valid entries: ``(x - mean) / (std + eps)``.

    Mean and (population, ``ddof=0``) standard deviation are taken over the entries where
    ``mask`` is 1 (all entries if ``mask`` is None); padded entries come back as 0.
    ``shift_mean=False`` only rescales: ``x / (std + eps)``, keeping the sign of every value. Whitening is
    a per-batch baseline and step size in one: it changes the gradient's scale, not (to first
    order) its direction, and keeps the step size independent of the reward's units.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    values = _float_rewards(values)
    if mask is None:
        m = values * 0.0 + 1.0
    else:
        if tuple(mask.shape) != tuple(values.shape):
            raise ValueError(f"mask must have the shape of values {tuple(values.shape)}, got {tuple(mask.shape)}")
        m = _as_float(mask, values)
    count = m.sum()
    if float(count) == 0:
        raise ValueError("mask selects no entries: cannot whiten an empty set")
    mean = (values * m).sum() / count
    var = (((values - mean) * m) ** 2).sum() / count
    out = (values - mean) / (var ** 0.5 + eps) if shift_mean else values / (var ** 0.5 + eps)
    return out * m
