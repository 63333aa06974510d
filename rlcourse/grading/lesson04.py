"""Checks for lesson 04 (actor-critic and GAE): the TD residual, n-step returns, the GAE recursion.

The learner works on one row of a rollout: 1-D arrays of length T that may hold several episodes
one after another. ``terminated[t] = 1`` when ``s_{t+1}`` is terminal (no bootstrap), ``dones[t] = 1``
when step t ends its episode (terminated or truncated: nothing flows back across it), and
``next_values[t] = V(s_{t+1})`` (for a truncated step, the value of the real final observation).
The cases are built so that a loop run forwards, a missing done-mask, bootstrapping from a
terminal state and an off-by-one in the discount each give a wrong answer.
"""
from __future__ import annotations

import numpy as np

from rlcourse import returns
from rlcourse.grading._core import assert_close, call_unmutated, passed

__all__ = ["check_td_residuals", "check_n_step_returns", "check_gae"]


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
    return cases


def _show(rewards, values, next_values, terminated, dones) -> str:
    return (f"rewards={rewards.tolist()}, values={values.tolist()}, next_values={next_values.tolist()}, "
            f"terminated={terminated.astype(int).tolist()}, dones={dones.astype(int).tolist()}")


def check_td_residuals(fn) -> None:
    """``fn(rewards, values, next_values, terminated, gamma) -> delta`` (1-D arrays)."""
    name = "check_td_residuals"
    n = 0
    for case, r, v, nv, term, done in _cases(40):
        for gamma in (0.9, 1.0):
            got = call_unmutated(name, case, fn, r, v, nv, term, gamma)
            want = returns.td_residuals(r[None], v[None], gamma, next_values=nv[None], terminated=term[None])[0]
            assert_close(name, f"{case}, gamma={gamma}: {_show(r, v, nv, term, done)}", want, got,
                         hint="delta_t = r_t + gamma * (1 - terminated_t) * next_values[t] - values[t]; "
                              "a terminal next state is worth 0")
            n += 1
    passed(name, n)


def check_n_step_returns(fn) -> None:
    """``fn(rewards, next_values, terminated, dones, gamma, n) -> G`` (1-D arrays)."""
    name = "check_n_step_returns"
    count = 0
    for case, r, v, nv, term, done in _cases(41):
        for n in (1, 2, 3, 20):
            got = call_unmutated(name, case, fn, r, nv, term, done, 0.9, n)
            want = returns.n_step_returns(r[None], v[None], 0.9, n, next_values=nv[None],
                                          terminated=term[None], dones=done[None])[0]
            assert_close(name, f"{case}, n={n}: {_show(r, v, nv, term, done)}", want, got,
                         hint="sum gamma^k r_{t+k} for k < m, where m = n or fewer if the episode (dones) or "
                              "the row ends first; then add gamma^m * (1 - terminated) * next_values at the "
                              "last step summed")
            count += 1
    passed(name, count)


def check_gae(fn) -> None:
    """``fn(rewards, values, next_values, terminated, dones, gamma, lam) -> advantages`` (1-D arrays)."""
    name = "check_gae"
    count = 0
    for case, r, v, nv, term, done in _cases(42):
        for gamma, lam in ((0.9, 0.0), (0.9, 0.95), (1.0, 1.0), (0.8, 0.5)):
            got = call_unmutated(name, case, fn, r, v, nv, term, done, gamma, lam)
            want = returns.gae(r[None], v[None], gamma, lam, next_values=nv[None], terminated=term[None],
                               dones=done[None])[0]
            assert_close(name, f"{case}, gamma={gamma}, lambda={lam}: {_show(r, v, nv, term, done)}", want, got,
                         hint="run the loop backwards (A_t needs A_{t+1}): A_t = delta_t + gamma * lambda * "
                              "(1 - dones_t) * A_{t+1}, starting from 0 after the last step")
            count += 1
    passed(name, count)
