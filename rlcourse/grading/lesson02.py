"""Checks for lesson 02 (REINFORCE and the policy-gradient theorem)."""
from __future__ import annotations

import numpy as np
import torch

from rlcourse import losses, returns
from rlcourse.classic.gradient_estimates import EpisodeBatch, softmax_score, softmax_score_gradients
from rlcourse.grading._core import assert_close, call_unmutated, fail, fail_if_mistake, passed

__all__ = ["check_softmax_score", "check_reinforce_loss", "check_episode_gradient"]


def check_softmax_score(fn) -> None:
    """``fn(theta, s, a) -> (S, A) array``: ``grad_theta log pi(a|s)`` for ``pi = softmax(theta[s])``."""
    name = "check_softmax_score"
    rng = np.random.default_rng(20)
    cases = [("uniform logits (theta = 0)", np.zeros((3, 2)), 1, 0),
             ("one state, three actions", np.array([[0.5, -1.0, 2.0]]), 0, 2)]
    cases += [(f"random theta #{i}", rng.normal(size=(4, 3)), int(rng.integers(4)), int(rng.integers(3)))
              for i in range(4)]
    for case, theta, s, a in cases:
        label = f"{case} with s={s}, a={a}, theta=\n{np.round(theta, 3)}"
        got = call_unmutated(name, label, fn, theta, s, a)
        assert_close(name, label, softmax_score(theta, s, a), got,
                     hint="log pi(a|s) = theta[s, a] - log sum_b exp(theta[s, b]): its gradient is "
                          "onehot(a) - pi(.|s) on row s, and 0 on every other row (other states' "
                          "logits do not enter pi(.|s))")
    passed(name, len(cases))


def _loss_cases(rng):
    cases = []
    for i, (N, T) in enumerate([(1, 1), (2, 3), (4, 5), (3, 6)]):
        logp = -rng.uniform(0.1, 3.0, size=(N, T))
        psi = rng.normal(size=(N, T)) * 3
        mask = np.ones((N, T))
        if T > 1:
            mask[rng.integers(N), rng.integers(1, T):] = 0.0  # one padded sequence
        cases.append((f"random batch #{i} (N={N}, T={T})", logp, psi, mask))
    logp = -rng.uniform(0.1, 3.0, size=(3, 4))
    cases.append(("one weight per sequence, psi of shape (N, 1)", logp, rng.normal(size=(3, 1)), np.ones((3, 4))))
    return cases


def check_reinforce_loss(fn) -> None:
    """``fn(logprobs, psi, mask) -> scalar tensor``: ``-(1/N) sum_i sum_t mask * logprobs * stopgrad(psi)``."""
    name = "check_reinforce_loss"
    cases = _loss_cases(np.random.default_rng(21))
    for case, logp, psi, mask in cases:
        lp = torch.tensor(logp, requires_grad=True)
        ps = torch.tensor(psi, requires_grad=True)  # a learner's psi may come out of a network
        mk = torch.tensor(mask)
        got = fn(lp, ps, mk)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            fail(name, case, "a scalar torch tensor", got,
                 "return one number for the whole batch (sum over steps, mean over sequences), as a tensor")
        expected = losses.reinforce_loss(torch.tensor(logp), torch.tensor(psi), mk)
        if np.isclose(float(got.detach()), -float(expected)):
            fail(name, case, float(expected), float(got.detach()),
                 "the sign is flipped: optimisers *minimise*, and we want to *increase* "
                 "sum_t psi * log pi, so the loss carries a minus sign")
        assert_close(name, case, expected, got.detach(),
                     hint="multiply logprobs by psi and by the mask, sum over everything, divide by "
                          "N = logprobs.shape[0] (the number of sequences, not the number of real steps)")
        if not got.requires_grad:
            fail(name, case, "a loss connected to logprobs' graph", "a tensor with no gradient",
                 "do not detach logprobs or convert to NumPy: the gradient flows through them")
        got.backward()
        if ps.grad is not None and torch.any(ps.grad != 0):
            fail(name, case, "no gradient reaching psi", "psi received a gradient",
                 "psi is a weight (a return or advantage), not something to optimise: use psi.detach()")
        assert_close(name, case + " (gradient with respect to logprobs)",
                     -np.broadcast_to(psi, logp.shape) * mask / logp.shape[0], lp.grad,
                     hint="d loss / d logprobs[i, t] should be -mask * psi / N")
    passed(name, len(cases))


def _episode_cases(rng):
    mdp_like = []
    for i, (S, A, T) in enumerate([(2, 2, 1), (3, 2, 4), (4, 3, 6), (5, 4, 8), (4, 2, 7)]):
        theta = rng.normal(size=(S, A))
        states = rng.integers(S, size=T)
        actions = rng.integers(A, size=T)
        rewards = rng.normal(size=T) + (np.arange(T) == T - 1) * 5.0
        gamma = [0.5, 0.9, 0.99, 1.0, 0.8][i]
        mdp_like.append((f"random episode #{i} (S={S}, A={A}, T={T}, gamma={gamma})",
                         theta, states, actions, rewards, gamma))
    return mdp_like


def check_episode_gradient(fn) -> None:
    """``fn(theta, states, actions, rewards, gamma) -> (S, A)``: ``sum_t gamma^t G_t grad log pi(a_t|s_t)``."""
    name = "check_episode_gradient"
    cases = _episode_cases(np.random.default_rng(22))
    for case, theta, states, actions, rewards, gamma in cases:
        got = call_unmutated(name, case, fn, theta, states, actions, rewards, gamma)
        batch = EpisodeBatch(states[None], actions[None], rewards[None], np.ones((1, len(states)), bool))
        G = returns.reward_to_go(batch.rewards, gamma)
        expected = softmax_score_gradients(theta, batch, G * returns.discount_weights(batch.mask, gamma))[0]
        no_discount = softmax_score_gradients(theta, batch, G)[0]
        fail_if_mistake(name, case, expected, got, no_discount,
                        "each step needs the factor gamma^t in front of G_t: the objective discounts "
                        "a reward at time k by gamma^k, not gamma^(k-t)")
        assert_close(name, case, expected, got,
                     hint="G_t = sum_{k >= t} gamma^(k-t) r_k sums from step t (not from 0); add "
                          "gamma^t * G_t * score(theta, s_t, a_t) for every step t")
    passed(name, len(cases))
