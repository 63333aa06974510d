"""Baselines ``b`` for ``Psi_t = G_t - b``: the three that need no critic network, as pure functions.

Any ``b`` that does not depend on the action ``a_t`` (nor on anything that happens after it)
leaves the gradient estimate unbiased, because ``E_{a ~ pi(.|s)}[grad log pi(a|s)] = 0``.
What a baseline changes is the variance (lesson 03 measures how much).
"""
from __future__ import annotations

import numpy as np

import torch


def batch_mean_baseline(values, mask=None):
    """``b = (sum_{i,t} mask * G) / (sum_{i,t} mask)``: the mean return over this batch's real steps.

    Padding must not count: averaging zeros from finished episodes would drag ``b`` towards 0.
    (It includes each sample's own return, which scales the expected gradient by about
    ``1 - 1/n``; a leave-one-out mean avoids that, see lesson 09.) Returns a scalar.
    """
    if mask is None:
        return values.mean()
    if isinstance(values, torch.Tensor):
        m = torch.as_tensor(mask, device=values.device).bool()
        real = torch.where(m, values, 0.0)
    else:
        m = np.asarray(mask, dtype=bool)
        real = np.where(m, values, 0.0)  # padding may hold anything: it must not count
    if int(m.sum()) == 0:
        raise ValueError("mask selects no entries: the batch mean is undefined")
    return real.sum() / m.sum()


def moving_average_baselines(batch_means, decay: float = 0.9) -> np.ndarray:
    """The baseline used for each batch ``k``: an exponential moving average of batches ``0..k-1``.

    ``b_0 = 0`` (no history yet), ``b_1 = m_0``, and ``b_{k+1} = decay * b_k + (1 - decay) * m_k``.
    Batch ``k``'s own mean ``m_k`` is *not* in ``b_k``: built from earlier, independent
    episodes, the baseline cannot correlate with this batch's actions.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    means = np.asarray(batch_means, dtype=float)
    if means.ndim != 1:
        raise ValueError(f"batch_means must be a 1-D sequence, got shape {means.shape}")
    out = np.zeros(len(means))
    for k in range(1, len(means)):
        out[k] = means[0] if k == 1 else decay * out[k - 1] + (1 - decay) * means[k - 1]
    return out


def mc_state_values(returns, states, mask, n_states: int) -> np.ndarray:
    """``V(s) = mean{G_{i,t} : s_{i,t} = s, mask[i, t]}``: every-visit Monte-Carlo values, 0 where unseen."""
    returns, states = np.asarray(returns, dtype=float), np.asarray(states)
    mask = np.asarray(mask, dtype=bool)
    total = np.bincount(states[mask], weights=returns[mask], minlength=n_states)
    count = np.bincount(states[mask], minlength=n_states)
    return np.divide(total, count, out=np.zeros(n_states), where=count > 0)


def state_value_baseline(returns, states, mask, n_states: int) -> np.ndarray:
    """A learned ``V(s)`` by Monte Carlo (:func:`mc_state_values`), looked up at every step: ``b[i, t] = V(s_t)``.

    It is indexed by the state only: a table per (state, action) would be ``Q``, and a baseline
    that depends on the action biases the gradient. Fit it on other episodes than those it is
    applied to (the check of lesson 03 fits and applies on one batch only to compare numbers).
    Padded steps get 0.
    """
    V = mc_state_values(returns, states, mask, n_states)
    return V[np.asarray(states)] * np.asarray(mask, dtype=bool)
