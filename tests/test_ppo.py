"""The PPO trainer: settings are validated, diagnostics are recorded, and it learns CartPole."""
import numpy as np
import pytest
import torch

import rlcourse  # noqa: F401
from rlcourse.classic.ppo import DIAGNOSTICS, PPOConfig, clip_table, explained_variance, train_ppo


def test_clip_table_values_and_selected_branches():
    values, branch = clip_table()
    np.testing.assert_array_equal(values, [[-4.0, -5.0, -7.5], [-0.8, -1.0, -1.5], [0.5, 1.0, 1.2], [2.5, 5.0, 6.0]])
    assert branch.tolist() == [["clipped", "equal", "unclipped"], ["clipped", "equal", "unclipped"],
                               ["unclipped", "equal", "clipped"], ["unclipped", "equal", "clipped"]]


def test_config_is_validated_with_named_arguments():
    with pytest.raises(ValueError, match="num_minibatches"):
        PPOConfig(num_envs=3, num_steps=5, num_minibatches=4)
    with pytest.raises(ValueError, match="gae_lambda"):
        PPOConfig(gae_lambda=1.5)
    with pytest.raises(TypeError):
        train_ppo(not_a_setting=1)


def test_explained_variance():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(t, t) == 1.0
    assert explained_variance(torch.full((4,), 2.5), t) == pytest.approx(0.0)


def test_ppo_learns_and_records_diagnostics():
    torch.set_num_threads(1)
    result = train_ppo(total_timesteps=12_288, seed=0, progress=False, target_return=None)
    n_updates = 12_288 // 256
    assert result.env_steps == 12_288 and result.solved_at_step is None
    for key in DIAGNOSTICS:
        assert len(result.updates[key]) == n_updates, key
    assert np.all(np.array(result.updates["approx_kl"]) >= 0)
    assert 0 < max(result.updates["clip_fraction"]) <= 1
    lr = result.updates["learning_rate"]
    assert lr[0] == pytest.approx(1e-3) and lr[-1] < lr[0]  # annealed
    first = np.mean(result.episodes.returns[:20])
    assert result.episodes.last_mean_return(20) > max(150.0, 5 * first)


def test_ppo_penalty_adapts_beta_by_the_rule_and_learns():
    from rlcourse import losses

    torch.set_num_threads(1)
    result = train_ppo(total_timesteps=12_288, seed=0, progress=False, target_return=None, loss_type="penalty",
                       kl_beta=1.0, kl_target=0.01)
    beta, kl = result.updates["kl_beta"], result.updates["update_kl"]
    assert beta[0] == 1.0 and len(set(beta)) > 1
    for i in range(len(beta) - 1):
        assert beta[i + 1] == losses.adaptive_kl_beta(beta[i], kl[i], 0.01)
    assert result.episodes.last_mean_return(20) > 3 * np.mean(result.episodes.returns[:20])


def test_loss_type_is_validated():
    with pytest.raises(ValueError, match="loss_type"):
        PPOConfig(loss_type="kl")
