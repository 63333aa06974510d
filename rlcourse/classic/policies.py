"""Policies and value baselines for the classic trainers.

Two kinds of observation, two kinds of network:

* a ``Discrete`` observation (the GridWorld's state index): a *table* of logits, one row per state,
  i.e. the tabular softmax policy whose exact gradient :mod:`rlcourse.tabular` computes;
* a ``Box`` observation (CartPole's 4 numbers): a small MLP.

Both map a batch of observations to action logits, so the trainer does not care which it has.
"""
from __future__ import annotations

import gymnasium as gym
import torch
from torch import nn


class TabularSoftmaxPolicy(nn.Module):
    """``pi(a|s) = softmax(theta[s])``: one learnable logit per (state, action), starting uniform."""

    def __init__(self, n_states: int, n_actions: int):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(n_states, n_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.theta[obs.long()]


class TabularValue(nn.Module):
    """A learned state-value baseline ``V(s) = v[s]``, one number per state."""

    def __init__(self, n_states: int):
        super().__init__()
        self.v = nn.Parameter(torch.zeros(n_states))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v[obs.long()]


def mlp(n_in: int, n_out: int, hidden: int = 64, out_std: float = 1.0) -> nn.Sequential:
    """``Linear -> tanh -> Linear -> tanh -> Linear``, orthogonally initialised (as in CleanRL).

    A small ``out_std`` on the last layer makes a policy start close to uniform, so early
    episodes explore instead of repeating whatever the random weights happened to prefer.
    """
    net = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                        nn.Linear(hidden, n_out))
    for layer, std in zip(net[::2], (2 ** 0.5, 2 ** 0.5, out_std)):
        nn.init.orthogonal_(layer.weight, std)
        nn.init.zeros_(layer.bias)
    return net


class MLPPolicy(nn.Module):
    """Action logits from a continuous observation vector."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()
        self.net = mlp(obs_dim, n_actions, hidden, out_std=0.01)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.float())


class MLPValue(nn.Module):
    """A learned state-value baseline ``V(s)`` from a continuous observation vector."""

    def __init__(self, obs_dim: int, hidden: int = 64):
        super().__init__()
        self.net = mlp(obs_dim, 1, hidden, out_std=1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.float()).squeeze(-1)


def make_policy(observation_space: gym.Space, action_space: gym.Space, hidden: int = 64) -> nn.Module:
    """A tabular softmax for a ``Discrete`` observation space, an MLP for a flat ``Box``."""
    if not isinstance(action_space, gym.spaces.Discrete):
        raise ValueError(f"action_space must be Discrete (REINFORCE here samples from a softmax), got {action_space}")
    if isinstance(observation_space, gym.spaces.Discrete):
        return TabularSoftmaxPolicy(int(observation_space.n), int(action_space.n))
    if isinstance(observation_space, gym.spaces.Box) and len(observation_space.shape) == 1:
        return MLPPolicy(observation_space.shape[0], int(action_space.n), hidden)
    raise ValueError(f"observation_space must be Discrete or a 1-D Box, got {observation_space}")


def make_value(observation_space: gym.Space, hidden: int = 64) -> nn.Module:
    """The matching state-value network for :func:`make_policy`'s policy."""
    if isinstance(observation_space, gym.spaces.Discrete):
        return TabularValue(int(observation_space.n))
    if isinstance(observation_space, gym.spaces.Box) and len(observation_space.shape) == 1:
        return MLPValue(observation_space.shape[0], hidden)
    raise ValueError(f"observation_space must be Discrete or a 1-D Box, got {observation_space}")
