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
    # Learning, judged on three seeds (one seed's return at 12k steps ranged 93-216 across seeds):
    # every seed at least quadruples its first episodes' return, and their mean passes 120.
    runs = [result] + [train_ppo(total_timesteps=12_288, seed=s, progress=False, target_return=None) for s in (1, 2)]
    firsts = [np.mean(r.episodes.returns[:20]) for r in runs]
    lasts = [r.episodes.last_mean_return(20) for r in runs]
    assert all(last > 4 * first for first, last in zip(firsts, lasts)), (firsts, lasts)
    assert np.mean(lasts) > 120.0, lasts


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


# ---------------------------------------------------------------------------------- never silently wrong
def small_batch(num_envs=2, num_steps=8, seed=0):
    from rlcourse.classic.actor_critic import ActorCritic, RolloutCollector, make_vector_env

    torch.manual_seed(seed)
    agent = ActorCritic(4, 2, hidden=8)
    batch = RolloutCollector(make_vector_env("CartPole-v1", num_envs, seed), seed).collect(
        agent, num_steps, 0.98, 0.8).flat()
    return agent, batch


def test_a_budget_below_one_batch_is_refused_not_silently_skipped():
    with pytest.raises(ValueError, match="total_timesteps=100 is less than one batch"):
        train_ppo(total_timesteps=100, progress=False)            # batch = 8 * 32 = 256
    with pytest.raises(ValueError, match="total_timesteps"):
        PPOConfig(total_timesteps=15, num_envs=2, num_steps=8)


def test_one_sample_minibatches_are_refused_with_norm_adv_and_stay_finite_without():
    # Before: adv.std() of one sample is NaN, and every parameter became NaN after one update.
    with pytest.raises(ValueError, match="num_minibatches=16.*norm_adv"):
        PPOConfig(total_timesteps=16, num_envs=2, num_steps=8, num_minibatches=16)
    result = train_ppo(total_timesteps=32, num_envs=2, num_steps=8, num_minibatches=16, norm_adv=False,
                       update_epochs=2, progress=False, target_return=None)
    params = torch.nn.utils.parameters_to_vector(result.agent.parameters())
    assert torch.isfinite(params).all() and len(result.updates["step"]) == 2


def test_a_nan_advantage_raises_and_leaves_the_parameters_untouched():
    from rlcourse.classic.ppo import ppo_update

    agent, batch = small_batch()
    batch["advantages"][3] = float("nan")
    before = torch.nn.utils.parameters_to_vector(agent.parameters()).clone()
    # Caught before the first minibatch step (a later minibatch must not find it half-way through).
    for norm_adv in (True, False):
        cfg = PPOConfig(total_timesteps=16, num_envs=2, num_steps=8, num_minibatches=2, norm_adv=norm_adv)
        with pytest.raises(ValueError, match=r"batch\['advantages'\] hold nan or inf"):
            ppo_update(agent, torch.optim.Adam(agent.parameters()), batch, cfg)
        assert torch.equal(torch.nn.utils.parameters_to_vector(agent.parameters()), before)


def test_advantages_are_whitened_with_the_population_std():
    """One SGD step (lr 1) on 2 transitions moves the actor by mean(A_norm grad log pi) exactly, with
    A_norm = (A - mean) / (std_ddof0 + 1e-8) = +-1 here; CleanRL's ddof=1 would give +-1/sqrt(2)."""
    import copy

    from rlcourse.classic.ppo import ppo_update

    agent, batch = small_batch(num_envs=1, num_steps=2, seed=3)
    adv = batch["advantages"].double().numpy()
    assert adv[0] != adv[1]
    a_norm = (adv - adv.mean()) / (adv.std(ddof=0) + 1e-8)
    oracle = copy.deepcopy(agent)
    logp, _ = oracle.logprob_entropy(batch["obs"], batch["actions"])
    (logp * torch.as_tensor(a_norm, dtype=logp.dtype)).mean().backward()
    expected_step = torch.cat([p.grad.reshape(-1) for p in oracle.actor.parameters()])
    cfg = PPOConfig(total_timesteps=2, num_envs=1, num_steps=2, update_epochs=1, max_grad_norm=1e9)
    before = torch.nn.utils.parameters_to_vector(agent.actor.parameters()).clone()
    ppo_update(agent, torch.optim.SGD(agent.parameters(), lr=1.0), batch, cfg)
    moved = torch.nn.utils.parameters_to_vector(agent.actor.parameters()) - before
    torch.testing.assert_close(moved, expected_step, atol=1e-6, rtol=1e-5)
    assert np.allclose(np.abs(a_norm), 1.0)


@pytest.mark.parametrize("loss_type", ["clip", "penalty"])
def test_update_kl_is_the_exact_kl_old_to_new_measured_by_a_loop(loss_type):
    import copy

    from rlcourse.classic.ppo import ppo_update

    agent, batch = small_batch(seed=1)
    old = copy.deepcopy(agent)
    cfg = PPOConfig(total_timesteps=16, num_envs=2, num_steps=8, num_minibatches=2, update_epochs=4,
                    learning_rate=3e-2, loss_type=loss_type)
    out = ppo_update(agent, torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate), batch, cfg,
                     torch.Generator().manual_seed(0))
    with torch.no_grad():
        p_old = torch.softmax(old.logits(batch["obs"]).double(), -1).numpy()
        p_new = torch.softmax(agent.logits(batch["obs"]).double(), -1).numpy()
    per_state = [sum(p * np.log(p / q) for p, q in zip(po, pn)) for po, pn in zip(p_old, p_new)]
    assert out["update_kl"] == pytest.approx(np.mean(per_state), rel=1e-3, abs=1e-7)
    assert out["update_kl"] > 1e-4     # the update did move the policy
