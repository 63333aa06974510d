"""Exact dynamic programming and tabular learning on small MDPs.

Everything here works on a :class:`TabularMDP`: arrays ``P[s, a, s']`` (transition probabilities),
``R[s, a]`` (expected immediate reward), a terminal mask and a start distribution. A policy is an
``(S, A)`` array whose rows are action probabilities.

Terminal states are absorbing in ``P`` (so ``P`` is a proper stochastic array), but every function
here treats them as "the episode has ended": their value is 0 and nothing flows out of them. That
makes ``gamma = 1`` well defined for policies that reach a terminal state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TabularMDP:
    """A finite MDP as arrays: ``P (S,A,S)``, ``R (S,A)``, ``terminal (S,)``, ``start (S,)``."""

    P: np.ndarray
    R: np.ndarray
    terminal: np.ndarray
    start: np.ndarray

    def __post_init__(self):
        P, R = np.asarray(self.P, float), np.asarray(self.R, float)
        if P.ndim != 3 or P.shape[0] != P.shape[2]:
            raise ValueError(f"P must have shape (S, A, S), got {P.shape}")
        if R.shape != P.shape[:2]:
            raise ValueError(f"R must have shape (S, A) = {P.shape[:2]}, got {R.shape}")
        if (P < 0).any() or not np.allclose(P.sum(-1), 1.0):
            raise ValueError("each P[s, a, :] must be a probability distribution (non-negative, sums to 1)")
        terminal = np.asarray(self.terminal, bool)
        start = np.asarray(self.start, float)
        if terminal.shape != (P.shape[0],) or start.shape != (P.shape[0],):
            raise ValueError(f"terminal and start must have shape ({P.shape[0]},)")
        if not np.isclose(start.sum(), 1.0) or (start < 0).any():
            raise ValueError("start must be a probability distribution over states")
        for name, value in (("P", P), ("R", R), ("terminal", terminal), ("start", start)):
            object.__setattr__(self, name, value)

    @property
    def n_states(self) -> int:
        return self.P.shape[0]

    @property
    def n_actions(self) -> int:
        return self.P.shape[1]


# ---------------------------------------------------------------------------------- policies
def uniform_policy(mdp: TabularMDP) -> np.ndarray:
    """The uniformly random policy, ``pi(a|s) = 1/A``."""
    return np.full((mdp.n_states, mdp.n_actions), 1.0 / mdp.n_actions)


def deterministic_policy(actions, n_actions: int) -> np.ndarray:
    """One-hot rows: ``pi(a|s) = 1`` if ``a == actions[s]``."""
    actions = np.asarray(actions, dtype=int)
    return np.eye(n_actions)[actions]


def greedy_policy(Q: np.ndarray) -> np.ndarray:
    """The greedy policy of ``Q``: ``pi(s) = argmax_a Q(s, a)``, ties to the lowest action index.

    Returns one-hot rows of shape ``(S, A)``.
    """
    Q = np.asarray(Q, float)
    return deterministic_policy(Q.argmax(axis=1), Q.shape[1])


def _check_policy(mdp: TabularMDP, policy) -> np.ndarray:
    policy = np.asarray(policy, float)
    if policy.shape != (mdp.n_states, mdp.n_actions):
        raise ValueError(f"policy must have shape (S, A) = {(mdp.n_states, mdp.n_actions)}, got {policy.shape}")
    if (policy < 0).any() or not np.allclose(policy.sum(1), 1.0):
        raise ValueError("each row of policy must be a probability distribution over actions")
    return policy


def _check_gamma(gamma: float) -> float:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    return float(gamma)


# ---------------------------------------------------------------------------------- evaluation
def policy_dynamics(mdp: TabularMDP, policy) -> tuple[np.ndarray, np.ndarray]:
    """The Markov chain a policy induces, with terminal states emptied.

    ``P_pi[s, s'] = sum_a pi(a|s) P[s, a, s']`` and ``r_pi[s] = sum_a pi(a|s) R[s, a]``,
    with the rows of terminal states set to zero (the episode is over there).
    """
    policy = _check_policy(mdp, policy)
    P_pi = np.einsum("sa,sat->st", policy, mdp.P)
    r_pi = (policy * mdp.R).sum(1)
    P_pi[mdp.terminal] = 0.0
    r_pi[mdp.terminal] = 0.0
    return P_pi, r_pi


def policy_evaluation(mdp: TabularMDP, policy, gamma: float) -> np.ndarray:
    """Exact state values of a policy by one linear solve.

    The Bellman expectation equation ``V = r_pi + gamma P_pi V`` is linear in ``V``, so
    ``V^pi = (I - gamma P_pi)^{-1} r_pi``.
    """
    gamma = _check_gamma(gamma)
    P_pi, r_pi = policy_dynamics(mdp, policy)
    A = np.eye(mdp.n_states) - gamma * P_pi
    try:
        V = np.linalg.solve(A, r_pi)
    except np.linalg.LinAlgError:
        raise ValueError("I - gamma * P_pi is singular: with gamma = 1 the policy must reach a "
                         "terminal state from every state (use gamma < 1)") from None
    if not np.all(np.isfinite(V)):
        raise ValueError("policy evaluation produced non-finite values; use gamma < 1")
    return V


def finite_horizon_evaluation(mdp: TabularMDP, policy, gamma: float, horizon: int) -> np.ndarray:
    """State values when at most ``horizon`` more steps are taken, by backward induction.

    ``V_0 = 0`` and ``V_h = r_pi + gamma P_pi V_{h-1}``; returns ``V_horizon``. The horizon (when the
    episode is cut) and the discount (how much a later reward weighs) are two separate settings:
    any ``gamma`` in [0, 1] goes with any horizon, and as ``horizon`` grows ``V_horizon`` tends to
    :func:`policy_evaluation`'s infinite-horizon values (whenever those are finite).
    """
    gamma = _check_gamma(gamma)
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 0:
        raise ValueError(f"horizon must be an integer >= 0, got {horizon!r}")
    P_pi, r_pi = policy_dynamics(mdp, policy)
    V = np.zeros(mdp.n_states)
    for _ in range(horizon):
        V = r_pi + gamma * P_pi @ V
    return V


def action_values(mdp: TabularMDP, V: np.ndarray, gamma: float) -> np.ndarray:
    """One-step lookahead: ``Q(s, a) = R(s, a) + gamma * sum_s' P(s'|s, a) V(s')`` (0 at terminals)."""
    Q = mdp.R + _check_gamma(gamma) * mdp.P @ np.asarray(V, float)
    Q[mdp.terminal] = 0.0
    return Q


def advantages(mdp: TabularMDP, policy, gamma: float) -> np.ndarray:
    """Exact advantages ``A(s, a) = Q^pi(s, a) - V^pi(s)``."""
    V = policy_evaluation(mdp, policy, gamma)
    return action_values(mdp, V, gamma) - V[:, None]


def bellman_expectation_backup(mdp: TabularMDP, V: np.ndarray, policy, gamma: float) -> np.ndarray:
    """``(T^pi V)(s) = sum_a pi(a|s) [R(s, a) + gamma sum_s' P(s'|s, a) V(s')]``."""
    policy = _check_policy(mdp, policy)
    return (policy * action_values(mdp, V, gamma)).sum(1)


def bellman_optimality_backup(mdp: TabularMDP, V: np.ndarray, gamma: float) -> np.ndarray:
    """``(T* V)(s) = max_a [R(s, a) + gamma sum_s' P(s'|s, a) V(s')]``."""
    return action_values(mdp, V, gamma).max(1)


# ---------------------------------------------------------------------------------- control
@dataclass
class PlanningResult:
    """What a planning algorithm returns: values, a greedy policy, and per-iteration history."""

    V: np.ndarray
    Q: np.ndarray
    policy: np.ndarray
    history: list


def value_iteration(mdp: TabularMDP, gamma: float, tol: float = 1e-10,
                    max_iterations: int = 100_000) -> PlanningResult:
    """Repeat ``V <- T* V`` until ``max_s |V_new(s) - V(s)| < tol``.

    ``T*`` is a gamma-contraction, so for gamma < 1 the iterates converge to ``V*`` from any start.
    ``history`` holds the sup-norm change of each sweep.
    """
    V = np.zeros(mdp.n_states)
    history = []
    for _ in range(max_iterations):
        V_new = bellman_optimality_backup(mdp, V, gamma)
        history.append(float(np.abs(V_new - V).max()))
        V = V_new
        if history[-1] < tol:
            Q = action_values(mdp, V, gamma)
            return PlanningResult(V=V, Q=Q, policy=greedy_policy(Q), history=history)
    raise RuntimeError(f"value iteration did not converge within max_iterations={max_iterations} "
                       f"(last change {history[-1]:.3g}); with gamma=1 some states may never terminate")


def policy_iteration(mdp: TabularMDP, gamma: float, max_iterations: int = 1000) -> PlanningResult:
    """Alternate exact evaluation and greedy improvement until the policy stops changing.

    Starts from the uniform policy. Improvement keeps the current action unless another is
    strictly better (by more than 1e-12): with ties, hopping between equally good actions would
    never stop. ``history`` holds the value vector of each policy in the sequence.
    """
    policy, actions, history = uniform_policy(mdp), None, []
    for _ in range(max_iterations):
        V = policy_evaluation(mdp, policy, gamma)
        history.append(V)
        Q = action_values(mdp, V, gamma)
        best = Q.argmax(1)
        if actions is not None:
            still_best = Q[np.arange(mdp.n_states), actions] >= Q.max(1) - 1e-12
            if still_best.all():
                return PlanningResult(V=V, Q=Q, policy=policy, history=history)
            best = np.where(still_best, actions, best)
        actions, policy = best, deterministic_policy(best, mdp.n_actions)
    raise RuntimeError(f"policy iteration did not converge within max_iterations={max_iterations}")


# ---------------------------------------------------------------------------------- learning
def q_learning_update(Q: np.ndarray, s: int, a: int, r: float, s_next: int, terminated: bool,
                      alpha: float, gamma: float) -> np.ndarray:
    """One Q-learning step; returns an updated copy of ``Q``.

    ``Q(s, a) <- Q(s, a) + alpha * (r + gamma * (1 - terminated) * max_a' Q(s', a') - Q(s, a))``

    At a terminal ``s'`` there is no future, so the target is just ``r``. (A time-limit truncation
    is *not* terminal: the future still exists, so we keep bootstrapping.)
    """
    target = r + (0.0 if terminated else gamma * float(np.max(Q[s_next])))
    Q = np.array(Q, dtype=float, copy=True)
    Q[s, a] += alpha * (target - Q[s, a])
    return Q


@dataclass
class QLearningResult:
    Q: np.ndarray
    episode_returns: np.ndarray  # undiscounted sum of rewards of each training episode
    episode_lengths: np.ndarray


def q_learning(env, episodes: int, alpha: float = 0.5, gamma: float = 0.9, epsilon: float = 0.2,
               seed: int = 0, exploring_starts: bool = False, max_steps: int = 100,
               progress: bool = False) -> QLearningResult:
    """Tabular Q-learning with epsilon-greedy exploration on a gymnasium env with discrete spaces.

    With probability ``epsilon`` the agent acts at random, otherwise greedily (ties broken at
    random, which matters at the start when every Q is 0). ``exploring_starts=True`` starts each
    episode in a uniformly random non-terminal state (``reset(options={"state": s})``), so every
    state's values get learned, not only those near the usual start.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not 0 <= epsilon <= 1:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    gamma = _check_gamma(gamma)
    from tqdm.auto import trange

    rng = np.random.default_rng(seed)
    n_s, n_a = env.observation_space.n, env.action_space.n
    Q = np.zeros((n_s, n_a))
    starts = np.flatnonzero(~env.unwrapped.terminal) if exploring_starts else None
    returns, lengths = np.zeros(episodes), np.zeros(episodes, dtype=int)
    for ep in trange(episodes, desc="Q-learning", disable=not progress):
        options = {"state": int(rng.choice(starts))} if exploring_starts else None
        s, _ = env.reset(seed=int(rng.integers(2**31)), options=options)
        for t in range(max_steps):
            if rng.random() < epsilon:
                a = int(rng.integers(n_a))
            else:
                best = np.flatnonzero(Q[s] == Q[s].max())
                a = int(rng.choice(best))
            s_next, r, terminated, truncated, _ = env.step(a)
            Q = q_learning_update(Q, s, a, r, s_next, terminated, alpha, gamma)
            returns[ep] += r
            s = s_next
            if terminated or truncated:
                break
        lengths[ep] = t + 1
    return QLearningResult(Q=Q, episode_returns=returns, episode_lengths=lengths)


# ---------------------------------------------------------------------------------- exact policy gradient
# A tabular softmax policy has one logit per (state, action): pi(a|s) = exp(theta[s, a]) / sum_b exp(theta[s, b]).
# On a small MDP its objective J(theta) and the gradient dJ/dtheta can be computed *exactly*, which
# gives the Monte-Carlo estimators of lessons 02-03 something true to be compared with.
def softmax_policy(theta) -> np.ndarray:
    """``pi(a|s) = exp(theta[s, a]) / sum_b exp(theta[s, b])`` for logits ``theta`` of shape ``(S, A)``."""
    theta = np.asarray(theta, dtype=float)
    if theta.ndim != 2:
        raise ValueError(f"theta must have shape (S, A), got {theta.shape}")
    z = np.exp(theta - theta.max(axis=1, keepdims=True))  # shifting the logits avoids overflow
    return z / z.sum(axis=1, keepdims=True)


def _check_theta(mdp: TabularMDP, theta) -> np.ndarray:
    theta = np.asarray(theta, dtype=float)
    if theta.shape != (mdp.n_states, mdp.n_actions):
        raise ValueError(f"theta must have shape (S, A) = {(mdp.n_states, mdp.n_actions)}, got {theta.shape}")
    if not np.all(np.isfinite(theta)):
        raise ValueError("theta must be finite")
    return theta


def discounted_visitation(mdp: TabularMDP, policy, gamma: float) -> np.ndarray:
    """Discounted state visitation ``d(s) = sum_t gamma^t Pr(s_t = s)`` from the start distribution.

    In matrix form ``d^T = mu^T (I - gamma P_pi)^{-1}``: the same linear system as policy evaluation,
    solved from the other side. Terminal states are counted when entered but pass nothing on
    (their rows of ``P_pi`` are empty). ``d`` is not normalised: it sums to the expected discounted
    episode length.
    """
    gamma = _check_gamma(gamma)
    P_pi, _ = policy_dynamics(mdp, policy)
    try:
        d = np.linalg.solve((np.eye(mdp.n_states) - gamma * P_pi).T, mdp.start)
    except np.linalg.LinAlgError:
        raise ValueError("I - gamma * P_pi is singular: with gamma = 1 the policy must reach a "
                         "terminal state from every state (use gamma < 1)") from None
    return d


def softmax_objective(mdp: TabularMDP, theta, gamma: float) -> float:
    """``J(theta) = E[sum_t gamma^t r_t] = sum_s mu(s) V^{pi_theta}(s)``, by exact policy evaluation."""
    theta = _check_theta(mdp, theta)
    return float(mdp.start @ policy_evaluation(mdp, softmax_policy(theta), gamma))


def softmax_policy_gradient(mdp: TabularMDP, theta, gamma: float) -> np.ndarray:
    """The exact gradient of :func:`softmax_objective`, by the policy-gradient theorem.

    ``dJ/dtheta[s, a] = d(s) * pi(a|s) * A^pi(s, a)``

    where ``d`` is the :func:`discounted_visitation` and ``A^pi = Q^pi - V^pi``. It comes from
    ``grad J = sum_s d(s) sum_b Q(s, b) grad pi(b|s)`` and the softmax derivative
    ``d pi(b|s) / d theta[s, a] = pi(b|s) (1[a = b] - pi(a|s))``. Returns an ``(S, A)`` array; rows
    of terminal states are 0 (nothing is decided there).
    """
    theta = _check_theta(mdp, theta)
    policy = softmax_policy(theta)
    return discounted_visitation(mdp, policy, gamma)[:, None] * policy * advantages(mdp, policy, gamma)


def softmax_policy_gradient_autograd(mdp: TabularMDP, theta, gamma: float) -> np.ndarray:
    """The same gradient by torch autograd through the exact evaluation ``V = (I - gamma P_pi)^{-1} r_pi``.

    A second, independent route (no policy-gradient theorem involved): build ``J(theta)`` with
    differentiable operations in float64 and let autograd differentiate the linear solve.
    """
    import torch

    theta = _check_theta(mdp, theta)
    gamma = _check_gamma(gamma)
    th = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    pi = torch.softmax(th, dim=1)
    P = torch.as_tensor(mdp.P, dtype=torch.float64)
    R = torch.as_tensor(mdp.R, dtype=torch.float64)
    alive = torch.as_tensor(~mdp.terminal, dtype=torch.float64)[:, None]  # empty the terminal rows
    P_pi = torch.einsum("sa,sat->st", pi, P) * alive
    r_pi = (pi * R).sum(1) * alive[:, 0]
    V = torch.linalg.solve(torch.eye(mdp.n_states, dtype=torch.float64) - gamma * P_pi, r_pi)
    J = torch.as_tensor(mdp.start, dtype=torch.float64) @ V
    J.backward()
    return th.grad.numpy()
