"""The shared rollout collector (truncation bootstrapping) and the A2C trainer."""
import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

import rlcourse  # noqa: F401
from rlcourse.classic.actor_critic import ActorCritic, RolloutCollector, make_vector_env, train_actor_critic


class CounterEnv(gym.Env):
    """obs = [steps taken so far]; reward 1 per step; never terminates by itself."""

    observation_space = gym.spaces.Box(0, 100, shape=(1,))
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        # action 1 at the second step ends the episode for real (a termination)
        return np.array([float(self.t)], dtype=np.float32), 1.0, bool(action == 1 and self.t == 2), False, {}


if "rlcourse-test/Counter-v0" not in gym.registry:
    gym.register("rlcourse-test/Counter-v0", entry_point=CounterEnv, max_episode_steps=3)


def counting_agent():
    """V(s) = s[0] exactly: a critic whose value of every observation we know."""
    agent = ActorCritic(1, 2, hidden=4)
    agent.critic = nn.Linear(1, 1)
    with torch.no_grad():
        agent.critic.weight.fill_(1.0)
        agent.critic.bias.zero_()
    return agent


def test_truncation_bootstraps_from_the_final_observation():
    gamma = 0.5
    collector = RolloutCollector(make_vector_env("rlcourse-test/Counter-v0", 3, seed=0), seed=0)
    ro = collector.collect(counting_agent(), num_steps=12, gamma=gamma, gae_lambda=0.0)  # A = delta
    obs, delta = ro.obs[..., 0], ro.advantages
    trunc = (ro.dones == 1) & (ro.terminated == 0)
    term = ro.terminated == 1
    assert trunc.any() and term.any()
    # truncated after step 3: the final observation is [3], not the reset observation [0]
    torch.testing.assert_close(delta[trunc], 1 + gamma * 3.0 - obs[trunc])
    torch.testing.assert_close(delta[term], 1 - obs[term])  # terminal: no bootstrap at all
    mid = ro.dones == 0
    torch.testing.assert_close(delta[mid], 1 + gamma * (obs[mid] + 1) - obs[mid])
    assert collector.episodes.returns and set(collector.episodes.lengths) <= {2, 3}


def test_rollout_returns_are_advantages_plus_values_and_logprobs_match():
    envs = make_vector_env("CartPole-v1", 2, seed=1)
    agent = ActorCritic(4, 2)
    ro = RolloutCollector(envs, seed=1).collect(agent, 16, 0.99, 0.95)
    torch.testing.assert_close(ro.returns, ro.advantages + ro.values)
    logp, _ = agent.logprob_entropy(ro.obs, ro.actions)
    torch.testing.assert_close(logp.detach(), ro.logprobs)
    assert ro.flat()["obs"].shape == (32, 4)


def test_actor_critic_learns_cartpole():
    torch.set_num_threads(1)
    result = train_actor_critic(total_timesteps=20_000, seed=0, progress=False)
    first = np.mean(result.episodes.returns[:20])
    assert result.episodes.last_mean_return(20) > max(100.0, 3 * first)


def test_bad_env_is_named():
    with pytest.raises(ValueError, match="discrete actions"):
        make_vector_env("Pendulum-v1", 1, seed=0)


class FixedLogits(nn.Module):
    """An actor whose logits are given (``-inf`` marks a masked action), plus a learnable offset."""

    def __init__(self, logits):
        super().__init__()
        self.fixed = logits
        self.shift = nn.Parameter(torch.zeros(logits.shape[-1], dtype=logits.dtype))

    def forward(self, obs):
        return self.fixed[: obs.shape[0]] + self.shift


def test_entropy_with_masked_actions_is_finite_and_matches_a_loop():
    """-inf logits (actions that are not allowed) count 0 log 0 = 0; p log p typed out gave NaN."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    logits[0, [1, 3]] = -float("inf")
    logits[2, :4] = -float("inf")                  # one legal action: entropy exactly 0
    logits[4, 0] = -float("inf")
    agent = ActorCritic(3, 5).double()
    agent.actor = FixedLogits(logits)
    obs, actions = torch.zeros(6, 3, dtype=torch.float64), torch.tensor([0, 1, 4, 2, 1, 3])
    logp, entropy = agent.logprob_entropy(obs, actions)
    for i in range(6):                             # the oracle: a loop over the legal actions only
        legal = [a for a in range(5) if logits[i, a] > -float("inf")]
        z = sum(np.exp(float(logits[i, a])) for a in legal)
        p = [np.exp(float(logits[i, a])) / z for a in legal]
        assert float(entropy[i].detach()) == pytest.approx(-sum(q * np.log(q) for q in p), abs=1e-12)
        assert float(logp[i].detach()) == pytest.approx(np.log(np.exp(float(logits[i, actions[i]])) / z), abs=1e-12)
    assert float(entropy[2].detach()) == 0.0
    entropy.sum().backward()
    assert torch.isfinite(agent.actor.shift.grad).all()


def test_a2c_refuses_settings_that_would_go_silently_wrong():
    with pytest.raises(ValueError, match="total_timesteps"):
        train_actor_critic(total_timesteps=100, num_envs=8, num_steps=16, progress=False)
    with pytest.raises(ValueError, match="norm_adv"):
        train_actor_critic(total_timesteps=10, num_envs=1, num_steps=1, norm_adv=True, progress=False)
    with pytest.raises(ValueError, match="max_grad_norm"):
        train_actor_critic(total_timesteps=128, max_grad_norm=0.0, progress=False)
