"""TRPO's pieces against explicit linear algebra, and its exact tabular bound."""
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


def test_trpo_keeps_every_accepted_step_inside_the_trust_region_and_learns():
    torch.set_num_threads(1)
    result = trpo.train_trpo(total_timesteps=16_384, num_envs=8, num_steps=128, max_kl=0.02, seed=0,
                             progress=False)
    kls = np.array([k for k, ok in zip(result.updates["kl"], result.updates["accepted"]) if ok])
    assert len(kls) >= 12 and np.all(kls <= 0.02)
    assert result.episodes.last_mean_return(20) > 2 * np.mean(result.episodes.returns[:20])
