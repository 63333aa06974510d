"""The lesson-01 checks accept the reference and reject plausible wrong answers."""
import numpy as np
import pytest

from grading_asserts import assert_fails, assert_passes
from rlcourse import returns, tabular
from rlcourse.grading import (CheckFailed, check_bellman_expectation_backup, check_discounted_return,
                              check_greedy_policy, check_q_learning_run, check_q_learning_update, check_value_iteration)
from rlcourse.grading.classic.lesson01 import _mdp


# ----------------------------------------------------------------------------- reference answers
def ref_return(rewards, gamma):
    return returns.discounted_return(rewards, gamma)


def ref_backup(V, P, R, policy, gamma):
    return tabular.bellman_expectation_backup(_mdp(P, R), V, policy, gamma)


def ref_vi(P, R, gamma, tol):
    return tabular.value_iteration(_mdp(P, R), gamma, tol).V


def ref_q_update(Q, s, a, r, s_next, terminated, alpha, gamma):
    return tabular.q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)


def ref_greedy(Q):
    return np.asarray(Q).argmax(1)


@pytest.mark.parametrize("check, fn", [
    (check_discounted_return, ref_return),
    (check_bellman_expectation_backup, ref_backup),
    (check_value_iteration, ref_vi),
    (check_q_learning_update, ref_q_update),
    (check_greedy_policy, ref_greedy),
])
def test_reference_passes_with_one_line(check, fn, capsys):
    assert_passes(check, fn, capsys)


# ----------------------------------------------------------------------------- wrong answers
def return_off_by_one(rewards, gamma):  # discounts the first reward too
    return sum(gamma ** (t + 1) * r for t, r in enumerate(rewards))


def return_undiscounted(rewards, gamma):
    return float(np.sum(rewards))


def return_mutates(rewards, gamma):
    for t in range(len(rewards)):
        rewards[t] *= gamma ** t  # writes into the caller's array
    return float(np.sum(rewards))


def return_reversed(rewards, gamma):  # discounts from the end
    return sum(gamma ** t * r for t, r in enumerate(rewards[::-1]))


def backup_max_for_sum(V, P, R, policy, gamma):
    return (R + gamma * P @ V).max(1)


def backup_no_discount(V, P, R, policy, gamma):
    return (policy * (R + P @ V)).sum(1)


def backup_wrong_axis(V, P, R, policy, gamma):  # sums over s instead of s'
    return (policy * (R + gamma * np.einsum("sat,s->sa", P, V))).sum(1)


def vi_one_sweep(P, R, gamma, tol):
    return (R + gamma * P @ np.zeros(P.shape[0])).max(1)


def vi_mean_for_max(P, R, gamma, tol):
    V = np.zeros(P.shape[0])
    for _ in range(2000):
        V = (R + gamma * P @ V).mean(1)
    return V


def q_no_terminal_mask(Q, s, a, r, s_next, terminated, alpha, gamma):
    Q = Q.copy()
    Q[s, a] += alpha * (r + gamma * Q[s_next].max() - Q[s, a])
    return Q


def q_in_place(Q, s, a, r, s_next, terminated, alpha, gamma):
    Q[s, a] += alpha * (r + (0 if terminated else gamma * Q[s_next].max()) - Q[s, a])
    return Q


def q_wrong_sign(Q, s, a, r, s_next, terminated, alpha, gamma):
    Q = Q.copy()
    Q[s, a] -= alpha * (r + (0 if terminated else gamma * Q[s_next].max()) - Q[s, a])
    return Q


def q_mean_for_max(Q, s, a, r, s_next, terminated, alpha, gamma):  # SARSA-like expected target
    Q = Q.copy()
    Q[s, a] += alpha * (r + (0 if terminated else gamma * Q[s_next].mean()) - Q[s, a])
    return Q


def vi_fixed_sweeps(P, R, gamma, tol):          # 1000 sweeps: exact at gamma 0.95, 632/1000 at 0.999
    V = np.zeros(P.shape[0])
    for _ in range(1000):
        V = (R + gamma * P @ V).max(axis=1)
    return V


def test_value_iteration_that_stops_after_a_fixed_number_of_sweeps_is_told_why():
    assert_fails(check_value_iteration, vi_fixed_sweeps, hint="not after a fixed number of sweeps")


def greedy_wrong_axis(Q):
    return np.asarray(Q).argmax(0)


def greedy_argmin(Q):
    return np.asarray(Q).argmin(1)


def greedy_returns_values(Q):
    return np.asarray(Q).max(1)


@pytest.mark.parametrize("check, wrong", [
    (check_discounted_return, return_off_by_one),
    (check_discounted_return, return_undiscounted),
    (check_discounted_return, return_mutates),
    (check_discounted_return, return_reversed),
    (check_bellman_expectation_backup, backup_max_for_sum),
    (check_bellman_expectation_backup, backup_no_discount),
    (check_bellman_expectation_backup, backup_wrong_axis),
    (check_value_iteration, vi_one_sweep),
    (check_value_iteration, vi_mean_for_max),
    (check_q_learning_update, q_no_terminal_mask),
    (check_q_learning_update, q_in_place),
    (check_q_learning_update, q_wrong_sign),
    (check_q_learning_update, q_mean_for_max),
    (check_greedy_policy, greedy_wrong_axis),
    (check_greedy_policy, greedy_argmin),
    (check_greedy_policy, greedy_returns_values),
])
def test_plausible_mistakes_fail(check, wrong):
    message = assert_fails(check, wrong)
    assert "expected" in message and "received" in message and "hint" in message


def test_returning_none_gets_a_hint():
    with pytest.raises(CheckFailed, match="return"):
        check_discounted_return(lambda rewards, gamma: None)


# ------------------------------------------------------------------ witnesses: named mistakes get their hint
def return_discounts_first_reward(rewards, gamma):  # gamma^(t+1) r_t
    return float(sum(gamma ** (t + 1) * r for t, r in enumerate(np.asarray(rewards, dtype=float))))


def test_discounting_the_first_reward_is_named():
    assert_fails(check_discounted_return, return_discounts_first_reward, hint="gamma * G")


def _q_learning_run(env, episodes, alpha, gamma, epsilon, seed, rng):
    Q = np.zeros((env.observation_space.n, env.action_space.n))
    env.reset(seed=seed)
    for _ in range(episodes):
        s, _ = env.reset()
        for _ in range(100):
            ties = np.flatnonzero(Q[s] == Q[s].max())
            a = int(rng.integers(4)) if rng.random() < epsilon else int(rng.choice(ties))
            s_next, r, terminated, truncated, _ = env.step(a)
            Q = tabular.q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)
            s = s_next
            if terminated or truncated:
                break
    return Q


def q_run_global_rng(env, episodes, alpha, gamma, epsilon, seed):  # an unseeded generator: seed ignored
    return _q_learning_run(env, episodes, alpha, gamma, epsilon, seed, np.random.default_rng())


def q_run_constant_seed(env, episodes, alpha, gamma, epsilon, seed):  # reseeded with 0 whatever seed says
    return _q_learning_run(env, episodes, alpha, gamma, epsilon, 0, np.random.default_rng(0))


@pytest.mark.parametrize("wrong, hint", [(q_run_global_rng, "the global RNG"), (q_run_constant_seed, "not a constant")])
def test_q_learning_run_must_follow_its_seed(wrong, hint):
    assert_fails(check_q_learning_run, wrong, hint=hint)


def test_q_learning_run_right_answer_passes(capsys):
    assert_passes(check_q_learning_run, lambda *a: _q_learning_run(*a, np.random.default_rng(a[-1])), capsys)
