"""The REINFORCE trainer: batching, baselines, and that it actually learns."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import tabular
from rlcourse.classic import reinforce
from rlcourse.classic.policies import MLPPolicy, TabularSoftmaxPolicy
from rlcourse.envs import GridWorld

GRID = dict(layout="maze2x3", slip=0.1, step_reward=-1.0)


def exact_J(policy, gamma=0.9):
    theta = policy.theta.detach().double().numpy()
    return tabular.softmax_objective(GridWorld(**GRID).mdp, theta, gamma)


def test_collect_episodes_masks_each_episode_exactly():
    torch.manual_seed(0)
    envs = reinforce.make_envs("CartPole-v1", 6)
    obs, _ = envs.reset(seed=0)
    policy = MLPPolicy(4, 2)
    obs_b, actions, rewards, mask, _ = reinforce.collect_episodes(envs, policy, obs, max_steps=1000)
    lengths = mask.sum(1)
    # CartPole pays +1 per step, so each episode's return equals its length, and the mask is a
    # prefix of ones (no step counted after the episode ended).
    torch.testing.assert_close(rewards.sum(1), lengths.float())
    for row, n in zip(mask, lengths):
        assert row[:n].all() and not row[n:].any()
    assert obs_b.shape[:2] == mask.shape and actions.shape == mask.shape
    assert mask.shape[1] == int(lengths.max())


@pytest.mark.parametrize("baseline", reinforce.BASELINES)
def test_every_baseline_improves_the_gridworld_policy(baseline):
    # Exact J of the learned tabular policy, not a noisy return: the uniform policy's J is the bar.
    start_J = exact_J(TabularSoftmaxPolicy(6, 4))
    result = reinforce.train_reinforce("rlcourse/GridWorld-v0", env_kwargs=GRID, episodes=400,
                                       gamma=0.9, lr=0.1, value_lr=0.1, baseline=baseline,
                                       seed=0, progress=False)
    h = result.history
    assert isinstance(result.policy, TabularSoftmaxPolicy)
    assert len(h.episode_returns) == 400 and len(h.loss) == 50 and h.episodes[-1] == 400
    assert exact_J(result.policy) > start_J + 8.0, (start_J, exact_J(result.policy))
    if baseline == "value":
        assert np.isfinite(h.value_loss).all() and result.value is not None
    if baseline == "none":
        assert np.all(np.array(h.baseline) == 0)


def test_time_discounted_reward_to_go_on_the_gridworld():
    result = reinforce.train_reinforce("rlcourse/GridWorld-v0", env_kwargs=GRID, episodes=200,
                                       gamma=0.9, lr=0.1, baseline="value", value_lr=0.1,
                                       time_discount=True, seed=1, progress=False)
    assert exact_J(result.policy) > exact_J(TabularSoftmaxPolicy(6, 4)) + 8.0


def test_cartpole_is_solved():
    result = reinforce.train_reinforce("CartPole-v1", episodes=1000, whiten=True, target_return=475,
                                       seed=0, progress=False)
    h = result.history
    assert isinstance(result.policy, MLPPolicy)
    assert h.solved_at_episode is not None and h.last_mean_return(20) >= 475


def test_on_update_is_called_after_each_update():
    calls = []
    reinforce.train_reinforce("rlcourse/GridWorld-v0", env_kwargs=GRID, episodes=16, batch_episodes=8,
                              progress=False, on_update=lambda policy, history: calls.append(len(history.loss)))
    assert calls == [1, 2]


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="baseline must be one of"):
        reinforce.train_reinforce(baseline="critic", progress=False)
    with pytest.raises(ValueError, match="psi must be one of"):
        reinforce.train_reinforce(psi="advantage", progress=False)
    with pytest.raises(ValueError, match="time_discount=True applies to psi='reward_to_go'"):
        reinforce.train_reinforce(psi="total_return", time_discount=True, progress=False)
    with pytest.raises(ValueError, match="gamma must be in"):
        reinforce.train_reinforce(gamma=2.0, progress=False)
    with pytest.raises(ValueError, match="observation_space must be Discrete or a 1-D Box"):
        from rlcourse.classic.policies import make_policy
        import gymnasium as gym
        make_policy(gym.spaces.Box(0, 1, (2, 2)), gym.spaces.Discrete(2))
