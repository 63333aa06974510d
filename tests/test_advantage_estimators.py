"""ReMax and REINFORCE++ advantages by hand, the greedy completion by enumeration, RLOO's exact
variance against enumeration of every group, and the undetached KL-shaped advantage's extra
gradient by autograd (lesson 09)."""
import itertools

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.losses import leave_one_out_advantages, reinforce_plus_plus_advantages, remax_advantages
from rlcourse.measure.exact_gradient import (EnumerablePolicy, estimator_stats, expected_gradient,
                                             gradient_estimates, rloo_variance, undetached_kl_objective)
from rlcourse.regularised_optimum import kl_regularised_optimum


def _policy_and_rewards(n_prompts=1, seed=0):
    pol = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=n_prompts, seed=seed)
    rewards = (torch.rand(n_prompts, pol.n_completions, generator=torch.Generator().manual_seed(seed)) < 0.4).float()
    return pol, rewards


# --- ReMax ---------------------------------------------------------------------------------------

def test_remax_subtracts_each_prompts_greedy_reward():
    rewards = torch.tensor([1.0, 0.0, 0.5,   0.2, 0.9, 0.4])
    greedy = torch.tensor([0.5, 0.9])
    assert torch.allclose(remax_advantages(rewards, greedy, 3), torch.tensor([0.5, -0.5, 0.0, -0.7, 0.0, -0.5]))
    assert torch.allclose(remax_advantages(rewards, rewards, 1), torch.zeros(6))           # K = 1 works
    batches = torch.stack([rewards, rewards + 1])                                          # (N, B)
    out = remax_advantages(batches, torch.stack([greedy, greedy + 1]), 3)
    assert torch.allclose(out[1], out[0])                       # an offset moves the greedy reward too: it cancels


@pytest.mark.parametrize("rewards, greedy, K", [(torch.ones(6), torch.ones(3), 3), (torch.ones(5), torch.ones(2), 2),
                                                (torch.ones(4), torch.tensor([1.0, float("nan")]), 2)])
def test_remax_rejects_bad_inputs(rewards, greedy, K):
    with pytest.raises(ValueError):
        remax_advantages(rewards, greedy, K)


# --- REINFORCE++ ---------------------------------------------------------------------------------

def test_reinforce_plus_plus_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # K = 1: mean 0.25, Bessel std sqrt(0.75 / 3) = 0.5
    assert torch.allclose(reinforce_plus_plus_advantages(r, std_floor=0.0), torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # K = 2: centred per group (0.5, -0.5, 0, 0), then the batch std sqrt(0.5 / 3), not each group's own
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (0.5 / 3) ** 0.5
    assert torch.allclose(reinforce_plus_plus_advantages(r, 2, std_floor=0.0), expected)
    # the floor is added to the std
    assert torch.allclose(reinforce_plus_plus_advantages(r, 2, std_floor=0.1),
                          torch.tensor([0.5, -0.5, 0.0, 0.0]) / ((0.5 / 3) ** 0.5 + 0.1))


def test_reinforce_plus_plus_token_statistics_equal_normalising_every_token():
    """The paper's statistics are over tokens: repeating each completion's advantage once per token
    and taking torch's mean and std of that list is the independent oracle."""
    gen = torch.Generator().manual_seed(0)
    rewards, lengths = torch.rand(12, generator=gen), torch.randint(1, 6, (12,), generator=gen)
    for K in (1, 3, 4):
        grouped = rewards.view(-1, K)
        centred = (grouped - grouped.mean(1, keepdim=True) if K > 1 else grouped).reshape(-1)
        tokens = centred.repeat_interleave(lengths)
        expected = (centred - tokens.mean()) / (tokens.std() + 1e-4)
        assert torch.allclose(reinforce_plus_plus_advantages(rewards, K, lengths=lengths), expected, atol=1e-6)
    # rows of a (N, B) input are independent batches
    rows = torch.stack([rewards, 3 * rewards, rewards.flip(0)])
    lens = torch.stack([lengths, lengths, lengths.flip(0)])
    out = reinforce_plus_plus_advantages(rows, 4, lengths=lens)
    for n in range(3):
        assert torch.allclose(out[n], reinforce_plus_plus_advantages(rows[n], 4, lengths=lens[n]))


def test_reinforce_plus_plus_equal_rewards_give_exact_zeros():
    for dtype in (torch.float32, torch.float64):
        r = torch.full((16,), 0.3, dtype=dtype)
        assert torch.equal(reinforce_plus_plus_advantages(r, 4), torch.zeros(16, dtype=dtype))
        assert torch.equal(reinforce_plus_plus_advantages(r), torch.zeros(16, dtype=dtype))


@pytest.mark.parametrize("kwargs", [dict(rewards=torch.ones(1)), dict(rewards=torch.ones(6), num_generations=4),
                                    dict(rewards=torch.ones(4), num_generations=0),
                                    dict(rewards=torch.ones(4), std_floor=-1.0),
                                    dict(rewards=torch.tensor([1.0, float("inf")])),
                                    dict(rewards=torch.ones(4), lengths=torch.tensor([1, 0, 2, 3])),
                                    dict(rewards=torch.ones(4), lengths=torch.ones(3))])
def test_reinforce_plus_plus_rejects_bad_inputs(kwargs):
    with pytest.raises(ValueError):
        reinforce_plus_plus_advantages(**kwargs)


# --- the oracle: greedy completion, ReMax and REINFORCE++ rows --------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_completion_is_the_one_whose_every_token_is_its_rows_argmax(seed):
    pol = EnumerablePolicy(vocab_size=4, max_len=3, n_prompts=3, seed=seed)
    best = pol.logits.detach().argmax(-1)
    for p in range(pol.n_prompts):
        argmax_everywhere = [c for c in range(pol.n_completions)
                             if all(int(best[p, pol.states[c, t]]) == int(pol.completions[c, t])
                                    for t in range(int(pol.lengths[c])))]
        assert argmax_everywhere == [int(pol.greedy_completions()[p])]


def test_remax_and_reinforce_plus_plus_on_the_oracle():
    pol, rewards = _policy_and_rewards()
    exact = pol.flat_grad(pol.objective(rewards))
    scores, gen = pol.score_matrix(), torch.Generator().manual_seed(4)
    J = float(pol.objective(rewards).detach())
    sigma = (J * (1 - J)) ** 0.5                                                # a 0/1 reward's std
    remax = {off: estimator_stats(gradient_estimates(pol, rewards + off, 4, "remax", 20_000, gen, scores), exact)
             for off in (0.0, 1.0)}
    for s in remax.values():
        assert s["bias"] < 5 * s["bias_se"], s                                  # unbiased, offset or not
    assert abs(remax[1.0]["variance"] / remax[0.0]["variance"] - 1) < 0.1       # the greedy reward carries the offset
    scaled = [estimator_stats(gradient_estimates(pol, rewards, K, "reinforce_pp", 20_000, gen, scores),
                              exact)["scale"] * sigma for K in (2, 4, 16)]
    assert scaled[0] < scaled[1] < scaled[2] < 1                                # towards grad J / sigma as B grows


# --- RLOO's variance -------------------------------------------------------------------------------

def _rloo_variance_by_enumeration(pol, rewards, K):
    """trace Cov of the RLOO estimate, summing over every tuple of K completions of every prompt."""
    probs, scores = pol.probs().detach(), pol.score_matrix()
    P, C = probs.shape
    per_prompt = []
    for p in range(P):
        tuples = torch.tensor(list(itertools.product(range(C), repeat=K)))            # (C^K, K)
        weight = probs[p][tuples].prod(1)
        adv = leave_one_out_advantages(rewards[p][tuples].reshape(-1), K).view(-1, K)
        g = (adv.unsqueeze(-1) * scores[p][tuples]).mean(1)                           # (C^K, D)
        per_prompt.append((weight, g))
    # the estimate is the mean over prompts: enumerate the joint draw (prompts independent)
    weight, g = per_prompt[0]
    for w2, g2 in per_prompt[1:]:
        weight = (weight[:, None] * w2[None]).reshape(-1)
        g = (g[:, None] + g2[None]).reshape(-1, g.shape[-1])
    g = g / P
    mean = (weight[:, None] * g).sum(0)
    return float((weight * ((g - mean) ** 2).sum(1)).sum())


@pytest.mark.parametrize("n_prompts, K", [(1, 2), (1, 3), (1, 4), (2, 2)])
def test_rloo_variance_matches_enumeration(n_prompts, K):
    pol, rewards = _policy_and_rewards(n_prompts, seed=n_prompts + K)
    rewards = rewards + 0.5 * torch.rand(rewards.shape, generator=torch.Generator().manual_seed(9))   # not only 0/1
    assert rloo_variance(pol, rewards, K) == pytest.approx(_rloo_variance_by_enumeration(pol, rewards, K), rel=1e-4)


def test_rloo_variance_falls_like_one_over_k_minus_one():
    """The closed form's leading term is sigma_c^2 / (K-1); the rest is O(1/K^2)."""
    pol, rewards = _policy_and_rewards()
    v = {K: rloo_variance(pol, rewards, K) for K in (2, 16, 1000, 2000)}
    assert abs(v[1000] * 999 / (v[2000] * 1999) - 1) < 1e-3                         # (K-1) Var -> sigma_c^2
    assert abs(v[2] / v[16] - 15) < abs(v[2] / v[16] - 8)
    with pytest.raises(ValueError, match="K"):
        rloo_variance(pol, rewards, 1)


# --- the undetached KL-shaped advantage ---------------------------------------------------------------

def test_undetached_advantage_adds_the_gradient_of_beta_over_2b_sum_log_pi_squared():
    """Autograd on a tiny batch: grad L_undetached - grad L_detached = grad (beta / 2B) sum_i (log pi(y_i))^2."""
    pol, rewards = _policy_and_rewards()
    ref = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=1, seed=1).logprobs().detach()[0]
    idx = pol.sample(6, torch.Generator().manual_seed(0))[0]
    beta, B = 0.3, len(idx)

    def loss(detach):
        logp = pol.logprobs()[0, idx]
        R = rewards[0, idx]
        A = R - R.mean() - beta * (logp - ref[idx])
        return -((A.detach() if detach else A) * logp).mean()

    extra = pol.flat_grad(loss(False)) - pol.flat_grad(loss(True))
    quadratic = pol.flat_grad(beta / (2 * B) * (pol.logprobs()[0, idx] ** 2).sum())
    assert torch.allclose(extra, quadratic, atol=1e-6)
    assert extra.norm() > 1e-2
    # the undetached loss written out: its theta-dependent quadratic part is (beta / B) sum (log pi)^2
    logp = pol.logprobs()[0, idx]
    R = rewards[0, idx]
    written_out = -((R - R.mean() + beta * ref[idx]) * logp).mean() + beta / B * (logp ** 2).sum()
    assert torch.allclose(pol.flat_grad(written_out), pol.flat_grad(loss(False)), atol=1e-6)


def test_undetached_advantage_climbs_an_entropy_bonus_in_expectation():
    pol, rewards = _policy_and_rewards()
    ref = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=1, seed=1).logprobs().detach()
    beta, b = 0.5, 0.2

    def surrogate(detach):
        def f(p):
            logp = p.logprobs()
            A = rewards - b - beta * (logp - ref)
            return -(A.detach() if detach else A) * logp
        return f

    assert torch.allclose(expected_gradient(pol, surrogate(True)),
                          -pol.flat_grad(pol.regularised_objective(rewards, ref, beta)), atol=1e-6)
    assert torch.allclose(expected_gradient(pol, surrogate(False)),
                          -pol.flat_grad(undetached_kl_objective(pol, rewards, ref, beta)), atol=1e-6)
    # its maximiser: objective = 2 beta log Z' - 2 beta KL(pi || pi_bug), pi_bug ~ pi_ref^(1/2) exp(R / 2 beta)
    bug = kl_regularised_optimum(ref / 2, rewards, 2 * beta)
    gaps = []
    for seed in range(3):
        other = EnumerablePolicy(vocab_size=4, max_len=2, n_prompts=1, seed=10 + seed)
        logp = other.logprobs().detach()
        kl = float((logp.exp() * (logp - bug)).sum())
        gaps.append(float(undetached_kl_objective(other, rewards, ref, beta).detach()) + 2 * beta * kl)
    assert max(gaps) - min(gaps) < 1e-5
