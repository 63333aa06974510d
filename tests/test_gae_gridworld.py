"""The GAE study of lesson 04: exact expected GAE against sampled means, and its limiting cases."""
import numpy as np
import pytest

import rlcourse  # noqa: F401
from rlcourse import tabular
from rlcourse.classic.gae_gridworld import GAEStudy, expected_gae, sample_episodes
from rlcourse.envs import GridWorld


@pytest.fixture(scope="module")
def setup():
    env = GridWorld("4x4", slip=0.1)
    policy = 0.6 * tabular.value_iteration(env.mdp, 0.9).policy + 0.4 * tabular.uniform_policy(env.mdp)
    return env, policy


def test_sampled_episodes_follow_the_mdp(setup):
    env, policy = setup
    ep = sample_episodes(env, policy, 4000, 60, np.random.default_rng(0))
    gamma = 0.9
    returns = (ep["rewards"] * gamma ** np.arange(60)[None, :]).sum(1)
    exact = env.start_distribution @ tabular.policy_evaluation(env.mdp, policy, gamma)
    assert abs(returns.mean() - exact) < 4 * returns.std() / np.sqrt(len(returns))
    # padding after termination carries nothing
    after = np.cumsum(ep["terminated"], axis=1) - ep["terminated"] > 0
    assert np.all(ep["mask"][after] == 0) and np.all(ep["rewards"][after] == 0)


@pytest.mark.parametrize("lam", [0.0, 0.6, 1.0])
def test_expected_gae_matches_the_sample_mean(setup, lam):
    env, policy = setup
    study = GAEStudy(env, policy, critic_noise=2.0, n_episodes=6000, max_steps=80, seed=1)
    V, _ = study.exact(0.9)
    want = expected_gae(env.mdp, policy, V + study.critic_error, 0.9, lam)
    est = study.estimates(lam, 0.9)
    ep = study.episodes
    s, a = ep["states"][:, 0], ep["actions"][:, 0]  # first steps: independent samples
    for key in set(zip(s.tolist(), a.tolist())):
        pick = (s == key[0]) & (a == key[1])
        if pick.sum() < 300:
            continue
        x = est[pick, 0]
        assert abs(x.mean() - want[key]) < 5 * x.std() / np.sqrt(len(x)) + 1e-9, (key, x.mean(), want[key])


def test_exact_critic_gives_zero_bias_and_lambda_one_gives_a_state_only_bias(setup):
    env, policy = setup
    mdp, gamma = env.mdp, 0.9
    V = tabular.policy_evaluation(mdp, policy, gamma)
    A = tabular.advantages(mdp, policy, gamma)
    alive = ~mdp.terminal
    for lam in (0.0, 0.5, 1.0):
        np.testing.assert_allclose(expected_gae(mdp, policy, V, gamma, lam)[alive], A[alive], atol=1e-10)
    e = np.where(alive, np.random.default_rng(0).normal(size=mdp.n_states), 0.0)
    bias = expected_gae(mdp, policy, V + e, gamma, 1.0) - A
    np.testing.assert_allclose(bias[alive], -np.repeat(e[alive, None], mdp.n_actions, 1), atol=1e-10)


def test_bias_variance_trend(setup):
    env, policy = setup
    bv = GAEStudy(env, policy, critic_noise=2.0, n_episodes=1000, max_steps=40).bias_variance([0.0, 0.5, 1.0], 0.9)
    assert bv["bias2"][0] > bv["bias2"][1] > bv["bias2"][2] and bv["bias2"][2] < 1e-12
    assert bv["variance"][0] < bv["variance"][1] < bv["variance"][2]
    np.testing.assert_allclose(bv["mse"], bv["bias2"] + bv["variance"])


def test_expected_n_step_limits_and_sample_mean(setup):
    from rlcourse.classic.gae_gridworld import expected_n_step

    env, policy = setup
    mdp, gamma = env.mdp, 0.9
    study = GAEStudy(env, policy, critic_noise=2.0, n_episodes=6000, max_steps=80, seed=2)
    V, _ = study.exact(gamma)
    V_hat = V + study.critic_error
    np.testing.assert_allclose(expected_n_step(mdp, policy, V_hat, gamma, 1), expected_gae(mdp, policy, V_hat, gamma, 0.0))
    np.testing.assert_allclose(expected_n_step(mdp, policy, V_hat, gamma, 400), expected_gae(mdp, policy, V_hat, gamma, 1.0),
                               atol=1e-8)
    ep = study.episodes
    from rlcourse import returns
    est = returns.n_step_returns(ep["rewards"], V_hat[ep["states"]], gamma, 3, next_values=V_hat[ep["next_states"]],
                                 terminated=ep["terminated"], dones=ep["dones"], mask=ep["mask"]) - V_hat[ep["states"]]
    want = expected_n_step(mdp, policy, V_hat, gamma, 3)
    s, a = ep["states"][:, 0], ep["actions"][:, 0]
    for key in set(zip(s.tolist(), a.tolist())):
        pick = (s == key[0]) & (a == key[1])
        if pick.sum() >= 300:
            x = est[pick, 0]
            assert abs(x.mean() - want[key]) < 5 * x.std() / np.sqrt(len(x)) + 1e-9
    bv = study.n_step_bias_variance([1, 3, 40], gamma)
    assert bv["bias2"][0] > bv["bias2"][1] > bv["bias2"][2] and bv["variance"][0] < bv["variance"][2]
