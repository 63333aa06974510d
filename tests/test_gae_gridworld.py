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


def test_bias_variance_trend_and_scores_against_a_per_visit_loop(setup):
    """bias2 and variance re-computed visit by visit in plain Python, and their sum against the
    directly measured squared error of the estimates (which holds only if the exact bias is right)."""
    env, policy = setup
    mdp, gamma = env.mdp, 0.9
    study = GAEStudy(env, policy, critic_noise=2.0, n_episodes=1000, max_steps=40)
    lambdas = [0.0, 0.5, 1.0]
    bv = study.bias_variance(lambdas, gamma)
    assert bv["bias2"][0] > bv["bias2"][1] > bv["bias2"][2] and bv["bias2"][2] < 1e-12
    assert bv["variance"][0] < bv["variance"][1] < bv["variance"][2]
    V, A = study.exact(gamma)
    ep = study.episodes
    visits = [(i, t) for i in range(ep["mask"].shape[0]) for t in range(ep["mask"].shape[1]) if ep["mask"][i, t]]
    for k, lam in enumerate(lambdas):
        est = study.estimates(lam, gamma)
        expected = expected_gae(mdp, policy, V + study.critic_error, gamma, lam)
        groups = {}
        for i, t in visits:
            groups.setdefault((int(ep["states"][i, t]), int(ep["actions"][i, t])), []).append(est[i, t])
        group_mean = {key: sum(xs) / len(xs) for key, xs in groups.items()}

        def centred_bias(s, a):  # b(s, a) minus its policy-weighted mean over the state's actions
            return (expected[s, a] - A[s, a]) - sum(policy[s, b] * (expected[s, b] - A[s, b])
                                                    for b in range(mdp.n_actions))

        bias2 = variance = direct = 0.0
        for i, t in visits:
            s, a = int(ep["states"][i, t]), int(ep["actions"][i, t])
            bias2 += centred_bias(s, a) ** 2 / len(visits)
            variance += (est[i, t] - group_mean[s, a]) ** 2 / len(visits)
            # the estimate's error w.r.t. the truth, up to the same state-only offset
            direct += (est[i, t] - A[s, a] - (expected[s, a] - A[s, a] - centred_bias(s, a))) ** 2 / len(visits)
        assert bv["bias2"][k] == pytest.approx(bias2, rel=1e-9, abs=1e-15)
        assert bv["variance"][k] == pytest.approx(variance, rel=1e-9)
        assert bv["mse"][k] == pytest.approx(direct, rel=0.05)


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
