"""Trust region policy optimisation (TRPO; Schulman et al., 2015), piece by piece.

TRPO maximises the importance-sampled surrogate under a KL trust region:

    maximise_theta  L(theta) = E_{s,a ~ pi_old}[ pi_theta(a|s) / pi_old(a|s) * A(s, a) ]
    subject to      KL_bar(theta) = E_{s ~ pi_old}[ KL(pi_old(.|s) || pi_theta(.|s)) ] <= delta

Around theta_old, L is linear (gradient g) and KL_bar quadratic (its Hessian is the Fisher
matrix F), which gives the step

    x = F^{-1} g                        (conjugate gradient, using only products F v)
    step = sqrt(2 delta / (x^T F x)) x  (the largest step along x with 1/2 step^T F step = delta)

then a backtracking line search that halves the step until the *exact* sample KL is <= delta
and the surrogate has improved. Pseudocode of one update::

    collect a rollout, A_t <- GAE                       (actor_critic.RolloutCollector)
    whiten A                                            (returns.whiten)
    g <- grad L;  x <- conjugate_gradient(F v, g)       (fisher_vector_product)
    theta <- line_search(theta_old + natural step)      (backtracking_line_search)
    fit V_phi to the returns with a few Adam epochs

:func:`policy_step` is one such update of the policy. Where there is nothing to follow (a zero
policy gradient, e.g. every advantage equal, or one action only, so that CG returns ``x = 0``)
it skips the step, documented in its result (``accepted=False, tries=0``), instead of failing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlcourse import kl, losses, returns, tabular
from rlcourse.classic.actor_critic import ActorCritic, RolloutCollector, TrainResult, make_vector_env, solved
from rlcourse.runtime import close_progress, seed_everything


# ---------------------------------------------------------------------------------- flat parameters
def flat_params(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def set_flat_params(params, flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def flat_grad(y: torch.Tensor, params, create_graph: bool = False) -> torch.Tensor:
    grads = torch.autograd.grad(y, params, create_graph=create_graph, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


# ---------------------------------------------------------------------------------- the natural gradient
def fisher_vector_product(kl_fn, params, v: torch.Tensor, damping: float = 0.0) -> torch.Tensor:
    """``(F + damping I) v`` by double backpropagation, never forming ``F``.

    ``F = grad^2 KL_bar(theta)`` at ``theta = theta_old``: the Hessian of the mean KL between the
    old policy (held fixed) and the current one, which equals the Fisher information matrix
    ``E[grad log pi grad log pi^T]`` there. ``F v = grad( grad(KL_bar)^T v )``: two backward passes,
    O(parameters) memory. ``kl_fn()`` must return ``KL_bar`` with a graph to ``params``.
    """
    grad_kl = flat_grad(kl_fn(), params, create_graph=True)
    Fv = flat_grad((grad_kl * v.detach()).sum(), params)
    return Fv + damping * v


def fisher_matrix(kl_fn, params) -> torch.Tensor:
    """The explicit Fisher matrix (Hessian of ``kl_fn``), one FVP per basis vector: small models only."""
    n = sum(p.numel() for p in params)
    return torch.stack([fisher_vector_product(kl_fn, params, e) for e in torch.eye(n)], dim=1)


def conjugate_gradient(Avp, b: torch.Tensor, iters: int = 10, tol: float = 1e-10):
    """Solve ``A x = b`` for a symmetric positive-definite ``A`` given only ``v -> A v``.

    Each iteration makes the residual orthogonal to one more A-conjugate search direction; in
    exact arithmetic it finishes in ``n`` iterations, and 10 already give a good natural-gradient
    direction for networks with thousands of parameters. Starts from ``x = 0``; stops early
    when ``r^T r <= tol``. Returns ``x``.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    x = torch.zeros_like(b)
    r = b.clone()  # residual b - A x, with x = 0
    p = b.clone()  # search direction
    rr = r @ r
    for _ in range(iters):
        if rr <= tol:  # converged (tol = 0: only an exact zero residual stops early)
            break
        Ap = Avp(p)
        pAp = p @ Ap
        if pAp <= 0:  # A is not positive definite along p (or p vanished): no further progress
            break
        alpha = rr / pAp  # exact minimiser of the quadratic along p
        x = x + alpha * p
        r = r - alpha * Ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p  # the next direction, A-conjugate to the previous ones
        rr = rr_new
    return x


def natural_step(direction: torch.Tensor, Fd: torch.Tensor, max_kl: float) -> torch.Tensor:
    """Scale ``direction = F^{-1} g`` to the edge of the quadratic trust region.

    ``step = sqrt(2 delta / (d^T F d)) d``, so that the quadratic KL model ``1/2 step^T F step``
    equals ``delta = max_kl``. ``Fd`` is ``F d``.
    """
    if max_kl <= 0:
        raise ValueError(f"max_kl must be > 0, got {max_kl!r}")
    dFd = float(direction @ Fd)
    if not dFd > 0:
        raise ValueError(f"d^T F d must be > 0 for a trust-region step, got {dFd}")
    return direction * (2 * max_kl / dFd) ** 0.5


@dataclass
class LineSearchResult:
    accepted: bool
    step_fraction: float  # 1, 1/2, 1/4... of the full natural step; 0 if nothing was accepted
    kl: float             # the mean KL of the accepted step (NaN if none)
    improvement: float    # surrogate gain of the accepted step (NaN if none)
    tries: int


@torch.no_grad()
def backtracking_line_search(params, full_step: torch.Tensor, surrogate_fn, kl_fn, max_kl: float,
                             backtrack_coef: float = 0.5, max_backtracks: int = 10) -> LineSearchResult:
    """Try ``theta_old + f * full_step`` for ``f = 1, 1/2, 1/4, ...``; keep the first that is safe.

    A step is accepted only if the (exact, sample-based) mean KL is ``<= max_kl`` *and* the
    surrogate improved (``> 0`` gain): the quadratic model behind the natural step may be wrong
    far from theta_old. If no fraction works, the parameters are restored (a skipped update).
    """
    old = flat_params(params)
    base = float(surrogate_fn())
    for i in range(max_backtracks):
        frac = backtrack_coef ** i
        set_flat_params(params, old + frac * full_step)
        kl, gain = float(kl_fn()), float(surrogate_fn()) - base
        if kl <= max_kl and gain > 0:
            return LineSearchResult(True, frac, kl, gain, i + 1)
    set_flat_params(params, old)
    return LineSearchResult(False, 0.0, float("nan"), float("nan"), max_backtracks)


# ---------------------------------------------------------------------------------- one update of the policy
@dataclass
class PolicyStep:
    gradient: torch.Tensor      # g = grad L(theta) at theta_old
    direction: torch.Tensor     # x ~ (F + damping I)^{-1} g, by conjugate gradient
    search: LineSearchResult    # what the line search accepted (tries=0: skipped, nothing to follow)


def policy_step(agent: ActorCritic, batch: dict, max_kl: float, cg_iters: int = 10,
                damping: float = 0.1) -> PolicyStep:
    """One TRPO update of ``agent.actor`` on a rollout (:meth:`Rollout.flat`'s dict), in place.

    The surrogate is ``L(theta) = mean(ratio * A)`` with the whitened advantages, the constraint
    ``KL_bar(theta) = mean_s KL(pi_old(.|s) || pi_theta(.|s))``, exact per state
    (:func:`rlcourse.kl.exact_kl`). If CG finds no direction with ``x^T F x > 0`` (the gradient
    is zero, or below CG's tolerance) the parameters are left as they are and the result says
    ``accepted=False, tries=0``. A NaN or infinite gradient raises ``FloatingPointError``.
    """
    policy_params = list(agent.actor.parameters())
    obs, actions, old_logp = batch["obs"], batch["actions"], batch["logprobs"]
    adv = returns.whiten(batch["advantages"])
    with torch.no_grad():
        old_log_dist = agent.log_distribution(obs)

    def surrogate():  # L(theta) = mean(ratio * A): the unclipped surrogate of PPO-penalty
        logp, _ = agent.logprob_entropy(obs, actions)
        return (losses.importance_ratio(logp, old_logp) * adv).mean()

    def mean_kl():  # KL_bar(theta), with a graph to theta for the Fisher-vector products
        return kl.exact_kl(old_log_dist, agent.log_distribution(obs)).mean()

    g = flat_grad(surrogate(), policy_params)
    if not torch.isfinite(g).all():
        raise FloatingPointError("the policy gradient is NaN or infinite: the update was not applied")
    Fvp = lambda v: fisher_vector_product(mean_kl, policy_params, v, damping)  # noqa: E731
    direction = conjugate_gradient(Fvp, g, iters=cg_iters)
    Fd = Fvp(direction)
    if not float(direction @ Fd) > 0:  # nothing to follow: a flat surrogate (x = 0)
        return PolicyStep(g, direction, LineSearchResult(False, 0.0, float("nan"), float("nan"), 0))
    full_step = natural_step(direction, Fd, max_kl)
    return PolicyStep(g, direction, backtracking_line_search(policy_params, full_step, surrogate, mean_kl, max_kl))


# ---------------------------------------------------------------------------------- the trainer
def train_trpo(env_id: str = "CartPole-v1", *, total_timesteps: int = 50_000, num_envs: int = 8,
               num_steps: int = 128, max_kl: float = 0.01, cg_iters: int = 10, damping: float = 0.1,
               gamma: float = 0.99, gae_lambda: float = 0.95, value_lr: float = 1e-3,
               value_epochs: int = 5, value_minibatches: int = 4, hidden: int = 64,
               target_return: float | None = None, target_window: int = 20, seed: int = 0,
               progress: bool = True) -> TrainResult:
    """TRPO on a discrete-action env. ``updates`` holds, per update: ``kl`` (of the accepted step),
    ``step_fraction``, ``improvement``, ``accepted``, ``value_loss`` and ``step``.
    ``max_kl`` is the trust region's radius delta. An update whose policy gradient is zero is
    skipped (``accepted`` False, ``step_fraction`` 0; the critic still learns): see :func:`policy_step`.
    """
    if total_timesteps < num_envs * num_steps:
        raise ValueError(f"total_timesteps must cover one rollout ({num_envs * num_steps}), got {total_timesteps}")
    if num_envs * num_steps < 2:
        raise ValueError(f"num_envs * num_steps must be >= 2 (whitened advantages of a single "
                         f"transition are 0), got {num_envs} * {num_steps}")
    if not max_kl > 0 or damping < 0 or cg_iters < 1:
        raise ValueError(f"max_kl must be > 0, damping >= 0 and cg_iters >= 1, got "
                         f"max_kl={max_kl!r}, damping={damping!r}, cg_iters={cg_iters!r}")
    from tqdm.auto import tqdm

    seed_everything(seed)
    envs = make_vector_env(env_id, num_envs, seed)
    agent = ActorCritic(envs.single_observation_space.shape[0], int(envs.single_action_space.n), hidden)
    value_opt = torch.optim.Adam(agent.critic.parameters(), lr=value_lr)
    collector = RolloutCollector(envs, seed)
    updates = {k: [] for k in ("kl", "step_fraction", "improvement", "accepted", "value_loss", "step")}
    solved_at = None
    bar = tqdm(total=total_timesteps, desc=f"TRPO {env_id}", unit="step", disable=not progress)
    while collector.global_step + num_envs * num_steps <= total_timesteps:
        batch = collector.collect(agent, num_steps, gamma, gae_lambda).flat()
        result = policy_step(agent, batch, max_kl, cg_iters, damping).search

        # The critic: a few epochs of minibatch regression on the GAE returns.
        obs = batch["obs"]
        n = obs.shape[0]
        for _ in range(value_epochs):
            for idx in torch.randperm(n).chunk(value_minibatches):
                v_loss = losses.value_loss(agent.value(obs[idx]), batch["returns"][idx])
                value_opt.zero_grad()
                v_loss.backward()
                value_opt.step()
        for key, val in (("kl", result.kl), ("step_fraction", result.step_fraction),
                         ("improvement", result.improvement), ("accepted", result.accepted),
                         ("value_loss", float(v_loss.detach())), ("step", collector.global_step)):
            updates[key].append(val)
        bar.update(num_envs * num_steps)
        if solved(collector.episodes, target_return, target_window):
            solved_at = collector.global_step
            break
    close_progress(bar)
    return collector.result(agent, updates, solved_at)


# ---------------------------------------------------------------------------------- exact quantities (lesson 05)
def surrogate_tabular(mdp: tabular.TabularMDP, old_policy, new_policy, gamma: float) -> float:
    """Kakade and Langford's local approximation, exactly on a small MDP:

    ``L_old(new) = J(old) + sum_s rho_old(s) sum_a new(a|s) A_old(s, a)``

    with ``rho_old`` the discounted visitation of the *old* policy. The true value satisfies the
    same identity with ``rho_new``; using ``rho_old`` is what makes L computable from old samples.
    """
    J_old = float(mdp.start @ tabular.policy_evaluation(mdp, old_policy, gamma))
    rho = tabular.discounted_visitation(mdp, old_policy, gamma)
    return J_old + float(rho @ (np.asarray(new_policy) * tabular.advantages(mdp, old_policy, gamma)).sum(1))


def improvement_lower_bound(mdp: tabular.TabularMDP, old_policy, new_policy, gamma: float) -> float:
    """TRPO's Theorem 1: ``J(new) >= L_old(new) - C * max_s KL(old(.|s) || new(.|s))``,

    ``C = 4 eps gamma / (1 - gamma)^2`` and ``eps = max_{s,a} |A_old(s, a)|``. Returns the right side
    (non-terminal states only). Maximising it step by step can only improve J; it is very
    conservative, which is why TRPO replaces the penalty by a constraint KL <= delta.
    """
    if not 0 <= gamma < 1:
        raise ValueError(f"gamma must be in [0, 1) for the bound, got {gamma!r}")
    A = tabular.advantages(mdp, old_policy, gamma)
    eps = float(np.abs(A[~mdp.terminal]).max())
    old, new = np.asarray(old_policy, float), np.asarray(new_policy, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(old > 0, old * (np.log(old) - np.log(new)), 0.0).sum(1)
    C = 4 * eps * gamma / (1 - gamma) ** 2
    return surrogate_tabular(mdp, old_policy, new_policy, gamma) - C * float(kl[~mdp.terminal].max())
