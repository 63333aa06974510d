"""DQN (rlcourse.classic.dqn): its target and loss against hand computation and finite differences,
and its fixed point against the exact Q* of the gridworld."""
import numpy as np
import pytest
import torch

import rlcourse  # noqa: F401  (before torch, as everywhere)
from rlcourse import tabular
from rlcourse.classic.dqn import DQNConfig, ReplayBuffer, dqn_loss, greedy_return, q_targets, train_dqn
from rlcourse.envs import GridWorld


def test_the_target_bootstraps_from_the_best_next_action_unless_the_episode_terminated():
    rewards = torch.tensor([1.0, 0.0, -2.0])
    next_q = torch.tensor([[0.5, 2.0], [3.0, -1.0], [7.0, 9.0]], requires_grad=True)
    terminated = torch.tensor([False, False, True])
    y = q_targets(rewards, next_q, terminated, gamma=0.9)
    assert torch.allclose(y, torch.tensor([1.0 + 0.9 * 2.0, 0.9 * 3.0, -2.0]))
    assert not y.requires_grad
    assert torch.allclose(q_targets(rewards, next_q, terminated.float(), gamma=0.0), rewards)
    with pytest.raises(ValueError, match="gamma"):
        q_targets(rewards, next_q, terminated, gamma=1.5)
    with pytest.raises(ValueError, match="must agree"):
        q_targets(rewards[:2], next_q, terminated, gamma=0.9)


def test_the_loss_is_the_mean_squared_td_error_of_the_actions_taken_with_its_finite_difference_gradient():
    torch.manual_seed(0)
    q = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    actions, y = torch.tensor([0, 2, 1, 1, 0]), torch.randn(5, dtype=torch.float64)
    loss = dqn_loss(q, actions, y)
    assert torch.isclose(loss, ((q[torch.arange(5), actions] - y) ** 2).mean())
    (grad,) = torch.autograd.grad(loss, q)
    eps, numeric = 1e-6, torch.zeros_like(q)
    for i in range(5):
        for j in range(3):
            bump = torch.zeros_like(q)
            bump[i, j] = eps
            numeric[i, j] = (dqn_loss(q + bump, actions, y) - dqn_loss(q - bump, actions, y)) / (2 * eps)
    assert torch.allclose(grad, numeric, atol=1e-8)
    assert grad[torch.arange(5), [1, 0, 0, 2, 1]].abs().max() == 0  # actions not taken get no gradient


def test_the_replay_buffer_keeps_the_last_transitions_and_one_slot_means_the_latest():
    buffer = ReplayBuffer(3, seed=0)
    for t in range(5):
        buffer.add(t, t % 4, float(t), t + 1, t == 4)
    assert len(buffer) == 3 and sorted(buffer.data[:, 0]) == [2, 3, 4]
    one = ReplayBuffer(1)
    one.add(1, 2, 3.0, 4, False)
    one.add(5, 1, -1.0, 6, True)
    batch = one.sample(4)
    assert batch["states"].tolist() == [5] * 4 and batch["terminated"].tolist() == [1.0] * 4


def test_a_linear_q_network_converges_to_the_exact_q_star_of_the_gridworld():
    """With one weight per (state, action) DQN is tabular Q-learning: its fixed point is Q*."""
    env = GridWorld("4x4")
    V = tabular.value_iteration(env.mdp, 0.9).V
    q_star = tabular.action_values(env.mdp, V, 0.9)
    result = train_dqn(hidden=0, exploring_starts=True, total_steps=4000, learning_rate=0.05, seed=0)
    live = ~env.terminal
    assert np.abs(result.Q[live] - q_star[live]).max() < 1e-3
    assert greedy_return(env, result.Q) == 10.0


def test_the_config_names_a_bad_setting():
    with pytest.raises(ValueError, match="buffer_size"):
        DQNConfig(buffer_size=0)
    with pytest.raises(ValueError, match="epsilon_end"):
        DQNConfig(epsilon_start=0.1, epsilon_end=0.5)


def test_finite_horizon_values_by_enumeration_and_their_limit():
    """Horizon and discount are separate: V at horizon H by summing over every path, any gamma."""
    env = GridWorld("maze2x3", slip=0.2)
    mdp, policy = env.mdp, tabular.uniform_policy(env.mdp)
    P_pi, r_pi = tabular.policy_dynamics(mdp, policy)
    for gamma in (0.5, 1.0):
        for horizon in (0, 1, 3):
            # sum over t < H of gamma^t (P_pi^t r_pi): the expected reward at each step, enumerated
            expected = sum(gamma ** t * np.linalg.matrix_power(P_pi, t) @ r_pi for t in range(horizon)) \
                if horizon else np.zeros(mdp.n_states)
            assert np.allclose(tabular.finite_horizon_evaluation(mdp, policy, gamma, horizon), expected)
    assert np.allclose(tabular.finite_horizon_evaluation(mdp, policy, 0.9, 400),
                       tabular.policy_evaluation(mdp, policy, 0.9))
    with pytest.raises(ValueError, match="horizon"):
        tabular.finite_horizon_evaluation(mdp, policy, 0.9, -1)
