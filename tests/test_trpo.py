"""TRPO's pieces against explicit linear algebra, and its exact tabular bound."""
import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

import rlcourse  # noqa: F401
from rlcourse import tabular
from rlcourse.classic import trpo
from rlcourse.envs import GridWorld


def small_policy_and_kl(seed=0, n_states=16, dim=3, n_actions=4):
    """A linear softmax policy on random observations, and its mean KL to a frozen copy of itself."""
    torch.manual_seed(seed)
    net = nn.Linear(dim, n_actions).double()
    obs = torch.randn(n_states, dim, dtype=torch.float64)
    with torch.no_grad():
        old = torch.log_softmax(net(obs), -1)

    def mean_kl():
        new = torch.log_softmax(net(obs), -1)
        return (old.exp() * (old - new)).sum(-1).mean()
    return net, obs, mean_kl


def fisher_from_scores(net, obs):
    """F = mean_s sum_a pi(a|s) grad log pi(a|s) grad log pi(a|s)^T, from per-sample gradients."""
    params = list(net.parameters())
    n = sum(p.numel() for p in params)
    F = torch.zeros(n, n, dtype=torch.float64)
    for s in range(obs.shape[0]):
        for a in range(net.out_features):
            logp = torch.log_softmax(net(obs[s]), -1)
            g = trpo.flat_grad(logp[a], params)
            F += logp[a].exp().detach() * torch.outer(g, g)
    return F / obs.shape[0]


def test_fisher_vector_product_matches_the_score_outer_product_fisher():
    net, obs, mean_kl = small_policy_and_kl()
    params = list(net.parameters())
    F = fisher_from_scores(net, obs)
    v = torch.randn(F.shape[0], dtype=torch.float64)
    torch.testing.assert_close(trpo.fisher_vector_product(mean_kl, params, v), F @ v)
    torch.testing.assert_close(trpo.fisher_vector_product(mean_kl, params, v, damping=0.1), F @ v + 0.1 * v)
    torch.testing.assert_close(trpo.fisher_matrix(mean_kl, params), F)


def test_conjugate_gradient_solves_the_damped_fisher_system():
    net, obs, mean_kl = small_policy_and_kl(seed=1)
    params = list(net.parameters())
    F = fisher_from_scores(net, obs) + 0.1 * torch.eye(16, dtype=torch.float64)
    g = torch.randn(16, dtype=torch.float64)
    x = trpo.conjugate_gradient(lambda v: trpo.fisher_vector_product(mean_kl, params, v, 0.1), g, iters=40, tol=1e-24)
    torch.testing.assert_close(x, torch.linalg.solve(F, g), atol=1e-7, rtol=1e-6)


def test_conjugate_gradient_finishes_in_n_steps_on_a_random_spd_matrix():
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    A, b = M @ M.T + 0.5 * torch.eye(6, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(trpo.conjugate_gradient(lambda v: A @ v, b, iters=6), torch.linalg.solve(A, b))
    assert not torch.allclose(trpo.conjugate_gradient(lambda v: A @ v, b, iters=2), torch.linalg.solve(A, b))


def test_natural_step_sits_on_the_quadratic_trust_region():
    A = torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=torch.float64)
    d = torch.tensor([1.0, -2.0], dtype=torch.float64)
    step = trpo.natural_step(d, A @ d, max_kl=0.01)
    assert float(0.5 * step @ A @ step) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="max_kl"):
        trpo.natural_step(d, A @ d, max_kl=0.0)


def test_line_search_accepts_only_safe_improving_steps_and_restores_otherwise():
    net, obs, mean_kl = small_policy_and_kl(seed=2)
    params = list(net.parameters())
    adv = torch.randn(obs.shape[0], dtype=torch.float64)
    actions = torch.randint(0, 4, (obs.shape[0],))
    with torch.no_grad():
        old_logp = torch.log_softmax(net(obs), -1).gather(-1, actions[:, None]).squeeze(-1)

    def surrogate():
        logp = torch.log_softmax(net(obs), -1).gather(-1, actions[:, None]).squeeze(-1)
        return (torch.exp(logp - old_logp) * adv).mean()
    g = trpo.flat_grad(surrogate(), params)
    before = trpo.flat_params(params)
    # a deliberately huge step along the gradient: it must be shrunk until KL <= delta
    res = trpo.backtracking_line_search(params, 100 * g, surrogate, mean_kl, max_kl=0.01)
    assert res.accepted and res.step_fraction < 1 and res.kl <= 0.01 and res.improvement > 0
    assert float(mean_kl().detach()) == pytest.approx(res.kl)
    trpo.set_flat_params(params, before)
    # a step *against* the gradient never improves the surrogate: rejected, parameters restored
    res = trpo.backtracking_line_search(params, -g, surrogate, mean_kl, max_kl=1.0)
    assert not res.accepted and torch.equal(trpo.flat_params(params), before)


def test_surrogate_is_first_order_exact_and_the_bound_holds():
    env = GridWorld("4x4", slip=0.1)
    mdp, gamma = env.mdp, 0.9
    rng = np.random.default_rng(0)
    theta = rng.normal(size=(mdp.n_states, mdp.n_actions))
    old = tabular.softmax_policy(theta)
    J_old = tabular.softmax_objective(mdp, theta, gamma)
    assert trpo.surrogate_tabular(mdp, old, old, gamma) == pytest.approx(J_old)
    # d/dtheta L_old(pi_theta) at theta_old is the exact policy gradient (other helper's oracle)
    grad_L = np.zeros_like(theta)
    h = 1e-6
    for idx in np.ndindex(theta.shape):
        e = np.zeros_like(theta)
        e[idx] = h
        grad_L[idx] = (trpo.surrogate_tabular(mdp, old, tabular.softmax_policy(theta + e), gamma)
                       - trpo.surrogate_tabular(mdp, old, tabular.softmax_policy(theta - e), gamma)) / (2 * h)
    np.testing.assert_allclose(grad_L, tabular.softmax_policy_gradient(mdp, theta, gamma), atol=1e-6)
    for scale in (0.01, 0.1, 1.0, 3.0):
        new_theta = theta + scale * rng.normal(size=theta.shape)
        J_new = tabular.softmax_objective(mdp, new_theta, gamma)
        assert J_new >= trpo.improvement_lower_bound(mdp, old, tabular.softmax_policy(new_theta), gamma) - 1e-9


def test_trpo_learns_cartpole():
    torch.set_num_threads(1)
    result = trpo.train_trpo(total_timesteps=16_384, num_envs=8, num_steps=128, max_kl=0.02, seed=0,
                             progress=False)
    assert sum(result.updates["accepted"]) >= 12
    assert result.episodes.last_mean_return(20) > 2 * np.mean(result.episodes.returns[:20])


def collected_batch(seed=0, hidden=4):
    """A CartPole rollout (2 envs x 64 steps, several episodes per row) and a small float64 agent."""
    from rlcourse.classic.actor_critic import ActorCritic, RolloutCollector, make_vector_env

    torch.manual_seed(seed)
    agent = ActorCritic(4, 2, hidden=hidden)
    with torch.no_grad():                          # a policy far from uniform: a real gradient
        agent.actor[-1].weight.mul_(100.0)
    rollout = RolloutCollector(make_vector_env("CartPole-v1", 2, seed), seed).collect(agent, 64, 0.99, 0.95)
    ends = rollout.dones.sum(0)
    assert (ends >= 1).all() and ends.sum() >= 3   # several episodes per row, cut mid-episode at the end
    batch = rollout.flat()
    return agent.double(), {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def test_policy_step_against_an_explicit_fisher_solve_and_an_independent_kl():
    """What the line search does not guarantee: the gradient, the CG direction and the accepted step
    against explicit per-sample linear algebra, and the reported KL and gain re-measured by a loop."""
    import copy

    agent, batch = collected_batch()
    old = copy.deepcopy(agent)
    params = list(old.actor.parameters())
    adv = batch["advantages"].numpy()
    a_norm = (adv - adv.mean()) / (adv.std() + 1e-8)
    n, damping, max_kl = len(adv), 0.1, 0.01
    # g = mean_i A_i grad log pi(a_i|s_i);  F = mean_i sum_a pi(a|s_i) grad log pi(a|s_i) grad log pi(a|s_i)^T
    g, F = 0.0, 0.0
    for i in range(n):
        logp = lambda a: torch.log_softmax(old.logits(batch["obs"][i]), -1)[a]  # noqa: E731
        scores = [trpo.flat_grad(logp(a), params) for a in range(2)]
        g = g + a_norm[i] * scores[int(batch["actions"][i])] / n
        F = F + sum(logp(a).exp().detach() * torch.outer(scores[a], scores[a]) for a in range(2)) / n
    F_damped = F + damping * torch.eye(len(g), dtype=torch.float64)
    x = torch.linalg.solve(F_damped, g)
    step = trpo.policy_step(agent, batch, max_kl=max_kl, cg_iters=200, damping=damping)
    # (the stored old log-probs are float32: the ratio at theta_old is 1 to ~1e-7)
    torch.testing.assert_close(step.gradient, g, atol=1e-8, rtol=1e-5)
    torch.testing.assert_close(step.direction, x, atol=1e-4 * float(x.norm()), rtol=1e-3)  # CG stops at |r|^2 <= 1e-10
    search = step.search
    assert search.accepted and search.tries >= 1
    moved = trpo.flat_params(agent.actor.parameters()) - trpo.flat_params(params)
    full = torch.sqrt(2 * max_kl / (x @ F_damped @ x)) * x
    torch.testing.assert_close(moved, search.step_fraction * full, atol=1e-4 * float(full.norm()), rtol=1e-3)
    with torch.no_grad():
        p_old = torch.softmax(old.logits(batch["obs"]), -1).numpy()
        p_new = torch.softmax(agent.logits(batch["obs"]), -1).numpy()
    kl = np.mean([sum(p * np.log(p / q) for p, q in zip(po, pn)) for po, pn in zip(p_old, p_new)])
    acts = batch["actions"].long().numpy()
    ratio = p_new[np.arange(n), acts] / p_old[np.arange(n), acts]
    assert search.kl == pytest.approx(kl, rel=1e-9)
    assert search.improvement == pytest.approx(np.mean(ratio * a_norm) - np.mean(a_norm), rel=1e-6)
    # the quadratic model: at a small accepted step the measured KL is close to 1/2 s^T F s
    quad = 0.5 * float(moved @ F @ moved)
    assert kl == pytest.approx(quad, rel=0.3)


class OneActionEnv(gym.Env):
    """One action only: log pi(a|s) = 0 for every parameter, so the policy gradient is exactly 0."""

    observation_space = gym.spaces.Box(-1, 1, shape=(2,))
    action_space = gym.spaces.Discrete(1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(2, self.t / 10, dtype=np.float32), 1.0, self.t >= 5, False, {}


if "rlcourse-test/OneAction-v0" not in gym.registry:
    gym.register("rlcourse-test/OneAction-v0", entry_point=OneActionEnv)


def test_a_zero_policy_gradient_skips_the_update_instead_of_crashing():
    # Before: natural_step raised "d^T F d must be > 0" from inside train_trpo.
    agent, batch = collected_batch(seed=1)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    before = trpo.flat_params(agent.parameters())
    step = trpo.policy_step(agent, batch, max_kl=0.01)
    assert float(step.gradient.abs().max()) == 0.0
    assert not step.search.accepted and step.search.tries == 0 and step.search.step_fraction == 0.0
    assert torch.equal(trpo.flat_params(agent.parameters()), before)
    result = trpo.train_trpo("rlcourse-test/OneAction-v0", total_timesteps=64, num_envs=2, num_steps=16,
                             progress=False)
    assert result.updates["accepted"] == [False, False] and result.updates["step_fraction"] == [0.0, 0.0]
    assert all(np.isfinite(result.updates["value_loss"]))     # the critic still learned


def test_trainer_arguments_are_validated():
    with pytest.raises(ValueError, match="max_kl"):
        trpo.train_trpo(total_timesteps=2048, max_kl=0.0, progress=False)
    with pytest.raises(ValueError, match="num_envs \\* num_steps"):
        trpo.train_trpo(total_timesteps=10, num_envs=1, num_steps=1, progress=False)
    with pytest.raises(ValueError, match="total_timesteps"):
        trpo.train_trpo(total_timesteps=100, progress=False)
