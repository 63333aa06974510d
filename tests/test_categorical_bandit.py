"""The categorical-bandit oracle: the KL-regularised optimum in closed form, and DPO converging to it."""
import numpy as np
import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.measure.categorical_bandit import CategoricalBandit, train_tabular_policy


@pytest.fixture(scope="module")
def bandit():
    return CategoricalBandit.random(n_prompts=3, n_answers=5, reward_scale=1.5, seed=0)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_closed_form_beats_every_perturbation_and_its_value_is_beta_log_z(bandit, beta):
    best = bandit.optimal_logprobs(beta)
    value = bandit.objective(best, beta)
    assert torch.allclose(value, beta * bandit.log_partition(beta))
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        other = torch.log_softmax(best + 0.3 * torch.randn(best.shape, generator=gen, dtype=torch.float64), -1)
        assert (bandit.objective(other, beta) <= value + 1e-12).all()


def test_optimum_found_by_gradient_ascent_is_the_closed_form(bandit):
    beta = 0.5
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=0.05)
    for _ in range(2000):
        loss = -bandit.objective(torch.log_softmax(logits, -1), beta).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # probabilities, not logs: answers with tiny mass converge slowly and barely matter
    assert torch.allclose(torch.softmax(logits, -1), bandit.optimal_logprobs(beta).exp(), atol=1e-4)


def test_reward_through_the_policy_and_partition_cancels(bandit):
    beta = 0.3
    best = bandit.optimal_logprobs(beta)
    recovered = bandit.implicit_reward(best, beta) + beta * bandit.log_partition(beta)[:, None]
    assert torch.allclose(recovered, bandit.reward)
    # Bradley-Terry on implicit rewards (no Z) equals Bradley-Terry on the true rewards
    r_hat = bandit.implicit_reward(best, beta)
    prompts, a, b = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 4]), torch.tensor([3, 2, 0])
    assert torch.allclose(torch.sigmoid(r_hat[prompts, a] - r_hat[prompts, b]),
                          bandit.preference_probability(prompts, a, b))


def test_sampled_preferences_follow_bradley_terry(bandit):
    pairs = bandit.sample_pairs(40000, rng=0)
    assert not torch.any(pairs["chosen"] == pairs["rejected"])
    x, w, l = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    # for one ordered pair of answers, the winning frequency matches the model's probability
    sel = (x == 0) & (((w == 0) & (l == 1)) | ((w == 1) & (l == 0)))
    freq = float(((w == 0) & sel).sum()) / float(sel.sum())
    p = float(bandit.preference_probability(0, 0, 1))
    assert abs(freq - p) < 4 * np.sqrt(p * (1 - p) / float(sel.sum()))
    det = bandit.sample_pairs(2000, rng=0, deterministic=True)
    assert torch.all(bandit.reward[det["prompt"], det["chosen"]] > bandit.reward[det["prompt"], det["rejected"]])


def test_dpo_converges_to_the_optimum_as_data_grows(bandit):
    beta = 0.5
    target = bandit.optimal_logprobs(beta)
    kls, errors = [], []
    for n in (300, 30000):
        fit = train_tabular_policy(bandit, bandit.sample_pairs(n, rng=2), beta, steps=400, lr=0.3)
        kls.append(float(bandit.kl(fit["logprobs"], target).mean()))
        gap = bandit.implicit_reward(fit["logprobs"], beta) - bandit.reward
        errors.append(float((gap - gap.mean(-1, keepdim=True)).abs().max()))
    assert kls[1] < kls[0] / 5 and kls[1] < 2e-3
    assert errors[1] < 0.15          # the reward is recovered up to a per-prompt constant


def test_deterministic_preferences_dpo_diverges_ipo_stays_at_its_target():
    beta = 0.5
    two = CategoricalBandit.random(n_prompts=2, n_answers=2, seed=3)
    pairs = two.sample_pairs(200, rng=0, deterministic=True)
    dpo = train_tabular_policy(two, pairs, beta, steps=600, lr=0.1, record_every=100)
    ipo = train_tabular_policy(two, pairs, beta, loss_type="ipo", steps=600, lr=0.1, record_every=100)
    assert dpo["margins"][-1] > dpo["margins"][3] > 4 / beta          # still growing, far past IPO's
    assert ipo["margins"][-1] == pytest.approx(1 / (2 * beta), abs=1e-3)
    assert ipo["kl"][-1] < dpo["kl"][-1] / 5


def test_bad_bandits_are_refused():
    with pytest.raises(ValueError, match="normalised"):
        CategoricalBandit(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        CategoricalBandit(torch.log_softmax(torch.zeros(2, 3), -1), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="finite"):
        CategoricalBandit(torch.log_softmax(torch.zeros(1, 2), -1), torch.tensor([[0.0, float("nan")]]))
    b = CategoricalBandit.random(2, 3)
    with pytest.raises(ValueError, match="beta"):
        b.optimal_logprobs(0.0)
    with pytest.raises(ValueError, match="n must"):
        b.sample_pairs(0)
    with pytest.raises(ValueError, match="steps"):
        train_tabular_policy(b, b.sample_pairs(3, rng=0), 0.1, steps=0)
