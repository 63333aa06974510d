"""The exact J(theta) and grad J(theta) of a tabular softmax policy, against independent oracles."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
from rlcourse import tabular
from rlcourse.classic.gradient_estimates import sample_episodes, softmax_score_gradients
from rlcourse.envs import GridWorld
from rlcourse.returns import discount_weights, reward_to_go


def central_differences(f, theta, eps=1e-5):
    grad = np.zeros_like(theta)
    for idx in np.ndindex(theta.shape):
        step = np.zeros_like(theta)
        step[idx] = eps
        grad[idx] = (f(theta + step) - f(theta - step)) / (2 * eps)
    return grad


def random_terminating_mdp(rng, n_states=6, n_actions=3):
    """A random MDP whose last state is terminal and reachable from every state."""
    P = rng.dirichlet(np.ones(n_states), size=(n_states, n_actions))
    P[-1] = np.eye(n_states)[-1]
    terminal = np.zeros(n_states, bool)
    terminal[-1] = True
    start = rng.dirichlet(np.ones(n_states - 1))
    return tabular.TabularMDP(P=P, R=rng.normal(size=(n_states, n_actions)), terminal=terminal,
                              start=np.append(start, 0.0))


MDPS = {
    "maze2x3": GridWorld("maze2x3").mdp,
    "maze2x3 slippery with step cost": GridWorld("maze2x3", slip=0.2, step_reward=-1.0).mdp,
    "4x4 slippery": GridWorld("4x4", slip=0.1).mdp,
    "random": random_terminating_mdp(np.random.default_rng(0)),
}


@pytest.mark.parametrize("name", list(MDPS))
@pytest.mark.parametrize("gamma", [0.5, 0.9, 1.0])
def test_exact_gradient_matches_finite_differences(name, gamma):
    mdp = MDPS[name]
    rng = np.random.default_rng(1)
    theta = rng.normal(scale=1.0, size=(mdp.n_states, mdp.n_actions))
    fd = central_differences(lambda th: tabular.softmax_objective(mdp, th, gamma), theta)
    exact = tabular.softmax_policy_gradient(mdp, theta, gamma)
    auto = tabular.softmax_policy_gradient_autograd(mdp, theta, gamma)
    assert np.abs(exact - fd).max() <= 1e-6
    assert np.abs(auto - fd).max() <= 1e-6
    assert np.abs(exact - auto).max() <= 1e-10
    assert np.abs(fd).max() > 1e-3  # a non-trivial gradient, not 0 == 0
    assert np.all(exact[mdp.terminal] == 0)


def test_objective_is_start_value_and_matches_simulation():
    mdp = MDPS["maze2x3 slippery with step cost"]
    theta = np.random.default_rng(2).normal(size=(mdp.n_states, mdp.n_actions))
    J = tabular.softmax_objective(mdp, theta, 0.9)
    batch = sample_episodes(mdp, tabular.softmax_policy(theta), 40_000, np.random.default_rng(3))
    G0 = reward_to_go(batch.rewards, 0.9, mask=batch.mask)[:, 0]
    assert abs(G0.mean() - J) < 3 * G0.std() / np.sqrt(len(G0))


def test_discounted_visitation_is_the_power_series():
    mdp = MDPS["4x4 slippery"]
    policy = tabular.softmax_policy(np.random.default_rng(4).normal(size=(mdp.n_states, mdp.n_actions)))
    P_pi, _ = tabular.policy_dynamics(mdp, policy)
    gamma, d_sum, row = 0.9, np.zeros(mdp.n_states), mdp.start.copy()
    for _ in range(600):  # sum_t gamma^t mu^T P_pi^t, term by term
        d_sum += row
        row = gamma * row @ P_pi
    np.testing.assert_allclose(tabular.discounted_visitation(mdp, policy, gamma), d_sum, atol=1e-10)


def test_softmax_policy_rows_and_stability():
    pi = tabular.softmax_policy(np.array([[0.0, 0.0], [1000.0, 0.0]]))
    np.testing.assert_allclose(pi, [[0.5, 0.5], [1.0, 0.0]])
    with pytest.raises(ValueError, match="theta must have shape"):
        tabular.softmax_policy(np.zeros(3))
    with pytest.raises(ValueError, match=r"theta must have shape \(S, A\) = \(6, 4\)"):
        tabular.softmax_policy_gradient(MDPS["maze2x3"], np.zeros((6, 3)), 0.9)
    with pytest.raises(ValueError, match="gamma must be in"):
        tabular.softmax_policy_gradient(MDPS["maze2x3"], np.zeros((6, 4)), 1.5)


SLIPPERY = GridWorld("maze2x3", slip=0.2, step_reward=-1.0)


def per_episode_estimates(mdp, theta, gamma, n, seed, time_discount=True, baseline=None, realized=False):
    batch = sample_episodes(mdp, tabular.softmax_policy(theta), n, np.random.default_rng(seed),
                            reward_table=SLIPPERY.reward_table if realized else None)
    psi = reward_to_go(batch.rewards, gamma, mask=batch.mask)
    if baseline is not None:
        psi = psi - baseline[batch.states]
    if time_discount:
        psi = psi * discount_weights(batch.mask, gamma)
    return softmax_score_gradients(theta, batch, psi).reshape(n, -1)


def z_scores(g, exact, directions):
    """z-score of the sample mean of ``g @ u`` against ``exact @ u``, for each direction ``u``."""
    proj = g @ directions.T  # (N, n_directions): one scalar estimate per episode and direction
    se = proj.std(0, ddof=1) / np.sqrt(len(g))
    return (proj.mean(0) - exact @ directions.T) / se


def fixed_directions(exact, n_random=3, seed=7):
    """The exact gradient's own direction plus a few fixed random ones (each a scalar test)."""
    rng = np.random.default_rng(seed)
    return np.vstack([exact / np.linalg.norm(exact), rng.normal(size=(n_random, exact.size))])


@pytest.mark.parametrize("use_baseline, realized", [(False, False), (True, False), (False, True), (True, True)])
def test_mc_estimator_mean_within_3_standard_errors(use_baseline, realized):
    # gamma^t G_t grad log pi is an unbiased estimate of grad J for the *discounted* objective;
    # truncation at the 200-step horizon adds at most 0.9^200 * 10 / 0.1 ~ 7e-8 of bias.
    # "Within 3 standard errors" is a test of a scalar, so we test scalar projections of the
    # gradient (each a 99.7% interval), and every component at the Bonferroni-corrected level
    # (16 components at a family-wise 0.27%: |z| < 4.0): testing 16 components at 3 SE each would
    # fail about 4% of the time for a perfectly unbiased estimator.
    mdp, gamma = MDPS["maze2x3 slippery with step cost"], 0.9
    theta = np.random.default_rng(5).normal(scale=0.5, size=(mdp.n_states, mdp.n_actions))
    baseline = tabular.policy_evaluation(mdp, tabular.softmax_policy(theta), gamma) if use_baseline else None
    g = per_episode_estimates(mdp, theta, gamma, 20_000, seed=6, baseline=baseline, realized=realized)
    exact = tabular.softmax_policy_gradient(mdp, theta, gamma).ravel()
    assert np.abs(z_scores(g, exact, fixed_directions(exact))).max() < 3.0
    se = g.std(0, ddof=1) / np.sqrt(len(g))
    live = se > 0  # entries of terminal states are exactly 0 in both
    np.testing.assert_array_equal(exact[~live], 0.0)
    assert live.sum() == 16
    assert np.abs((g.mean(0) - exact)[live] / se[live]).max() < 4.0


def test_estimator_without_gamma_t_is_detectably_biased():
    # The same tests must *fail* for the common estimator that drops gamma^t: it is biased.
    mdp, gamma = MDPS["maze2x3 slippery with step cost"], 0.9
    theta = np.random.default_rng(5).normal(scale=0.5, size=(mdp.n_states, mdp.n_actions))
    g = per_episode_estimates(mdp, theta, gamma, 20_000, seed=6, time_discount=False)
    exact = tabular.softmax_policy_gradient(mdp, theta, gamma).ravel()
    assert np.abs(z_scores(g, exact, fixed_directions(exact))).max() > 10.0


def test_realized_rewards_are_the_environments():
    env = SLIPPERY
    batch = sample_episodes(env.mdp, tabular.uniform_policy(env.mdp), 300, np.random.default_rng(8),
                            reward_table=env.reward_table)
    real = batch.rewards[batch.mask]
    # every realized reward is one the env can pay (-1 per step, +9 into the goal, -11 into the trap)
    assert set(np.unique(real)) <= {-1.0, 9.0, -11.0} and {-1.0, 9.0, -11.0} & set(np.unique(real))
    # the last reward of an episode that ended in a terminal state is the goal's or the trap's
    ended = batch.mask.sum(1) < batch.mask.shape[1]
    last = batch.rewards[np.arange(len(batch)), batch.mask.sum(1) - 1]
    assert np.all(np.isin(last[ended], [9.0, -11.0]))
    with pytest.raises(ValueError, match="reward_table must have the shape of P"):
        sample_episodes(env.mdp, tabular.uniform_policy(env.mdp), 3, np.random.default_rng(0), reward_table=np.zeros(3))


def test_score_gradients_reject_a_theta_of_the_wrong_size():
    mdp = MDPS["maze2x3"]
    batch = sample_episodes(mdp, tabular.uniform_policy(mdp), 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="has no row or column"):
        softmax_score_gradients(np.zeros((2, 4)), batch, 1.0)
