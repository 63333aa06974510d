"""Actor-critic: a policy (the actor) trained with advantages that a learned value (the critic) supplies.

This module also holds what PPO and TRPO share with it: the two-network agent, and the rollout
collector that runs a vectorised gymnasium env for a fixed number of steps and scores every step
with GAE, bootstrapping correctly where an episode was *truncated* by a time limit.

Pseudocode of the synchronous advantage actor-critic (A2C; Mnih et al., 2016)::

    for each update:
        run n_envs envs for n_steps steps                       (collect_rollout)
        A_t <- GAE(gamma, lambda) from r_t and V_phi(s_t)          (returns.gae)
        policy loss = -mean( log pi(a_t|s_t) A_t )                (losses.reinforce_loss)
        value loss  = 1/2 mean( (V_phi(s_t) - (A_t + V_old(s_t)))^2 )   (losses.value_loss)
        one gradient step on  policy loss + vf_coef * value loss - ent_coef * entropy
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import rlcourse  # noqa: F401  (registers the course's envs)
from rlcourse import kl, losses, returns
from rlcourse.classic.policies import mlp
from rlcourse.runtime import close_progress, seed_everything


class ActorCritic(nn.Module):
    """Two separate MLPs on a flat observation: action logits (actor) and ``V(s)`` (critic).

    Separate networks (no shared trunk) keep the value loss from disturbing the policy's features,
    as in CleanRL's CartPole agent. The actor's last layer starts tiny (std 0.01) so that the first
    policy is nearly uniform; the critic's starts at std 1.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()
        self.actor = mlp(obs_dim, n_actions, hidden, out_std=0.01)
        self.critic = mlp(obs_dim, 1, hidden, out_std=1.0)

    def _cast(self, obs: torch.Tensor) -> torch.Tensor:
        # observations arrive as float32 (or float64 from NumPy); match the parameters' dtype
        return obs.to(next(self.parameters()).dtype)

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self._cast(obs))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self._cast(obs)).squeeze(-1)

    def log_distribution(self, obs: torch.Tensor) -> torch.Tensor:
        """``log pi(.|s)`` over all actions, shape ``(..., n_actions)``: what exact KL and entropy take."""
        return torch.log_softmax(self.logits(obs), dim=-1)

    def logprob_entropy(self, obs: torch.Tensor, actions: torch.Tensor):
        """``log pi(a|s)`` of the given actions and the entropy of ``pi(.|s)``, with grad.

        The entropy is :func:`rlcourse.kl.entropy`, which counts ``0 log 0 = 0``: an action masked
        with a ``-inf`` logit contributes nothing (``p log p`` typed out here would give NaN).
        """
        logp_all = self.log_distribution(obs)
        logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return logp, kl.entropy(logp_all)


def make_vector_env(env_id: str, num_envs: int, seed: int, env_kwargs: dict | None = None) -> gym.vector.VectorEnv:
    """``num_envs`` copies stepped together, resetting *in the same step* an episode ends.

    ``SAME_STEP`` autoreset returns the first observation of the next episode at once and puts
    the real last observation in ``info["final_obs"]``; we need it to bootstrap truncated episodes.
    (Gymnasium's default, ``NEXT_STEP``, instead spends one extra step per episode on the reset.)
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                        **(env_kwargs or {}))
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        raise ValueError(f"{env_id} must have discrete actions, got {envs.single_action_space}")
    if not (isinstance(envs.single_observation_space, gym.spaces.Box)
            and len(envs.single_observation_space.shape) == 1):
        raise ValueError(f"{env_id} must have a flat Box observation, got {envs.single_observation_space}")
    envs.action_space.seed(seed)
    return envs


@dataclass
class Rollout:
    """``num_steps x num_envs`` transitions, flattened to ``(B,)`` for minibatching by :meth:`flat`."""

    obs: torch.Tensor         # (T, N, obs_dim)
    actions: torch.Tensor     # (T, N)
    logprobs: torch.Tensor    # (T, N) log pi_old(a_t|s_t) at collection time
    values: torch.Tensor      # (T, N) V_old(s_t)
    advantages: torch.Tensor  # (T, N) GAE
    returns: torch.Tensor     # (T, N) the critic's targets A_t + V_old(s_t)
    rewards: torch.Tensor     # (T, N)
    terminated: torch.Tensor  # (T, N) 1 where s_{t+1} is terminal
    dones: torch.Tensor       # (T, N) 1 where the episode ended (terminated or truncated)

    def flat(self) -> dict:
        return {k: v.reshape(-1, *v.shape[2:]) for k, v in self.__dict__.items()}


@dataclass
class EpisodeLog:
    """Undiscounted return, length and the env step count at the end of every finished episode."""

    returns: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    def last_mean_return(self, window: int = 20) -> float:
        if not self.returns:
            raise ValueError("no episode has finished yet")
        return float(np.mean(self.returns[-window:]))


class RolloutCollector:
    """Keeps a vector env running across updates and turns each stretch of it into a :class:`Rollout`."""

    def __init__(self, envs: gym.vector.VectorEnv, seed: int):
        self.envs = envs
        self.obs, _ = envs.reset(seed=seed)
        self.running_return = np.zeros(envs.num_envs)
        self.running_length = np.zeros(envs.num_envs, dtype=int)
        self.global_step = 0
        self.episodes = EpisodeLog()
        self.start = time.perf_counter()

    @torch.no_grad()
    def collect(self, agent: ActorCritic, num_steps: int, gamma: float, gae_lambda: float) -> Rollout:
        T, N = num_steps, self.envs.num_envs
        obs = torch.zeros((T, N) + self.envs.single_observation_space.shape)
        actions, logprobs, values, rewards, terminated, dones, next_values = (torch.zeros(T, N) for _ in range(7))
        for t in range(T):
            obs[t] = torch.as_tensor(self.obs, dtype=torch.float32)
            logits = agent.logits(obs[t])
            a = torch.distributions.Categorical(logits=logits).sample()
            actions[t] = a
            logprobs[t] = torch.log_softmax(logits, -1).gather(-1, a[:, None]).squeeze(-1)
            values[t] = agent.value(obs[t])
            self.obs, r, term, trunc, info = self.envs.step(a.numpy())
            rewards[t] = torch.as_tensor(r, dtype=torch.float32)
            terminated[t] = torch.as_tensor(term, dtype=torch.float32)
            done = term | trunc
            dones[t] = torch.as_tensor(done, dtype=torch.float32)
            # Truncation bootstrapping: a time limit is not a terminal state. The value after a
            # truncated step is V(final observation), not V(the next episode's first observation)
            # that self.obs now holds, and not 0 as for a real termination.
            if trunc.any():
                final = torch.as_tensor(np.stack(info["final_obs"][trunc]), dtype=torch.float32)
                next_values[t, torch.as_tensor(trunc)] = agent.value(final)
            self._log_episodes(r, done)
        # V(s_{t+1}) of every step: the next row's value, except where the episode ended (set above
        # for truncations; irrelevant for terminations, which gae multiplies by 1 - terminated).
        last_value = agent.value(torch.as_tensor(self.obs, dtype=torch.float32))
        following = torch.cat([values[1:], last_value[None]], dim=0)
        next_values = torch.where(dones.bool(), next_values, following)
        # returns.gae works on (rows, time): transpose the (T, N) buffers to (N, T) and back.
        adv = returns.gae(rewards.T, values.T, gamma, gae_lambda, next_values=next_values.T,
                          terminated=terminated.T, dones=dones.T).T
        return Rollout(obs=obs, actions=actions, logprobs=logprobs, values=values, advantages=adv,
                       returns=adv + values, rewards=rewards, terminated=terminated, dones=dones)

    def result(self, agent: ActorCritic, updates: dict, solved_at: int | None) -> "TrainResult":
        """Close the envs and package what the run produced (every trainer ends here)."""
        self.envs.close()
        return TrainResult(agent=agent, episodes=self.episodes, updates=updates,
                           env_steps=self.global_step, solved_at_step=solved_at,
                           seconds=time.perf_counter() - self.start)

    def _log_episodes(self, rewards, done):
        self.global_step += self.envs.num_envs
        self.running_return += rewards
        self.running_length += 1
        for i in np.flatnonzero(done):
            self.episodes.returns.append(float(self.running_return[i]))
            self.episodes.lengths.append(int(self.running_length[i]))
            self.episodes.steps.append(self.global_step)
        self.running_return[done] = 0.0
        self.running_length[done] = 0


@dataclass
class TrainResult:
    """The trained agent, its episodes, per-update diagnostics and when it was solved."""

    agent: ActorCritic
    episodes: EpisodeLog
    updates: dict
    env_steps: int
    solved_at_step: int | None
    seconds: float


def solved(episodes: EpisodeLog, target_return: float | None, window: int) -> bool:
    """True once ``window`` episodes have finished and their mean return reaches ``target_return``."""
    return (target_return is not None and len(episodes.returns) >= window
            and episodes.last_mean_return(window) >= target_return)


def clip_gradients(agent: nn.Module, max_grad_norm: float) -> float:
    """Clip the gradient's global norm to ``max_grad_norm`` (one unlucky batch cannot take a giant
    step); raise instead of stepping if any gradient is NaN or infinite, so that a broken batch
    never turns the parameters into NaN silently. Returns the norm before clipping."""
    try:
        return float(nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm, error_if_nonfinite=True))
    except RuntimeError as err:
        raise FloatingPointError(f"non-finite gradient: the update was not applied ({err})") from None


def train_actor_critic(env_id: str = "CartPole-v1", *, total_timesteps: int = 100_000, num_envs: int = 8,
                       num_steps: int = 16, learning_rate: float = 1e-3, gamma: float = 0.99,
                       gae_lambda: float = 0.95, vf_coef: float = 0.5, ent_coef: float = 0.01,
                       max_grad_norm: float = 0.5, norm_adv: bool = False, hidden: int = 64,
                       target_return: float | None = None, target_window: int = 20, seed: int = 0,
                       env_kwargs: dict | None = None, progress: bool = True) -> TrainResult:
    """A2C with GAE: one gradient step per rollout of ``num_envs * num_steps`` transitions.

    Stops after ``total_timesteps`` env steps, or as soon as the mean return of the last
    ``target_window`` episodes reaches ``target_return`` (``solved_at_step`` records when).
    ``updates`` holds per-update lists: ``policy_loss``, ``value_loss``, ``entropy``, ``step``.
    """
    if total_timesteps < num_envs * num_steps:
        raise ValueError(f"total_timesteps must cover one rollout ({num_envs * num_steps}), got {total_timesteps}")
    if norm_adv and num_envs * num_steps < 2:
        raise ValueError("norm_adv=True needs at least 2 transitions per rollout (num_envs * num_steps): "
                         "one advantage normalised by its own std is always 0")
    if not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
    from tqdm.auto import tqdm

    seed_everything(seed)
    envs = make_vector_env(env_id, num_envs, seed, env_kwargs)
    agent = ActorCritic(envs.single_observation_space.shape[0], int(envs.single_action_space.n), hidden)
    opt = torch.optim.Adam(agent.parameters(), lr=learning_rate)
    collector = RolloutCollector(envs, seed)
    updates = {"policy_loss": [], "value_loss": [], "entropy": [], "step": []}
    solved_at = None
    bar = tqdm(total=total_timesteps, desc=f"A2C {env_id}", unit="step", disable=not progress)
    while collector.global_step + num_envs * num_steps <= total_timesteps:
        ro = collector.collect(agent, num_steps, gamma, gae_lambda)
        adv = returns.whiten(ro.advantages) if norm_adv else ro.advantages
        logp, entropy = agent.logprob_entropy(ro.obs, ro.actions)
        # the mean over all T*N steps: reinforce_loss sums over time and averages over rows
        policy_loss = losses.reinforce_loss(logp.T, adv.T) / num_steps
        v_loss = losses.value_loss(agent.value(ro.obs), ro.returns)
        loss = policy_loss + vf_coef * v_loss - ent_coef * entropy.mean()
        opt.zero_grad()
        loss.backward()
        clip_gradients(agent, max_grad_norm)
        opt.step()
        for key, val in (("policy_loss", policy_loss), ("value_loss", v_loss), ("entropy", entropy.mean())):
            updates[key].append(float(val.detach()))
        updates["step"].append(collector.global_step)
        bar.update(num_envs * num_steps)
        if solved(collector.episodes, target_return, target_window):
            solved_at = collector.global_step
            break
    close_progress(bar)
    return collector.result(agent, updates, solved_at)
