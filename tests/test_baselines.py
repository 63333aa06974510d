"""Critic-free baselines and the tabular softmax score, against loops and finite differences."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse import tabular
from rlcourse.classic import baselines
from rlcourse.classic.gradient_estimates import softmax_score


def test_batch_mean_ignores_padding():
    G = np.array([[3.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    assert baselines.batch_mean_baseline(G, mask) == pytest.approx(11 / 4)
    assert float(baselines.batch_mean_baseline(torch.tensor(G), torch.tensor(mask))) == pytest.approx(11 / 4)
    assert baselines.batch_mean_baseline(G) == pytest.approx(11 / 6)
    with pytest.raises(ValueError, match="mask selects no entries"):
        baselines.batch_mean_baseline(G, np.zeros_like(mask))


def test_moving_average_uses_only_earlier_batches():
    means, decay = [4.0, 8.0, -2.0, 6.0], 0.5
    expected, b = [0.0], None
    for m in means[:-1]:  # the definition, step by step
        b = m if b is None else decay * b + (1 - decay) * m
        expected.append(b)
    np.testing.assert_allclose(baselines.moving_average_baselines(means, decay), expected)
    with pytest.raises(ValueError, match="decay must be in"):
        baselines.moving_average_baselines(means, 1.0)


def test_state_value_baseline_is_the_per_state_mean():
    rng = np.random.default_rng(0)
    G = rng.normal(size=(4, 6))
    states = rng.integers(0, 3, size=(4, 6))
    mask = rng.random((4, 6)) < 0.8
    got = baselines.state_value_baseline(G, states, mask, n_states=5)
    for i in range(4):
        for t in range(6):
            if not mask[i, t]:
                assert got[i, t] == 0
                continue
            same = [G[j, k] for j in range(4) for k in range(6) if mask[j, k] and states[j, k] == states[i, t]]
            assert got[i, t] == pytest.approx(np.mean(same))


def test_softmax_score_matches_finite_differences_of_log_pi():
    theta = np.random.default_rng(1).normal(size=(3, 4))
    for s, a in [(0, 0), (1, 3), (2, 2)]:
        fd = np.zeros_like(theta)
        for idx in np.ndindex(theta.shape):
            e = np.zeros_like(theta)
            e[idx] = 1e-6
            fd[idx] = (np.log(tabular.softmax_policy(theta + e)[s, a])
                       - np.log(tabular.softmax_policy(theta - e)[s, a])) / 2e-6
        np.testing.assert_allclose(softmax_score(theta, s, a), fd, atol=1e-8)
