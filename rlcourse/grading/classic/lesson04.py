"""Checks for lesson 04 (actor-critic and GAE): the TD residual, n-step returns, the GAE recursion.

The learner works on one row of a rollout: 1-D arrays of length T that may hold several episodes
one after another. ``terminated[t] = 1`` when ``s_{t+1}`` is terminal (no bootstrap), ``dones[t] = 1``
when step t ends its episode (terminated or truncated: nothing flows back across it), and
``next_values[t] = V(s_{t+1})`` (for a truncated step, the value of the real final observation).
The cases are built so that a loop run forwards, a missing done-mask, bootstrapping from a
terminal state and an off-by-one in the discount each give a wrong answer; they also hold integer
rewards, exact zeros (a zero residual, a zero value that is not terminal), several discounts, and
a long row where float32 drifts. Inputs are the caller's own arrays, compared after each call.
"""
from __future__ import annotations

import numpy as np

from rlcourse import returns, tabular
from rlcourse.grading._core import assert_close, call_unmutated, fail, passed, references

__all__ = ["check_td_residuals", "check_n_step_returns", "check_gae", "check_batch_td_critic"]


def _row(rng: np.random.Generator, T: int, ends: dict):
    """One row with episode ends at given steps: ``ends = {t: "terminated" | "truncated"}``."""
    rewards = np.round(rng.normal(size=T), 2)
    values = np.round(rng.normal(size=T), 2)
    next_values = np.append(values[1:], np.round(rng.normal(), 2))
    terminated, dones = np.zeros(T), np.zeros(T)
    for t, kind in ends.items():
        dones[t] = 1.0
        terminated[t] = float(kind == "terminated")
        next_values[t] = np.round(rng.normal(), 2)  # V of the final observation, not of the next episode's start
    return rewards, values, next_values, terminated, dones


def _cases(seed: int):
    rng = np.random.default_rng(seed)
    cases = [("one step, not terminated", *_row(rng, 1, {})),
             ("one step that terminates", *_row(rng, 1, {0: "terminated"})),
             ("a row with no episode end (bootstrap at the end)", *_row(rng, 5, {})),
             ("an episode that terminates mid-row, then a new one", *_row(rng, 6, {2: "terminated"})),
             ("an episode truncated mid-row (time limit), then a new one", *_row(rng, 6, {3: "truncated"})),
             ("several episode ends", *_row(rng, 9, {1: "terminated", 4: "truncated", 6: "terminated"}))]
    cases += [(f"random row #{i}", *_row(rng, 12, {int(t): ("terminated" if rng.random() < 0.5 else "truncated")
                                                   for t in rng.choice(12, size=3, replace=False)}))
              for i in range(4)]
    r, v, nv, term, done = _row(rng, 6, {3: "terminated"})
    r[1], v[1], nv[1] = 0.0, 0.0, 0.0            # a zero value that is not terminal, and a zero residual
    r[4], nv[4], v[4] = 1.0, 2.0, 1.0 + 2.0      # delta_4 = 0 exactly when gamma = 1
    cases.append(("exact zeros (a zero residual, a zero next value that is not terminal)", r, v, nv, term, done))
    r, v, nv, term, done = _row(rng, 5, {2: "terminated"})
    cases.append(("integer rewards and flags", np.round(r * 3).astype(int), v, nv, term.astype(int), done.astype(int)))
    return cases


def _long_row(seed: int):
    """2000 steps, one episode end: float32 arithmetic drifts visibly over such a row."""
    rng = np.random.default_rng(seed)
    return ("a long row (2000 steps)", *_row(rng, 2000, {1500: "terminated"}))


def _show(rewards, values, next_values, terminated, dones) -> str:
    return (f"rewards={rewards.tolist()}, values={values.tolist()}, next_values={next_values.tolist()}, "
            f"terminated={terminated.astype(int).tolist()}, dones={dones.astype(int).tolist()}")


@references("rlcourse.returns:td_residuals")
def check_td_residuals(fn) -> None:
    """``fn(rewards, values, next_values, terminated, gamma) -> delta`` (1-D arrays)."""
    __tracebackhide__ = True
    name = "check_td_residuals"
    n = 0
    for case, r, v, nv, term, done in _cases(40):
        for gamma in (0.9, 1.0, 0.5):
            got = call_unmutated(name, case, fn, r, v, nv, term, gamma)
            want = returns.td_residuals(r[None], v[None], gamma, next_values=nv[None], terminated=term[None])[0]
            assert_close(name, f"{case}, gamma={gamma}: {_show(r, v, nv, term, done)}", want, got,
                         hint="delta_t = r_t + gamma * (1 - terminated_t) * next_values[t] - values[t]; "
                              "a terminal next state is worth 0")
            n += 1
    passed(name, n)


@references("rlcourse.returns:n_step_returns")
def check_n_step_returns(fn) -> None:
    """``fn(rewards, next_values, terminated, dones, gamma, n) -> G`` (1-D arrays)."""
    __tracebackhide__ = True
    name = "check_n_step_returns"
    count = 0
    for j, (case, r, v, nv, term, done) in enumerate(_cases(41)):
        for n in (1, 2, 3, 20):
            gamma = (0.9, 0.5, 1.0)[(j + n) % 3]
            got = call_unmutated(name, case, fn, r, nv, term, done, gamma, n)
            want = returns.n_step_returns(r[None], v[None], gamma, n, next_values=nv[None],
                                          terminated=term[None], dones=done[None])[0]
            assert_close(name, f"{case}, n={n}, gamma={gamma}: {_show(r, v, nv, term, done)}", want, got,
                         hint="sum gamma^k r_{t+k} for k < m, where m = n or fewer if the episode (dones) or "
                              "the row ends first; then add gamma^m * (1 - terminated) * next_values at the "
                              "last step summed")
            count += 1
    passed(name, count)


@references("rlcourse.returns:gae", "rlcourse.returns:gae_from_n_step")
def check_gae(fn) -> None:
    """``fn(rewards, values, next_values, terminated, dones, gamma, lam) -> advantages`` (1-D arrays)."""
    __tracebackhide__ = True
    name = "check_gae"
    count = 0
    for case, r, v, nv, term, done in _cases(42) + [_long_row(43)]:
        settings = ((0.999, 0.99),) if len(r) > 100 else ((0.9, 0.0), (0.9, 0.95), (1.0, 1.0), (0.8, 0.5))
        for gamma, lam in settings:
            got = call_unmutated(name, case, fn, r, v, nv, term, done, gamma, lam)
            want = returns.gae(r[None].astype(float), v[None], gamma, lam, next_values=nv[None],
                               terminated=term[None], dones=done[None])[0]
            shown = _show(r, v, nv, term, done) if len(r) < 100 else "(too long to show)"
            assert_close(name, f"{case}, gamma={gamma}, lambda={lam}: {shown}", want, got, rtol=1e-9, atol=1e-9,
                         hint="run the loop backwards (A_t needs A_{t+1}): A_t = delta_t + gamma * lambda * "
                              "(1 - dones_t) * A_{t+1}, starting from 0 after the last step; in float64")
            count += 1
    passed(name, count)


def _transitions(seed: int, n: int):
    """``n`` transitions of the uniform random policy on the slippery maze, from random non-terminal states."""
    from rlcourse.envs import GridWorld

    env = GridWorld("maze2x3", slip=0.1)
    mdp, rng = env.mdp, np.random.default_rng(seed)
    states = rng.choice(np.flatnonzero(~mdp.terminal), size=n)
    actions = rng.integers(mdp.n_actions, size=n)
    cdf = mdp.P[states, actions].cumsum(1)
    next_states = np.minimum((rng.random(n)[:, None] > cdf).sum(1), mdp.n_states - 1)
    rewards = env.reward_table[states, actions, next_states]
    return mdp, states, rewards, next_states, mdp.terminal[next_states].astype(float)


def _batch_td_reference(V0, states, rewards, next_states, terminated, gamma, lr, sweeps):
    V = np.array(V0, dtype=float)
    counts = np.bincount(states, minlength=len(V))
    for _ in range(sweeps):
        delta = rewards + gamma * (1.0 - terminated) * V[next_states] - V[states]
        V = V + lr * np.bincount(states, weights=delta, minlength=len(V)) / np.maximum(counts, 1)
    return V


@references("rlcourse.tabular:policy_evaluation", "rlcourse.returns:td_residuals")
def check_batch_td_critic(fn) -> None:
    """``fn(V0, states, rewards, next_states, terminated, gamma, lr, sweeps) -> V``: train a critic by TD(0).

    The experiment: on a fixed batch of transitions, each sweep moves every state's value by ``lr``
    times the mean TD residual of the transitions that start there (states never seen keep their
    ``V0``). After the sweeps the critic must match that procedure and be close to the true
    values of the policy, computed exactly from the model.
    """
    __tracebackhide__ = True
    name = "check_batch_td_critic"
    n = 0
    for seed, gamma in ((0, 0.9), (1, 0.5)):
        mdp, states, rewards, next_states, terminated = _transitions(seed, 4000)
        V0 = np.random.default_rng(seed + 10).normal(size=mdp.n_states) * 3   # terminal states too: never bootstrap from them
        case = f"4000 transitions of a random policy on the slippery maze, gamma={gamma}, lr=0.5, 200 sweeps"
        got = call_unmutated(name, case, fn, V0, states, rewards, next_states, terminated, gamma, 0.5, 200)
        want = _batch_td_reference(V0, states, rewards, next_states, terminated, gamma, 0.5, 200)
        assert_close(name, case, want, got, atol=1e-6,
                     hint="each sweep: delta = rewards + gamma * (1 - terminated) * V[next_states] - V[states] "
                          "(use your td_residuals); V[s] += lr * mean of delta over the transitions starting in s "
                          "(np.bincount with weights); all states at once, from the V of the previous sweep")
        true_V = tabular.policy_evaluation(mdp, tabular.uniform_policy(mdp), gamma)
        live = ~mdp.terminal
        error = float(np.abs(to_float(got)[live] - true_V[live]).max())
        if not error < 0.5:
            fail(name, case, "a critic within 0.5 of the true values", f"max error {error:.3f}",
                 "more sweeps, or check the update")
        n += 1
    passed(name, n)


def to_float(x) -> np.ndarray:
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=float)
