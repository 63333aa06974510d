"""Deep Q-learning (DQN; Mnih et al., 2015, "Human-level control through deep reinforcement learning",
Nature 518) on the gridworld: Q-learning with a network instead of a table, and the two pieces that
keep it from chasing its own tail.

    target     y = r + gamma * (1 - terminated) * max_a' Q_target(s', a')        (:func:`q_targets`)
    loss       L = mean_b (Q(s_b, a_b) - y_b)^2,  y held fixed                     (:func:`dqn_loss`)

- **Experience replay**: transitions go into a buffer and each update draws a random batch from it,
  so one update does not see 32 consecutive, correlated steps of one episode, and each transition is
  reused. ``buffer_size=1`` turns it off: every update learns from the latest transition only.
- **A target network**: ``Q_target`` is a copy of ``Q`` refreshed every ``target_update_every``
  updates, so the target ``y`` stands still while ``Q`` moves towards it. ``target_update_every=1``
  turns it off: the targets come from the network being trained.

The state is the gridworld's cell index as a one-hot vector; with ``hidden=0`` the network is linear
in it, one weight per (state, action): a table, and then DQN's fixed point is tabular Q-learning's,
``Q*`` of :func:`rlcourse.tabular.value_iteration` (the tests check it).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from rlcourse.envs import GridWorld


def q_targets(rewards: torch.Tensor, next_q_target: torch.Tensor, terminated: torch.Tensor, *,
              gamma: float) -> torch.Tensor:
    """``y = r + gamma (1 - terminated) max_a' Q_target(s', a')``: ``(B,)``, with no gradient.

    Args:
        rewards: ``(B,)`` the reward of each transition.
        next_q_target: ``(B, A)`` the target network's values of the next state.
        terminated: ``(B,)`` bool or 0/1: the episode ended there, so there is no future to bootstrap
            from (a time-limit truncation is not termination: the future still exists).
        gamma: the discount in [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if next_q_target.ndim != 2 or rewards.shape != next_q_target.shape[:1] or terminated.shape != rewards.shape:
        raise ValueError(f"rewards (B,), next_q_target (B, A) and terminated (B,) must agree, got "
                         f"{tuple(rewards.shape)}, {tuple(next_q_target.shape)}, {tuple(terminated.shape)}")
    future = next_q_target.detach().max(dim=1).values
    return (rewards + gamma * (1.0 - terminated.to(rewards.dtype)) * future).detach()


def dqn_loss(q_values: torch.Tensor, actions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``mean_b (Q(s_b, a_b) - y_b)^2``: the squared TD error of the actions taken; ``y`` is detached.

    Args:
        q_values: ``(B, A)`` the online network's values of the states.
        actions: ``(B,)`` integer actions taken.
        targets: ``(B,)`` from :func:`q_targets`.
    """
    if q_values.ndim != 2 or actions.shape != q_values.shape[:1] or targets.shape != actions.shape:
        raise ValueError(f"q_values (B, A), actions (B,) and targets (B,) must agree, got "
                         f"{tuple(q_values.shape)}, {tuple(actions.shape)}, {tuple(targets.shape)}")
    taken = q_values.gather(1, actions.long()[:, None]).squeeze(1)
    return F.mse_loss(taken, targets.detach())


class ReplayBuffer:
    """The last ``capacity`` transitions ``(s, a, r, s', terminated)``; :meth:`sample` draws a batch uniformly."""

    def __init__(self, capacity: int, *, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.rng = capacity, np.random.default_rng(seed)
        self.data = np.zeros((capacity, 5))
        self.size, self.next = 0, 0

    def add(self, s: int, a: int, r: float, s_next: int, terminated: bool) -> None:
        self.data[self.next] = (s, a, r, s_next, float(terminated))
        self.next = (self.next + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def __len__(self) -> int:
        return self.size

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn with replacement (all of them, the latest, when capacity is 1)."""
        rows = self.data[self.rng.integers(self.size, size=batch_size)]
        return {"states": torch.as_tensor(rows[:, 0], dtype=torch.long),
                "actions": torch.as_tensor(rows[:, 1], dtype=torch.long),
                "rewards": torch.as_tensor(rows[:, 2], dtype=torch.float32),
                "next_states": torch.as_tensor(rows[:, 3], dtype=torch.long),
                "terminated": torch.as_tensor(rows[:, 4], dtype=torch.float32)}


class QNetwork(nn.Module):
    """``Q(s, .)`` from the one-hot state: linear (a table) when ``hidden=0``, else one hidden layer."""

    def __init__(self, n_states: int, n_actions: int, hidden: int = 32):
        super().__init__()
        self.n_states = n_states
        self.net = nn.Linear(n_states, n_actions) if hidden == 0 else nn.Sequential(
            nn.Linear(n_states, hidden), nn.Tanh(), nn.Linear(hidden, n_actions))
        if hidden == 0:
            nn.init.zeros_(self.net.weight)
            nn.init.zeros_(self.net.bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.net(F.one_hot(states, self.n_states).float())


@dataclass
class DQNConfig:
    layout: str = "4x4"  # the GridWorld layout (rlcourse.envs.gridworld.LAYOUTS)
    slip: float = 0.0  # probability that a move goes sideways
    total_steps: int = 3000  # environment steps; one update per step once learning has started
    learning_rate: float = 3e-3  # Adam's step size
    gamma: float = 0.9  # discount
    batch_size: int = 32  # transitions per update
    buffer_size: int = 4000  # replay capacity; 1 = no replay (learn from the latest transition)
    target_update_every: int = 50  # updates between copies into the target network; 1 = no target network
    hidden: int = 32  # hidden units; 0 = linear in the one-hot state (a table)
    epsilon_start: float = 1.0  # exploration: epsilon-greedy, linearly annealed...
    epsilon_end: float = 0.1  # ...to this value...
    epsilon_decay_steps: int = 2000  # ...over this many environment steps
    learning_starts: int = 200  # environment steps before the first update
    max_episode_steps: int = 50  # an episode is cut (truncated, not terminated) after this many steps
    exploring_starts: bool = False  # start each episode in a random non-terminal state
    seed: int = 0  # seeds the network, the buffer, exploration and the environment

    def __post_init__(self):
        for name in ("total_steps", "batch_size", "buffer_size", "target_update_every", "max_episode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.epsilon_end <= self.epsilon_start <= 1.0:
            raise ValueError(f"need 0 <= epsilon_end <= epsilon_start <= 1, got {self.epsilon_end}, "
                             f"{self.epsilon_start}")
        if self.hidden < 0 or self.learning_starts < 0 or self.epsilon_decay_steps < 1:
            raise ValueError("hidden and learning_starts must be >= 0 and epsilon_decay_steps >= 1")


@dataclass
class DQNResult:
    q_network: QNetwork
    Q: np.ndarray  # (n_states, n_actions) the final network's values
    episode_returns: np.ndarray  # undiscounted return of each training episode
    losses: np.ndarray  # the loss of each update


def greedy_return(env: GridWorld, Q: np.ndarray, max_steps: int = 50) -> float:
    """The undiscounted return of acting greedily in ``Q`` from the start (deterministic worlds)."""
    s, _ = env.reset(seed=0)
    total = 0.0
    for _ in range(max_steps):
        s, r, terminated, truncated, _ = env.step(int(np.argmax(Q[s])))
        total += r
        if terminated or truncated:
            break
    return total


def train_dqn(config: DQNConfig | None = None, *, progress: bool = False, **overrides) -> DQNResult:
    """Train a Q-network on the gridworld with epsilon-greedy exploration, replay and a target network."""
    from tqdm.auto import trange

    cfg = dataclasses.replace(config or DQNConfig(), **overrides)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    env = GridWorld(cfg.layout, slip=cfg.slip)
    n_s, n_a = env.observation_space.n, env.action_space.n
    q = QNetwork(n_s, n_a, cfg.hidden)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=cfg.learning_rate)
    buffer = ReplayBuffer(cfg.buffer_size, seed=cfg.seed + 1)
    starts = np.flatnonzero(~env.terminal)
    returns, losses, episode_return, t_episode, updates = [], [], 0.0, 0, 0
    s, _ = env.reset(seed=cfg.seed, options={"state": int(rng.choice(starts))} if cfg.exploring_starts else None)
    for step in trange(cfg.total_steps, desc="DQN", disable=not progress):
        epsilon = max(cfg.epsilon_end, cfg.epsilon_start - (cfg.epsilon_start - cfg.epsilon_end)
                      * step / cfg.epsilon_decay_steps)
        if rng.random() < epsilon:
            a = int(rng.integers(n_a))
        else:
            with torch.no_grad():
                a = int(q(torch.tensor([s])).argmax())
        s_next, r, terminated, truncated, _ = env.step(a)
        t_episode += 1
        truncated = truncated or t_episode >= cfg.max_episode_steps
        buffer.add(s, a, r, s_next, terminated)
        episode_return += r
        s = s_next
        if terminated or truncated:
            returns.append(episode_return)
            episode_return, t_episode = 0.0, 0
            s, _ = env.reset(options={"state": int(rng.choice(starts))} if cfg.exploring_starts else None)
        if step + 1 < cfg.learning_starts:
            continue
        batch = buffer.sample(cfg.batch_size)
        with torch.no_grad():
            y = q_targets(batch["rewards"], target(batch["next_states"]), batch["terminated"], gamma=cfg.gamma)
        loss = dqn_loss(q(batch["states"]), batch["actions"], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        updates += 1
        if updates % cfg.target_update_every == 0:
            target.load_state_dict(q.state_dict())
    with torch.no_grad():
        Q = q(torch.arange(n_s)).numpy().astype(float)
    return DQNResult(q_network=q, Q=Q, episode_returns=np.array(returns), losses=np.array(losses))
