"""Proximal policy optimisation (PPO-clip; Schulman et al., 2017) for discrete-action gymnasium envs.

Pseudocode::

    for each update (anneal the learning rate linearly to 0 over the budget):
        run num_envs envs for num_steps steps with pi_old                 (RolloutCollector)
        A_t <- GAE(gamma, lambda), bootstrapping truncated episodes       (returns.gae)
        for epoch in 1..update_epochs:
            for each shuffled minibatch:
                whiten A within the minibatch                                (returns.whiten)
                loss = -L^CLIP + vf_coef * L^V - ent_coef * H              (losses.ppo_clip_loss, ...)
                clip the gradient's global norm, take an Adam step
            stop the epochs early if approx KL > target_kl (optional)

Every formula comes from :mod:`rlcourse.returns`, :mod:`rlcourse.losses` and :mod:`rlcourse.kl`; this file only wires
them together, commenting each implementation detail where it happens (the "37 details" of
Huang et al., 2022, that matter on CartPole). The defaults are the CartPole-v1 settings of
rl-baselines3-zoo (8 envs x 32 steps, 20 epochs, gamma 0.98, lambda 0.8, lr 1e-3 annealed), which
solve it in about 100k steps instead of the 500k budget of CleanRL's generic defaults.

``loss_type="penalty"`` swaps the clipped loss for PPO-penalty: the unclipped surrogate minus
``beta * KL(pi_old || pi_theta)`` (exact per state), with beta halved or doubled after each update
by :func:`rlcourse.losses.adaptive_kl_beta` so the update's KL tracks ``kl_target``.

Advantage normalisation (``norm_adv``) is :func:`rlcourse.returns.whiten`: mean and *population*
standard deviation (``ddof=0``) of the minibatch, ``(A - mean) / (std + 1e-8)``, the convention of
every trainer in the course. (CleanRL's ``adv.std()`` uses ``ddof=1``; at 256 samples the two
differ by 0.2%, and ``ddof=1`` turns a one-sample minibatch into NaN.)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from rlcourse import kl, losses, returns
from rlcourse.classic.actor_critic import (ActorCritic, RolloutCollector, TrainResult, clip_gradients,
                                           make_vector_env, solved)
from rlcourse.runtime import close_progress, seed_everything


@dataclass
class PPOConfig:
    """PPO's settings, named as in CleanRL's ``ppo.py``."""

    env_id: str = "CartPole-v1"
    total_timesteps: int = 150_000  # rounded down to whole batches; at least one batch
    num_envs: int = 8
    num_steps: int = 32            # per env per rollout: a batch of num_envs * num_steps transitions
    learning_rate: float = 1e-3
    anneal_lr: bool = True         # linearly to 0 at total_timesteps
    gamma: float = 0.98
    gae_lambda: float = 0.8
    num_minibatches: int = 1
    update_epochs: int = 20
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = False
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    loss_type: str = "clip"        # "clip" (PPO-clip) or "penalty" (PPO-penalty, adaptive beta)
    kl_beta: float = 1.0           # PPO-penalty: the initial beta ...
    kl_target: float = 0.01        # ... adapted after each update towards this mean KL
    hidden: int = 64
    target_return: float | None = 475.0  # stop once the last `target_window` episodes average this
    target_window: int = 20
    seed: int = 0

    def __post_init__(self):
        for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "hidden"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        batch_size = self.num_envs * self.num_steps
        if batch_size % self.num_minibatches:
            raise ValueError(f"num_minibatches={self.num_minibatches} must divide the batch "
                             f"num_envs * num_steps = {batch_size}")
        if self.total_timesteps < batch_size:
            raise ValueError(f"total_timesteps={self.total_timesteps} is less than one batch "
                             f"(num_envs * num_steps = {batch_size}): PPO would not update at all")
        if self.norm_adv and batch_size // self.num_minibatches < 2:
            raise ValueError(f"num_minibatches={self.num_minibatches} leaves one transition per minibatch, "
                             f"and norm_adv=True cannot normalise a single advantage (its std is 0): "
                             f"use fewer minibatches or norm_adv=False")
        if not 0 <= self.gamma <= 1 or not 0 <= self.gae_lambda <= 1:
            raise ValueError(f"gamma and gae_lambda must be in [0, 1], got {self.gamma}, {self.gae_lambda}")
        if self.loss_type not in ("clip", "penalty"):
            raise ValueError(f"loss_type must be 'clip' or 'penalty', got {self.loss_type!r}")
        if self.learning_rate <= 0 or self.clip_coef < 0:
            raise ValueError(f"learning_rate must be > 0 and clip_coef >= 0, got "
                             f"{self.learning_rate}, {self.clip_coef}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm!r}")


DIAGNOSTICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "update_kl",
               "explained_variance", "learning_rate", "kl_beta", "step")


def train_ppo(config: PPOConfig | None = None, *, progress: bool = True, **overrides) -> TrainResult:
    """Train PPO-clip; returns the agent, every finished episode and per-update diagnostics.

    ``train_ppo(total_timesteps=50_000, seed=1)`` overrides fields of :class:`PPOConfig`.
    ``result.updates`` maps each name in :data:`DIAGNOSTICS` to one value per update (averaged
    over that update's minibatch steps); ``result.solved_at_step`` is the env step at which the
    mean return of the last ``target_window`` episodes first reached ``target_return``.
    """
    cfg = PPOConfig(**{**asdict(config or PPOConfig()), **overrides})
    from tqdm.auto import tqdm

    seed_everything(cfg.seed)
    envs = make_vector_env(cfg.env_id, cfg.num_envs, cfg.seed)
    agent = ActorCritic(envs.single_observation_space.shape[0], int(envs.single_action_space.n), cfg.hidden)
    # Adam's eps=1e-5 instead of 1e-8: CleanRL's (and baselines') choice, slightly steadier updates.
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5)
    collector = RolloutCollector(envs, cfg.seed)
    batch_size = cfg.num_envs * cfg.num_steps
    num_updates = cfg.total_timesteps // batch_size
    history = {k: [] for k in DIAGNOSTICS}
    generator = torch.Generator().manual_seed(cfg.seed)
    beta = cfg.kl_beta
    solved_at = None
    bar = tqdm(total=num_updates * batch_size, desc=f"PPO {cfg.env_id}", unit="step", disable=not progress)
    for update in range(num_updates):
        # Learning-rate annealing: the step size shrinks linearly to 0 at the end of the budget,
        # so late updates polish the policy instead of knocking it off its peak.
        lr = cfg.learning_rate * (1.0 - update / num_updates) if cfg.anneal_lr else cfg.learning_rate
        for group in opt.param_groups:
            group["lr"] = lr

        ro = collector.collect(agent, cfg.num_steps, cfg.gamma, cfg.gae_lambda)
        diag = ppo_update(agent, opt, ro.flat(), cfg, generator, kl_beta=beta)
        for key, value in diag.items():
            history[key].append(value)
        history["kl_beta"].append(beta)
        if cfg.loss_type == "penalty":  # PPO-penalty: adapt beta to the KL this update produced
            beta = losses.adaptive_kl_beta(beta, diag["update_kl"], cfg.kl_target)
        history["explained_variance"].append(explained_variance(ro.values, ro.returns))
        history["learning_rate"].append(lr)
        history["step"].append(collector.global_step)
        bar.update(batch_size)
        if collector.episodes.returns:
            bar.set_postfix(mean_return=f"{collector.episodes.last_mean_return(cfg.target_window):.0f}", refresh=False)
        if solved(collector.episodes, cfg.target_return, cfg.target_window):
            solved_at = collector.global_step
            break
    close_progress(bar)
    return collector.result(agent, history, solved_at)


def ppo_update(agent: ActorCritic, opt: torch.optim.Optimizer, batch: dict, cfg: PPOConfig,
               generator: torch.Generator | None = None, kl_beta: float | None = None) -> dict:
    """PPO's optimisation phase on one rollout: ``update_epochs`` passes of shuffled minibatches.

    ``batch`` is :meth:`Rollout.flat`'s dict (``obs``, ``actions``, ``logprobs``, ``values``,
    ``advantages``, ``returns``). Returns the diagnostics averaged over the minibatch steps taken,
    plus ``update_kl``: the exact mean KL(pi_old || pi_new) over the batch's states after the update.
    With ``cfg.loss_type == "penalty"`` the policy loss is PPO-penalty with coefficient ``kl_beta``.
    """
    for key in ("advantages", "returns", "logprobs", "values"):  # before any step, not mid-epoch
        if not torch.isfinite(batch[key]).all():
            raise ValueError(f"batch['{key}'] hold nan or inf: the update was not applied")
    with torch.no_grad():  # pi_old(.|s) for every state: the exact per-state KL of PPO-penalty
        old_log_dist = agent.log_distribution(batch["obs"])
    beta = cfg.kl_beta if kl_beta is None else kl_beta
    batch_size = batch["actions"].shape[0]
    minibatch_size = batch_size // cfg.num_minibatches
    sums = dict.fromkeys(("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"), 0.0)
    n_steps_taken = 0
    for epoch in range(cfg.update_epochs):
        # Minibatches: a fresh shuffle each epoch, every transition used once per epoch.
        order = torch.randperm(batch_size, generator=generator)
        for lo in range(0, batch_size, minibatch_size):
            idx = order[lo:lo + minibatch_size]
            logp, entropy = agent.logprob_entropy(batch["obs"][idx], batch["actions"][idx])
            adv = batch["advantages"][idx]
            if cfg.norm_adv:
                # Advantage normalisation per minibatch: zero mean, unit std. The scale of the
                # rewards then does not set the step size; the sign of each advantage is kept
                # relative to the minibatch mean.
                adv = returns.whiten(adv)
            if cfg.loss_type == "clip":
                policy_loss = losses.ppo_clip_loss(logp, batch["logprobs"][idx], adv, clip_coef=cfg.clip_coef)
            else:  # PPO-penalty: no clip; the KL to pi_old, exact per state, is the brake
                kl_to_old = kl.exact_kl(old_log_dist[idx], agent.log_distribution(batch["obs"][idx]))
                policy_loss = losses.ppo_penalty_loss(logp, batch["logprobs"][idx], adv, kl_to_old, beta)
            # The value loss, optionally clipped around the old values (baselines' detail).
            v_loss = losses.value_loss(agent.value(batch["obs"][idx]), batch["returns"][idx],
                                       old_values=batch["values"][idx],
                                       clip_coef=cfg.clip_coef if cfg.clip_vloss else None)
            # One loss for both networks: vf_coef weighs the critic, the entropy bonus keeps
            # exploring (ent_coef = 0 is fine on CartPole, whose reward is dense).
            loss = policy_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy.mean()
            opt.zero_grad()
            loss.backward()
            # Global gradient-norm clipping: one unlucky minibatch cannot take a giant step.
            clip_gradients(agent, cfg.max_grad_norm)
            opt.step()
            diag = losses.ppo_diagnostics(logp, batch["logprobs"][idx], mask=None, clip_coef=cfg.clip_coef)
            for key, val in (("policy_loss", policy_loss), ("value_loss", v_loss),
                             ("entropy", entropy.mean()), ("approx_kl", diag["approx_kl"]),
                             ("clip_fraction", diag["clip_fraction"])):
                sums[key] += float(val.detach()) if torch.is_tensor(val) else val
            n_steps_taken += 1
        # Early stopping on KL (optional): if this epoch moved the policy too far from pi_old,
        # the remaining epochs would optimise a surrogate that no longer describes it.
        if cfg.target_kl is not None and diag["approx_kl"] > cfg.target_kl:
            break
    out = {key: total / n_steps_taken for key, total in sums.items()}
    with torch.no_grad():
        out["update_kl"] = float(kl.exact_kl(old_log_dist, agent.log_distribution(batch["obs"])).mean())
    return out


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """``1 - Var(target - predicted) / Var(target)``: 1 for a perfect critic, 0 for a constant one."""
    var = float(target.var())
    return float("nan") if var == 0 else 1.0 - float((target - predicted).var()) / var


# ---------------------------------------------------------------------------------- the clip table (lesson 06)
def clip_table(ratios=(0.5, 1.0, 1.5), advantages=(-5.0, -1.0, 1.0, 5.0), clip_coef: float = 0.2):
    """``L^CLIP = min(r A, clip(r, 1-eps, 1+eps) A)`` on a grid, and which branch the min selects.

    Returns ``(values, branch)``, both of shape ``(len(advantages), len(ratios))``: the objective
    from :func:`rlcourse.losses.ppo_clip_objective`, and ``"clipped"`` where the clipped product is
    strictly smaller (the min picks it), ``"unclipped"`` where the plain ``r A`` is strictly
    smaller, ``"equal"`` where they coincide (r inside the clip range).
    """
    r = torch.tensor(ratios, dtype=torch.float64)[None, :].expand(len(advantages), -1)
    A = torch.tensor(advantages, dtype=torch.float64)[:, None].expand(-1, len(ratios))
    values = losses.ppo_clip_objective(r, A, clip_coef).numpy()
    unclipped = (r * A).numpy()
    clipped = (torch.clamp(r, 1 - clip_coef, 1 + clip_coef) * A).numpy()
    branch = np.where(clipped < unclipped, "clipped", np.where(unclipped < clipped, "unclipped", "equal"))
    return values, branch


# ---------------------------------------------------------------------------------- L^CLIP as a lower bound (lesson 06)
@torch.no_grad()
def surrogates_along_interpolation(agent_old: ActorCritic, agent_new: ActorCritic, batch: dict, alphas,
                                   clip_coef: float = 0.2) -> dict:
    """PPO's Figure 2: the surrogates along ``theta(alpha) = theta_old + alpha (theta_new - theta_old)``.

    For each alpha, on a batch collected by the old policy (normalised advantages ``A``):

    * ``cpi``: ``L^CPI = mean(r A)``, the conservative-policy-iteration surrogate (no clip);
    * ``clip``: ``L^CLIP = mean(min(r A, clip(r, 1 - eps, 1 + eps) A))``, never above ``cpi``;
    * ``kl``: ``mean_s KL(pi_old(.|s) || pi_alpha(.|s))``, exact per state.

    ``alpha = 0`` is the old policy, ``alpha = 1`` the new one. Returns arrays keyed as above.
    """
    import copy

    old_flat = torch.nn.utils.parameters_to_vector(agent_old.actor.parameters())
    new_flat = torch.nn.utils.parameters_to_vector(agent_new.actor.parameters())
    probe = copy.deepcopy(agent_old)
    adv = returns.whiten(batch["advantages"])
    old_dist = agent_old.log_distribution(batch["obs"])
    out = {"alpha": [], "cpi": [], "clip": [], "kl": []}
    for alpha in alphas:
        torch.nn.utils.vector_to_parameters(old_flat + float(alpha) * (new_flat - old_flat), probe.actor.parameters())
        logp, _ = probe.logprob_entropy(batch["obs"], batch["actions"])
        ratio = losses.importance_ratio(logp, batch["logprobs"])
        out["alpha"].append(float(alpha))
        out["cpi"].append(float((ratio * adv).mean()))
        out["clip"].append(float(losses.ppo_clip_objective(ratio, adv, clip_coef).mean()))
        out["kl"].append(float(kl.exact_kl(old_dist, probe.log_distribution(batch["obs"])).mean()))
    return {k: np.array(v) for k, v in out.items()}
