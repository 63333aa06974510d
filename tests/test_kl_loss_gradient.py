"""kl.expected_loss_gradient against three independent oracles: autograd token by token, finite differences
of the exact KLs, and the GRPO loss that tests/test_trl_parity_grpo.py ties to TRL's."""
import rlcourse  # noqa: F401  (before torch)
import pytest
import torch

from rlcourse import kl
from rlcourse.losses.grpo import per_token_loss


def _pair(seed, shape=(3, 7), scale=1.5):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(*shape, generator=g, dtype=torch.float64)
    ref_logits = scale * torch.randn(*shape, generator=g, dtype=torch.float64)
    sampler_logits = logits + torch.randn(*shape, generator=g, dtype=torch.float64)
    return logits, ref_logits, sampler_logits


def _by_autograd(logits, ref_logits, estimator, sampler_logits=None):
    """sum_v mu(v) d k(v) / d z, one token at a time: each k(v) differentiated by autograd on its own."""
    z = logits.clone().requires_grad_(True)
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(ref_logits, -1)
    logmu = logp.detach() if sampler_logits is None else torch.log_softmax(sampler_logits, -1)
    total = torch.zeros_like(logits)
    for v in range(logits.shape[-1]):
        lp, lq, lm = logp[..., v], logq[..., v], logmu[..., v]
        log_r = lq - lp
        k = {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": log_r.exp() - 1 - log_r,
             "rho_k3": (lp - lm).exp() * (log_r.exp() - 1 - log_r)}[estimator]
        (grad,) = torch.autograd.grad(k.sum(), z, retain_graph=True)
        total += lm.exp().unsqueeze(-1) * grad
    return total


def _finite_difference(f, logits, h=1e-6):
    """d f(z).sum() / d z by central differences (float64)."""
    grad = torch.zeros_like(logits)
    flat, out = logits.reshape(-1), grad.reshape(-1)
    for i in range(flat.numel()):
        up, down = flat.clone(), flat.clone()
        up[i] += h
        down[i] -= h
        out[i] = (f(up.view_as(logits)).sum() - f(down.view_as(logits)).sum()) / (2 * h)
    return grad


@pytest.mark.parametrize("estimator", kl.LOSS_ESTIMATORS)
@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "from-a-sampler"])
def test_equals_autograd_token_by_token(estimator, on_policy):
    logits, ref_logits, sampler_logits = _pair(0)
    sampler = None if on_policy else sampler_logits
    got = kl.expected_loss_gradient(torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1), estimator,
                                    None if on_policy else torch.log_softmax(sampler_logits, -1))
    torch.testing.assert_close(got, _by_autograd(logits, ref_logits, estimator, sampler), atol=1e-12, rtol=1e-10)


def test_which_kl_each_estimator_follows_by_finite_differences():
    logits, ref_logits, sampler_logits = _pair(1, shape=(2, 5), scale=2.0)
    logq = torch.log_softmax(ref_logits, -1)
    reverse = _finite_difference(lambda z: kl.exact_kl(torch.log_softmax(z, -1), logq), logits)
    forward = _finite_difference(lambda z: kl.exact_kl(logq, torch.log_softmax(z, -1)), logits)
    logp, logmu = torch.log_softmax(logits, -1), torch.log_softmax(sampler_logits, -1)
    g = {name: kl.expected_loss_gradient(logp, logq, name) for name in kl.LOSS_ESTIMATORS}
    assert g["k1"].abs().max() < 1e-15                                    # E[grad log pi] = 0
    torch.testing.assert_close(g["k2"], reverse, atol=1e-8, rtol=1e-6)   # the reverse KL's
    torch.testing.assert_close(g["k3"], forward, atol=1e-8, rtol=1e-6)   # the forward KL's
    torch.testing.assert_close(g["rho_k3"], reverse, atol=1e-8, rtol=1e-6)
    # from any sampler, rho * k3 still follows the reverse KL; plain k3 and k2 follow neither
    off = {name: kl.expected_loss_gradient(logp, logq, name, logmu) for name in kl.LOSS_ESTIMATORS}
    torch.testing.assert_close(off["rho_k3"], reverse, atol=1e-8, rtol=1e-6)
    for name in ("k2", "k3"):
        assert min((off[name] - reverse).norm(), (off[name] - forward).norm()) > 1e-2 * reverse.norm()
    assert off["k1"].norm() > 1e-3                                        # E_mu[grad log pi] is not 0


@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "from-a-sampler"])
def test_rho_k3_is_the_expected_gradient_of_grpos_kl_term_with_bias_correction(on_policy):
    """Each token v as a one-token completion: GRPO's per-token loss with A = 0 and beta = 1 is TRL's
    per_token_kl * coef_1 (tests/test_trl_parity_grpo.py); its gradient, averaged under mu, is rho_k3's."""
    logits, ref_logits, sampler_logits = _pair(2, shape=(6,))
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    logmu = logp.detach() if on_policy else torch.log_softmax(sampler_logits, -1)
    logq = torch.log_softmax(ref_logits, -1)
    V = logits.shape[-1]
    for use_bias_correction_kl, estimator in ((True, "rho_k3"), (False, "k3")):
        loss = per_token_loss(logp[:, None], logmu[:, None], torch.zeros(V, dtype=torch.float64),
                              torch.ones(V, 1), "grpo", beta=1.0, ref_logprobs=logq[:, None],
                              use_bias_correction_kl=use_bias_correction_kl)
        (grad,) = torch.autograd.grad((logmu.exp() * loss[:, 0]).sum(), z, retain_graph=True)
        want = kl.expected_loss_gradient(logp.detach(), logq, estimator, None if on_policy else logmu)
        torch.testing.assert_close(grad, want, atol=1e-12, rtol=1e-10)


def test_rho_k3_and_k2_have_the_same_per_token_gradient_on_policy():
    """d(rho k3)/d log pi = rho log(pi/pi_ref): k2's gradient times rho, which is 1 on-policy."""
    logits, ref_logits, _ = _pair(3)
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    torch.testing.assert_close(kl.expected_loss_gradient(logp, logq, "rho_k3"),
                               kl.expected_loss_gradient(logp, logq, "k2"), atol=1e-15, rtol=0)


def test_float32_far_apart_stays_finite():
    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(30 * torch.randn(4, 11, generator=g), -1)      # r up to e^60 on rare tokens
    logq = torch.log_softmax(torch.randn(4, 11, generator=g), -1)
    for name in kl.LOSS_ESTIMATORS:
        got = kl.expected_loss_gradient(logp, logq, name)
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), name
        assert got.sum(-1).abs().max() < 1e-4                               # a logit shift changes nothing


def test_bad_inputs_are_named():
    logp = torch.log_softmax(torch.randn(2, 4), -1)
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl.expected_loss_gradient(logp, logp, "k4")
    with pytest.raises(ValueError, match="one shape"):
        kl.expected_loss_gradient(logp, logp[:1], "k1")
    with pytest.raises(ValueError, match="Were these logits"):
        kl.expected_loss_gradient(3 * logp, logp, "k2")
