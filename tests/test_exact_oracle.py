"""The enumerable LM policy: its sums against brute force and finite differences, and the
estimator facts lessons 09-10 rely on (RLOO unbiased, batch mean shrinks by (K-1)/K, which KL
each k-estimator descends)."""
import pytest

import rlcourse  # noqa: F401
import torch

from rlcourse.kl import kl_k1, kl_k2, kl_k3
from rlcourse.measure.exact_gradient import (ESTIMATORS, EnumerablePolicy, estimator_stats, expected_gradient,
                                      gradient_estimates)


def _policy_and_rewards(n_prompts=1, seed=0):
    pol = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=n_prompts, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(n_prompts, pol.n_completions, generator=gen) < 0.4).float()
    return pol, rewards


def test_completions_are_enumerated_and_probabilities_sum_to_one():
    pol = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=2)
    assert pol.n_completions == 1 + 3 * 4
    assert torch.allclose(pol.probs().sum(1), torch.ones(2))
    # Brute force: token by token from the softmax rows.
    row = torch.softmax(pol.logits.detach(), -1)
    for c, (ids, m) in enumerate(zip(pol.completions.tolist(), pol.mask.tolist())):
        p, prefix = 1.0, ()
        for tok, real in zip(ids, m):
            if real:
                p = p * row[0, pol.state_index[prefix], tok]
                prefix = prefix + (tok,)
        assert abs(float(pol.probs().detach()[0, c]) - float(p)) < 1e-6
    assert pol.lengths.tolist()[0] == 1 and max(pol.lengths.tolist()) == 2


def test_sampling_frequencies_match_probabilities():
    pol, _ = _policy_and_rewards()
    draws = pol.sample(200_000, torch.Generator().manual_seed(1))
    freq = torch.bincount(draws[0], minlength=pol.n_completions).float() / draws.shape[1]
    assert torch.allclose(freq, pol.probs()[0].detach(), atol=4e-3)


def test_exact_gradient_matches_finite_differences():
    pol, rewards = _policy_and_rewards(n_prompts=2)
    grad = pol.flat_grad(pol.objective(rewards))
    flat = pol.logits.detach().reshape(-1)
    h = 1e-3
    for i in range(0, flat.numel(), 5):
        plus, minus = flat.clone(), flat.clone()
        plus[i] += h
        minus[i] -= h
        with torch.no_grad():
            jp = (pol.logprobs(plus.view_as(pol.logits)).exp() * rewards).sum(1).mean()
            jm = (pol.logprobs(minus.view_as(pol.logits)).exp() * rewards).sum(1).mean()
        assert abs(float((jp - jm) / (2 * h)) - float(grad[i])) < 1e-4


def test_score_matrix_rows_are_gradients_of_log_probabilities():
    pol, _ = _policy_and_rewards(n_prompts=2)
    scores = pol.score_matrix()
    for p, c in [(0, 0), (1, 5), (0, 12)]:
        assert torch.allclose(scores[p, c], pol.flat_grad(pol.logprobs()[p, c]), atol=1e-6)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_estimator_bias(K):
    pol, rewards = _policy_and_rewards()
    exact = pol.flat_grad(pol.objective(rewards))
    scores = pol.score_matrix()
    gen = torch.Generator().manual_seed(K)
    stats = {e: estimator_stats(gradient_estimates(pol, rewards, K, e, 20_000, gen, scores), exact)
             for e in ESTIMATORS}
    for unbiased in ("reinforce", "rloo"):
        assert stats[unbiased]["bias"] < 5 * stats[unbiased]["bias_se"], (unbiased, stats[unbiased])
    assert abs(stats["batch_mean"]["scale"] - (K - 1) / K) < 0.03
    assert abs(stats["grpo"]["scale"] - 1) > 0.2                  # the std scaling is not unbiased
    # A constant added to every reward: the baselines remove it, plain REINFORCE's variance grows.
    shifted = {e: estimator_stats(gradient_estimates(pol, rewards + 1.0, K, e, 20_000, gen, scores), exact)
               for e in ("reinforce", "rloo")}
    assert shifted["reinforce"]["variance"] > 2 * stats["reinforce"]["variance"]
    assert abs(shifted["rloo"]["variance"] / stats["rloo"]["variance"] - 1) < 0.1


def test_gradient_estimates_reject_bad_arguments():
    pol, rewards = _policy_and_rewards()
    with pytest.raises(ValueError, match="estimator"):
        gradient_estimates(pol, rewards, 4, "ppo", 10)
    with pytest.raises(ValueError, match="K"):
        gradient_estimates(pol, rewards, 1, "rloo", 10)
    with pytest.raises(ValueError, match="rewards"):
        gradient_estimates(pol, rewards[:, :3], 4, "rloo", 10)


def test_which_kl_each_estimator_descends():
    pol, _ = _policy_and_rewards()
    ref = pol.logprobs().detach()
    with torch.no_grad():
        pol.logits.add_(0.5 * torch.randn(pol.logits.shape, generator=torch.Generator().manual_seed(3)))
    reverse = pol.flat_grad(pol.kl(ref))
    forward = pol.flat_grad(pol.kl(ref, reverse=False))
    in_loss = {n: expected_gradient(pol, lambda p, k=k: k(p.logprobs(), ref))
               for n, k in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3))}
    assert in_loss["k1"].norm() < 1e-6                          # E[grad log pi] = 0
    assert torch.allclose(in_loss["k2"], reverse, atol=1e-5)   # k2 in the loss: KL(pi || ref)
    assert torch.allclose(in_loss["k3"], forward, atol=1e-5)   # k3 in the loss: KL(ref || pi)
    assert not torch.allclose(reverse, forward, atol=1e-2)
    k1_reward = expected_gradient(pol, lambda p: kl_k1(p.logprobs(), ref).detach() * p.logprobs())
    assert torch.allclose(k1_reward, reverse, atol=1e-5)       # k1 in the reward: KL(pi || ref)
