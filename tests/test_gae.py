"""TD residuals, n-step returns and GAE against definitions written out element by element."""
import numpy as np
import pytest
import torch

import rlcourse  # noqa: F401
from rlcourse import returns


def random_batch(rng, N=3, T=9, p_done=0.25, p_trunc=0.5):
    """Rows holding several episodes; some ends are terminations, others truncations."""
    rewards = rng.normal(size=(N, T))
    values = rng.normal(size=(N, T))
    dones = (rng.random((N, T)) < p_done).astype(float)
    truncated = dones * (rng.random((N, T)) < p_trunc)
    terminated = dones - truncated
    # V(s_{t+1}): the next visited state's value, except after an episode end, where it is the
    # value of the real final observation (drawn afresh), and after the last column.
    next_values = np.concatenate([values[:, 1:], rng.normal(size=(N, 1))], axis=1)
    next_values = np.where(dones > 0, rng.normal(size=(N, T)), next_values)
    return rewards, values, next_values, terminated, dones


def n_step_by_hand(r, v_next, term, done, gamma, n, t):
    """One G_t^(n) with explicit loops over a single row."""
    T, G = len(r), 0.0
    for k in range(n):
        G += gamma ** k * r[t + k]
        if done[t + k] or t + k == T - 1 or k == n - 1:
            return G + gamma ** (k + 1) * (1 - term[t + k]) * v_next[t + k]
    raise AssertionError("unreachable")


def mc_by_hand(r, v_next, term, done, gamma, t):
    """G_t until the episode (or row) ends, bootstrapped from V only if it was not terminated."""
    return n_step_by_hand(r, v_next, term, done, gamma, len(r) - t, t)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 20])
def test_n_step_returns_match_the_definition(n):
    rng = np.random.default_rng(n)
    r, v, nv, term, done = random_batch(rng)
    got = returns.n_step_returns(r, v, 0.9, n, next_values=nv, terminated=term, dones=done)
    want = np.array([[n_step_by_hand(r[i], nv[i], term[i], done[i], 0.9, n, t) for t in range(r.shape[1])]
                     for i in range(r.shape[0])])
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_td_residuals_are_one_step_advantages():
    rng = np.random.default_rng(0)
    r, v, nv, term, done = random_batch(rng)
    delta = returns.td_residuals(r, v, 0.95, next_values=nv, terminated=term)
    np.testing.assert_allclose(delta, r + 0.95 * (1 - term) * nv - v, atol=1e-12)
    np.testing.assert_allclose(
        delta, returns.n_step_returns(r, v, 0.95, 1, next_values=nv, terminated=term, dones=done) - v, atol=1e-12)


@pytest.mark.parametrize("gamma, lam", [(0.9, 0.0), (0.9, 0.5), (0.99, 0.95), (1.0, 0.7), (0.8, 1.0)])
def test_gae_equals_weighted_sum_of_n_step_advantages(gamma, lam):
    rng = np.random.default_rng(int(lam * 100))
    r, v, nv, term, done = random_batch(rng, N=4, T=12)
    kw = dict(next_values=nv, terminated=term, dones=done)
    np.testing.assert_allclose(returns.gae(r, v, gamma, lam, **kw),
                               returns.gae_from_n_step(r, v, gamma, lam, **kw), atol=1e-10)


def test_gae_lambda_zero_is_td_and_lambda_one_is_monte_carlo():
    rng = np.random.default_rng(7)
    r, v, nv, term, done = random_batch(rng)
    kw = dict(next_values=nv, terminated=term)
    np.testing.assert_allclose(returns.gae(r, v, 0.9, 0.0, dones=done, **kw),
                               returns.td_residuals(r, v, 0.9, **kw), atol=1e-12)
    mc = np.array([[mc_by_hand(r[i], nv[i], term[i], done[i], 0.9, t) for t in range(r.shape[1])]
                   for i in range(r.shape[0])])
    np.testing.assert_allclose(returns.gae(r, v, 0.9, 1.0, dones=done, **kw), mc - v, atol=1e-12)


def test_gae_lambda_one_without_critic_bootstrap_is_reward_to_go_minus_v():
    """One terminated episode per row: GAE(1) + V is exactly the (other helper's) reward-to-go."""
    rng = np.random.default_rng(3)
    r, v = rng.normal(size=(2, 6)), rng.normal(size=(2, 6))
    term = np.zeros((2, 6))
    term[:, -1] = 1
    np.testing.assert_allclose(returns.gae(r, v, 0.97, 1.0, terminated=term) + v,
                               returns.reward_to_go(r, 0.97), atol=1e-12)


def test_default_next_values_shift_and_last_value():
    r = np.array([[1.0, 2.0, 3.0]])
    v = np.array([[0.5, 0.25, 0.125]])
    delta = returns.td_residuals(r, v, 0.5, last_value=np.array([4.0]))
    np.testing.assert_allclose(delta, [[1 + 0.5 * 0.25 - 0.5, 2 + 0.5 * 0.125 - 0.25, 3 + 0.5 * 4 - 0.125]])


def test_truncation_bootstraps_and_termination_does_not():
    r, v = np.ones((1, 2)), np.zeros((1, 2))
    nv = np.array([[7.0, 9.0]])  # V of the final observation after step 0, then of the next state
    done = np.array([[1.0, 0.0]])
    trunc = returns.gae(r, v, 0.5, 0.9, next_values=nv, terminated=np.zeros((1, 2)), dones=done)
    term = returns.gae(r, v, 0.5, 0.9, next_values=nv, terminated=done, dones=done)
    np.testing.assert_allclose(trunc, [[1 + 0.5 * 7, 1 + 0.5 * 9]])
    np.testing.assert_allclose(term, [[1.0, 1 + 0.5 * 9]])  # nothing flows from step 1 into step 0


def test_mask_treats_padding_as_the_end():
    rng = np.random.default_rng(5)
    r, v = rng.normal(size=(2, 5)), rng.normal(size=(2, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=float)
    got = returns.gae(r, v, 0.9, 0.8, mask=mask)
    short = returns.gae(r[:1, :3], v[:1, :3], 0.9, 0.8)
    np.testing.assert_allclose(got[0, :3], short[0])
    assert np.all(got[0, 3:] == 0)
    np.testing.assert_allclose(got, returns.gae_from_n_step(r, v, 0.9, 0.8, mask=mask), atol=1e-12)


def test_torch_and_numpy_agree_and_targets_are_detached():
    rng = np.random.default_rng(11)
    r, v, nv, term, done = random_batch(rng)
    vt = torch.tensor(v, requires_grad=True)
    kw = dict(next_values=nv, terminated=term, dones=done)
    out = returns.gae(torch.tensor(r), vt, 0.9, 0.95, **{k: torch.tensor(x) for k, x in kw.items()})
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    np.testing.assert_allclose(out.numpy(), returns.gae(r, v, 0.9, 0.95, **kw), atol=1e-12)


def test_bad_arguments_are_named():
    r = np.zeros((2, 3))
    with pytest.raises(ValueError, match="gae_lambda"):
        returns.gae(r, r, 0.9, 1.5)
    with pytest.raises(ValueError, match="n must be"):
        returns.n_step_returns(r, r, 0.9, 0)
    with pytest.raises(ValueError, match="values"):
        returns.td_residuals(r, np.zeros((2, 4)), 0.9)
    with pytest.raises(ValueError, match="last_value"):
        returns.gae(r, r, 0.9, 0.9, next_values=r, last_value=np.zeros(2))
