import itertools

import gymnasium
import numpy as np
import pytest

import rlcourse  # noqa: F401
from rlcourse import tabular
from rlcourse.envs import GRIDWORLD_ID, GridWorld
from rlcourse.grading.classic.lesson01 import random_mdp


def small_mdp(seed=0, S=4, A=3):
    P, R = random_mdp(np.random.default_rng(seed), S, A)
    return tabular.TabularMDP(P=P, R=R, terminal=np.zeros(S, bool), start=np.full(S, 1 / S))


def brute_force_optimal_values(mdp, gamma):
    """V*(s) = max over all deterministic policies of V^pi(s): exhaustive enumeration."""
    best = np.full(mdp.n_states, -np.inf)
    for actions in itertools.product(range(mdp.n_actions), repeat=mdp.n_states):
        pi = tabular.deterministic_policy(actions, mdp.n_actions)
        best = np.maximum(best, tabular.policy_evaluation(mdp, pi, gamma))
    return best


def test_policy_evaluation_matches_iterated_backups():
    mdp = small_mdp()
    pi = np.random.default_rng(1).dirichlet(np.ones(3), size=4)
    V = np.zeros(4)
    for _ in range(3000):  # a 0.9-contraction: 0.9^3000 is far below 1e-12
        V = tabular.bellman_expectation_backup(mdp, V, pi, 0.9)
    assert np.allclose(tabular.policy_evaluation(mdp, pi, 0.9), V, atol=1e-10)


def test_policy_evaluation_two_state_closed_form():
    # One non-terminal state that pays 1 and stays with prob p, else ends: V = 1 / (1 - gamma p).
    p, gamma = 0.7, 0.9
    P = np.array([[[p, 1 - p]], [[0.0, 1.0]]])
    mdp = tabular.TabularMDP(P=P, R=np.array([[1.0], [0.0]]), terminal=np.array([False, True]),
                             start=np.array([1.0, 0.0]))
    V = tabular.policy_evaluation(mdp, np.ones((2, 1)), gamma)
    assert V == pytest.approx([1 / (1 - gamma * p), 0.0])


@pytest.mark.parametrize("layout, slip", [("maze2x3", 0.0), ("maze2x3", 0.3), ("4x4", 0.2)])
def test_policy_evaluation_matches_monte_carlo_rollouts_of_the_real_env(layout, slip):
    """Exact V^pi(start) agrees with the mean discounted return of episodes from env.step."""
    gamma = 0.9
    env = gymnasium.make(GRIDWORLD_ID, layout=layout, slip=slip).unwrapped
    pi = tabular.uniform_policy(env.mdp)
    V = tabular.policy_evaluation(env.mdp, pi, gamma)
    rng = np.random.default_rng(0)
    returns = []
    for i in range(3000):
        s, _ = env.reset(seed=i)
        G, discount = 0.0, 1.0
        for _ in range(300):
            s, r, terminated, _, _ = env.step(int(rng.integers(4)))
            G += discount * r
            discount *= gamma
            if terminated:
                break
        returns.append(G)
    se = np.std(returns) / np.sqrt(len(returns))
    assert abs(np.mean(returns) - V[env.state_of(0, 0)]) < 4 * se


@pytest.mark.parametrize("seed", range(3))
def test_value_and_policy_iteration_find_the_brute_force_optimum(seed):
    mdp = small_mdp(seed, S=4, A=3)
    V_star = brute_force_optimal_values(mdp, 0.9)
    vi = tabular.value_iteration(mdp, 0.9, tol=1e-12)
    pi = tabular.policy_iteration(mdp, 0.9)
    assert np.allclose(vi.V, V_star, atol=1e-9)
    assert np.allclose(pi.V, V_star, atol=1e-9)
    # the greedy policies are optimal, checked by exact evaluation
    assert np.allclose(tabular.policy_evaluation(mdp, vi.policy, 0.9), V_star, atol=1e-9)
    assert np.allclose(tabular.policy_evaluation(mdp, pi.policy, 0.9), V_star, atol=1e-9)


@pytest.mark.parametrize("layout, slip", [("maze2x3", 0.0), ("4x4", 0.0), ("4x4", 0.2)])
def test_gridworld_optimum_by_enumeration_and_gamma_one(layout, slip):
    env = GridWorld(layout, slip=slip, step_reward=-1.0)
    mdp = env.mdp
    if layout == "maze2x3":  # enumerate all 4^6 deterministic policies
        assert np.allclose(tabular.value_iteration(mdp, 0.95).V, brute_force_optimal_values(mdp, 0.95))
    # gamma = 1 is well defined because terminal states end the episode
    vi = tabular.value_iteration(mdp, 1.0)
    pi = tabular.policy_iteration(mdp, 1.0)
    assert np.allclose(vi.V, pi.V, atol=1e-6)
    if slip == 0 and layout == "maze2x3":
        # shortest safe route from the start is 3 steps: -1 -1 + (10 - 1)
        assert vi.V[env.state_of(0, 0)] == pytest.approx(7.0)


def test_policy_evaluation_rejects_nonterminating_policy_at_gamma_one():
    env = GridWorld("maze2x3")
    always_up = tabular.deterministic_policy(np.zeros(6, int), 4)
    with pytest.raises(ValueError, match="gamma"):
        tabular.policy_evaluation(env.mdp, always_up, 1.0)


def test_q_learning_update_is_pure_and_correct():
    Q = np.arange(6, dtype=float).reshape(3, 2)
    before = Q.copy()
    new = tabular.q_learning_update(Q, 0, 1, 1.0, 2, False, 0.5, 0.9)
    assert np.array_equal(Q, before)
    assert new[0, 1] == pytest.approx(1 + 0.5 * (1 + 0.9 * 5 - 1))
    assert np.array_equal(np.delete(new.ravel(), 1), np.delete(before.ravel(), 1))
    terminal = tabular.q_learning_update(Q, 0, 1, 1.0, 2, True, 0.5, 0.9)
    assert terminal[0, 1] == pytest.approx(1 + 0.5 * (1 - 1))


def test_q_learning_finds_an_optimal_greedy_policy_on_4x4():
    env = gymnasium.make(GRIDWORLD_ID, layout="4x4")
    result = tabular.q_learning(env, episodes=1500, alpha=0.5, gamma=0.9, epsilon=0.2, seed=0,
                                exploring_starts=True)
    mdp = env.unwrapped.mdp
    V_star = tabular.value_iteration(mdp, 0.9).V
    V_greedy = tabular.policy_evaluation(mdp, tabular.greedy_policy(result.Q), 0.9)
    assert np.allclose(V_greedy, V_star, atol=1e-8)
    assert result.episode_returns.shape == (1500,)


@pytest.mark.parametrize("bad, message", [
    (dict(P=np.ones((2, 1, 3)) / 3), "shape"),
    (dict(R=np.zeros((2, 2))), "R must have shape"),
    (dict(P=np.full((2, 1, 2), 0.7)), "probability distribution"),
    (dict(start=np.array([0.5, 0.2])), "start"),
])
def test_mdp_validation(bad, message):
    kwargs = dict(P=np.full((2, 1, 2), 0.5), R=np.zeros((2, 1)), terminal=np.zeros(2, bool),
                  start=np.array([1.0, 0.0]))
    kwargs.update(bad)
    with pytest.raises(ValueError, match=message):
        tabular.TabularMDP(**kwargs)


def test_bad_policy_and_gamma_are_named():
    mdp = small_mdp()
    with pytest.raises(ValueError, match="policy must have shape"):
        tabular.policy_evaluation(mdp, np.ones((2, 2)), 0.9)
    with pytest.raises(ValueError, match="gamma must be"):
        tabular.policy_evaluation(mdp, tabular.uniform_policy(mdp), 1.5)
