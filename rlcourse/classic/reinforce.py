"""REINFORCE for gymnasium environments with discrete actions.

Pseudocode (Williams, 1992; Spinning Up's "vanilla policy gradient" without a critic step size)::

    for each update:
        run the policy for `batch_episodes` complete episodes (side by side, in a vector env)
        Psi_t  <- R(tau) or the reward-to-go G_t, minus a baseline b      (losses.psi_*)
        theta  <- theta - lr * grad reinforce_loss(log pi(a_t|s_t), Psi)  (losses.reinforce_loss)
        if the baseline is learned: fit V(s_t) to G_t by a few MSE steps

Baselines (``baseline=``):

* ``"none"``           - ``b = 0``;
* ``"batch_mean"``     - ``b`` = the mean of Psi over this batch's steps. It includes each sample
                         itself, which shrinks the expected gradient by about ``1/n_steps``
                         (lesson 03) - harmless in practice;
* ``"moving_average"`` - ``b`` = an exponential moving average of earlier batches' means (so it is
                         independent of this batch: unbiased; 0 for the first batch);
* ``"value"``          - ``b = V_phi(s_t)``, a learned state value fitted to the reward-to-go
                         after each update (it is used *before* it sees this batch: unbiased).

The trainer is thin on purpose: every formula is imported from :mod:`rlcourse.returns` and
:mod:`rlcourse.losses`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch

import rlcourse  # noqa: F401  (registers rlcourse/GridWorld-v0)
from rlcourse import losses, returns
from rlcourse.classic.baselines import batch_mean_baseline, moving_average_baselines
from rlcourse.classic.policies import make_policy, make_value
from rlcourse.runtime import close_progress, seed_everything

PSI_KINDS = ("total_return", "reward_to_go")
BASELINES = ("none", "batch_mean", "moving_average", "value")


@dataclass
class ReinforceHistory:
    """What happened during training, ready to plot.

    Per episode (in the order they finished collecting): ``episode_returns`` (undiscounted sum of
    rewards) and ``episode_lengths``. Per update: ``loss``, ``baseline`` (mean b over the batch),
    ``grad_norm`` of the policy gradient, ``value_loss`` (learned baseline only, else NaN) and
    ``episodes`` (episodes seen so far).
    """

    episode_returns: list = field(default_factory=list)
    episode_lengths: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    baseline: list = field(default_factory=list)
    grad_norm: list = field(default_factory=list)
    value_loss: list = field(default_factory=list)
    episodes: list = field(default_factory=list)
    solved_at_episode: int | None = None
    seconds: float = 0.0

    def last_mean_return(self, window: int = 20) -> float:
        """Mean undiscounted return of the last ``window`` episodes."""
        if not self.episode_returns:
            raise ValueError("no episodes were recorded")
        return float(np.mean(self.episode_returns[-window:]))


@dataclass
class ReinforceResult:
    policy: torch.nn.Module
    value: torch.nn.Module | None
    history: ReinforceHistory


def collect_episodes(envs: gym.vector.VectorEnv, policy: torch.nn.Module, obs, max_steps: int,
                     device: torch.device | str = "cpu"):
    """Run every sub-env of ``envs`` until its current episode ends; return padded ``(K, T)`` tensors.

    Sub-envs that finish early keep stepping (a vector env steps all at once) but their steps are
    masked out: the vector env auto-resets them, and that next episode is not ours. Returns
    ``obs (K, T, ...)``, ``actions``, ``rewards``, ``mask`` (on ``device``) and the observation
    to continue from.
    """
    K = envs.num_envs
    alive = np.ones(K, dtype=bool)
    obs_list, act_list, rew_list, mask_list = [], [], [], []
    for _ in range(max_steps):
        obs_t = torch.as_tensor(obs, device=device)
        with torch.no_grad():  # acting needs no graph; log-probs are recomputed in one batch later
            probs = torch.softmax(policy(obs_t), dim=-1)
        actions = torch.multinomial(probs, 1).squeeze(-1)
        obs, reward, terminated, truncated, _ = envs.step(actions.cpu().numpy())
        obs_list.append(obs_t)
        act_list.append(actions)
        rew_list.append(torch.as_tensor(np.where(alive, reward, 0.0), dtype=torch.float32, device=device))
        mask_list.append(torch.as_tensor(alive, device=device))
        alive = alive & ~(terminated | truncated)
        if not alive.any():
            break
    stack = lambda xs: torch.stack(xs, dim=1)  # noqa: E731  (K, T, ...)
    return stack(obs_list), stack(act_list), stack(rew_list), stack(mask_list), obs


def make_envs(env_id: str, n_envs: int, env_kwargs: dict | None = None) -> gym.vector.VectorEnv:
    """``n_envs`` copies of ``env_id`` stepped together (CartPole has a NumPy-vectorised version)."""
    return gym.make_vec(env_id, num_envs=n_envs, **(env_kwargs or {}))


def train_reinforce(env_id: str = "CartPole-v1", *, episodes: int = 1000, batch_episodes: int = 8,
                    gamma: float = 0.99, psi: str = "reward_to_go", baseline: str = "none",
                    lr: float = 0.01, value_lr: float = 0.01, value_steps: int = 5,
                    ema_decay: float = 0.9, whiten: bool = False, time_discount: bool = False,
                    hidden: int = 64, max_steps: int = 1000, env_kwargs: dict | None = None,
                    target_return: float | None = None, target_window: int = 20,
                    seed: int = 0, progress: bool = True, on_update=None,
                    device: torch.device | str = "cpu") -> ReinforceResult:
    """Train a softmax policy with REINFORCE; stop after ``episodes`` episodes (or at ``target_return``).

    Args:
        env_id: a gymnasium id with discrete actions (``"CartPole-v1"``, ``"rlcourse/GridWorld-v0"``).
        episodes: the budget, in episodes (rounded up to whole batches).
        batch_episodes: episodes per update (they run side by side in a vector env).
        psi: ``"total_return"`` (R(tau) weighs every step) or ``"reward_to_go"``.
        baseline: one of :data:`BASELINES` (see the module docstring).
        lr, value_lr: Adam step sizes of the policy and of the learned baseline.
        value_steps: MSE steps on the value baseline per update.
        ema_decay: decay of the moving-average baseline.
        whiten: standardise Psi over the batch after the baseline (scale-free step sizes).
        time_discount: weigh step t by ``gamma^t`` (unbiased for the discounted objective; lesson 02).
        max_steps: cap on steps per episode on top of the env's own time limit.
        target_return: stop early once the mean return of the last ``target_window`` episodes
            reaches it (the "solved" criterion); ``history.solved_at_episode`` records when.
        progress: show a tqdm progress bar.
        on_update: called as ``on_update(policy, history)`` after every update (e.g. to record the
            exact J(theta) of a tabular policy).
        device: where the networks live. The CPU is the default because these networks are tiny
            and every step crosses to the environment on the CPU anyway; ``runtime.device()``
            picks an accelerator.
    """
    if psi not in PSI_KINDS:
        raise ValueError(f"psi must be one of {PSI_KINDS}, got {psi!r}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if episodes < 1 or batch_episodes < 1:
        raise ValueError(f"episodes and batch_episodes must be >= 1, got {episodes} and {batch_episodes}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if time_discount and psi == "total_return":
        raise ValueError("time_discount=True applies to psi='reward_to_go' only: R(tau) already "
                         "discounts every reward from time 0")
    if not 0.0 <= ema_decay < 1.0:
        raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay!r}")
    from tqdm.auto import tqdm

    seed_everything(seed)
    envs = make_envs(env_id, batch_episodes, env_kwargs)
    policy = make_policy(envs.single_observation_space, envs.single_action_space, hidden).to(device)
    value = make_value(envs.single_observation_space, hidden).to(device) if baseline == "value" else None
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    value_opt = torch.optim.Adam(value.parameters(), lr=value_lr) if value is not None else None
    batch_means = []  # the mean Psi of each past batch, for the moving-average baseline
    history = ReinforceHistory()
    start = time.perf_counter()
    obs, _ = envs.reset(seed=seed)
    bar = tqdm(total=episodes, desc=f"REINFORCE {env_id}", disable=not progress, unit="ep")
    while len(history.episode_returns) < episodes:
        obs_b, actions, rewards, mask, obs = collect_episodes(envs, policy, obs, max_steps, device)
        obs, _ = envs.reset()  # every sub-env starts a fresh episode for the next batch
        maskf = mask.float()

        # Psi: the weight of each step's score, built from the rewards (no gradient flows into it).
        G = returns.reward_to_go(rewards, gamma, mask=mask)
        weight = G if psi == "reward_to_go" else losses.psi_total_return(rewards, gamma, mask) * maskf
        if baseline == "none":
            b = torch.zeros((), device=device)
        elif baseline == "batch_mean":
            b = batch_mean_baseline(weight, mask)
        elif baseline == "moving_average":  # from earlier batches only (the appended 0 is unused)
            b = torch.tensor(float(moving_average_baselines(batch_means + [0.0], ema_decay)[-1]), device=device)
        else:
            with torch.no_grad():
                b = value(obs_b)
        psi_t = (weight - b) * returns.discount_weights(mask, gamma if time_discount else 1.0)
        if whiten:
            psi_t = returns.whiten(psi_t, mask)

        logp = torch.log_softmax(policy(obs_b), dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        loss = losses.reinforce_loss(logp, psi_t, mask)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in policy.parameters()))
        opt.step()

        value_loss = float("nan")
        if value is not None:  # fit V(s_t) to the reward-to-go *after* using it as this batch's baseline
            for _ in range(value_steps):
                v_loss = losses.value_loss(value(obs_b), G, mask=mask)  # 1/2 masked MSE to G_t
                value_opt.zero_grad()
                v_loss.backward()
                value_opt.step()
            value_loss = float(v_loss.detach())
        batch_means.append(float(batch_mean_baseline(weight, mask)))

        ep_returns = rewards.sum(1).tolist()
        history.episode_returns += ep_returns
        history.episode_lengths += mask.sum(1).tolist()
        history.loss.append(float(loss.detach()))
        history.baseline.append(float((torch.broadcast_to(b, mask.shape) * maskf).sum() / maskf.sum()))
        history.grad_norm.append(float(grad_norm))
        history.value_loss.append(value_loss)
        history.episodes.append(len(history.episode_returns))
        if on_update is not None:
            on_update(policy, history)
        bar.update(len(ep_returns))
        recent = history.last_mean_return(target_window)
        bar.set_postfix(mean_return=f"{recent:.1f}")
        if (target_return is not None and len(history.episode_returns) >= target_window
                and recent >= target_return):
            history.solved_at_episode = len(history.episode_returns)
            break
    close_progress(bar)
    envs.close()
    history.seconds = time.perf_counter() - start
    return ReinforceResult(policy=policy, value=value, history=history)
