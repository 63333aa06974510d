"""The off-policy corrections (rlcourse.losses.off_policy) against hand-worked numbers, and the exact
mean and variance of the corrected estimators (rlcourse.measure.exact_off_policy) against closed forms and
against Monte-Carlo sampling. TRL parity: tests/test_trl_parity_off_policy.py."""
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.measure.exact_gradient import EnumerablePolicy
from rlcourse.measure.exact_off_policy import exact_off_policy_gradient, perturbed_logits, token_scores
from rlcourse.losses.off_policy import (SAMPLER_IS_MODES, check_is_bounds, check_sampler_logprobs,
                                        effective_sample_size, off_policy_sequence_mask, sampler_gap_stats,
                                        sampler_importance_weights)

LOG = math.log
# Two completions: row 0 has three real tokens, row 1 has one (then padding holding junk).
OLD = torch.tensor([[LOG(0.5), LOG(0.2), LOG(0.9)], [LOG(0.3), 5.0, float("nan")]], dtype=torch.float64)
MU = torch.tensor([[LOG(0.25), LOG(0.4), LOG(0.1)], [LOG(0.6), -1.0, -2.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
TOKEN_RATIOS = torch.tensor([[2.0, 0.5, 9.0], [0.5, 1.0, 1.0]], dtype=torch.float64)   # pi_old / mu, 1 on padding
SEQUENCE_RATIOS = torch.tensor([[9.0], [0.5]], dtype=torch.float64)                      # 2 * 0.5 * 9, and 0.5


@pytest.mark.parametrize("mode, clip_min, clip_max, expected", [
    ("token_truncate", None, 3.0, [[2.0, 0.5, 3.0], [0.5, 1.0, 1.0]]),
    ("token_truncate", 0.6, 3.0, [[2.0, 0.6, 3.0], [0.6, 1.0, 1.0]]),
    ("token_truncate", None, None, [[2.0, 0.5, 9.0], [0.5, 1.0, 1.0]]),
    ("token_mask", None, 3.0, [[2.0, 0.5, 0.0], [0.5, 1.0, 1.0]]),
    ("token_mask", 0.6, 3.0, [[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]]),
    ("sequence_truncate", None, 3.0, [[3.0], [0.5]]),
    ("sequence_truncate", 0.6, None, [[9.0], [0.6]]),
    ("sequence_mask", None, 3.0, [[0.0], [0.5]]),
    ("sequence_mask", 0.6, 10.0, [[9.0], [0.0]]),
])
def test_importance_weights_by_hand(mode, clip_min, clip_max, expected):
    got = sampler_importance_weights(OLD, MU, MASK, mode, clip_min, clip_max)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_the_cap_acts_on_the_ratio_after_exponentiating_and_the_weight_is_a_constant():
    old = torch.tensor([[LOG(0.5)]], requires_grad=True)
    mu = torch.tensor([[LOG(0.1)]])                                   # ratio 5, log-ratio 1.61
    w = sampler_importance_weights(old, mu, torch.ones(1, 1), "token_truncate", None, 3.0)
    assert abs(float(w) - 3.0) < 1e-6                                  # min(5, 3), not exp(min(1.61, 3)) = 5
    assert not w.requires_grad


def test_sequence_weight_is_the_product_of_the_token_weights_and_nan_counts_as_no_correction():
    raw = sampler_importance_weights(OLD, MU, MASK, "token_truncate", None, None)
    assert torch.allclose(raw, TOKEN_RATIOS)
    seq = sampler_importance_weights(OLD, MU, MASK, "sequence_truncate", None, None)
    assert torch.allclose(seq, SEQUENCE_RATIOS)
    nan_mu = MU.clone()
    nan_mu[0, 1] = float("nan")                                       # a real token the sampler could not score
    assert torch.allclose(sampler_importance_weights(OLD, nan_mu, MASK, "sequence_truncate", None, None),
                          torch.tensor([[18.0], [0.5]], dtype=torch.float64))


def test_bad_modes_bounds_and_shapes_are_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        sampler_importance_weights(OLD, MU, MASK, "sequence")
    with pytest.raises(ValueError, match="clip_min .* must not exceed clip_max"):
        sampler_importance_weights(OLD, MU, MASK, "token_mask", 3.0, 2.0)
    with pytest.raises(ValueError, match="clip_max must be None or a number >= 0"):
        sampler_importance_weights(OLD, MU, MASK, "token_mask", None, -1.0)
    with pytest.raises(ValueError, match="one shape"):
        sampler_importance_weights(OLD, MU[:, :2], MASK)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min"):
        check_is_bounds("0.5", 3.0, "vllm_importance_sampling_clip_min")


def test_off_policy_sequence_mask_by_hand():
    # per-token gap log mu - log pi over the real tokens: row 0: 0.6, row 1: 0.2, row 2: 0.6, row 3: 0.5 (= delta)
    logp = torch.zeros(4, 3)
    mu = torch.tensor([[0.3, 0.9, 0.6], [0.2, 9.0, 9.0], [0.6, 0.6, 0.6], [0.5, 0.5, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv = torch.tensor([-1.0, -1.0, 0.0, -0.5])
    kept = off_policy_sequence_mask(adv, logp, mu, mask, 0.5)
    # row 0 dropped (A < 0, gap 0.6 > 0.5); row 1 kept (its padding's 9.0 is not counted); row 2 kept (A = 0);
    # row 3 kept: its NaN counts 0, so the gap is (0.5 + 0.5 + 0) / 3 = 0.33 <= 0.5
    assert kept.tolist() == [[0], [1], [1], [1]] and kept.dtype == mask.dtype
    assert off_policy_sequence_mask(adv[:, None], logp, mu, mask, 0.6).tolist() == [[1], [1], [1], [1]]  # gap == delta kept
    with pytest.raises(ValueError, match="threshold must be a number >= 0"):
        off_policy_sequence_mask(adv, logp, mu, mask, -0.1)
    with pytest.raises(ValueError, match="advantages must hold one value per sequence"):
        off_policy_sequence_mask(adv[:3], logp, mu, mask, 0.5)


def test_effective_sample_size_closed_forms():
    assert effective_sample_size(torch.full((7,), 2.5)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([0.0, 0.0, 4.0, 0.0])) == pytest.approx(0.25)
    assert effective_sample_size(torch.tensor([1.0, 3.0])) == pytest.approx(16 / (2 * 10))
    assert effective_sample_size(torch.zeros(3)) == 0.0


def test_gap_stats_by_hand():
    stats = sampler_gap_stats(OLD, MU, MASK, sampler_importance_weights(OLD, MU, MASK, "token_mask", None, 3.0), cap=3.0)
    gaps = torch.tensor([LOG(2), LOG(0.5), LOG(9), LOG(0.5)], dtype=torch.float64)
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx(float(gaps.abs().mean()))
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(LOG(9))
    assert stats["sampling/kl"] == pytest.approx(float(-gaps.mean()))
    assert stats["sampling/token_ratio_std"] == pytest.approx(float(torch.tensor([2.0, 0.5, 9.0, 0.5]).std()))
    assert stats["sampling/token_above_cap"] == pytest.approx(0.25)
    assert stats["sampling/sequence_above_cap"] == pytest.approx(0.5)
    assert stats["sampling/token_outside_cap"] == pytest.approx(0.25)            # 9 only: 2 and 0.5 lie within [1/3, 3]
    assert stats["sampling/sequence_outside_cap"] == pytest.approx(0.5)
    assert sampler_gap_stats(OLD, MU, MASK, cap=1.9)["sampling/token_outside_cap"] == pytest.approx(1.0)
    assert stats["sampling/sequence_ess"] == pytest.approx(9.5 ** 2 / (2 * 81.25))
    assert (stats["sampling/importance_sampling_ratio/min"], stats["sampling/importance_sampling_ratio/max"]) == (0.0, 2.0)
    assert stats["sampling/importance_sampling_ratio/mean"] == pytest.approx(0.75)
    seq = sampler_gap_stats(OLD, MU, MASK, sampler_importance_weights(OLD, MU, MASK, "sequence_truncate", None, 3.0))
    assert seq["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.75)


def test_sampler_logprobs_are_checked_by_name():
    ids, mask = torch.zeros(2, 3, dtype=torch.long), MASK
    good = torch.where(MASK.bool(), MU, torch.zeros_like(MU))
    assert check_sampler_logprobs(good, ids, mask) is good
    junk_on_padding = good.clone()
    junk_on_padding[1, 2] = float("nan")                               # padding may hold anything
    check_sampler_logprobs(junk_on_padding, ids, mask)
    for bad, message in [(good[:, :2], r"sampler_logprobs must have the completions' shape \(2, 3\)"),
                         (torch.where(MASK.bool(), good, 0.0).masked_fill(torch.eye(2, 3).bool(), float("nan")),
                          "sampler_logprobs holds 1 NaN"),            # (0, 0) is real, (1, 1) is padding
                         (good.exp(), "log-probs above 0"),
                         (good.long(), "floating-point")]:
        with pytest.raises(ValueError, match=message):
            check_sampler_logprobs(bad, ids, mask)
    with pytest.raises(TypeError, match="sampler_logprobs must be a torch.Tensor"):
        check_sampler_logprobs(good.tolist(), ids, mask)


# ------------------------------------------------------------------ the exact oracle of the estimators
def _problem(max_len=3, seed=0, vocab_size=4):
    policy = EnumerablePolicy(vocab_size=vocab_size, max_len=max_len, n_prompts=2, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + 1)
    rewards = (torch.rand(2, policy.n_completions, generator=gen, dtype=torch.float64) < 0.4).double()
    return policy, rewards


def _weights(mode, cap):
    return lambda old, mu, mask, adv: sampler_importance_weights(old, mu, mask, mode, None, cap)


def test_with_the_sampler_equal_to_the_policy_every_estimator_is_the_exact_gradient():
    policy, rewards = _problem()
    exact = policy.flat_grad(policy.objective(rewards))
    for fn in [None, *(_weights(m, 2.0) for m in SAMPLER_IS_MODES),
               lambda o, s, m, a: off_policy_sequence_mask(a, o, s, m, 0.1)]:
        result = exact_off_policy_gradient(policy, policy.logits.detach(), rewards, fn)
        assert result["bias"] < 1e-12 and torch.allclose(result["exact"], exact)
        assert result["kl"] == pytest.approx(0.0, abs=1e-12)


def test_the_untruncated_sequence_weight_is_unbiased_and_the_token_weight_only_for_one_token():
    policy, rewards = _problem()
    sampler = perturbed_logits(policy, 1.0, seed=3)
    uncorrected = exact_off_policy_gradient(policy, sampler, rewards)
    sequence = exact_off_policy_gradient(policy, sampler, rewards, _weights("sequence_truncate", None))
    token = exact_off_policy_gradient(policy, sampler, rewards, _weights("token_truncate", None))
    size = float(uncorrected["exact"].norm())
    assert sequence["bias"] < 1e-10 * size
    assert uncorrected["bias"] > 0.1 * size and 1e-3 * size < token["bias"] < uncorrected["bias"]
    one_token, one_rewards = _problem(max_len=1, vocab_size=6)       # completions of one token: no prefix to mismatch
    token_1 = exact_off_policy_gradient(one_token, perturbed_logits(one_token, 1.0, seed=3), one_rewards,
                                        _weights("token_truncate", None))
    assert token_1["bias"] < 1e-10 * float(token_1["exact"].norm())


def test_truncation_trades_bias_for_variance():
    policy, rewards = _problem()
    sampler = perturbed_logits(policy, 1.0, seed=3)
    runs = [exact_off_policy_gradient(policy, sampler, rewards, _weights("sequence_truncate", cap))
            for cap in (0.5, 1.0, 2.0, 5.0, None)]
    biases, variances = [r["bias"] for r in runs], [r["variance"] for r in runs]
    assert all(a > b for a, b in zip(biases, biases[1:])) and biases[-1] < 1e-10
    assert all(a < b for a, b in zip(variances, variances[1:]))


def test_exact_mean_and_variance_match_sampling():
    """The oracle's sums against 40,000 sampled completions per prompt drawn from the sampler."""
    policy, rewards = _problem(seed=4)
    sampler = perturbed_logits(policy, 0.8, seed=5)
    fn = _weights("token_mask", 2.0)
    result = exact_off_policy_gradient(policy, sampler, rewards, fn)
    n = 40_000
    scores = token_scores(policy)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        old, mu = policy.token_logprobs(), policy.token_logprobs(sampler)
    estimates = 0
    for p in range(2):
        idx = torch.multinomial(mu[p].sum(-1).exp(), n, replacement=True, generator=gen)
        adv = rewards[p] - (old[p].sum(-1).exp() * rewards[p]).sum()
        w = fn(old[p], mu[p], policy.mask, adv) * policy.mask
        g = adv[:, None] * (w[:, :, None] * scores[p]).sum(1)
        estimates = estimates + g[idx] / 2                              # the mean over the two prompts
    mean = estimates.mean(0)
    stderr = (estimates.var(0) / n).sqrt()
    assert ((mean - result["mean"]).abs() < 5 * stderr + 1e-12).all()
    assert float(((estimates - mean) ** 2).sum(1).mean()) == pytest.approx(result["variance"], rel=0.05)


def test_oracle_refuses_bad_shapes():
    policy, rewards = _problem()
    with pytest.raises(ValueError, match="sampler_logits must have the policy's logits shape"):
        exact_off_policy_gradient(policy, policy.logits.detach()[0], rewards)
    with pytest.raises(ValueError, match="weight_fn must return"):
        exact_off_policy_gradient(policy, policy.logits.detach(), rewards, lambda o, s, m, a: torch.ones(3))
    with pytest.raises(ValueError, match="scale must be a number >= 0"):
        perturbed_logits(policy, -1.0)
