"""The KL-regularised optimum (closed form) and the exact over-optimisation curve of PreferenceTask."""
import rlcourse  # noqa: F401  (before torch)
import itertools

import numpy as np
import pytest
import torch

from rlcourse.measure.overoptimisation import optimum_curve
from rlcourse.tasks.preference import LETTERS, PreferenceTask
from rlcourse.regularised_optimum import kl_regularised_optimum


def objective(p, ref, reward, beta):
    """E_p[r] - beta KL(p || ref), written out for the test."""
    nz = p > 0
    return float((p * reward).sum() - beta * (p[nz] * np.log(p[nz] / ref[nz])).sum())


def test_the_tilted_reference_beats_every_other_policy_on_the_objective():
    rng = np.random.default_rng(0)
    ref = rng.dirichlet(np.ones(6))
    reward = rng.normal(size=6)
    for beta in (0.1, 1.0, 5.0):
        star = kl_regularised_optimum(torch.tensor(ref).log(), torch.tensor(reward), beta).exp().numpy()
        by_hand = ref * np.exp(reward / beta) / (ref * np.exp(reward / beta)).sum()
        assert star == pytest.approx(by_hand, abs=1e-12)
        best = objective(star, ref, reward, beta)
        # the optimum's value is beta log Z
        assert best == pytest.approx(beta * np.log((ref * np.exp(reward / beta)).sum()), abs=1e-10)
        for other in rng.dirichlet(np.ones(6), size=200):
            assert objective(other, ref, reward, beta) <= best + 1e-12


def test_log_space_survives_large_rewards_and_keeps_impossible_answers_impossible():
    ref = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64).log()
    logp = kl_regularised_optimum(ref, torch.tensor([1000.0, 0.0, 5000.0], dtype=torch.float64), 0.01)
    assert torch.isfinite(logp[:2]).all() and logp[2] == -np.inf
    assert float(logp[0].exp()) == pytest.approx(1.0)
    # a large kl_coef leaves the reference as it is; rows are independent along dim
    ref2 = torch.log_softmax(torch.randn(3, 4, dtype=torch.float64), -1)
    assert torch.allclose(kl_regularised_optimum(ref2, torch.randn(3, 4, dtype=torch.float64), 1e9), ref2)


@pytest.mark.parametrize("bad, match", [
    (dict(kl_coef=0.0), "kl_coef"), (dict(kl_coef=float("nan")), "kl_coef"), (dict(kl_coef=True), "kl_coef"),
    (dict(rewards=torch.tensor([0.0, float("nan")])), "rewards must be finite"),
    (dict(rewards=torch.zeros(3)), "same shape"),
])
def test_bad_input_is_named(bad, match):
    args = dict(ref_logprobs=torch.tensor([0.5, 0.5]).log(), rewards=torch.zeros(2), kl_coef=1.0) | bad
    with pytest.raises(ValueError, match=match):
        kl_regularised_optimum(**args)


@pytest.mark.parametrize("length_bias", [0.0, 0.4])
def test_the_curve_equals_a_word_by_word_enumeration(length_bias):
    """A task small enough to list every word: pi* over words, not over classes, gives the same numbers."""
    task = PreferenceTask(target_length=2, max_length=3, beta=3.0, length_bias=length_bias)
    words = ["".join(w) for n in range(1, 4) for w in itertools.product(LETTERS, repeat=n)]
    ref = np.array([1 / 3 * 8.0 ** -len(w) for w in words])
    prompts = ["ab:", "ce:", "hh:"]
    coefs = [3.0, 0.5, 0.1]
    rows = optimum_curve(task, coefs, prompts=prompts)
    for coef, row in zip(coefs, rows):
        kl, gold, proxy, length = [], [], [], []
        for prompt in prompts:
            g = np.array([task.gold_score(prompt, w) for w in words])
            r = task.beta * np.array([task.rater_utility(prompt, w) for w in words])
            p = ref * np.exp((r - r.max()) / coef)
            p /= p.sum()
            kl.append((p * np.log(p / ref)).sum()); gold.append(p @ g); proxy.append(p @ r)
            length.append(p @ np.array([len(w) for w in words]))
        assert row["kl"] == pytest.approx(np.mean(kl), abs=1e-10)
        assert row["gold"] == pytest.approx(np.mean(gold), abs=1e-10)
        assert row["proxy"] == pytest.approx(np.mean(proxy), abs=1e-10)
        assert row["length"] == pytest.approx(np.mean(length), abs=1e-10)


def test_unbiased_raters_give_a_curve_that_only_rises_and_biased_ones_one_that_peaks():
    coefs = [10, 3, 1, 0.3, 0.1, 0.05, 0.02, 0.01]
    fair = optimum_curve(PreferenceTask(), coefs)
    assert all(a["kl"] < b["kl"] and a["gold"] < b["gold"] for a, b in zip(fair, fair[1:]))
    biased = optimum_curve(PreferenceTask(length_bias=0.26), coefs)
    gold = [r["gold"] for r in biased]
    top = int(np.argmax(gold))
    assert 0 < top < len(coefs) - 1 and gold[top] - gold[0] > 0.2 and gold[top] - gold[-1] > 0.2
    assert all(a["proxy"] < b["proxy"] for a, b in zip(biased, biased[1:]))   # the proxy never stops rising
