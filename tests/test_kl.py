"""KL estimators against exact enumeration over small categorical distributions, and exact KL
and entropy against ``torch.distributions``."""
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
from torch.distributions import Categorical, kl_divergence

from rlcourse.kl import KL_ESTIMATORS, entropy, exact_kl, kl_k1, kl_k2, kl_k3


def random_log_dist(gen: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(scale * torch.randn(*shape, generator=gen, dtype=torch.float64), -1)


def expectation_under_p(estimator, logp_full, logq_full):
    """``E_{x~p}[k(x)] = sum_x p(x) k(log p(x), log q(x))``: the estimator's mean, by enumeration."""
    return (logp_full.exp() * estimator(logp_full, logq_full)).sum(-1)


def variance_under_p(estimator, logp_full, logq_full):
    p, k = logp_full.exp(), estimator(logp_full, logq_full)
    mean = (p * k).sum(-1)
    return (p * (k - mean.unsqueeze(-1)) ** 2).sum(-1)


@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0])
def test_k1_and_k3_are_unbiased_by_exact_enumeration(scale):
    gen = torch.Generator().manual_seed(0)
    logp, logq = random_log_dist(gen, 20, 7, scale=scale), random_log_dist(gen, 20, 7, scale=scale)
    kl = exact_kl(logp, logq)
    assert (kl > 0).all()
    torch.testing.assert_close(expectation_under_p(kl_k1, logp, logq), kl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expectation_under_p(kl_k3, logp, logq), kl, rtol=1e-10, atol=1e-12)


def test_k2_is_biased_but_agrees_to_second_order():
    gen = torch.Generator().manual_seed(1)
    logp = random_log_dist(gen, 50, 6)
    direction = torch.randn(50, 6, generator=gen, dtype=torch.float64)
    biases = []
    for eps in (0.4, 0.2, 0.1):
        logq = torch.log_softmax(logp + eps * direction, -1)
        bias = expectation_under_p(kl_k2, logp, logq) - exact_kl(logp, logq)
        biases.append(bias.abs().mean().item())
    # Far apart the bias is a real error, not rounding ...
    far = torch.log_softmax(logp + 2.0 * direction, -1)
    rel = (expectation_under_p(kl_k2, logp, far) - exact_kl(logp, far)).abs() / exact_kl(logp, far)
    assert rel.mean() > 0.05
    # ... and it is third order: halving the perturbation divides it by about 2^3 = 8,
    # while the KL itself only falls by 2^2 = 4.
    assert 6.0 < biases[0] / biases[1] < 10.0 and 6.0 < biases[1] / biases[2] < 10.0


def test_k3_has_lower_variance_than_k1_when_close_but_not_when_far():
    gen = torch.Generator().manual_seed(2)
    logp = random_log_dist(gen, 200, 10)
    close = torch.log_softmax(logp + 0.2 * torch.randn(200, 10, generator=gen, dtype=torch.float64), -1)
    assert (variance_under_p(kl_k3, logp, close) < variance_under_p(kl_k1, logp, close)).all()
    # pi_ref puts much more mass than pi_theta on a token: r is huge there and k3's variance explodes.
    logp_far = torch.log(torch.tensor([0.98, 0.01, 0.01], dtype=torch.float64))
    logq_far = torch.log(torch.tensor([0.01, 0.01, 0.98], dtype=torch.float64))
    assert variance_under_p(kl_k3, logp_far, logq_far) > variance_under_p(kl_k1, logp_far, logq_far)


def test_k2_and_k3_are_never_negative_and_k1_often_is():
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(10_000, generator=gen, dtype=torch.float64) * 30
    logq = -torch.rand(10_000, generator=gen, dtype=torch.float64) * 30
    assert (kl_k3(logp, logq) >= 0).all() and (kl_k2(logp, logq) >= 0).all()
    assert (kl_k1(logp, logq) < 0).float().mean() > 0.3
    same = kl_k3(logp, logp)
    assert (same == 0).all() and (kl_k1(logp, logp) == 0).all()


def test_monte_carlo_means_match_the_exact_kl():
    gen = torch.Generator().manual_seed(4)
    logp, logq = random_log_dist(gen, 8), random_log_dist(gen, 8)
    n = 200_000
    x = torch.multinomial(logp.exp(), n, replacement=True, generator=gen)
    kl = exact_kl(logp, logq).item()
    for name in ("k1", "k3"):
        k = KL_ESTIMATORS[name](logp[x], logq[x])
        stderr = k.std().item() / math.sqrt(n)
        assert abs(k.mean().item() - kl) < 4 * stderr, name


def test_k3_is_short_by_the_reference_mass_outside_the_policy_support():
    # Unbiasedness of k3 needs E_p[r] = 1, i.e. q has no mass where p has none.
    logp = torch.log(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    logq = torch.log(torch.tensor([0.3, 0.5, 0.2], dtype=torch.float64))
    p = logp.exp()
    support = p > 0
    mean_k3 = (p[support] * kl_k3(logp[support], logq[support])).sum()
    assert mean_k3.item() == pytest.approx(exact_kl(logp, logq).item() - 0.2, abs=1e-12)


def test_k3_is_accurate_for_tiny_log_ratios_in_float32():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float32)
    log_r = torch.tensor([1e-4, -3e-4], dtype=torch.float32)
    got = kl_k3(logp, logp + log_r).double()
    lr = log_r.double()
    expected = torch.expm1(lr) - lr   # about log_r^2 / 2: 5e-9 and 4.5e-8
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=0)


def test_gradients_are_the_closed_forms():
    logp = torch.tensor([-0.5, -1.5, -3.0], dtype=torch.float64, requires_grad=True)
    logq = torch.tensor([-0.7, -1.0, -2.0], dtype=torch.float64)
    r = (logq - logp).exp().detach()
    (g3,) = torch.autograd.grad(kl_k3(logp, logq).sum(), logp)
    (g2,) = torch.autograd.grad(kl_k2(logp, logq).sum(), logp)
    (g1,) = torch.autograd.grad(kl_k1(logp, logq).sum(), logp)
    torch.testing.assert_close(g3, 1 - r)
    torch.testing.assert_close(g2, (logp - logq).detach())
    torch.testing.assert_close(g1, torch.ones(3, dtype=torch.float64))


def test_exact_kl_and_entropy_match_torch_distributions():
    gen = torch.Generator().manual_seed(5)
    logits_p = 2 * torch.randn(4, 3, 11, generator=gen)
    logits_q = 2 * torch.randn(4, 3, 11, generator=gen)
    logp, logq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    expected = kl_divergence(Categorical(logits=logits_p), Categorical(logits=logits_q))
    torch.testing.assert_close(exact_kl(logp, logq), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy(logp), Categorical(logits=logits_p).entropy(), rtol=1e-5, atol=1e-6)
    # Another dimension for the vocabulary.
    torch.testing.assert_close(exact_kl(logp.transpose(1, 2), logq.transpose(1, 2), dim=1), expected,
                               rtol=1e-5, atol=1e-6)


def test_exact_kl_and_entropy_edge_cases():
    uniform = torch.full((5,), -math.log(5), dtype=torch.float64)
    assert entropy(uniform).item() == pytest.approx(math.log(5))
    one_hot = torch.log(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    assert entropy(one_hot).item() == 0.0
    logq = torch.log(torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64))
    assert exact_kl(one_hot, logq).item() == pytest.approx(-math.log(0.5))   # finite: 0 log 0 = 0
    assert exact_kl(logq, one_hot).item() == math.inf                        # q = 0 where p > 0
    assert exact_kl(logq, logq).item() == 0.0


def test_gradients_stay_finite_when_some_tokens_are_impossible():
    # Top-k sampling or a masked vocabulary gives log-probs of -inf; 0 * log 0 must not poison grads.
    logits = torch.tensor([[2.0, 0.5, -float("inf"), 0.0]], requires_grad=True)
    logq = torch.log_softmax(torch.tensor([[0.3, 0.2, 0.1, 0.0]]), -1)
    logp = torch.log_softmax(logits, -1)
    (g_kl,) = torch.autograd.grad(exact_kl(logp, logq).sum(), logits)
    (g_h,) = torch.autograd.grad(entropy(torch.log_softmax(logits, -1)).sum(), logits)
    assert torch.isfinite(g_kl[:, [0, 1, 3]]).all() and torch.isfinite(g_h[:, [0, 1, 3]]).all()
    # ... and they are the gradients of the same quantities over the three possible tokens.
    finite = logits.detach()[:, [0, 1, 3]].clone().requires_grad_(True)
    logp3 = torch.log_softmax(finite, -1)
    (expected,) = torch.autograd.grad((logp3.exp() * (logp3 - logq[:, [0, 1, 3]])).sum(), finite)
    torch.testing.assert_close(g_kl[:, [0, 1, 3]], expected)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="same shape"):
        kl_k3(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="floating-point"):
        kl_k1(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match="log_softmax"):
        exact_kl(logits, torch.log_softmax(logits, -1))
    with pytest.raises(ValueError, match="logp_full"):
        entropy(torch.tensor(0.0))
