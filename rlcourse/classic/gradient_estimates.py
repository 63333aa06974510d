"""Monte-Carlo policy-gradient estimates for a tabular softmax policy, one per episode.

On a :class:`~rlcourse.tabular.TabularMDP` we can sample many episodes fast (all of them in step,
with NumPy) and turn each into its own gradient estimate

    g_i = sum_t Psi_{i,t} * grad_theta log pi_theta(a_t | s_t),

so that the spread of the ``g_i`` (their variance) and their mean can be set against the exact
gradient of :func:`rlcourse.tabular.softmax_policy_gradient`. Lessons 02-03 use this to measure
estimators instead of describing them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlcourse import tabular


@dataclass
class EpisodeBatch:
    """N episodes padded to T steps: ``states``, ``actions`` (ints), ``rewards`` and ``mask`` (N, T).

    ``mask[i, t]`` is True while episode i is still running at step t.
    """

    states: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    mask: np.ndarray

    def __len__(self) -> int:
        return self.states.shape[0]


def sample_episodes(mdp: tabular.TabularMDP, policy, n_episodes: int, rng: np.random.Generator,
                    horizon: int = 200, reward_table=None) -> EpisodeBatch:
    """Run ``n_episodes`` episodes of ``policy`` on ``mdp`` side by side, each for at most ``horizon`` steps.

    An episode ends when it enters a terminal state. Truncating at ``horizon`` biases a discounted
    estimate by at most ``gamma^horizon * max|r| / (1 - gamma)``: negligible for the defaults here
    (0.9^200 ~ 7e-10).

    ``reward_table[s, a, s']`` (e.g. ``GridWorld.reward_table``) gives the reward actually received
    on each transition, as the environment would pay it. Without it each step records the
    expected reward ``R[s, a]``: also unbiased for every estimator here (the noise
    ``r_t - R[s_t, a_t]`` has mean zero given everything up to ``a_t``, so it only multiplies
    scores with which it averages out), with slightly less variance.
    """
    policy = tabular._check_policy(mdp, policy)
    if reward_table is not None:
        reward_table = np.asarray(reward_table, dtype=float)
        if reward_table.shape != mdp.P.shape:
            raise ValueError(f"reward_table must have the shape of P {mdp.P.shape}, got {reward_table.shape}")
    if n_episodes < 1:
        raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    S = mdp.n_states
    states = np.zeros((n_episodes, horizon), dtype=np.int64)
    actions = np.zeros((n_episodes, horizon), dtype=np.int64)
    rewards = np.zeros((n_episodes, horizon))
    mask = np.zeros((n_episodes, horizon), dtype=bool)
    s = rng.choice(S, size=n_episodes, p=mdp.start)
    alive = ~mdp.terminal[s]
    cum_policy, cum_P = policy.cumsum(1), mdp.P.cumsum(2)
    for t in range(horizon):
        if not alive.any():
            return EpisodeBatch(states[:, :t], actions[:, :t], rewards[:, :t], mask[:, :t])
        # Inverse-CDF sampling of every episode's action and next state at once.
        a = np.minimum((rng.random(n_episodes)[:, None] > cum_policy[s]).sum(1), mdp.n_actions - 1)
        s_next = np.minimum((rng.random(n_episodes)[:, None] > cum_P[s, a]).sum(1), S - 1)
        states[:, t], actions[:, t], mask[:, t] = s, a, alive
        r = mdp.R[s, a] if reward_table is None else reward_table[s, a, s_next]
        rewards[:, t] = np.where(alive, r, 0.0)
        s = np.where(alive, s_next, s)
        alive = alive & ~mdp.terminal[s]
    return EpisodeBatch(states, actions, rewards, mask)


def softmax_score(theta, state: int, action: int) -> np.ndarray:
    """``grad_theta log pi(action | state)`` for a tabular softmax, an ``(S, A)`` array.

    ``log pi(a|s) = theta[s, a] - log sum_b exp(theta[s, b])``, so the derivative is
    ``onehot(a) - pi(.|s)`` on row ``s`` and 0 on every other row.
    """
    theta = np.asarray(theta, dtype=float)
    score = np.zeros_like(theta)
    score[state] = -tabular.softmax_policy(theta[state:state + 1])[0]
    score[state, action] += 1.0
    return score


def softmax_score_gradients(theta, batch: EpisodeBatch, psi) -> np.ndarray:
    """Per-episode estimates ``g_i = sum_t mask * Psi_{i,t} * grad_theta log pi(a_t | s_t)``, shape ``(N, S, A)``.

    For a tabular softmax the score has a closed form: ``grad_theta log pi(a|s)`` is zero outside
    row ``s`` and equals ``onehot(a) - pi(.|s)`` on it. So each step adds ``Psi`` at ``[s_t, a_t]``
    and subtracts ``Psi * pi(.|s_t)`` from row ``s_t``. Their mean over episodes is minus the
    gradient of :func:`rlcourse.losses.reinforce_loss` on the same batch (a unit test checks it).
    """
    theta = np.asarray(theta, dtype=float)
    pi = tabular.softmax_policy(theta)
    N, T = batch.states.shape
    if N and T and (batch.states.max() >= theta.shape[0] or batch.actions.max() >= theta.shape[1]):
        raise ValueError(f"theta of shape {theta.shape} has no row or column for some of the batch's "
                         f"states (max {batch.states.max()}) or actions (max {batch.actions.max()})")
    psi = np.broadcast_to(np.asarray(psi, dtype=float), (N, T)) * batch.mask
    rows = np.broadcast_to(np.arange(N)[:, None], (N, T))
    grads = np.zeros((N,) + theta.shape)
    np.add.at(grads, (rows, batch.states, batch.actions), psi)
    weight_per_state = np.zeros((N, theta.shape[0]))
    np.add.at(weight_per_state, (rows, batch.states), psi)
    return grads - weight_per_state[:, :, None] * pi[None]


def cosine_similarity(u, v) -> float:
    """``u . v / (|u| |v|)`` of two arrays, flattened."""
    u, v = np.ravel(u), np.ravel(v)
    return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v) + 1e-300))


def relative_error(estimate, exact) -> float:
    """``|estimate - exact| / |exact|`` (Euclidean norms over all entries)."""
    return float(np.linalg.norm(np.ravel(estimate) - np.ravel(exact)) / np.linalg.norm(np.ravel(exact)))
