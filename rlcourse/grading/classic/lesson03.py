"""Checks for lesson 03 (reward-to-go, baselines, importance sampling).

Besides seeded random cases: integer rewards (``np.zeros_like`` of an int array truncates), long
episodes where float32 drifts, padding that holds non-zero values (a baseline must ignore them,
not rely on them being 0), products of hundreds of ratios and log-probs near -800 (a product of
probabilities underflows to 0/0), and inputs written in place, compared on the caller's own tensors.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse import losses, returns, tabular
from rlcourse.classic import baselines
from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, passed, references,
                                    to_numpy)

__all__ = ["check_reward_to_go", "check_batch_mean_baseline", "check_value_baseline",
           "check_moving_average_baselines", "check_importance_weight", "check_baseline_variance"]


@references("rlcourse.returns:reward_to_go", "rlcourse.returns:discounted_return",
            "rlcourse.losses.policy_gradient:psi_reward_to_go")
def check_reward_to_go(fn) -> None:
    """``fn(rewards, gamma) -> array``: ``G_t = sum_{k >= t} gamma^(k-t) r_k`` for one episode."""
    __tracebackhide__ = True
    name = "check_reward_to_go"
    rng = np.random.default_rng(30)
    cases = [("a single reward", np.array([2.0]), 0.9),
             ("reward only at the end", np.array([0.0, 0.0, 0.0, 1.0]), 0.5),
             ("reward only at the start", np.array([1.0, 0.0, 0.0]), 0.9),
             ("gamma = 1 (plain suffix sums)", np.array([1.0, 2.0, 3.0]), 1.0),
             ("integer rewards", np.array([1, 0, 0, 1]), 0.5),
             ("a long episode (2000 steps, gamma = 0.999)", rng.normal(size=2000) + 0.5, 0.999)]
    cases += [(f"random episode #{i}", rng.normal(size=int(rng.integers(3, 10))), float(rng.uniform(0.5, 0.99)))
              for i in range(4)]
    for case, rewards, gamma in cases:
        label = f"{case} (rewards={np.round(rewards[:8], 3).tolist()}{'...' if len(rewards) > 8 else ''}, gamma={gamma:.4g})"
        got = call_unmutated(name, label, fn, rewards, gamma)
        expected = returns.reward_to_go(rewards[None], gamma)[0]
        prefix = np.array([returns.discounted_return(rewards[:t + 1], gamma) for t in range(len(rewards))])
        whole = np.full(len(rewards), returns.discounted_return(rewards, gamma))
        fail_if_mistake(name, label, expected, got, whole,
                        "that is the whole episode's return sum_{i=0}^{T-1} gamma^i r_i written at every t; "
                        "G_t starts at i = t: G_t = sum_{i=t}^{T-1} gamma^(i-t) r_i")
        fail_if_mistake(name, label, expected, got, prefix,
                        "that sums the rewards from the start up to t; reward-to-go sums from t to the end "
                        "(an action cannot change rewards that came before it)")
        assert_close(name, label, expected, got, rtol=1e-9, atol=1e-9,
                     hint="work backwards: G_{T-1} = r_{T-1}, then G_t = r_t + gamma * G_{t+1}; "
                          "G_t includes r_t itself; keep G in float64 (np.zeros(len(rewards)), not zeros_like "
                          "of integer rewards; float32 drifts on long episodes)")
    passed(name, len(cases))


def _padded_batch(rng, N, T):
    """Returns of N episodes padded to T steps; the padding holds junk (non-zero), as buffers often do."""
    values = rng.normal(size=(N, T)) * 5 + 3
    lengths = rng.integers(1, T + 1, size=N)
    lengths[0] = T
    lengths[-1] = min(lengths[-1], T - 1)
    mask = np.arange(T)[None, :] < lengths[:, None]
    return values, mask


@references("rlcourse.classic.baselines:batch_mean_baseline", "rlcourse.losses.grpo:batch_mean_advantages")
def check_batch_mean_baseline(fn) -> None:
    """``fn(returns, mask) -> float``: the mean of ``returns`` over the real (unpadded) steps."""
    __tracebackhide__ = True
    name = "check_batch_mean_baseline"
    rng = np.random.default_rng(31)
    cases = [("no padding", rng.normal(size=(2, 3)), np.ones((2, 3), bool))]
    for i in range(4):
        values, mask = _padded_batch(rng, int(rng.integers(2, 6)), int(rng.integers(3, 8)))
        cases.append((f"padded batch #{i} (padding holds non-zero values)", values, mask))
    values, mask = _padded_batch(rng, 3, 5)
    cases.append(("a 0/1 integer mask", values, mask.astype(int)))
    cases.append(("zeroed padding", values * mask, mask))
    for case, values, mask in cases:
        label = f"{case}: returns=\n{np.round(values, 2)}\nmask=\n{mask.astype(int)}"
        got = call_unmutated(name, label, fn, values, mask)
        expected = baselines.batch_mean_baseline(values, mask)
        if got is not None and np.size(to_numpy(got)) == 1 and not mask.all() \
                and np.isclose(float(to_numpy(got)), (values * mask).mean()):
            fail(name, label, expected, got,
                 "the padded zeros were averaged in: divide the masked sum by mask.sum(), "
                 "not by the number of entries")
        assert_close(name, label, expected, got,
                     hint="b = sum(mask * returns) / sum(mask): one number; padded entries may hold anything, "
                          "multiply them by the mask (or select returns[mask.astype(bool)])")
    passed(name, len(cases))


@references("rlcourse.classic.baselines:state_value_baseline", "rlcourse.classic.baselines:mc_state_values")
def check_value_baseline(fn) -> None:
    """``fn(returns, states, actions, mask, n_states) -> (N, T)``: ``b[i, t] = V(s_t)``, the mean return seen in ``s_t``."""
    __tracebackhide__ = True
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
                          "taken there; padded steps hold junk, leave them out), then look the average up at "
                          "every step; padded steps get 0")
        n_cases += 1
    passed(name, n_cases)


@references("rlcourse.classic.baselines:moving_average_baselines", "rlcourse.losses.grpo:moving_average_baseline")
def check_moving_average_baselines(fn) -> None:
    """``fn(batch_means, decay) -> array``: the baseline for each batch, from *earlier* batches only."""
    __tracebackhide__ = True
    name = "check_moving_average_baselines"
    rng = np.random.default_rng(33)
    cases = [("a single batch", np.array([5.0]), 0.9),
             ("two batches", np.array([5.0, 1.0]), 0.9),
             ("constant means", np.full(5, 2.0), 0.8),
             ("integer means", np.array([3, 2, 4, 1, 5]), 0.5)]
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


@references("rlcourse.losses:trajectory_importance_weight",
            "rlcourse.losses.policy_gradient:trajectory_importance_weight")
def check_importance_weight(fn) -> None:
    """``fn(logprobs_new, logprobs_old, mask) -> (N,) tensor``: ``prod_t pi_new(a_t|s_t) / pi_old(a_t|s_t)``."""
    __tracebackhide__ = True
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
    new = -rng.uniform(0.5, 1.5, size=(2, 300))
    cases.append(("300 steps each (a product of 300 ratios)", new, new + rng.normal(size=(2, 300)) * 0.05,
                  np.ones((2, 300))))
    cases.append(("very unlikely actions (log-probs near -800)", np.array([[-799.5, -800.0]]),
                  np.array([[-800.0, -799.8]]), np.ones((1, 2))))
    for case, new, old, mask in cases:
        new_t, old_t, mask_t = torch.tensor(new), torch.tensor(old), torch.tensor(mask)
        got = call_unmutated(name, case, fn, new_t, old_t, mask_t)
        expected = losses.trajectory_importance_weight(torch.tensor(new), torch.tensor(old), torch.tensor(mask))
        if got is not None and to_numpy(got).shape == tuple(expected.shape) \
                and np.allclose(to_numpy(got), 1 / expected.numpy()) and not np.allclose(expected.numpy(), 1):
            fail(name, case, expected, got, "the ratio is upside down: new policy over old policy "
                                            "(the samples came from the old one)")
        assert_close(name, case, expected, got,
                     hint="rho = exp(sum_t mask * (logprobs_new - logprobs_old)): a product of the "
                          "per-step ratios (not their sum or mean), skipping padded steps; a ratio of "
                          "probabilities exp(new) / exp(old) is 0/0 for log-probs near -800", rtol=1e-6, atol=1e-9)
    passed(name, len(cases))


def _episode_gradients(env, theta, n_episodes, seed, use_baseline):
    """The reference measurement: per-episode estimates sum_t gamma^t (G_t - b) score_t."""
    from rlcourse.classic.gradient_estimates import sample_episodes, softmax_score_gradients

    batch = sample_episodes(env.mdp, tabular.softmax_policy(theta), n_episodes, np.random.default_rng(seed),
                            reward_table=env.reward_table)
    G = returns.reward_to_go(batch.rewards, 0.9, mask=batch.mask)
    if use_baseline:
        G = (G - baselines.batch_mean_baseline(G, batch.mask)) * batch.mask
    return softmax_score_gradients(theta, batch, G * returns.discount_weights(batch.mask, 0.9))


@references()
def check_baseline_variance(fn) -> None:
    """``fn(env, theta, n_episodes, use_baseline, seed) -> (mean_gradient, variance)``: a measurement.

    The experiment: from ``n_episodes`` sampled episodes, the per-episode REINFORCE estimates
    ``g_i = sum_t gamma^t (G_t - b) grad log pi(a_t|s_t)`` (gamma = 0.9, ``b`` the batch-mean
    baseline over real steps, or 0), their mean, and their total variance (summed over the entries
    of theta). Passes when both means point along the exact gradient, the baseline cuts the
    variance, and each variance agrees with an independent measurement on other episodes.
    """
    __tracebackhide__ = True
    from rlcourse.classic.gradient_estimates import cosine_similarity
    from rlcourse.envs import GridWorld

    name = "check_baseline_variance"
    env = GridWorld("maze2x3", slip=0.1, step_reward=-1.0)
    mdp = env.mdp
    theta = np.random.default_rng(102).normal(scale=0.5, size=(mdp.n_states, mdp.n_actions))
    exact = tabular.softmax_policy_gradient(mdp, theta, 0.9)
    measured = {}
    for use_baseline in (False, True):
        case = f"maze2x3 (slip=0.1, step_reward=-1), 2000 episodes, use_baseline={use_baseline}, seed=0"
        got = call_unmutated(name, case, fn, env, theta, 2000, use_baseline, 0)
        if not isinstance(got, tuple) or len(got) != 2:
            fail(name, case, "a pair (mean_gradient, variance)", got, "return g.mean(axis=0), g.var(axis=0).sum()")
        mean, variance = to_numpy(got[0]), float(to_numpy(got[1]))
        cos = cosine_similarity(mean, exact)
        if mean.shape != exact.shape or not cos > 0.97:
            fail(name, case, "a mean gradient along the exact one (cosine > 0.97)",
                 f"cosine {cos:.3f}" if mean.shape == exact.shape else f"shape {mean.shape}",
                 "g_i = sum over the real steps t of gamma^t * (G_t - b) * score(theta, s_t, a_t); average over episodes")
        independent = _episode_gradients(env, theta, 4000, 12345, use_baseline).var(0).sum()
        if not 0.75 * independent < variance < 1.33 * independent:
            fail(name, case, f"a total variance near {independent:.1f} (measured on other episodes)", variance,
                 "the variance of the per-episode estimates g_i around their mean, summed over the entries of "
                 "theta: g.var(axis=0).sum() (not the variance of the mean, nor of the returns)")
        measured[use_baseline] = variance
    if not measured[True] < 0.8 * measured[False]:
        fail(name, "the two measurements", f"variance with the baseline < 0.8 x {measured[False]:.1f}",
             measured[True], "subtract the batch-mean return b from every real step's G_t")
    passed(name, 3)
