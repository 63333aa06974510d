"""Checks for lesson 07b (KL to a reference): the exact KL over a vocabulary, the k3 estimator, and
the experiment that measures k1 against k3 on samples.

Each check compares the learner's function with the reference in :mod:`rlcourse.kl` on inputs
built to expose one plausible mistake each: the KL's direction reversed, the ratio inverted,
``log(softmax(x))`` underflowing where ``log_softmax`` stays finite, a mean over the vocabulary
instead of a sum; and on the families every check probes: extreme magnitudes, inputs written in
place (the caller's own tensors are compared after the call), and a KL whose gradient does not
reach the logits.
"""
from __future__ import annotations

import numpy as np

import torch

from rlcourse import kl
from rlcourse.grading._core import assert_close, call_unmutated, fail, gradient_flowing, passed, references, to_numpy
from rlcourse.grading.lesson07 import _grad_free

__all__ = ["check_exact_kl", "check_kl_k3", "check_kl_estimators"]


@references("rlcourse.kl:exact_kl")
def check_exact_kl(fn) -> None:
    """``fn(logits_p, logits_q) -> (...)``: ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` over the
    last dimension, with ``p = softmax(logits_p)`` and ``q = softmax(logits_q)``, differentiable."""
    __tracebackhide__ = True
    name = "check_exact_kl"
    gen = torch.Generator().manual_seed(76)
    V = 9
    base = 2 * torch.randn(2, 3, V, generator=gen)
    cases = [("identical distributions (KL = 0)", base, base.clone()),
             ("one position, q a perturbation of p", base[0, :1], base[0, :1] + torch.randn(1, V, generator=gen)),
             ("random logits (B=2, T=3)", base, 2 * torch.randn(2, 3, V, generator=gen)),
             ("random logits far apart (B=3, T=2)", 4 * torch.randn(3, 2, V, generator=gen), 4 * torch.randn(3, 2, V, generator=gen)),
             ("a very confident p (some p(v) underflow to exactly 0)", 200 * torch.randn(2, 2, V, generator=gen),
              2 * torch.randn(2, 2, V, generator=gen)),
             ("a very confident q (some q(v) underflow where p(v) > 0)", 2 * torch.randn(2, 2, V, generator=gen),
              120 * torch.randn(2, 2, V, generator=gen))]
    answers = []
    for case, logits_p, logits_q in cases:
        logits_p = logits_p.clone().requires_grad_(True)
        got = call_unmutated(name, case, fn, logits_p, logits_q)
        logp, logq = torch.log_softmax(logits_p.detach().double(), -1), torch.log_softmax(logits_q.double(), -1)
        expected = kl.exact_kl(logp, logq)
        hint = ("KL(p || q) = sum_v p(v) (log p(v) - log q(v)) over the last dimension, with log p and log q "
                "from torch.log_softmax of the logits")
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        if got_np is not None and got_np.shape == tuple(expected.shape):
            reverse = to_numpy(kl.exact_kl(logq, logp))
            if not np.isfinite(got_np).all():
                hint = ("log(softmax(x)) is -inf where a probability underflows, and 0 * (-inf) is nan: "
                        "take log p and log q from torch.log_softmax (finite)")
            elif not np.allclose(reverse, to_numpy(expected), atol=1e-4) and np.allclose(got_np, reverse, atol=1e-4, rtol=1e-4):
                hint = ("that is KL(q || p): the direction is reversed. Weight by p, the policy the tokens come "
                        "from: sum_v p(v) (log p(v) - log q(v))")
            elif (got_np < -1e-5).any():
                hint = "a KL is never negative: weight each log-ratio by p(v) and mind the sign of log p - log q"
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-4, rtol=1e-4)
        answers.append((case, logits_p, logits_q, got))
    # The values first (they name the usual mistakes), then the gradients of the same answers.
    for case, logits_p, logits_q, got in answers:
        (grad,) = gradient_flowing(name, case, got, [logits_p],
                                   "the KL is differentiated when it is a loss: compute it with torch operations "
                                   "on the logits, without .detach()")
        ref = logits_p.detach().clone().requires_grad_(True)
        (want,) = torch.autograd.grad(kl.exact_kl(torch.log_softmax(ref, -1), torch.log_softmax(logits_q, -1)).sum(), [ref])
        assert_close(name, f"{case}: the gradient with respect to logits_p", want, grad, atol=1e-4, rtol=1e-3,
                     hint="both p(v) and log p(v) depend on logits_p: detach neither")
    passed(name, len(cases))


@references("rlcourse.kl:kl_k3")
def check_kl_k3(fn) -> None:
    """``fn(logp, logq) -> tensor``: ``k3 = (rho - 1) - log rho`` with ``rho = exp(logq - logp)``."""
    __tracebackhide__ = True
    name = "check_kl_k3"
    gen = torch.Generator().manual_seed(73)
    cases = [("identical policies (k3 = 0)", torch.tensor([-0.5, -2.0]), torch.tensor([-0.5, -2.0])),
             ("reference more likely than the policy (rho > 1)", torch.tensor([-2.0]), torch.tensor([-0.5])),
             ("reference less likely than the policy (rho < 1)", torch.tensor([-0.5]), torch.tensor([-2.0]))]
    for i in range(3):
        logp = -3 * torch.rand(2, 5, generator=gen, dtype=torch.float64)
        cases.append((f"random log-probs #{i} (shape (2, 5))", logp,
                      logp + 0.8 * torch.randn(2, 5, generator=gen, dtype=torch.float64)))
    cases.append(("very unlikely tokens (log-probs near -800)", torch.tensor([-800.0, -799.0], dtype=torch.float64),
                  torch.tensor([-799.5, -800.0], dtype=torch.float64)))
    # rho = exp(-800) underflows to 0 in float64 (exp(-120) in float32): log(rho) is then -inf and
    # k3 inf, where (rho - 1) - (logq - logp) = 799 (119) is finite. Only the log-ratio itself is safe.
    cases.append(("a token the reference almost never writes (logq - logp = -800, float64)",
                  torch.tensor([-1.0, -0.5], dtype=torch.float64), torch.tensor([-801.0, -0.7], dtype=torch.float64)))
    cases.append(("a token the reference almost never writes (logq - logp = -120, float32)",
                  torch.tensor([-1.0, -0.5]), torch.tensor([-121.0, -0.7])))
    for case, logp, logq in cases:
        got = call_unmutated(name, case, fn, logp, logq)
        expected = kl.kl_k3(logp, logq)
        hint = ("k3 = (rho - 1) - log rho with rho = pi_ref / pi_theta = exp(logq - logp) (a difference of logs: "
                "exp(-800) / exp(-800) is 0/0); it is never negative")
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        if got_np is not None and got_np.shape == tuple(expected.shape):
            if np.allclose(got_np, to_numpy(kl.kl_k3(logq, logp)), atol=1e-7) and not torch.equal(logp, logq):
                hint = ("the ratio is inverted: rho = pi_ref(x) / pi_theta(x) = exp(logq - logp), "
                        "since the samples come from pi_theta")
            elif np.allclose(got_np, to_numpy(kl.kl_k1(logp, logq)), atol=1e-7) and not torch.equal(logp, logq):
                hint = "that is k1 = -log rho; k3 adds the zero-mean control variate (rho - 1)"
            elif not np.isfinite(got_np).all():
                hint = ("log(rho) with rho = exp(logq - logp) is -inf once the exponential underflows to 0: "
                        "use the log-ratio logq - logp itself for log rho, and exp only for rho - 1")
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-7, rtol=1e-6)
    passed(name, len(cases))


@references("rlcourse.kl:kl_k1", "rlcourse.kl:kl_k3", "rlcourse.kl:kl_k2")
def check_kl_estimators(fn) -> None:
    """``fn(logits_p, logits_q, n_samples, seed) -> {"k1": (mean, std), "k3": (mean, std)}``: a measurement.

    The experiment: draw ``n_samples`` tokens from ``p = softmax(logits_p)`` (a ``torch.Generator``
    seeded with ``seed``), evaluate k1 = -log rho and k3 = (rho - 1) - log rho with rho = q(x) / p(x) on each,
    and report each estimator's mean and standard deviation. Both means must estimate the exact
    KL(p || q) (within 4 standard errors), k3 must spread less than k1 when p and q are close,
    and no k3 sample is negative.
    """
    __tracebackhide__ = True
    name = "check_kl_estimators"
    gen = torch.Generator().manual_seed(74)
    n = 0
    for scale in (0.1, 0.3):
        logits_p = torch.randn(50, generator=gen, dtype=torch.float64)
        logits_q = logits_p + scale * torch.randn(50, generator=gen, dtype=torch.float64)
        case = f"a 50-token vocabulary, q a perturbation of p (scale {scale}), 20000 samples, seed=0"
        got = call_unmutated(name, case, fn, logits_p, logits_q, 20000, 0)
        if not isinstance(got, dict) or not {"k1", "k3"} <= set(got):
            fail(name, case, 'a dict {"k1": (mean, std), "k3": (mean, std)}', got,
                 "return the mean and standard deviation of each estimator over the samples")
        logp, logq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
        exact = float((logp.exp() * (logp - logq)).sum())
        stats = {}
        for key in ("k1", "k3"):
            mean, std = (float(to_numpy(v)) for v in got[key])
            if not (std > 0 and abs(mean - exact) < 4 * std / np.sqrt(20000) + 1e-12):
                fail(name, f"{case}: the {key} estimate", f"a mean within 4 standard errors of KL = {exact:.5f}",
                     f"mean {mean:.5f}, std {std:.5f}",
                     "sample x ~ p with torch.multinomial(p, n, replacement=True, generator=g); rho = exp(logq[x] - "
                     "logp[x]) with log-softmaxed logits; k1 = -log rho, k3 = (rho - 1) - log rho")
            stats[key] = (mean, std)
        if not stats["k3"][1] < stats["k1"][1]:
            fail(name, case, f"k3's std below k1's ({stats['k1'][1]:.5f})", stats["k3"][1],
                 "k3 adds the control variate (rho - 1), which has mean 0 and cancels most of k1's noise")
        n += 1
    passed(name, n)
