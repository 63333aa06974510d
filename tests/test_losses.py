"""The REINFORCE surrogate and the Psi helpers."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import losses, returns, tabular
from rlcourse.classic.gradient_estimates import sample_episodes, softmax_score_gradients
from rlcourse.envs import GridWorld


def test_reinforce_loss_value_by_hand():
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    psi = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    expected = -((-0.5 * 1 - 1.0 * 2) + (-0.1 * 4 - 0.2 * 5 - 0.3 * 6)) / 2
    assert float(losses.reinforce_loss(logp, psi, mask)) == pytest.approx(expected)
    assert float(losses.reinforce_loss(logp, psi, mask.bool())) == pytest.approx(expected)
    # one weight per sequence broadcasts over its steps
    per_seq = losses.reinforce_loss(logp, torch.tensor([[2.0], [-1.0]]))
    assert float(per_seq) == pytest.approx(-(2 * (-3.5) - 1 * (-0.6)) / 2)


def test_gradient_equals_the_score_function_estimate_on_the_gridworld():
    # Oracle: the closed-form per-episode score-function gradients of a tabular softmax.
    mdp = GridWorld("maze2x3", slip=0.2, step_reward=-1.0).mdp
    theta = np.random.default_rng(0).normal(size=(mdp.n_states, mdp.n_actions))
    batch = sample_episodes(mdp, tabular.softmax_policy(theta), 64, np.random.default_rng(1))
    rewards, mask = torch.as_tensor(batch.rewards), torch.as_tensor(batch.mask)
    psi = losses.psi_reward_to_go(rewards, 0.9, mask, time_discount=True)
    th = torch.tensor(theta, requires_grad=True)
    logp = torch.log_softmax(th[torch.as_tensor(batch.states)], -1).gather(
        -1, torch.as_tensor(batch.actions)[..., None]).squeeze(-1)
    losses.reinforce_loss(logp, psi, mask).backward()
    expected = softmax_score_gradients(theta, batch, psi.numpy()).mean(0)
    np.testing.assert_allclose(-th.grad.numpy(), expected, atol=1e-12)


def test_psi_is_detached():
    logp = torch.randn(3, 4, requires_grad=True)
    psi = torch.randn(3, 4, requires_grad=True)
    losses.reinforce_loss(logp, psi).backward()
    assert psi.grad is None
    np.testing.assert_allclose(logp.grad.numpy(), -psi.detach().numpy() / 3, rtol=1e-6)


def test_padding_gets_no_gradient():
    logp = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    losses.reinforce_loss(logp, torch.ones(2, 3), mask).backward()
    assert torch.all(logp.grad[mask == 0] == 0)


def test_psi_helpers():
    rewards = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    g = 0.5
    torch.testing.assert_close(losses.psi_total_return(rewards, g, mask),
                               torch.tensor([[1 + 0.5 * 2 + 0.25 * 4], [3 + 0.5 * 5]]))
    rtg = torch.tensor([[1 + 1 + 1.0, 2 + 2.0, 4.0], [3 + 2.5, 5.0, 0.0]])
    torch.testing.assert_close(losses.psi_reward_to_go(rewards, g, mask), rtg)
    torch.testing.assert_close(losses.psi_reward_to_go(rewards, g, mask, time_discount=True),
                               rtg * torch.tensor([[1, 0.5, 0.25], [1, 0.5, 0.0]]))
    V = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    torch.testing.assert_close(losses.psi_reward_to_go_minus_baseline(rewards, V, g, mask),
                               (rtg - V) * mask)
    torch.testing.assert_close(losses.psi_reward_to_go_minus_baseline(rewards, 1.5, g, mask),
                               (rtg - 1.5) * mask)
    # the same numbers as the NumPy path of returns.py
    np.testing.assert_allclose(rtg.numpy(), returns.reward_to_go(rewards.numpy(), g, mask=mask.numpy()))


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="logprobs must be a torch tensor of shape"):
        losses.reinforce_loss(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\)"):
        losses.reinforce_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"psi must be a number, \(N, 1\)"):
        losses.reinforce_loss(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="baseline must be broadcastable"):
        losses.psi_reward_to_go_minus_baseline(torch.zeros(2, 3), torch.zeros(4), 0.9)


def test_trajectory_importance_weight_is_the_product_of_ratios():
    rng = np.random.default_rng(3)
    new, old = torch.tensor(rng.normal(size=(3, 4))), torch.tensor(rng.normal(size=(3, 4)))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    got = losses.trajectory_importance_weight(new, old, mask)
    for i in range(3):
        ratio = 1.0
        for t in range(4):
            if mask[i, t]:
                ratio *= float(torch.exp(new[i, t]) / torch.exp(old[i, t]))
        assert float(got[i]) == pytest.approx(ratio)
    with pytest.raises(ValueError, match="old_logprobs must be a tensor of the shape"):
        losses.trajectory_importance_weight(new, old[:, :2])


def test_importance_weighting_recovers_an_on_policy_expectation():
    # E_old[rho(tau) f(tau)] = E_new[f(tau)] on a 2-step bandit with exact enumeration.
    p_new, p_old = torch.tensor([0.7, 0.3]), torch.tensor([0.4, 0.6])
    f = torch.tensor([[1.0, 2.0], [3.0, -1.0]])  # f(a0, a1)
    lhs = sum(p_new[a] * p_new[b] * f[a, b] for a in range(2) for b in range(2))
    rhs = 0.0
    for a in range(2):
        for b in range(2):
            lp_new = torch.log(torch.stack([p_new[a], p_new[b]]))[None]
            lp_old = torch.log(torch.stack([p_old[a], p_old[b]]))[None]
            rhs += p_old[a] * p_old[b] * losses.trajectory_importance_weight(lp_new, lp_old)[0] * f[a, b]
    assert float(rhs) == pytest.approx(float(lhs))
