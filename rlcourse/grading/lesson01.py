"""Checks for lesson 01 (the gridworld MDP)."""
from __future__ import annotations

import numpy as np

from rlcourse import returns, tabular
from rlcourse.grading._core import assert_close, call_unmutated, fail, passed

__all__ = ["check_discounted_return", "check_bellman_expectation_backup", "check_value_iteration",
           "check_q_learning_update", "check_greedy_policy"]


def random_mdp(rng: np.random.Generator, n_states: int = 5, n_actions: int = 3):
    """A random MDP with no terminal states: ``P (S,A,S)`` rows from a Dirichlet, ``R (S,A)`` normal."""
    P = rng.dirichlet(np.ones(n_states) * 0.5, size=(n_states, n_actions))
    R = rng.normal(size=(n_states, n_actions))
    return P, R


def _mdp(P, R) -> tabular.TabularMDP:
    n = P.shape[0]
    return tabular.TabularMDP(P=P, R=R, terminal=np.zeros(n, bool), start=np.full(n, 1 / n))


def check_discounted_return(fn) -> None:
    """``fn(rewards, gamma) -> float``: the discounted return ``sum_t gamma^t r_t``."""
    name = "check_discounted_return"
    rng = np.random.default_rng(1)
    cases = [("a single reward", np.array([5.0]), 0.9),
             ("gamma = 0 (only r_0 counts)", np.array([1.0, 2.0, 3.0]), 0.0),
             ("gamma = 1 (plain sum)", np.array([1.0, -2.0, 4.0]), 1.0),
             ("reward only at the end", np.array([0.0, 0.0, 0.0, 10.0]), 0.5),
             ("an empty episode", np.zeros(0), 0.9)]
    cases += [(f"random episode #{i}", rng.normal(size=rng.integers(2, 12)), float(rng.uniform(0.5, 0.99)))
              for i in range(5)]
    for case, rewards, gamma in cases:
        got = call_unmutated(name, case, fn, rewards, gamma)
        assert_close(name, f"{case} (rewards={np.round(rewards, 3).tolist()}, gamma={gamma:.3g})",
                     returns.discounted_return(rewards, gamma), got,
                     hint="the first reward is not discounted: G = r_0 + gamma*r_1 + gamma^2*r_2 + ...")
    passed(name, len(cases))


def check_bellman_expectation_backup(fn) -> None:
    """``fn(V, P, R, policy, gamma) -> V_new``: one sweep of ``V <- T^pi V``."""
    name = "check_bellman_expectation_backup"
    rng = np.random.default_rng(2)
    n_cases = 0
    for i, (S, A) in enumerate([(1, 1), (3, 2), (5, 4), (6, 3)]):
        P, R = random_mdp(rng, S, A)
        policy = rng.dirichlet(np.ones(A), size=S)
        V = rng.normal(size=S)
        for gamma in (0.0, 0.9):
            case = f"random MDP #{i} with S={S}, A={A}, gamma={gamma}"
            got = call_unmutated(name, case, fn, V, P, R, policy, gamma)
            assert_close(name, case, tabular.bellman_expectation_backup(_mdp(P, R), V, policy, gamma), got,
                         hint="V_new(s) = sum_a pi(a|s) * (R(s,a) + gamma * sum_s' P(s'|s,a) V(s')); "
                              "an expectation over actions is a weighted sum, not a max")
            n_cases += 1
    passed(name, n_cases)


def check_value_iteration(fn) -> None:
    """``fn(P, R, gamma, tol) -> V``: the optimal values ``V*`` by value iteration."""
    name = "check_value_iteration"
    rng = np.random.default_rng(3)
    n_cases = 0
    for i, (S, A, gamma) in enumerate([(1, 2, 0.5), (4, 2, 0.9), (6, 3, 0.95), (8, 4, 0.8)]):
        P, R = random_mdp(rng, S, A)
        case = f"random MDP #{i} with S={S}, A={A}, gamma={gamma}"
        got = call_unmutated(name, case, fn, P, R, gamma, 1e-10)
        expected = tabular.value_iteration(_mdp(P, R), gamma, tol=1e-12).V
        assert_close(name, case, expected, got, atol=1e-6,
                     hint="repeat V(s) <- max_a [R(s,a) + gamma * sum_s' P(s'|s,a) V(s')] until the "
                          "largest change is below tol (one sweep is not enough)")
        n_cases += 1
    passed(name, n_cases)


def check_q_learning_update(fn) -> None:
    """``fn(Q, s, a, r, s_next, terminated, alpha, gamma) -> Q_new`` (a copy; ``Q`` unchanged)."""
    name = "check_q_learning_update"
    rng = np.random.default_rng(4)
    n_cases = 0
    for i in range(6):
        Q = rng.normal(size=(5, 3))
        s, a, s_next = int(rng.integers(5)), int(rng.integers(3)), int(rng.integers(5))
        r, alpha, gamma = float(rng.normal()), float(rng.uniform(0.1, 0.9)), 0.9
        for terminated in (False, True):
            case = (f"random case #{i}: s={s}, a={a}, r={r:.3f}, s_next={s_next}, "
                    f"terminated={terminated}, alpha={alpha:.2f}")
            got = call_unmutated(name, case, fn, Q, s, a, r, s_next, terminated, alpha, gamma)
            expected = tabular.q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)
            hint = ("target = r + gamma * max_a' Q(s_next, a'), and just r when terminated; "
                    "then Q(s,a) += alpha * (target - Q(s,a)), changing only that one entry")
            assert_close(name, case, expected, got, hint=hint)
            n_cases += 1
    passed(name, n_cases)


def check_greedy_policy(fn) -> None:
    """``fn(Q) -> actions``: for each state, an action with the largest Q-value."""
    name = "check_greedy_policy"
    rng = np.random.default_rng(5)
    cases = [("one state", np.array([[0.0, 2.0, 1.0]])),
             ("negative values", -rng.uniform(1, 5, size=(4, 3))),
             ("ties (any best action is fine)", np.array([[1.0, 1.0, 0.0], [0.0, 3.0, 3.0]]))]
    cases += [(f"random Q #{i}", rng.normal(size=(6, 4))) for i in range(4)]
    for case, Q in cases:
        got = call_unmutated(name, case, fn, Q)
        actions = to_int_actions(got)
        if actions is None or actions.shape != (Q.shape[0],):
            fail(name, case, f"{Q.shape[0]} action indices", got,
                 "return one integer action per state (row of Q), e.g. with argmax over axis=1")
        picked = Q[np.arange(Q.shape[0]), np.clip(actions, 0, Q.shape[1] - 1)]
        if (actions < 0).any() or (actions >= Q.shape[1]).any() or not np.allclose(picked, Q.max(1)):
            fail(name, f"{case}, Q=\n{np.round(Q, 3)}", Q.argmax(1), actions,
                 "the greedy action maximises Q(s, a) over a (axis=1), not over states")
    passed(name, len(cases))


def to_int_actions(x):
    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(arr == np.round(arr)):
            return None
    return arr.astype(int)
