"""Ziegler et al.'s adaptive KL controller: the update against hand computations, the closed loop it
steers, and the trainers that use it (each seed its own controller)."""
import math

import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse.tasks import AdditionTask
from rlcourse.lm import load_checkpoint
from rlcourse.lm.scalar_head import ScalarHeadModel
from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer, adaptive_kl_coef
from rlcourse.trainers.ppo_rlhf_seeds import SeedBatchedPPORLHFTrainer


@pytest.mark.parametrize("kl, expected", [
    (9.0, 0.1 * (1 + 0.2 * 64 / 10_000)),      # 9 / 6 - 1 = 0.5, clipped to 0.2: the coefficient grows
    (6.6, 0.1 * (1 + 0.1 * 64 / 10_000)),      # 6.6 / 6 - 1 = 0.1, inside the clip
    (6.0, 0.1),                                 # on target: unchanged
    (4.5, 0.1 * (1 - 0.2 * 64 / 10_000)),      # 4.5 / 6 - 1 = -0.25, clipped to -0.2
    (0.0, 0.1 * (1 - 0.2 * 64 / 10_000)),      # no KL at all: the largest step down
])
def test_update_against_hand_computations(kl, expected):
    got = adaptive_kl_coef(0.1, kl, target=6.0, n_steps=64, horizon=10_000)
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_papers_k_beta_and_the_codes_horizon_are_one_rate():
    # Ziegler et al.: beta <- beta (1 + K_beta e) with K_beta = 0.1; their code: K_beta = n_steps / horizon.
    e = 7.2 / 6.0 - 1                                                 # 0.2, exactly at the clip
    paper = adaptive_kl_coef(0.05, 7.2, target=6.0, n_steps=1, horizon=1, k_beta=0.1)
    code = adaptive_kl_coef(0.05, 7.2, target=6.0, n_steps=1_000, horizon=10_000)
    assert paper == pytest.approx(0.05 * (1 + 0.1 * e)) and code == pytest.approx(paper)
    assert adaptive_kl_coef(0.05, 7.2, target=6.0, n_steps=64, horizon=100, k_beta=0.5) == \
        pytest.approx(0.05 * (1 + 0.5 * 0.2 * 0.64))


def test_the_closed_loop_reaches_the_target_from_either_side():
    """Against a toy policy whose KL falls as the coefficient grows, KL = c / beta, the controller
    settles at beta* = c / target from starting values 100 times apart, with a step of at most 20%."""
    c, target = 0.3, 1.5
    for beta in (0.002, 0.2):
        path = [beta]
        for _ in range(200):
            path.append(adaptive_kl_coef(path[-1], c / path[-1], target=target, n_steps=64, horizon=64))
        steps = [b / a for a, b in zip(path, path[1:])]
        assert all(0.8 - 1e-12 <= s <= 1.2 + 1e-12 for s in steps)
        assert path[-1] == pytest.approx(c / target, rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kl_coef=0.0), "kl_coef"), (dict(target=0.0), "target"), (dict(horizon=-1.0), "horizon"),
    (dict(n_steps=0), "n_steps"), (dict(kl=float("nan")), "kl"), (dict(k_beta=-0.1), "k_beta")])
def test_bad_arguments_are_refused(kwargs, match):
    args = dict(kl_coef=0.1, kl=1.0, target=6.0, n_steps=64, horizon=10_000) | kwargs
    with pytest.raises(ValueError, match=match):
        adaptive_kl_coef(args.pop("kl_coef"), args.pop("kl"), **args)


def test_config_defaults_keep_the_coefficient_fixed():
    cfg = PPOConfig()
    assert (cfg.adap_kl_ctrl, cfg.target, cfg.horizon) == (False, 6.0, 10_000.0)   # TRL <= 0.11's target and horizon
    with pytest.raises(ValueError, match="initial kl_coef"):
        PPOConfig(adap_kl_ctrl=True, kl_coef=0.0)
    with pytest.raises(ValueError, match="target"):
        PPOConfig(target=0.0)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("addition-partial", device="cpu")


def _config(**kwargs):
    return PPOConfig(**{**dict(batch_size=8, response_length=6, num_ppo_epochs=1, learning_rate=1e-3, kl_coef=0.2,
                               adap_kl_ctrl=True, target=0.05, horizon=16.0), **kwargs})


def test_the_trainer_shapes_each_batch_with_the_coefficient_it_logs(checkpoint):
    model, tok = checkpoint
    task = AdditionTask()
    trainer = PPORLHFTrainer(_config(), model, tok, task.reward, ScalarHeadModel(model, head_std=0.0), task.prompts)
    history = trainer.train(4, progress=False)
    coef = 0.2
    for row in history:
        assert row["objective/kl_coef"] == pytest.approx(coef, rel=1e-12)
        # the penalty of this batch was shaped with this coefficient: non_score_reward = -kl_coef * objective/kl
        assert row["objective/non_score_reward"] == pytest.approx(-coef * row["objective/kl"], rel=1e-5, abs=1e-7)
        coef = adaptive_kl_coef(coef, row["objective/kl"], target=0.05, n_steps=8, horizon=16.0)
    assert trainer.kl_coef == pytest.approx(coef, rel=1e-12)
    assert trainer.config.kl_coef == 0.2   # the config is not moved
    fixed = PPORLHFTrainer(_config(adap_kl_ctrl=False), model, tok, task.reward, ScalarHeadModel(model, head_std=0.0),
                           task.prompts)
    fixed.train(1, progress=False)
    assert "objective/kl_coef" not in fixed.history[0] and fixed.kl_coef == 0.2


def test_each_seed_has_its_own_controller(checkpoint):
    model, tok = checkpoint
    task = AdditionTask()
    trainer = SeedBatchedPPORLHFTrainer(_config(), model, tok, task.reward, ScalarHeadModel(model, head_std=0.0),
                                        task.prompts, seeds=[3, 4])
    trainer.kl_coef[1] = 0.5        # seed 4 starts elsewhere: each seed's coefficient must follow its own path
    trainer.train(3, progress=False)
    for s, history in enumerate(trainer.history):
        coef = (0.2, 0.5)[s]
        for row in history:
            assert row["objective/kl_coef"] == pytest.approx(coef, rel=1e-12)
            assert row["objective/non_score_reward"] == pytest.approx(-coef * row["objective/kl"], rel=1e-5, abs=1e-7)
            coef = adaptive_kl_coef(coef, row["objective/kl"], target=0.05, n_steps=8, horizon=16.0)
        assert trainer.kl_coef[s] == pytest.approx(coef, rel=1e-12)
    # the rewards of seed s are shaped with seed s's coefficient
    batch = trainer.rollout([p for seed in trainer.seeds for p in task.prompts(8, seed * 100_003 + 3)])
    rewards, kl = trainer.token_rewards(batch)
    for s in range(2):
        rows = slice(8 * s, 8 * s + 8)
        penalty = (rewards[rows].sum(1) - batch["scores"][rows])
        assert torch.allclose(penalty, -trainer.kl_coef[s] * kl[rows].sum(1), atol=1e-6)
    assert math.isfinite(sum(trainer.kl_coef))
