"""Checks for lesson 03 (reward-to-go, baselines, importance sampling)."""
from __future__ import annotations

import numpy as np
import torch

from rlcourse import losses, returns
from rlcourse.classic import baselines
from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, to_numpy

__all__ = ["check_reward_to_go", "check_batch_mean_baseline", "check_value_baseline",
           "check_moving_average_baselines", "check_importance_weight"]


def check_reward_to_go(fn) -> None:
    """``fn(rewards, gamma) -> array``: ``G_t = sum_{k >= t} gamma^(k-t) r_k`` for one episode."""
    name = "check_reward_to_go"
    rng = np.random.default_rng(30)
    cases = [("a single reward", np.array([2.0]), 0.9),
             ("reward only at the end", np.array([0.0, 0.0, 0.0, 1.0]), 0.5),
             ("reward only at the start", np.array([1.0, 0.0, 0.0]), 0.9),
             ("gamma = 1 (plain suffix sums)", np.array([1.0, 2.0, 3.0]), 1.0)]
    cases += [(f"random episode #{i}", rng.normal(size=int(rng.integers(3, 10))), float(rng.uniform(0.5, 0.99)))
              for i in range(4)]
    for case, rewards, gamma in cases:
        label = f"{case} (rewards={np.round(rewards, 3).tolist()}, gamma={gamma:.3g})"
        got = call_unmutated(name, label, fn, rewards, gamma)
        expected = returns.reward_to_go(rewards[None], gamma)[0]
        prefix = np.array([returns.discounted_return(rewards[:t + 1], gamma) for t in range(len(rewards))])
        fail_if_mistake(name, label, expected, got, prefix,
                        "that sums the rewards from the start up to t; reward-to-go sums from t to the end "
                        "(an action cannot change rewards that came before it)")
        assert_close(name, label, expected, got,
                     hint="work backwards: G_{T-1} = r_{T-1}, then G_t = r_t + gamma * G_{t+1}; "
                          "G_t includes r_t itself")
    passed(name, len(cases))


def _padded_batch(rng, N, T):
    values = rng.normal(size=(N, T)) * 5 + 3
    lengths = rng.integers(1, T + 1, size=N)
    lengths[0] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    return values * mask, mask


def check_batch_mean_baseline(fn) -> None:
    """``fn(returns, mask) -> float``: the mean of ``returns`` over the real (unpadded) steps."""
    name = "check_batch_mean_baseline"
    rng = np.random.default_rng(31)
    cases = [("no padding", rng.normal(size=(2, 3)), np.ones((2, 3), bool))]
    for i in range(4):
        values, mask = _padded_batch(rng, int(rng.integers(2, 6)), int(rng.integers(3, 8)))
        cases.append((f"padded batch #{i}", values, mask))
    for case, values, mask in cases:
        label = f"{case}: returns=\n{np.round(values, 2)}\nmask=\n{mask.astype(int)}"
        got = call_unmutated(name, label, fn, values, mask)
        expected = baselines.batch_mean_baseline(values, mask)
        if got is not None and np.size(to_numpy(got)) == 1 and not mask.all() \
                and np.isclose(float(to_numpy(got)), values.mean()):
            fail(name, label, expected, got,
                 "the padded zeros were averaged in: divide the masked sum by mask.sum(), "
                 "not by the number of entries")
        assert_close(name, label, expected, got, hint="b = sum(mask * returns) / sum(mask): one number")
    passed(name, len(cases))


def check_value_baseline(fn) -> None:
    """``fn(returns, states, actions, mask, n_states) -> (N, T)``: ``b[i, t] = V(s_t)``, the mean return seen in ``s_t``."""
    name = "check_value_baseline"
    rng = np.random.default_rng(32)
    n_cases = 0
    for i, (N, T, S, A) in enumerate([(1, 4, 2, 2), (3, 5, 3, 2), (6, 8, 4, 3), (8, 6, 5, 4)]):
        values, mask = _padded_batch(rng, N, T)
        states = rng.integers(S, size=(N, T))
        actions = rng.integers(A, size=(N, T))
        label = f"random batch #{i} (N={N}, T={T}, {S} states, {A} actions)"
        got = call_unmutated(name, label, fn, values, states, actions, mask, S)
        expected = baselines.state_value_baseline(values, states, mask, S)
        other_actions = rng.integers(A, size=(N, T))  # resampled, not relabelled: the groups change
        again = call_unmutated(name, label, fn, values, states, other_actions, mask, S)
        if got is not None and again is not None and to_numpy(got).shape == to_numpy(again).shape \
                and not np.allclose(to_numpy(again), to_numpy(got)):
            fail(name, label + ", then the same batch with other actions", got, again,
                 "the baseline changed when only the actions changed: b must not depend on the "
                 "action (a per-(state, action) average is Q, and it biases the gradient)")
        assert_close(name, label, expected, got,
                     hint="average the returns of all real steps in each state (whatever action was "
                          "taken there), then look the average up at every step; padded steps get 0")
        n_cases += 1
    passed(name, n_cases)


def check_moving_average_baselines(fn) -> None:
    """``fn(batch_means, decay) -> array``: the baseline for each batch, from *earlier* batches only."""
    name = "check_moving_average_baselines"
    rng = np.random.default_rng(33)
    cases = [("a single batch", np.array([5.0]), 0.9),
             ("two batches", np.array([5.0, 1.0]), 0.9),
             ("constant means", np.full(5, 2.0), 0.8)]
    cases += [(f"random sequence #{i}", rng.normal(size=int(rng.integers(4, 10))) * 10, float(rng.uniform(0.5, 0.95)))
              for i in range(3)]
    for case, means, decay in cases:
        label = f"{case} (batch_means={np.round(means, 2).tolist()}, decay={decay:.3g})"
        got = call_unmutated(name, label, fn, means, decay)
        expected = baselines.moving_average_baselines(means, decay)
        # The same average, but with batch k's own mean already folded into b_k.
        including = baselines.moving_average_baselines(np.append(means, 0.0), decay)[1:]
        fail_if_mistake(name, label, expected, got, including,
                        "batch k's baseline includes batch k's own mean: shift by one, b_0 = 0 and "
                        "b_k uses batch_means[:k] only")
        assert_close(name, label, expected, got,
                     hint="b_0 = 0, b_1 = m_0, then b_{k+1} = decay * b_k + (1 - decay) * m_k "
                          "(decay weighs the old average, 1 - decay the new mean)")
    passed(name, len(cases))


def check_importance_weight(fn) -> None:
    """``fn(logprobs_new, logprobs_old, mask) -> (N,) tensor``: ``prod_t pi_new(a_t|s_t) / pi_old(a_t|s_t)``."""
    name = "check_importance_weight"
    rng = np.random.default_rng(34)
    cases = []
    for i, (N, T) in enumerate([(1, 1), (2, 3), (4, 5), (3, 6)]):
        new = -rng.uniform(0.1, 2.0, size=(N, T))
        old = -rng.uniform(0.1, 2.0, size=(N, T))
        mask = np.ones((N, T))
        if T > 1:
            mask[-1, T // 2:] = 0.0
        cases.append((f"random batch #{i} (N={N}, T={T})", new, old, mask))
    cases.append(("identical policies", np.log(np.full((2, 3), 0.25)), np.log(np.full((2, 3), 0.25)), np.ones((2, 3))))
    for case, new, old, mask in cases:
        got = fn(torch.tensor(new), torch.tensor(old), torch.tensor(mask))
        expected = losses.trajectory_importance_weight(torch.tensor(new), torch.tensor(old), torch.tensor(mask))
        if got is not None and to_numpy(got).shape == tuple(expected.shape) \
                and np.allclose(to_numpy(got), 1 / expected.numpy()) and not np.allclose(expected.numpy(), 1):
            fail(name, case, expected, got, "the ratio is upside down: new policy over old policy "
                                            "(the samples came from the old one)")
        assert_close(name, case, expected, got,
                     hint="rho = exp(sum_t mask * (logprobs_new - logprobs_old)): a product of the "
                          "per-step ratios (not their sum or mean), skipping padded steps")
    passed(name, len(cases))
