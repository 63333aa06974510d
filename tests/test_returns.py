"""Batched returns, reward-to-go and whitening against brute-force loops."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import returns


def brute_reward_to_go(rewards, gamma, dones=None, mask=None):
    """Loop over every (i, t) and sum forward until the episode ends: the definition, verbatim."""
    N, T = rewards.shape
    dones = np.zeros((N, T)) if dones is None else np.asarray(dones, float)
    mask = np.ones((N, T)) if mask is None else np.asarray(mask, float)
    G = np.zeros((N, T))
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                continue
            total, discount = 0.0, 1.0
            for k in range(t, T):
                if not mask[i, k]:
                    break
                total += discount * rewards[i, k]
                discount *= gamma
                if dones[i, k]:
                    break
            G[i, t] = total
    return G


def random_batch(rng, N=5, T=9):
    rewards = rng.normal(size=(N, T))
    lengths = rng.integers(1, T + 1, size=N)
    mask = np.arange(T)[None, :] < lengths[:, None]
    dones = (rng.random((N, T)) < 0.2) & mask
    return rewards, dones, mask


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.99, 1.0])
def test_reward_to_go_matches_brute_force(gamma):
    rng = np.random.default_rng(0)
    for _ in range(5):
        rewards, dones, mask = random_batch(rng)
        np.testing.assert_allclose(returns.reward_to_go(rewards, gamma), brute_reward_to_go(rewards, gamma))
        np.testing.assert_allclose(returns.reward_to_go(rewards, gamma, mask=mask),
                                   brute_reward_to_go(rewards, gamma, mask=mask))
        np.testing.assert_allclose(returns.reward_to_go(rewards, gamma, dones=dones, mask=mask),
                                   brute_reward_to_go(rewards, gamma, dones, mask))


def test_reward_to_go_torch_matches_numpy_and_is_detached():
    rng = np.random.default_rng(1)
    rewards, dones, mask = random_batch(rng)
    r = torch.tensor(rewards, requires_grad=True)
    G = returns.reward_to_go(r, 0.9, dones=torch.as_tensor(dones), mask=torch.as_tensor(mask))
    assert isinstance(G, torch.Tensor) and not G.requires_grad
    np.testing.assert_allclose(G.numpy(), brute_reward_to_go(rewards, 0.9, dones, mask))


def test_episode_returns_and_single_episode_agree():
    rng = np.random.default_rng(2)
    rewards, _, mask = random_batch(rng)
    got = returns.episode_returns(rewards, 0.8, mask=mask)
    for i in range(len(rewards)):
        assert got[i] == pytest.approx(returns.discounted_return(rewards[i][mask[i]], 0.8))


def test_discount_weights():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    np.testing.assert_allclose(returns.discount_weights(mask, 0.5), [[1, 0.5, 0.25, 0], [1, 0, 0, 0]])
    np.testing.assert_allclose(returns.discount_weights(torch.as_tensor(mask), 0.5).numpy(),
                               [[1, 0.5, 0.25, 0], [1, 0, 0, 0]])


def test_whiten_matches_a_loop_over_valid_entries():
    rng = np.random.default_rng(3)
    values, _, mask = random_batch(rng)
    valid = [values[i, t] for i in range(values.shape[0]) for t in range(values.shape[1]) if mask[i, t]]
    mean = sum(valid) / len(valid)
    std = (sum((v - mean) ** 2 for v in valid) / len(valid)) ** 0.5
    expected = np.where(mask, (values - mean) / (std + 1e-8), 0.0)
    np.testing.assert_allclose(returns.whiten(values, mask), expected)
    np.testing.assert_allclose(returns.whiten(torch.as_tensor(values), torch.as_tensor(mask)).numpy(), expected)
    np.testing.assert_allclose(returns.whiten(values, mask, shift_mean=False),
                               np.where(mask, values / (std + 1e-8), 0.0))
    full = returns.whiten(values)
    assert full.mean() == pytest.approx(0.0, abs=1e-12) and full.std() == pytest.approx(1.0, abs=1e-6)


def test_whiten_of_equal_values_is_zero_not_nan():
    out = returns.whiten(np.full((2, 3), 4.0))
    assert np.all(out == 0.0)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="rewards must have shape"):
        returns.reward_to_go(np.zeros(3), 0.9)
    with pytest.raises(ValueError, match="gamma must be in"):
        returns.reward_to_go(np.zeros((2, 3)), -0.1)
    with pytest.raises(ValueError, match="mask must have the shape of rewards"):
        returns.reward_to_go(np.zeros((2, 3)), 0.9, mask=np.ones((2, 2)))
    with pytest.raises(ValueError, match="dones must have the shape of rewards"):
        returns.reward_to_go(np.zeros((2, 3)), 0.9, dones=np.ones(3))
    with pytest.raises(ValueError, match="mask selects no entries"):
        returns.whiten(np.ones((2, 2)), np.zeros((2, 2)))


def test_mixed_numpy_and_torch_inputs():
    rewards = np.array([[1.0, 2.0, 3.0]])
    mask = np.array([[True, True, False]])
    expected = brute_reward_to_go(rewards, 0.5, mask=mask)
    np.testing.assert_allclose(returns.reward_to_go(torch.tensor(rewards), 0.5, mask=mask).numpy(), expected)
    np.testing.assert_allclose(returns.reward_to_go(rewards, 0.5, mask=torch.tensor(mask)), expected)
