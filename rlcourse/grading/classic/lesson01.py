"""Checks for lesson 01 (the gridworld MDP).

Besides seeded random cases, each check probes what a plausible wrong answer gets wrong: integer
inputs (``np.zeros_like`` of an int array truncates every update), long episodes where float32
drifts, several discounts (never one gamma everywhere), a transition back into the same state
(``s_next == s``), and inputs written in place (the caller's own arrays are compared with a copy).
"""
from __future__ import annotations

import numpy as np

from rlcourse import returns, tabular
from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed, references

__all__ = ["check_discounted_return", "check_bellman_expectation_backup", "check_value_iteration",
           "check_q_learning_update", "check_greedy_policy", "check_q_learning_run"]


def random_mdp(rng: np.random.Generator, n_states: int = 5, n_actions: int = 3):
    """A random MDP with no terminal states: ``P (S,A,S)`` rows from a Dirichlet, ``R (S,A)`` normal."""
    P = rng.dirichlet(np.ones(n_states) * 0.5, size=(n_states, n_actions))
    R = rng.normal(size=(n_states, n_actions))
    return P, R


def _mdp(P, R) -> tabular.TabularMDP:
    n = P.shape[0]
    return tabular.TabularMDP(P=P, R=np.asarray(R, float), terminal=np.zeros(n, bool), start=np.full(n, 1 / n))


@references("rlcourse.returns:discounted_return", "rlcourse.returns:reward_to_go",
            "rlcourse.losses.policy_gradient:psi_total_return")
def check_discounted_return(fn) -> None:
    """``fn(rewards, gamma) -> float``: the discounted return ``sum_t gamma^t r_t``."""
    __tracebackhide__ = True
    name = "check_discounted_return"
    rng = np.random.default_rng(1)
    cases = [("a single reward", np.array([5.0]), 0.9),
             ("gamma = 0 (only r_0 counts)", np.array([1.0, 2.0, 3.0]), 0.0),
             ("gamma = 1 (plain sum)", np.array([1.0, -2.0, 4.0]), 1.0),
             ("reward only at the end", np.array([0.0, 0.0, 0.0, 10.0]), 0.5),
             ("an empty episode", np.zeros(0), 0.9),
             ("integer rewards", np.array([1, 0, 2, 1]), 0.5),
             ("a long episode (3000 steps, gamma = 0.999)", rng.normal(size=3000) + 1.0, 0.999)]
    cases += [(f"random episode #{i}", rng.normal(size=rng.integers(2, 12)), float(rng.uniform(0.5, 0.99)))
              for i in range(5)]
    for case, rewards, gamma in cases:
        label = f"{case} (rewards={np.round(rewards[:8], 3).tolist()}{'...' if len(rewards) > 8 else ''}, gamma={gamma:.4g})"
        got = call_unmutated(name, label, fn, rewards, gamma)
        want = returns.discounted_return(rewards, gamma)
        fail_if_mistake(name, label, want, got, gamma * want,
                        "that is gamma * G: every reward discounted once too often (gamma^(t+1) r_t); "
                        "the first reward counts in full, G = sum_{t=0}^{T-1} gamma^t r_t")
        assert_close(name, label, want, got, rtol=1e-9, atol=1e-9,
                     hint="the first reward is not discounted: G = r_0 + gamma*r_1 + gamma^2*r_2 + ...; "
                          "compute in float64 (float32 drifts on long episodes)")
    passed(name, len(cases))


@references("rlcourse.tabular:bellman_expectation_backup", "rlcourse.tabular:action_values")
def check_bellman_expectation_backup(fn) -> None:
    """``fn(V, P, R, policy, gamma) -> V_new``: one sweep of ``V <- T^pi V``."""
    __tracebackhide__ = True
    name = "check_bellman_expectation_backup"
    rng = np.random.default_rng(2)
    n_cases = 0
    for i, (S, A) in enumerate([(1, 1), (3, 2), (5, 4), (6, 3)]):
        P, R = random_mdp(rng, S, A)
        if i == 1:
            P = np.zeros((S, A, S))
            P[np.arange(S), :, np.arange(S)] = 1.0    # every action stays put: s' = s
        policy = rng.dirichlet(np.ones(A), size=S)
        V = rng.normal(size=S)
        if i == 3:
            R = np.round(R * 3).astype(int)           # integer rewards
        for gamma in (0.0, 0.5, 0.9, 0.99):
            case = f"random MDP #{i} with S={S}, A={A}, gamma={gamma}" + (" (s' = s)" if i == 1 else "") + \
                   (" (integer rewards)" if i == 3 else "")
            got = call_unmutated(name, case, fn, V, P, R, policy, gamma)
            assert_close(name, case, tabular.bellman_expectation_backup(_mdp(P, R), V, policy, gamma), got,
                         hint="V_new(s) = sum_a pi(a|s) * (R(s,a) + gamma * sum_s' P(s'|s,a) V(s')); "
                              "an expectation over actions is a weighted sum, not a max")
            n_cases += 1
    passed(name, n_cases)


@references("rlcourse.tabular:value_iteration", "rlcourse.tabular:bellman_optimality_backup",
            "rlcourse.tabular:policy_iteration")
def check_value_iteration(fn) -> None:
    """``fn(P, R, gamma, tol) -> V``: the optimal values ``V*`` by value iteration."""
    __tracebackhide__ = True
    name = "check_value_iteration"
    rng = np.random.default_rng(3)
    n_cases = 0
    for i, (S, A, gamma) in enumerate([(1, 2, 0.5), (4, 2, 0.9), (6, 3, 0.95), (8, 4, 0.8), (5, 3, 0.7)]):
        P, R = random_mdp(rng, S, A)
        if i == 4:
            R = np.round(R * 4).astype(int)
        case = f"random MDP #{i} with S={S}, A={A}, gamma={gamma}" + (" (integer rewards)" if i == 4 else "")
        got = call_unmutated(name, case, fn, P, R, gamma, 1e-10)
        expected = tabular.value_iteration(_mdp(P, R), gamma, tol=1e-12).V
        assert_close(name, case, expected, got, atol=1e-6,
                     hint="repeat V(s) <- max_a [R(s,a) + gamma * sum_s' P(s'|s,a) V(s')] until the "
                          "largest change is below tol (one sweep is not enough); keep V in floats")
        n_cases += 1
    # gamma = 0.999: a reward of 1 forever is worth 1000, and after k sweeps from V = 0 value
    # iteration holds (1 - 0.999^k) * 1000: 632 after 1000 sweeps, 99.995% only after ~10^4.
    # A fixed number of sweeps passes the cases above and fails here; iterate until the change < tol.
    P = np.zeros((2, 2, 2))
    P[0, 0, 0] = P[0, 1, 1] = P[1, :, 1] = 1.0        # state 1 is absorbing and pays 1 per step
    R = np.array([[0.0, 0.5], [1.0, 1.0]])
    case = "a slow chain with gamma=0.999 (V*(1) = 1/(1 - gamma) = 1000)"
    got = call_unmutated(name, case, fn, P, R, 0.999, 1e-10)
    expected = tabular.value_iteration(_mdp(P, R), 0.999, tol=1e-12).V
    assert_close(name, case, expected, got, atol=1e-5, rtol=1e-8,
                 hint="with gamma close to 1 the values converge slowly (the error shrinks by gamma per "
                      "sweep): stop when the largest change is below tol, not after a fixed number of sweeps")
    passed(name, n_cases + 1)


@references("rlcourse.tabular:q_learning_update")
def check_q_learning_update(fn) -> None:
    """``fn(Q, s, a, r, s_next, terminated, alpha, gamma) -> Q_new`` (a copy; ``Q`` unchanged)."""
    __tracebackhide__ = True
    name = "check_q_learning_update"
    rng = np.random.default_rng(4)
    n_cases = 0
    hint = ("target = r + gamma * max_a' Q(s_next, a'), and just r when terminated; "
            "then Q(s,a) += alpha * (target - Q(s,a)), changing only that one entry of a float copy")
    for i in range(8):
        Q = rng.normal(size=(5, 3))
        s, a, s_next = int(rng.integers(5)), int(rng.integers(3)), int(rng.integers(5))
        r, alpha, gamma = float(rng.normal()), float(rng.uniform(0.1, 0.9)), [0.9, 0.5, 0.99, 0.0][i % 4]
        what = ""
        if i == 5:
            s_next, Q[s, a] = s, Q[s].max() + 1.0   # a self-loop whose own entry is the max
            what = " (s_next = s)"
        if i == 6:
            Q, r = np.zeros((5, 3), dtype=int), 1     # a table initialised with integers
            what = " (an integer table)"
        for terminated in (False, True):
            case = (f"random case #{i}{what}: s={s}, a={a}, r={r:.3f}, s_next={s_next}, "
                    f"terminated={terminated}, alpha={alpha:.2f}, gamma={gamma}")
            got = call_unmutated(name, case, fn, Q, s, a, r, s_next, terminated, alpha, gamma)
            expected = tabular.q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)
            assert_close(name, case, expected, got, hint=hint)
            n_cases += 1
    passed(name, n_cases)


@references("rlcourse.tabular:greedy_policy")
def check_greedy_policy(fn) -> None:
    """``fn(Q) -> actions``: for each state, an action with the largest Q-value."""
    __tracebackhide__ = True
    name = "check_greedy_policy"
    rng = np.random.default_rng(5)
    cases = [("one state", np.array([[0.0, 2.0, 1.0]])),
             ("negative values", -rng.uniform(1, 5, size=(4, 3))),
             ("ties (any best action is fine)", np.array([[1.0, 1.0, 0.0], [0.0, 3.0, 3.0]])),
             ("an integer table", rng.integers(-5, 5, size=(4, 3))),
             ("huge magnitudes", rng.normal(size=(3, 4)) * 1e300)]
    cases += [(f"random Q #{i}", rng.normal(size=(6, 4))) for i in range(4)]
    for case, Q in cases:
        got = call_unmutated(name, case, fn, Q)
        actions = to_int_actions(got)
        if actions is None or actions.shape != (Q.shape[0],):
            fail(name, case, f"{Q.shape[0]} action indices", got,
                 "return one integer action per state (row of Q), e.g. with argmax over axis=1")
        picked = Q[np.arange(Q.shape[0]), np.clip(actions, 0, Q.shape[1] - 1)]
        if (actions < 0).any() or (actions >= Q.shape[1]).any() or not np.array_equal(picked, Q.max(1)):
            fail(name, f"{case}, Q=\n{Q}", Q.argmax(1), actions,
                 "the greedy action maximises Q(s, a) over a (axis=1), not over states")
    passed(name, len(cases))


def to_int_actions(x):
    __tracebackhide__ = True
    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f" or not np.all(arr == np.round(arr)):
            return None
    return arr.astype(int)


@references("rlcourse.tabular:q_learning")
def check_q_learning_run(fn) -> None:
    """``fn(env, episodes, alpha, gamma, epsilon, seed) -> Q``: Q-learning finds an optimal policy.

    The experiment: on the lesson's maze, ``episodes`` episodes of epsilon-greedy Q-learning must
    leave a table whose greedy action is optimal (by value iteration on the exact model) in every
    non-terminal state, at two seeds and two discounts.
    """
    __tracebackhide__ = True
    from rlcourse.envs import GridWorld

    name = "check_q_learning_run"
    n, tables = 1, {}
    tables[0.9, 0] = _q_learning_reproducible(name, fn, GridWorld)
    for gamma in (0.9, 0.5):
        for seed in (0, 1):
            env = GridWorld("maze2x3")
            case = f"the maze2x3 gridworld, 300 episodes, alpha=0.5, gamma={gamma}, epsilon=0.2, seed={seed}"
            Q = fn(env, 300, 0.5, gamma, 0.2, seed)
            if Q is None or np.shape(Q) != (env.observation_space.n, env.action_space.n):
                fail(name, case, f"a Q table of shape {(env.observation_space.n, env.action_space.n)}",
                     None if Q is None else f"shape {np.shape(Q)}", "return the learned table Q")
            Q = np.asarray(Q, dtype=float)
            mdp = env.mdp
            V = tabular.value_iteration(mdp, gamma, tol=1e-12).V
            Q_star = tabular.action_values(mdp, V, gamma)
            states = np.flatnonzero(~mdp.terminal)
            greedy = Q[states].argmax(1)
            wrong = states[Q_star[states, greedy] < Q_star[states].max(1) - 1e-9]
            if len(wrong):
                fail(name, case, "an optimal greedy action in every non-terminal state",
                     f"suboptimal actions in states {wrong.tolist()}; Q=\n{np.round(Q, 2)}",
                     "each episode: reset, then until terminated or 100 steps: with probability epsilon a "
                     "random action, else argmax Q[s]; step; Q = q_learning_update(...) with gamma; s = s_next")
            tables[gamma, seed] = Q
            n += 1
    if np.array_equal(tables[0.9, 0], tables[0.9, 1]):
        fail(name, "gamma=0.9, seeds 0 and 1", "two different tables", np.round(tables[0.9, 1], 3),
             "seed the generator with the `seed` argument, not a constant: another seed must explore differently")
    passed(name, n + 1)


def _q_learning_reproducible(name, fn, GridWorld) -> np.ndarray:
    """Same seed twice: the same table (no unseeded draws); judged before convergence, which an
    unseeded run may miss by chance. Returns the table of gamma=0.9, seed=0."""
    __tracebackhide__ = True
    first, again = (np.asarray(fn(GridWorld("maze2x3"), 300, 0.5, 0.9, 0.2, 0), dtype=float) for _ in range(2))
    if not np.array_equal(first, again):
        fail(name, "gamma=0.9, seed=0 run twice", np.round(first, 3), np.round(again, 3),
             "draw every random choice from np.random.default_rng(seed) and reset the env with seed=seed: "
             "the global RNG gives another table at every call")
    return first
