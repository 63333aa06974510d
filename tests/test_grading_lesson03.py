"""Lesson 03's checks pass the reference and catch plausible mistakes."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import losses
from rlcourse.classic import baselines
from rlcourse.grading import (check_batch_mean_baseline, check_importance_weight, check_moving_average_baselines,
                              check_reward_to_go, check_value_baseline)
from rlcourse.grading._core import CheckFailed
from grading_asserts import assert_fails

# ------------------------------------------------------------------ reward-to-go
def rtg_ok(rewards, gamma):
    out, running = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def rtg_from_start(rewards, gamma):
    return np.array([sum(gamma ** k * rewards[k] for k in range(t + 1)) for t in range(len(rewards))])


def rtg_off_by_one(rewards, gamma):
    return np.append(rtg_ok(rewards, gamma)[1:], 0.0)


def rtg_undiscounted(rewards, gamma):
    return np.cumsum(np.asarray(rewards)[::-1])[::-1]


def rtg_discount_from_zero(rewards, gamma):  # gamma^k instead of gamma^(k - t)
    return np.array([sum(gamma ** k * rewards[k] for k in range(t, len(rewards))) for t in range(len(rewards))])


def rtg_in_place(rewards, gamma):
    for t in reversed(range(len(rewards) - 1)):
        rewards[t] += gamma * rewards[t + 1]
    return rewards


def test_reward_to_go_check(capsys):
    check_reward_to_go(rtg_ok)
    assert "✔ check_reward_to_go" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (rtg_from_start, "from the start"), (rtg_off_by_one, "includes r_t"), (rtg_undiscounted, "gamma"),
    (rtg_discount_from_zero, "gamma"), (rtg_in_place, "in place")])
def test_reward_to_go_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_reward_to_go(wrong)


# ------------------------------------------------------------------ batch mean
def mean_ok(returns, mask):
    return (returns * mask).sum() / mask.sum()


def test_batch_mean_check(capsys):
    check_batch_mean_baseline(mean_ok)
    check_batch_mean_baseline(baselines.batch_mean_baseline)
    assert capsys.readouterr().out.count("✔") == 2


@pytest.mark.parametrize("wrong, message", [
    (lambda r, m: r.mean(), "padded entries may hold anything"),
    (lambda r, m: (r * m).mean(1), "shape"),
    (lambda r, m: np.median(r[m]), "mask"),
    (lambda r, m: (r * m).sum() / m.size, "padded zeros")])
def test_batch_mean_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_batch_mean_baseline(wrong)


# ------------------------------------------------------------------ value baseline
def value_ok(returns, states, actions, mask, n_states):
    return baselines.state_value_baseline(returns, states, mask, n_states)


def value_per_action(returns, states, actions, mask, n_states):
    """A per-(state, action) average: Q, not V. It depends on the action."""
    out = np.zeros_like(returns, dtype=float)
    for s in range(n_states):
        for a in range(actions.max() + 1):
            sel = mask & (states == s) & (actions == a)
            if sel.any():
                out[sel] = returns[sel].mean()
    return out


def value_including_padding(returns, states, actions, mask, n_states):
    V = np.array([returns[states == s].mean() if (states == s).any() else 0.0 for s in range(n_states)])
    return V[states] * mask


def value_global_mean(returns, states, actions, mask, n_states):
    return np.full(returns.shape, (returns * mask).sum() / mask.sum()) * mask


def test_value_baseline_check(capsys):
    check_value_baseline(value_ok)
    assert "✔ check_value_baseline" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (value_per_action, "must not depend on the action"), (value_including_padding, "padded"), (value_global_mean, "each state")])
def test_value_baseline_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_value_baseline(wrong)


def test_value_baseline_check_names_action_dependence():
    # An answer right on the reference's numbers but that moves with the actions is caught by name.
    def sneaky(returns, states, actions, mask, n_states):
        base = baselines.state_value_baseline(returns, states, mask, n_states)
        return base + 1e-3 * (actions != sneaky.first.get(returns.shape, actions)).astype(float) * mask
    sneaky.first = {}

    def recording(returns, states, actions, mask, n_states):
        sneaky.first.setdefault(returns.shape, actions.copy())
        return sneaky(returns, states, actions, mask, n_states)
    with pytest.raises(CheckFailed, match="must not depend on the action"):
        check_value_baseline(recording)


# ------------------------------------------------------------------ moving average
def ema_ok(batch_means, decay):
    out, b = np.zeros(len(batch_means)), None
    for k in range(1, len(batch_means)):
        m = batch_means[k - 1]
        b = m if b is None else decay * b + (1 - decay) * m
        out[k] = b
    return out


def ema_including_current(batch_means, decay):
    out, b = np.zeros(len(batch_means)), None
    for k, m in enumerate(batch_means):
        b = m if b is None else decay * b + (1 - decay) * m
        out[k] = b
    return out


def ema_swapped(batch_means, decay):
    return ema_ok(batch_means, 1 - decay)


def ema_from_zero(batch_means, decay):  # b_1 = (1 - decay) m_0: a cold start, not the first mean
    out = np.zeros(len(batch_means))
    for k in range(1, len(batch_means)):
        out[k] = decay * out[k - 1] + (1 - decay) * batch_means[k - 1]
    return out


def test_moving_average_check(capsys):
    check_moving_average_baselines(ema_ok)
    check_moving_average_baselines(baselines.moving_average_baselines)
    assert capsys.readouterr().out.count("✔") == 2


@pytest.mark.parametrize("wrong, message", [
    (ema_including_current, "own mean"), (ema_swapped, "decay"), (ema_from_zero, "b_1 = m_0")])
def test_moving_average_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_moving_average_baselines(wrong)


# ------------------------------------------------------------------ importance weight
def iw_ok(new, old, mask):
    return torch.exp(((new - old) * mask).sum(1))


def test_importance_weight_check(capsys):
    check_importance_weight(iw_ok)
    check_importance_weight(losses.trajectory_importance_weight)
    assert capsys.readouterr().out.count("✔") == 2


@pytest.mark.parametrize("wrong, message", [
    (lambda new, old, mask: torch.exp(((old - new) * mask).sum(1)), "upside down"),
    (lambda new, old, mask: torch.exp(new - old).sum(1), "product"),
    (lambda new, old, mask: (torch.exp(new - old) * mask).mean(1), "product"),
    (lambda new, old, mask: torch.exp((new - old).sum(1)), "padded"),
    (lambda new, old, mask: torch.exp((new - old) * mask), "shape")])
def test_importance_weight_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_importance_weight(wrong)


# ------------------------------------------------------------------ witnesses: named mistakes get their hint
def rtg_whole_return_everywhere(rewards, gamma):  # sum_{i=0}^{T-1} gamma^i r_i written for every t
    whole = sum(gamma ** i * r for i, r in enumerate(np.asarray(rewards, dtype=float)))
    return np.full(len(rewards), whole)


def test_whole_return_at_every_step_is_named():
    assert_fails(check_reward_to_go, rtg_whole_return_everywhere, hint="G_t starts at i = t")
