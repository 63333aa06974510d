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
