"""The lesson-04 checks accept the reference and reject plausible wrong answers."""
import numpy as np
import pytest

from grading_asserts import assert_fails, assert_passes
from rlcourse.grading import check_gae, check_n_step_returns, check_td_residuals


# ----------------------------------------------------------------------------- reference answers
def td_residuals(rewards, values, next_values, terminated, gamma):
    return rewards + gamma * (1 - terminated) * next_values - values


def n_step_returns(rewards, next_values, terminated, dones, gamma, n):
    T, G = len(rewards), np.zeros(len(rewards))
    for t in range(T):
        for k in range(n):
            G[t] += gamma ** k * rewards[t + k]
            if dones[t + k] or t + k == T - 1 or k == n - 1:
                G[t] += gamma ** (k + 1) * (1 - terminated[t + k]) * next_values[t + k]
                break
    return G


def gae(rewards, values, next_values, terminated, dones, gamma, lam):
    delta = td_residuals(rewards, values, next_values, terminated, gamma)
    A, running = np.zeros_like(delta), 0.0
    for t in reversed(range(len(delta))):
        running = delta[t] + gamma * lam * (1 - dones[t]) * running
        A[t] = running
    return A


# ----------------------------------------------------------------------------- plausible mistakes
def td_always_bootstraps(rewards, values, next_values, terminated, gamma):
    return rewards + gamma * next_values - values


def td_wrong_sign(rewards, values, next_values, terminated, gamma):
    return values - rewards - gamma * (1 - terminated) * next_values


def n_step_ignores_dones(rewards, next_values, terminated, dones, gamma, n):
    return n_step_returns(rewards, next_values, terminated, np.zeros_like(dones), gamma, n)


def n_step_discount_off_by_one(rewards, next_values, terminated, dones, gamma, n):
    T, G = len(rewards), np.zeros(len(rewards))
    for t in range(T):
        for k in range(n):
            G[t] += gamma ** k * rewards[t + k]
            if dones[t + k] or t + k == T - 1 or k == n - 1:
                G[t] += gamma ** k * (1 - terminated[t + k]) * next_values[t + k]
                break
    return G


def gae_forwards(rewards, values, next_values, terminated, dones, gamma, lam):
    delta = td_residuals(rewards, values, next_values, terminated, gamma)
    A, running = np.zeros_like(delta), 0.0
    for t in range(len(delta)):
        running = delta[t] + gamma * lam * (1 - dones[t]) * running
        A[t] = running
    return A


def gae_missing_done_mask(rewards, values, next_values, terminated, dones, gamma, lam):
    return gae(rewards, values, next_values, terminated, np.zeros_like(dones), gamma, lam)


def gae_masks_with_terminated_only(rewards, values, next_values, terminated, dones, gamma, lam):
    return gae(rewards, values, next_values, terminated, terminated, gamma, lam)


def gae_without_lambda(rewards, values, next_values, terminated, dones, gamma, lam):
    return gae(rewards, values, next_values, terminated, dones, gamma, 1.0)


def gae_in_place(rewards, values, next_values, terminated, dones, gamma, lam):
    rewards += 0.0  # harmless, but then writes into the caller's array:
    rewards[:] = gae(rewards.copy(), values, next_values, terminated, dones, gamma, lam)
    return rewards


@pytest.mark.parametrize("check, fn", [(check_td_residuals, td_residuals), (check_n_step_returns, n_step_returns),
                                       (check_gae, gae)])
def test_reference_passes_with_one_line(check, fn, capsys):
    assert_passes(check, fn, capsys)


@pytest.mark.parametrize("check, wrong", [
    (check_td_residuals, td_always_bootstraps),
    (check_td_residuals, td_wrong_sign),
    (check_n_step_returns, n_step_ignores_dones),
    (check_n_step_returns, n_step_discount_off_by_one),
    (check_gae, gae_forwards),
    (check_gae, gae_missing_done_mask),
    (check_gae, gae_masks_with_terminated_only),
    (check_gae, gae_without_lambda),
    (check_gae, gae_in_place),
])
def test_wrong_answers_fail(check, wrong):
    assert_fails(check, wrong)
