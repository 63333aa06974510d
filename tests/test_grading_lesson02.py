"""Lesson 02's checks pass the reference and catch plausible mistakes."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import losses, returns
from rlcourse.classic.gradient_estimates import softmax_score
from rlcourse.grading import check_episode_gradient, check_reinforce_loss, check_softmax_score
from rlcourse.grading._core import CheckFailed


def softmax(x):
    z = np.exp(x - x.max())
    return z / z.sum()


# ------------------------------------------------------------------ softmax score
def score_ok(theta, s, a):
    g = np.zeros(np.shape(theta))
    g[s] = -softmax(theta[s])
    g[s, a] += 1
    return g


def score_onehot_only(theta, s, a):
    g = np.zeros_like(theta)
    g[s, a] = 1.0
    return g


def score_wrong_sign(theta, s, a):
    return -score_ok(theta, s, a)


def score_every_row(theta, s, a):
    g = -np.exp(theta) / np.exp(theta).sum(1, keepdims=True)
    g[s, a] += 1
    return g


def score_in_place(theta, s, a):
    theta -= theta.max()
    return score_ok(theta, s, a)


def test_softmax_score_check(capsys):
    check_softmax_score(score_ok)
    check_softmax_score(softmax_score)
    assert capsys.readouterr().out.count("✔ check_softmax_score") == 2


@pytest.mark.parametrize("wrong", [score_onehot_only, score_wrong_sign, score_every_row, score_in_place])
def test_softmax_score_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_softmax_score(wrong)


# ------------------------------------------------------------------ REINFORCE loss
def loss_ok(logprobs, psi, mask):
    return -(logprobs * psi.detach() * mask).sum() / logprobs.shape[0]


def loss_no_minus(logprobs, psi, mask):
    return (logprobs * psi.detach() * mask).sum() / logprobs.shape[0]


def loss_not_detached(logprobs, psi, mask):
    return -(logprobs * psi * mask).sum() / logprobs.shape[0]


def loss_no_mask(logprobs, psi, mask):
    return -(logprobs * psi.detach()).sum() / logprobs.shape[0]


def loss_token_mean(logprobs, psi, mask):
    return -(logprobs * psi.detach() * mask).sum() / mask.sum()


def loss_detached_logprobs(logprobs, psi, mask):
    return torch.tensor(float(-(logprobs * psi * mask).sum().detach() / logprobs.shape[0]))


def loss_numpy(logprobs, psi, mask):
    return float(-(logprobs * psi * mask).sum().detach() / logprobs.shape[0])


def test_reinforce_loss_check(capsys):
    check_reinforce_loss(loss_ok)
    check_reinforce_loss(losses.reinforce_loss)
    assert capsys.readouterr().out.count("✔ check_reinforce_loss") == 2


@pytest.mark.parametrize("wrong, message", [
    (loss_no_minus, "sign is flipped"), (loss_not_detached, "psi.detach"), (loss_no_mask, "mask"),
    (loss_token_mean, "number of sequences"), (loss_detached_logprobs, "without a gradient"),
    (loss_numpy, "scalar torch tensor")])
def test_reinforce_loss_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_reinforce_loss(wrong)


# ------------------------------------------------------------------ per-episode gradient
def make_episode_gradient(psi_of, gamma_t=True, sign=1.0):
    def fn(theta, states, actions, rewards, gamma):
        psi = psi_of(np.asarray(rewards, float), gamma)
        g = np.zeros_like(theta, dtype=float)
        for t, (s, a) in enumerate(zip(states, actions)):
            g += (gamma ** t if gamma_t else 1.0) * psi[t] * score_ok(theta, s, a)
        return sign * g
    return fn


def rtg(rewards, gamma):
    return returns.reward_to_go(rewards[None], gamma)[0]


def from_start(rewards, gamma):  # "reward-to-go" that sums from 0 to t
    return np.array([returns.discounted_return(rewards[:t + 1], gamma) for t in range(len(rewards))])


def off_by_one(rewards, gamma):  # G_{t+1} instead of G_t
    return np.append(rtg(rewards, gamma)[1:], 0.0)


def test_episode_gradient_check(capsys):
    check_episode_gradient(make_episode_gradient(rtg))
    assert "✔ check_episode_gradient" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (make_episode_gradient(rtg, gamma_t=False), "gamma\\^t"),
    (make_episode_gradient(from_start), "sums from step t"),
    (make_episode_gradient(off_by_one), "G_t"),
    (make_episode_gradient(rtg, sign=-1.0), "G_t"),
    # R(tau) on every step is a valid estimator too, but not this one: the check asks for reward-to-go
    (make_episode_gradient(lambda r, g: np.full(len(r), returns.discounted_return(r, g)), gamma_t=False), "G_t")])
def test_episode_gradient_check_catches(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_episode_gradient(wrong)
