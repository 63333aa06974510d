"""GAE's bias and variance, measured against the *exact* advantage on a gridworld (lesson 04).

On a tabular MDP :mod:`rlcourse.tabular` computes ``A^pi(s, a)`` exactly, so every sample-based
advantage estimate can be scored: for each visited ``(s, a)``, its mean over many episodes minus
the truth is the bias, its spread is the variance. A critic is never perfect, so the study adds a
fixed error to the exact values, ``V_hat(s) = V^pi(s) + e(s)``: that error is where the bias of
small lambda comes from (with the exact V, every lambda is unbiased).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rlcourse import returns, tabular


def sample_episodes(env, policy, n_episodes: int, max_steps: int, rng: np.random.Generator) -> dict:
    """Run ``n_episodes`` episodes of a tabular ``policy`` on a GridWorld's arrays, side by side.

    Returns ``(N, T)`` arrays ``states``, ``actions``, ``rewards``, ``next_states``, ``terminated``
    (entered a goal or trap), ``dones`` (terminated, or cut at ``max_steps``: truncated) and
    ``mask`` (1 on real steps). Rewards come from ``env.reward_table[s, a, s']``, as in ``step``.
    """
    env = env.unwrapped
    policy = np.asarray(policy, float)
    if n_episodes < 1 or max_steps < 1:
        raise ValueError(f"n_episodes and max_steps must be >= 1, got {n_episodes}, {max_steps}")
    N, T = n_episodes, max_steps
    out = {k: np.zeros((N, T), dtype=int) for k in ("states", "actions", "next_states")}
    out.update({k: np.zeros((N, T)) for k in ("rewards", "terminated", "dones", "mask")})
    s = rng.choice(len(env.cells), size=N, p=env.start_distribution)
    alive = np.ones(N, dtype=bool)
    for t in range(T):
        a = (rng.random(N)[:, None] > np.cumsum(policy[s], axis=1)).sum(1)  # inverse-CDF sampling
        a = np.minimum(a, policy.shape[1] - 1)
        s2 = (rng.random(N)[:, None] > np.cumsum(env.P[s, a], axis=1)).sum(1)
        s2 = np.minimum(s2, env.P.shape[0] - 1)
        term = env.terminal[s2]
        for key, val in (("states", s), ("actions", a), ("next_states", s2), ("terminated", term),
                         ("rewards", env.reward_table[s, a, s2]), ("mask", np.ones(N))):
            out[key][:, t] = np.where(alive, val, 0)
        out["dones"][:, t] = alive & (term | (t == T - 1))
        alive = alive & ~term
        s = s2
    return out


@dataclass
class GAEStudy:
    """Fixed episodes of a fixed policy, and a critic with a fixed error, scored at any (gamma, lambda)."""

    env: object
    policy: np.ndarray
    critic_noise: float = 1.0
    n_episodes: int = 2000
    max_steps: int = 30
    seed: int = 0
    episodes: dict = field(init=False)
    critic_error: np.ndarray = field(init=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        self.episodes = sample_episodes(self.env, self.policy, self.n_episodes, self.max_steps, rng)
        mdp = self.env.unwrapped.mdp
        self.critic_error = np.where(mdp.terminal, 0.0, rng.normal(0.0, self.critic_noise, mdp.n_states))

    def exact(self, gamma: float):
        """The exact ``V^pi`` and ``A^pi`` at this discount."""
        mdp = self.env.unwrapped.mdp
        return tabular.policy_evaluation(mdp, self.policy, gamma), tabular.advantages(mdp, self.policy, gamma)

    def estimates(self, gae_lambda: float, gamma: float) -> np.ndarray:
        """GAE(gamma, lambda) of every sampled step, with the noisy critic ``V^pi + e``; ``(N, T)``."""
        V, _ = self.exact(gamma)
        V_hat = V + self.critic_error
        ep = self.episodes
        return returns.gae(ep["rewards"], V_hat[ep["states"]], gamma, gae_lambda,
                           next_values=V_hat[ep["next_states"]], terminated=ep["terminated"],
                           dones=ep["dones"], mask=ep["mask"])

    def bias_variance(self, lambdas, gamma: float) -> dict:
        """The error of GAE that matters for the policy gradient, for each lambda.

        * ``bias2``: the exact bias ``b(s, a) = E[A_hat | s, a] - A(s, a)`` (:func:`expected_gae`)
          with its policy-weighted mean over actions removed in each state, squared and averaged
          over the visits. A state-only offset (``b(s, a) = b(s)``) is a baseline: it leaves the
          expected policy gradient unchanged, so it is not counted;
        * ``variance``: the spread of the sampled estimates around their mean within each visited
          ``(s, a)``, averaged over the visits;
        * ``mse = bias2 + variance``.
        """
        mdp = self.env.unwrapped.mdp
        V, _ = self.exact(gamma)
        return self._score(gamma, [(expected_gae(mdp, self.policy, V + self.critic_error, gamma, float(lam)),
                                    self.estimates(float(lam), gamma)) for lam in np.atleast_1d(lambdas)])

    def n_step_bias_variance(self, ns, gamma: float) -> dict:
        """The same scores for the n-step advantages ``G_t^(n) - V_hat(s_t)`` (:func:`expected_n_step`)."""
        mdp = self.env.unwrapped.mdp
        V, _ = self.exact(gamma)
        V_hat = V + self.critic_error
        ep = self.episodes
        values = V_hat[ep["states"]] * ep["mask"]
        scored = []
        for n in ns:
            est = returns.n_step_returns(ep["rewards"], V_hat[ep["states"]], gamma, int(n),
                                         next_values=V_hat[ep["next_states"]], terminated=ep["terminated"],
                                         dones=ep["dones"], mask=ep["mask"]) - values
            scored.append((expected_n_step(mdp, self.policy, V_hat, gamma, int(n)), est))
        return self._score(gamma, scored)

    def _score(self, gamma: float, expected_and_estimates) -> dict:
        _, A = self.exact(gamma)
        ep = self.episodes
        valid = ep["mask"] > 0
        keys = (ep["states"] * A.shape[1] + ep["actions"])[valid]
        counts = np.bincount(keys, minlength=A.size)
        out = {"bias2": [], "variance": [], "mse": []}
        for expected, estimates in expected_and_estimates:
            b = expected - A
            b = b - (self.policy * b).sum(1, keepdims=True)  # drop the state-only part (a baseline)
            est = estimates[valid]
            mean_k = np.bincount(keys, est, minlength=A.size) / np.maximum(counts, 1)
            out["bias2"].append(float(np.mean(b.reshape(-1)[keys] ** 2)))
            out["variance"].append(float(np.mean((est - mean_k[keys]) ** 2)))
            out["mse"].append(out["bias2"][-1] + out["variance"][-1])
        return {k: np.array(v) for k, v in out.items()}


def _td_and_chain(mdp: tabular.TabularMDP, policy, V_hat, gamma: float):
    """``D(s, a) = E[delta | s, a]`` and the state-action chain ``M[(s,a), (s',a')] = P(s'|s,a) pi(a'|s')``."""
    policy = np.asarray(policy, float)
    alive = (~mdp.terminal).astype(float)
    V_hat = np.asarray(V_hat, float) * alive
    D = mdp.R + gamma * mdp.P @ V_hat - V_hat[:, None]
    D[mdp.terminal] = 0.0
    S, nA = policy.shape
    M = np.einsum("sat,tb->satb", mdp.P * alive[None, None, :], policy).reshape(S * nA, S * nA)
    M[np.repeat(mdp.terminal, nA)] = 0.0
    return D.reshape(-1), M


def expected_n_step(mdp: tabular.TabularMDP, policy, V_hat, gamma: float, n: int) -> np.ndarray:
    """``E[G_t^(n) - V_hat(s_t) | s, a]`` exactly (no time limit): ``sum_{k<n} gamma^k (M^k D)(s, a)``.

    The n-step advantage telescopes into the first n TD residuals, ``sum_{k<n} gamma^k delta_{t+k}``
    (an episode that ends earlier contributes zeros), and each residual's expectation k steps ahead
    is ``M^k D`` on the state-action chain.
    """
    D, M = _td_and_chain(mdp, policy, V_hat, gamma)
    total, term = np.zeros_like(D), D.copy()
    for k in range(n):
        total += gamma ** k * term
        term = M @ term
    return total.reshape(np.asarray(policy).shape)


def expected_gae(mdp: tabular.TabularMDP, policy, V_hat, gamma: float, gae_lambda: float) -> np.ndarray:
    """``E[A_hat^GAE | s_t = s, a_t = a]`` exactly, for a critic ``V_hat`` (no time limit).

    With ``D(s, a) = E[delta_t | s, a] = R(s, a) + gamma sum_s' P(s'|s,a) V_hat(s') - V_hat(s)``
    (``V_hat = 0`` at terminal states) the recursion ``A_t = delta_t + gamma lambda A_{t+1}``
    becomes a linear system over state-action pairs:

    ``X(s, a) = D(s, a) + gamma lambda sum_{s', a'} P(s'|s, a) pi(a'|s') X(s', a')``

    (nothing flows back from a terminal ``s'``). With the exact ``V_hat = V^pi``, ``D = A`` is
    already the advantage and the expected continuation is 0: every lambda is unbiased.
    """
    D, M = _td_and_chain(mdp, policy, V_hat, gamma)
    X = np.linalg.solve(np.eye(len(D)) - gamma * gae_lambda * M, D)
    return X.reshape(np.asarray(policy).shape)
