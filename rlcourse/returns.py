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
        import torch

        return torch.as_tensor(x, device=like.device).to(like.dtype)
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=like.dtype)


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

        # Powers in NumPy float64, then the default dtype (MPS has no float64).
        powers = torch.as_tensor(gamma ** np.arange(mask.shape[1], dtype=float), dtype=torch.get_default_dtype(),
                                 device=mask.device)
        return powers[None, :] * mask.to(torch.get_default_dtype())
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


# ---------------------------------------------------------------------------------- TD, n-step returns and GAE
# Lesson 04: estimators that lean on a critic V. Besides the rewards they take ``values[i, t] =
# V(s_t)`` of the visited states and, for each step, the value of the state it led to. Episodes
# end in two ways, as in gymnasium:
#
# * ``terminated[i, t] = 1``: s_{t+1} is terminal. Its value is 0 by definition, so nothing is
#   bootstrapped from it;
# * ``dones[i, t] = 1``: step t is the last of its episode in this row, terminated *or* truncated
#   (a time limit). Nothing flows back across it. A truncated step is done but not terminated:
#   the future still exists, so its target bootstraps from ``next_values[i, t] = V(s_{t+1})`` of
#   the real final observation (the one the env reported before it reset itself).
#
# ``next_values`` defaults to ``values`` shifted one step left, with ``last_value`` (default 0)
# after the last column: right for one episode per row and for a rollout cut mid-episode. With a
# ``mask`` and no ``next_values``, a step followed by padding is the end of its episode (value 0),
# as for a language model's completion that ended with EOS.
def _critic_inputs(rewards, values, gamma, next_values, last_value, terminated, dones, mask):
    """Validate and fill in the arrays every critic-based estimator needs (all as floats)."""
    rewards = _float_rewards(rewards)
    _validate_batch(rewards, gamma, dones, mask)
    if hasattr(rewards, "detach"):
        rewards = rewards.detach()
    for name, value in (("values", values), ("next_values", next_values), ("terminated", terminated)):
        if value is not None and tuple(value.shape) != tuple(rewards.shape):
            raise ValueError(f"{name} must have the shape of rewards {tuple(rewards.shape)}, "
                             f"got {tuple(value.shape)}")
    values = _as_float(values.detach() if hasattr(values, "detach") else values, rewards)
    m = _as_float(mask, rewards) if mask is not None else None
    if next_values is None:
        next_values = values * 0.0
        next_values[:, :-1] = values[:, 1:]
        if m is not None:
            next_values[:, :-1] = next_values[:, :-1] * m[:, 1:]  # followed by padding: the end
        if last_value is not None:
            if tuple(last_value.shape) != (rewards.shape[0],):
                raise ValueError(f"last_value must have shape (N,) = ({rewards.shape[0]},), "
                                 f"got {tuple(last_value.shape)}")
            lv = last_value.detach() if hasattr(last_value, "detach") else last_value
            next_values[:, -1] = _as_float(lv, rewards)
    else:
        if last_value is not None:
            raise ValueError("give either next_values or last_value, not both "
                             "(next_values[:, -1] already is the value after the last step)")
        next_values = _as_float(next_values.detach() if hasattr(next_values, "detach") else next_values,
                                rewards)
    keep_value = 1.0 - _as_float(terminated, rewards) if terminated is not None else rewards * 0.0 + 1.0
    if dones is None:  # without dones, only terminations end episodes
        dones = terminated
    keep_trace = 1.0 - _as_float(dones, rewards) if dones is not None else rewards * 0.0 + 1.0
    if m is not None:
        rewards = rewards * m
    return rewards, values, next_values, keep_value, keep_trace, m


def td_residuals(rewards, values, gamma: float, *, next_values=None, last_value=None, terminated=None,
                 mask=None):
    """One-step TD errors ``delta_t = r_t + gamma (1 - terminated_t) V(s_{t+1}) - V(s_t)``.

    ``delta_t`` is the one-step estimate of the advantage ``A(s_t, a_t)``: unbiased when ``V`` is
    the true ``V^pi`` (its expectation is then ``Q - V``), and of low variance, since only one
    random reward enters it. Shapes ``(N, T)``; see the section comment for the optional arguments.
    Returns an array or tensor of the input's kind, 0 on padding, detached from any graph.
    """
    rewards, values, next_values, keep_value, _, m = _critic_inputs(
        rewards, values, gamma, next_values, last_value, terminated, None, mask)
    delta = rewards + gamma * keep_value * next_values - values
    return delta * m if m is not None else delta


def n_step_returns(rewards, values, gamma: float, n: int, *, next_values=None, last_value=None,
                   terminated=None, dones=None, mask=None):
    """n-step returns: ``n`` real rewards, then the critic's estimate of the rest.

    ``G_t^(n) = sum_{k=0}^{m-1} gamma^k r_{t+k} + gamma^m (1 - terminated_{t+m-1}) V(s_{t+m})``

    with ``m = min(n, steps left in the episode within the row)``: the sum stops early at the end
    of an episode (``dones``) or of the row. ``n = 1`` is the TD target ``r_t + gamma V(s_{t+1})``;
    ``n >= T`` is the Monte-Carlo return (bootstrapped only where an episode was cut short).
    Computed directly from the definition, one shift per k: O(n N T). Returns ``(N, T)``.
    """
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    rewards, values, next_values, keep_value, keep_trace, m = _critic_inputs(
        rewards, values, gamma, next_values, last_value, terminated, dones, mask)
    T = rewards.shape[1]
    row_end = rewards * 0.0
    row_end[:, -1] = 1.0
    G, alive = rewards * 0.0, rewards * 0.0 + 1.0
    for k in range(int(n)):
        G = G + alive * gamma ** k * _shift_left(rewards, k)
        # stop after step t+k at the end of its episode, of the row, or after n rewards
        stop = 1.0 - _shift_left(keep_trace, k) * (1.0 - _shift_left(row_end, k))
        if k == n - 1 or k == T - 1:
            stop = stop * 0.0 + 1.0
        bootstrap = gamma ** (k + 1) * _shift_left(keep_value, k) * _shift_left(next_values, k)
        G = G + alive * stop * bootstrap
        alive = alive * (1.0 - stop)
        if k == T - 1:
            break
    return G * m if m is not None else G


def _shift_left(x, k: int):
    """``out[:, t] = x[:, t + k]``, and 0 where ``t + k`` runs past the last column."""
    if k == 0:
        return x
    out = x * 0.0
    out[:, :x.shape[1] - k] = x[:, k:]
    return out


def gae(rewards, values, gamma: float, gae_lambda: float, *, next_values=None, last_value=None,
        terminated=None, dones=None, mask=None):
    """Generalized advantage estimation, GAE(gamma, lambda) (Schulman et al., 2016).

    ``A_t = sum_{l >= 0} (gamma lambda)^l delta_{t+l}``, computed backwards in O(N T) by

    ``A_t = delta_t + gamma lambda (1 - done_t) A_{t+1}``,  ``A_T = 0``,

    with the TD residuals ``delta_t`` of :func:`td_residuals`. It is the exponentially weighted
    average of the n-step advantages ``A_t^(n) = G_t^(n) - V(s_t)`` with weights
    ``(1 - lambda) lambda^(n-1)`` (:func:`gae_from_n_step` computes it that way). ``lambda = 0``
    gives ``delta_t`` (low variance, biased by V's errors); ``lambda = 1`` gives
    ``G_t - V(s_t)`` (unbiased, the variance of Monte Carlo). The critic's regression target
    ("lambda-return") is ``A_t + V(s_t)``. Returns ``(N, T)``, 0 on padding, detached.
    """
    if not 0.0 <= gae_lambda <= 1.0:
        raise ValueError(f"gae_lambda must be in [0, 1], got {gae_lambda!r}")
    rewards, values, next_values, keep_value, keep_trace, m = _critic_inputs(
        rewards, values, gamma, next_values, last_value, terminated, dones, mask)
    delta = rewards + gamma * keep_value * next_values - values
    if m is not None:
        delta = delta * m
    A, running = delta * 0.0, delta[:, 0] * 0.0
    for t in range(delta.shape[1] - 1, -1, -1):  # backwards: A_t needs A_{t+1}
        running = delta[:, t] + gamma * gae_lambda * keep_trace[:, t] * running
        A[:, t] = running
    return A


def gae_from_n_step(rewards, values, gamma: float, gae_lambda: float, **kwargs):
    """GAE by its definition, a weighted sum of n-step advantages (the oracle for :func:`gae`).

    ``A_t = (1 - lambda) sum_{n=1}^{T-1} lambda^(n-1) A_t^(n) + lambda^(T-1) A_t^(T)``

    The infinite sum ``(1 - lambda) sum_{n>=1} lambda^(n-1) A_t^(n)`` is finite here because
    ``A_t^(n)`` stops changing once n reaches the end of the row: its tail of weights adds up to
    ``lambda^(T-1)``. Costs O(N T^3): for tests and small illustrations only. ``kwargs`` are
    those of :func:`n_step_returns`.
    """
    if not 0.0 <= gae_lambda <= 1.0:
        raise ValueError(f"gae_lambda must be in [0, 1], got {gae_lambda!r}")
    rewards = _float_rewards(rewards)
    T = rewards.shape[1]
    base = _as_float(values.detach() if hasattr(values, "detach") else values, rewards)
    total = rewards * 0.0
    for n in range(1, T + 1):
        weight = (1 - gae_lambda) * gae_lambda ** (n - 1) if n < T else gae_lambda ** (T - 1)
        if weight == 0:
            continue
        total = total + weight * (n_step_returns(rewards, values, gamma, n, **kwargs) - base)
    mask = kwargs.get("mask")
    return total * _as_float(mask, total) if mask is not None else total
