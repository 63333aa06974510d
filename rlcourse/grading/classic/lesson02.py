"""Checks for lesson 02 (REINFORCE and the policy-gradient theorem).

Beyond seeded random cases the checks probe: very large logits (``exp`` overflows without the
max-shift), integer inputs, padding whose log-probs and weights are non-zero, a result whose
``requires_grad`` flag was set by hand (no gradient reaches the log-probs), weights modified in
place through ``.detach()`` (which shares memory with the caller's tensor), and several discounts.
"""
from __future__ import annotations

import numpy as np
import torch

from rlcourse import losses, returns, tabular
from rlcourse.classic.gradient_estimates import EpisodeBatch, softmax_score, softmax_score_gradients
from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references)

__all__ = ["check_softmax_score", "check_reinforce_loss", "check_episode_gradient", "check_reinforce_gridworld"]


@references("rlcourse.classic.gradient_estimates:softmax_score")
def check_softmax_score(fn) -> None:
    """``fn(theta, s, a) -> (S, A) array``: ``grad_theta log pi(a|s)`` for ``pi = softmax(theta[s])``."""
    __tracebackhide__ = True
    name = "check_softmax_score"
    rng = np.random.default_rng(20)
    cases = [("uniform logits (theta = 0)", np.zeros((3, 2)), 1, 0),
             ("one state, three actions", np.array([[0.5, -1.0, 2.0]]), 0, 2),
             ("integer logits", np.array([[1, 0, 2], [0, 3, 1]]), 1, 0),
             ("very large logits (exp overflows)", np.array([[800.0, 799.0, 0.0], [1.0, 2.0, 3.0]]), 0, 1)]
    cases += [(f"random theta #{i}", rng.normal(size=(4, 3)), int(rng.integers(4)), int(rng.integers(3)))
              for i in range(4)]
    for case, theta, s, a in cases:
        label = f"{case} with s={s}, a={a}, theta=\n{np.round(theta, 3)}"
        got = call_unmutated(name, label, fn, theta, s, a)
        assert_close(name, label, softmax_score(theta, s, a), got,
                     hint="log pi(a|s) = theta[s, a] - log sum_b exp(theta[s, b]): its gradient is "
                          "onehot(a) - pi(.|s) on row s (a float array even for integer theta; subtract "
                          "the row's max before exp), and 0 on every other row")
    passed(name, len(cases))


def _loss_cases(rng):
    cases = []
    for i, (N, T) in enumerate([(1, 1), (2, 3), (4, 5), (3, 6)]):
        logp = -rng.uniform(0.1, 3.0, size=(N, T))
        psi = rng.normal(size=(N, T)) * 3
        mask = np.ones((N, T))
        if T > 1:
            mask[rng.integers(N), rng.integers(1, T):] = 0.0  # one padded sequence: its logp and psi stay non-zero
        cases.append((f"random batch #{i} (N={N}, T={T})", logp, psi, mask))
    logp = -rng.uniform(0.1, 3.0, size=(3, 4))
    cases.append(("one weight per sequence, psi of shape (N, 1)", logp, rng.normal(size=(3, 1)), np.ones((3, 4))))
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=bool)
    cases.append(("a boolean mask", -rng.uniform(0.1, 3.0, size=(2, 4)), rng.normal(size=(2, 4)), mask))
    return cases


@references("rlcourse.losses:reinforce_loss", "rlcourse.losses.policy_gradient:reinforce_loss")
def check_reinforce_loss(fn) -> None:
    """``fn(logprobs, psi, mask) -> scalar tensor``: ``-(1/N) sum_i sum_t mask * logprobs * stopgrad(psi)``."""
    __tracebackhide__ = True
    name = "check_reinforce_loss"
    cases = _loss_cases(np.random.default_rng(21))
    for case, logp, psi, mask in cases:
        lp = torch.tensor(logp, requires_grad=True)
        ps = torch.tensor(psi, requires_grad=True)  # a learner's psi may come out of a network
        mk = torch.tensor(mask)
        got = call_unmutated(name, case, fn, lp, ps, mk)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            fail(name, case, "a scalar torch tensor", got,
                 "return one number for the whole batch (sum over steps, mean over sequences), as a tensor")
        expected = losses.reinforce_loss(torch.tensor(logp), torch.tensor(psi), mk)
        if np.isclose(float(got.detach()), -float(expected)) and abs(float(expected)) > 1e-9:
            fail(name, case, float(expected), float(got.detach()),
                 "the sign is flipped: optimisers *minimise*, and we want to *increase* "
                 "sum_t psi * log pi, so the loss carries a minus sign")
        assert_close(name, case, expected, got.detach(),
                     hint="multiply logprobs by psi and by the mask, sum over everything, divide by "
                          "N = logprobs.shape[0] (the number of sequences, not the number of real steps)")
        grad_lp, grad_ps = gradient_flowing(name, case, got, [lp, ps],
                                            "do not detach logprobs, convert to NumPy or rebuild the loss with "
                                            "torch.tensor(...): the gradient flows through logprobs")
        if torch.any(grad_ps != 0):
            fail(name, case, "no gradient reaching psi", "psi received a gradient",
                 "psi is a weight (a return or advantage), not something to optimise: use psi.detach()")
        assert_close(name, case + " (gradient with respect to logprobs)",
                     -np.broadcast_to(psi, logp.shape) * mask / logp.shape[0], grad_lp,
                     hint="d loss / d logprobs[i, t] should be -mask * psi / N")
    passed(name, len(cases))


def _episode_cases(rng):
    mdp_like = []
    for i, (S, A, T) in enumerate([(2, 2, 1), (3, 2, 4), (4, 3, 6), (5, 4, 8), (4, 2, 7), (3, 3, 5)]):
        theta = rng.normal(size=(S, A))
        states = rng.integers(S, size=T)
        actions = rng.integers(A, size=T)
        rewards = rng.normal(size=T) + (np.arange(T) == T - 1) * 5.0
        gamma = [0.5, 0.9, 0.99, 1.0, 0.8, 0.7][i]
        what = ""
        if i == 5:
            rewards, what = rng.integers(-2, 4, size=T), ", integer rewards"
        mdp_like.append((f"random episode #{i} (S={S}, A={A}, T={T}, gamma={gamma}{what})",
                         theta, states, actions, rewards, gamma))
    return mdp_like


@references("rlcourse.classic.gradient_estimates:softmax_score_gradients")
def check_episode_gradient(fn) -> None:
    """``fn(theta, states, actions, rewards, gamma) -> (S, A)``: ``sum_t gamma^t G_t grad log pi(a_t|s_t)``."""
    __tracebackhide__ = True
    name = "check_episode_gradient"
    cases = _episode_cases(np.random.default_rng(22))
    for case, theta, states, actions, rewards, gamma in cases:
        got = call_unmutated(name, case, fn, theta, states, actions, rewards, gamma)
        batch = EpisodeBatch(states[None], actions[None], rewards[None].astype(float), np.ones((1, len(states)), bool))
        G = returns.reward_to_go(batch.rewards, gamma)
        expected = softmax_score_gradients(theta, batch, G * returns.discount_weights(batch.mask, gamma))[0]
        no_discount = softmax_score_gradients(theta, batch, G)[0]
        fail_if_mistake(name, case, expected, got, no_discount,
                        "each step needs the factor gamma^t in front of G_t: the objective discounts "
                        "a reward at time k by gamma^k, not gamma^(k-t)")
        assert_close(name, case, expected, got,
                     hint="G_t = sum_{k >= t} gamma^(k-t) r_k sums from step t (not from 0), in floats; add "
                          "gamma^t * G_t * score(theta, s_t, a_t) for every step t")
    passed(name, len(cases))


@references("rlcourse.classic.reinforce:train_reinforce", "rlcourse.tabular:softmax_policy_gradient")
def check_reinforce_gridworld(fn) -> None:
    """``fn(env, iterations, episodes_per_update, lr, seed) -> theta``: REINFORCE learns the maze.

    The experiment: starting from ``theta = 0`` (a uniform policy, J = -6.8 on the slippery maze
    with a step cost), 60 updates of 16 episodes each must lift the exact objective J(theta) above
    a threshold, at two seeds. J is computed exactly from the model, not from the learner's runs.
    """
    __tracebackhide__ = True
    from rlcourse.envs import GridWorld

    name = "check_reinforce_gridworld"
    n = 0
    for seed in (0, 1):
        env = GridWorld("maze2x3", slip=0.1, step_reward=-1.0)
        mdp = env.mdp
        start = tabular.softmax_objective(mdp, np.zeros((mdp.n_states, mdp.n_actions)), 0.9)
        best = float(mdp.start @ tabular.value_iteration(mdp, 0.9, tol=1e-12).V)
        threshold = start + 0.8 * (best - start)
        case = f"maze2x3 (slip=0.1, step_reward=-1), 60 updates of 16 episodes, lr=0.5, seed={seed}"
        theta = fn(env, 60, 16, 0.5, seed)
        if theta is None or np.shape(theta) != (mdp.n_states, mdp.n_actions):
            fail(name, case, f"theta of shape {(mdp.n_states, mdp.n_actions)}",
                 None if theta is None else f"shape {np.shape(theta)}", "return the trained logits theta")
        J = tabular.softmax_objective(mdp, np.asarray(theta, dtype=float), 0.9)
        if not J >= threshold:
            fail(name, case, f"J(theta) >= {threshold:.3f} (uniform policy: {start:.3f}, optimum: {best:.3f})",
                 f"J(theta) = {J:.3f}",
                 "each update: sample episodes with sample_episodes(env.mdp, softmax_policy(theta), n, rng, "
                 "reward_table=env.reward_table), average episode_gradient over them (only the real steps, "
                 "mask), and step *up* the gradient: theta = theta + lr * g")
        n += 1
    passed(name, n)
