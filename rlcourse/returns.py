"""Returns and their relatives, as pure functions.

The discounted return of a reward sequence ``r_0, r_1, ..., r_{T-1}`` is

    G_0 = sum_{t=0}^{T-1} gamma^t r_t = r_0 + gamma r_1 + gamma^2 r_2 + ...

Batches and the conventions every function here follows
--------------------------------------------------------
Batched functions work on ``(N, T)`` arrays: N rows (episodes, rollouts of a vectorised env, or
language-model completions), T time steps. They accept NumPy arrays, lists or torch tensors and
return the kind they were given (NumPy float64, or a tensor of the rewards' dtype and device),
detached from any autograd graph: returns and advantages are targets, never differentiated.

* **Masks mean "not there".** ``mask[i, t] = 0`` marks a step that does not exist: left or right
  padding, or a hole inside a row (say, tokens a tool wrote into a conversation). Whatever the
  arrays hold there (garbage, NaN, inf), a masked step's output is exactly 0 and no real step's
  output depends on it: recursions run over the real steps of a row in order, as if the masked
  ones were deleted.
* **Episode ends.** A row may hold several episodes one after the other. An episode ends at
  step t when ``dones``, ``terminated`` or ``truncated`` is set there, and nothing flows back
  across its end. How it ended decides what is bootstrapped after it:

  - a *termination* (``s_{t+1}`` is terminal) bootstraps nothing: a terminal state is worth 0;
  - a *truncation* (a time limit) bootstraps from the value of the truncated episode's own next
    state, ``next_values[i, t] = V(s_{t+1})`` (the final observation the env reported before it
    reset), never from the next episode's first state.

  ``terminated`` marks terminations and ``truncated`` truncations. ``dones`` marks ends of either
  kind: given together with ``terminated``, a done step that is not terminated is a truncation
  (gymnasium's ``done = terminated | truncated``); without ``terminated``, a done step that is not
  ``truncated`` is a termination. So ``dones`` alone always means "the episode really ended here".
* **The end of a row** that is not the end of an episode (a rollout cut mid-episode) bootstraps
  from ``last_value[i]``, 0 by default: a language model's completion ends where its row does.
* ``next_values[i, t]`` defaults to the value of the next real step in the row (``last_value``
  after the last one). Reward-to-go has no critic: it never bootstraps, so there a truncated
  episode's return is the sum of the rewards it got.
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from rlcourse.kl import as_mask


def discounted_return(rewards, gamma: float) -> float:
    """``G_0 = sum_t gamma^t r_t`` for one episode's rewards (a 1-D sequence)."""
    rewards = np.asarray(rewards, dtype=float)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be a 1-D sequence, got shape {rewards.shape}")
    _check_unit_interval("gamma", gamma)
    if not np.isfinite(rewards).all():
        raise ValueError("rewards must be finite, got nan or inf")
    return float(np.sum(gamma ** np.arange(len(rewards)) * rewards))


# ---------------------------------------------------------------------------------- input handling
def _check_unit_interval(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (a number), got {value!r}")


def _floats(x, name: str):
    """``x`` as a detached float tensor, and a function that turns a result back into x's kind."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x if x.is_floating_point() else x.to(torch.get_default_dtype())), (lambda out: out)
    try:
        array = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array, a tensor or a list of numbers, "
                        f"got {type(x).__name__}") from None
    return torch.from_numpy(array), (lambda out: out.numpy())


def _like(x, name: str, ref: torch.Tensor) -> torch.Tensor:
    """An optional companion array of ``ref``'s shape, as ``ref``'s dtype and device."""
    x, _ = _floats(x, name)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the shape of rewards {tuple(ref.shape)}, got {tuple(x.shape)}")
    return x.to(device=ref.device, dtype=ref.dtype)


def _flags(x, name: str, ref: torch.Tensor, shape_of: str = "rewards") -> torch.Tensor | None:
    """A 0/1 (or bool) flag array of ``ref``'s shape as a bool tensor; None stays None.

    The package's one mask check, :func:`rlcourse.kl.as_mask` (0 and 1 only, ``ref``'s shape).
    """
    return as_mask(x, ref, name, shape_of)


def _batch(rewards, gamma, mask):
    """Validate ``rewards`` (N, T), ``gamma`` and ``mask``; return float rewards, bool mask, restore."""
    _check_unit_interval("gamma", gamma)
    r, restore = _floats(rewards, "rewards")
    if r.ndim != 2:
        raise ValueError(f"rewards must have shape (N, T), got {tuple(r.shape)}")
    m = torch.ones_like(r, dtype=torch.bool) if mask is None else _flags(mask, "mask", r)
    check_finite("rewards", r, m)
    return r, m, restore


def check_integer(name: str, value, minimum: int = 1) -> int:
    """``value`` as a Python int if it is an integer (any ``numbers.Integral``: int, a NumPy integer)
    of at least ``minimum``; else ``ValueError`` naming ``name``. ``True`` and ``2.0`` are refused:
    a bool or a float where a count is expected is a bug, not a count."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_finite(name: str, x: torch.Tensor, real: torch.Tensor | None, check=torch.isfinite) -> None:
    """Raise ``ValueError`` naming ``name`` if ``check(x)`` fails at a real entry (``real`` None: every entry).

    ``check`` is ``torch.isfinite`` (no nan, no inf) unless the caller allows inf (e.g. a log-prob
    of -inf, whose gradient is still defined where the mask is 0). Masked entries may hold anything.
    """
    bad = ~check(x) if real is None else ~check(x) & real
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} hold nan or inf at {int(bad.sum())} real (unmasked) entries, the "
                         f"first at {where}; masked entries may hold anything")


def _episode_ends(r, dones, terminated, truncated):
    """Bool ``(ends, terminal)``: where an episode ends, and where it ends by termination."""
    dones, terminated, truncated = (_flags(x, n, r) for x, n in
                                    ((dones, "dones"), (terminated, "terminated"), (truncated, "truncated")))
    none = torch.zeros_like(r, dtype=torch.bool)
    ends = none | (dones if dones is not None else none) | (terminated if terminated is not None else none) \
        | (truncated if truncated is not None else none)
    if terminated is not None:
        terminal = terminated
    else:
        terminal = (dones if dones is not None else none) & ~(truncated if truncated is not None else none)
    return ends, terminal


def _has_real_step_after(m: torch.Tensor) -> torch.Tensor:
    """``out[i, t]``: is there a real step after column t in row i?"""
    later = m.flip(1).cumsum(1).flip(1)  # real steps at or after t
    return (later - m.long()) > 0


# ---------------------------------------------------------------------------------- the backward scan
def _scan(r, m, gamma, decay, ends, bootstrap):
    """``out_t = r_t + gamma * bootstrap_t + decay * [not ends_t] * out_{next real step}`` over real steps.

    One backward pass serves reward-to-go (``bootstrap = 0``, ``decay = gamma``) and GAE (``r``
    holds the TD residuals, ``decay = gamma * lambda``). Masked steps are skipped and get 0.
    """
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        value = r[:, t] + gamma * bootstrap[:, t] + decay * torch.where(ends[:, t], 0.0, running)
        out[:, t] = torch.where(m[:, t], value, 0.0)
        running = torch.where(m[:, t], value, running)
    return out


def reward_to_go(rewards, gamma: float, dones=None, mask=None, *, terminated=None, truncated=None):
    """Discounted reward-to-go of every step: ``G_t = sum_{k >= t} gamma^{k-t} r_k``, within its episode.

    Computed backwards with ``G_t = r_t + gamma (1 - end_t) G_{next(t)}`` (``next(t)`` the next real
    step of the row; 0 after the last), O(N T). Episode ends and masks follow the module's
    conventions. Returns ``(N, T)``, exactly 0 on masked steps.
    """
    r, m, restore = _batch(rewards, gamma, mask)
    ends, _ = _episode_ends(r, dones, terminated, truncated)
    return restore(_scan(r, m, gamma, gamma, ends, torch.zeros_like(r)))


def episode_returns(rewards, gamma: float, mask=None):
    """The discounted return ``G_0 = sum_t gamma^t r_t`` of each row's first episode: shape ``(N,)``.

    ``G_0`` is read at each row's first real step (left padding is skipped); a row with no real
    step returns 0.
    """
    r, m, restore = _batch(rewards, gamma, mask)
    G = _scan(r, m, gamma, gamma, torch.zeros_like(m), torch.zeros_like(r))
    if r.shape[1] == 0:
        return restore(r.new_zeros(r.shape[0]))
    first = m.long().argmax(1, keepdim=True)  # the first real column (0 for an empty row, whose G is 0)
    return restore(G.gather(1, first)[:, 0])


def discount_weights(mask, gamma: float, dones=None):
    """``gamma^t`` at every step of a batch ``(N, T)``, with t counted in real steps since the episode began.

    With ``gamma < 1`` the objective ``E[sum_t gamma^t r_t]`` values a decision at time t at only
    ``gamma^t``, so an unbiased estimate of its gradient weighs step t by ``gamma^t``. Masked
    steps get 0 and do not advance t (left padding starts at ``gamma^0``); after a step in
    ``dones`` a new episode starts at ``gamma^0``. Returns the kind of ``mask`` (NumPy float64,
    or a tensor of the default float dtype).
    """
    _check_unit_interval("gamma", gamma)
    m_float, restore = _floats(mask, "mask")
    if m_float.ndim != 2:
        raise ValueError(f"mask must have shape (N, T), got {tuple(m_float.shape)}")
    m = _flags(m_float, "mask", m_float)
    ends = _flags(dones, "dones", m_float, "mask") if dones is not None else torch.zeros_like(m)
    steps = torch.zeros_like(m_float)
    count = torch.zeros_like(m_float[:, 0])
    for t in range(m.shape[1]):
        steps[:, t] = count
        count = torch.where(ends[:, t] & m[:, t], 0.0, count + m[:, t].to(count.dtype))
    if isinstance(mask, torch.Tensor):
        steps = steps.to(torch.get_default_dtype())
    return restore(torch.where(m, torch.pow(float(gamma), steps), 0.0))


def whiten(values, mask=None, shift_mean: bool = True, eps: float = 1e-8, unbiased: bool = False):
    """Standardise values over the real entries: ``(x - mean) / (std + eps)``.

    Mean and (population, ``ddof=0``) standard deviation are taken over the entries where
    ``mask`` is 1 (all entries if ``mask`` is None), in float64; masked entries come back as
    exactly 0 whatever they held. ``shift_mean=False`` only rescales: ``x / (std + eps)``.
    When the spread is no more than ``eps`` (all values equal, up to float leftovers) there is no
    scale to remove and nothing is rescaled: equal values whiten to exactly 0, and with
    ``shift_mean=False`` they come back unchanged (never divided by ``eps``).

    ``unbiased=True`` takes the std with Bessel's correction, ``sqrt(sum (x - mean)^2 / (n - 1))``,
    as verl's ``masked_whiten`` does (``masked_var(unbiased=True)``; it also puts its ``1e-8`` inside
    the square root): every whitened value shrinks by ``sqrt((n - 1) / n)``. The default
    (population std, divisor ``n``) is OpenRLHF's (``compute_advantages_and_returns``); with
    ``unbiased=True`` at least two entries must be real.

    Whitening is a per-batch baseline and step size in one: it changes the gradient's scale, not
    (to first order) its direction, and keeps the step size independent of the reward's units.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    x, restore = _floats(values, "values")
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else _flags(mask, "mask", x)
    if not m.any():
        raise ValueError("mask selects no entries: cannot whiten an empty set")
    check_finite("values", x, m)
    # Sums in float64 (where the device has it): n equal float32 values then have a mean equal to
    # each of them, so they centre to exactly 0 (a float32 sum left 0.749 for sixteen 0.3s).
    x64 = torch.where(m, x.to(torch.float32 if x.device.type == "mps" else torch.float64), 0.0)
    count = m.sum()
    if unbiased and count < 2:
        raise ValueError("unbiased=True (Bessel's correction) needs at least two real entries")
    mean = x64.sum() / count
    std = ((torch.where(m, x64 - mean, 0.0) ** 2).sum() / (count - 1 if unbiased else count)).sqrt()
    scale = std + eps if std > eps else torch.ones_like(std)
    out = (x64 - mean) / scale if shift_mean else x64 / scale
    return restore(torch.where(m, out, 0.0).to(x.dtype))


# ---------------------------------------------------------------------------------- TD, n-step returns and GAE
# Lesson 04: estimators that lean on a critic V. Besides the rewards they take ``values[i, t] =
# V(s_t)`` of the visited states; see the module docstring for episode ends, masks,
# ``next_values`` and ``last_value``.
def _critic_inputs(rewards, values, gamma, *, next_values=None, last_value=None, terminated=None,
                   truncated=None, dones=None, mask=None):
    """Validate; return rewards, values, mask, episode ends and the value bootstrapped after each step."""
    r, m, restore = _batch(rewards, gamma, mask)
    v = _like(values, "values", r)
    check_finite("values", v, m)
    ends, terminal = _episode_ends(r, dones, terminated, truncated)
    N = r.shape[0]
    if last_value is None:
        lv = r.new_zeros(N)
    else:
        if next_values is not None:
            raise ValueError("give either next_values or last_value, not both "
                             "(next_values already holds the value after every step)")
        lv = last_value.detach() if isinstance(last_value, torch.Tensor) else torch.from_numpy(
            np.asarray(last_value, dtype=float))
        if lv.ndim == 0:
            lv = lv.expand(N)
        if tuple(lv.shape) != (N,):
            raise ValueError(f"last_value must be a number or have shape (N,) = ({N},), got {tuple(lv.shape)}")
        lv = lv.to(device=r.device, dtype=r.dtype)
        if not torch.isfinite(lv).all():
            raise ValueError("last_value must be finite, got nan or inf")
    if next_values is not None:
        nv = _like(next_values, "next_values", r)
        check_finite("next_values", nv, m & ~terminal)
    else:
        truncations = ends & ~terminal & m & _has_real_step_after(m)
        if truncations.any():
            raise ValueError("truncated episodes bootstrap from V of their own final observation: "
                             "pass next_values (the next step in the row belongs to the next episode)")
        nv = torch.zeros_like(r)
        following = lv
        for t in range(r.shape[1] - 1, -1, -1):
            nv[:, t] = following
            following = torch.where(m[:, t], v[:, t], following)
    bootstrap = torch.where(terminal | ~m, 0.0, nv)
    return r, torch.where(m, v, 0.0), m, ends, bootstrap, restore


def td_residuals(rewards, values, gamma: float, *, next_values=None, last_value=None, terminated=None,
                 truncated=None, dones=None, mask=None):
    """One-step TD errors ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``, with ``V(terminal) = 0``.

    ``delta_t`` is the one-step estimate of the advantage ``A(s_t, a_t)``: unbiased when ``V`` is
    the true ``V^pi`` (its expectation is then ``Q - V``), and of low variance, since only one
    random reward enters it. Returns ``(N, T)``, 0 on masked steps, detached.
    """
    r, v, m, ends, bootstrap, restore = _critic_inputs(
        rewards, values, gamma, next_values=next_values, last_value=last_value, terminated=terminated,
        truncated=truncated, dones=dones, mask=mask)
    return restore(torch.where(m, r + gamma * bootstrap - v, 0.0))


def gae(rewards, values, gamma: float, gae_lambda: float, *, next_values=None, last_value=None,
        terminated=None, truncated=None, dones=None, mask=None):
    """Generalized advantage estimation, GAE(gamma, lambda) (Schulman et al., 2016, arXiv 1506.02438).

    ``A_t = sum_{l >= 0} (gamma lambda)^l delta_{t+l}``, computed backwards in O(N T) by

    ``A_t = delta_t + gamma lambda (1 - end_t) A_{next(t)}``,  0 after the last real step,

    with the TD residuals ``delta_t`` of :func:`td_residuals` and ``next(t)`` the next real step
    of the row. It is the exponentially weighted average of the n-step advantages
    ``A_t^(n) = G_t^(n) - V(s_t)`` with weights ``(1 - lambda) lambda^(n-1)`` (see
    :func:`gae_from_n_step`). ``lambda = 0`` gives ``delta_t`` (low variance, biased by V's errors);
    ``lambda = 1`` gives ``G_t - V(s_t)`` (unbiased, the variance of Monte Carlo). The critic's
    regression target ("lambda-return") is ``A_t + V(s_t)``. Returns ``(N, T)``, 0 on masked steps.
    """
    _check_unit_interval("gae_lambda", gae_lambda)
    r, v, m, ends, bootstrap, restore = _critic_inputs(
        rewards, values, gamma, next_values=next_values, last_value=last_value, terminated=terminated,
        truncated=truncated, dones=dones, mask=mask)
    delta = torch.where(m, r + gamma * bootstrap - v, 0.0)
    return restore(_scan(delta, m, 0.0, gamma * gae_lambda, ends, torch.zeros_like(r)))


def n_step_returns(rewards, values, gamma: float, n: int, *, next_values=None, last_value=None,
                   terminated=None, truncated=None, dones=None, mask=None):
    """n-step returns: ``n`` real rewards, then the critic's estimate of the rest.

    ``G_t^(n) = sum_{k=0}^{j-1} gamma^k r_{t+k} + gamma^j V(s_{t+j})``

    over the real steps ``t, t+1, ...`` of the row, with ``j = min(n, steps left in the episode
    within the row)``: the sum stops early at an episode's end, where a termination bootstraps 0
    and a truncation ``next_values``, or at the row's end (``last_value``). ``n = 1`` is the TD
    target; ``n >= T`` is the Monte-Carlo return. O(n N T). Returns ``(N, T)``, 0 on masked steps.
    """
    n = check_integer("n", n)   # a NumPy integer would make `k == n - 1` a numpy bool, which torch's `|` refuses
    r, v, m, ends, bootstrap, restore = _critic_inputs(
        rewards, values, gamma, next_values=next_values, last_value=last_value, terminated=terminated,
        truncated=truncated, dones=dones, mask=mask)
    N, T = r.shape
    # next_real[i, t]: the next real column after t (T when there is none), found backwards.
    next_real = torch.full((N, T + 1), T, dtype=torch.long, device=r.device)
    for t in range(T - 2, -1, -1):
        next_real[:, t] = torch.where(m[:, t + 1], t + 1, next_real[:, t + 1])
    stops = torch.cat([ends | (next_real[:, :T] == T), ends.new_ones(N, 1)], dim=1)
    padded_r = torch.cat([torch.where(m, r, 0.0), r.new_zeros(N, 1)], dim=1)
    padded_b = torch.cat([bootstrap, r.new_zeros(N, 1)], dim=1)
    pos = torch.arange(T, device=r.device).expand(N, T)
    alive, G = m.clone(), torch.zeros_like(r)
    for k in range(min(int(n), T)):
        G = G + torch.where(alive, gamma ** k * padded_r.gather(1, pos), 0.0)
        stop = stops.gather(1, pos) | (k == n - 1)
        G = G + torch.where(alive & stop, gamma ** (k + 1) * padded_b.gather(1, pos), 0.0)
        alive = alive & ~stop
        pos = next_real.gather(1, pos)
    return restore(G)


def gae_from_n_step(rewards, values, gamma: float, gae_lambda: float, **kwargs):
    """GAE by its definition, a weighted sum of n-step advantages (lesson 04's illustration).

    ``A_t = (1 - lambda) sum_{n=1}^{T-1} lambda^(n-1) A_t^(n) + lambda^(T-1) A_t^(T)``

    The infinite sum ``(1 - lambda) sum_{n>=1} lambda^(n-1) A_t^(n)`` is finite here because
    ``A_t^(n)`` stops changing once n reaches the end of the row: its tail of weights adds up to
    ``lambda^(T-1)``. Costs O(N T^3): for small illustrations only. ``kwargs`` are those of
    :func:`n_step_returns`.
    """
    _check_unit_interval("gae_lambda", gae_lambda)
    _, v, _, _, _, restore = _critic_inputs(rewards, values, gamma, **kwargs)  # validated, 0 on masked steps
    base = restore(v)
    total = base * 0
    T = v.shape[1]
    for n in range(1, T + 1):
        weight = (1 - gae_lambda) * gae_lambda ** (n - 1) if n < T else gae_lambda ** (T - 1)
        if weight:
            total = total + weight * (n_step_returns(rewards, values, gamma, n, **kwargs) - base)
    return total
