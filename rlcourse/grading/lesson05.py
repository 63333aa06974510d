"""Checks for lesson 05 (TRPO): the importance-sampled surrogate, conjugate gradient, the natural step.

Inputs are torch tensors (float64). The surrogate's cases include log-probabilities near -800,
where a ratio of probabilities is 0/0; conjugate gradient gets only a matrix-vector product and
must use at most ``iters`` of them; the natural step must land on the quadratic trust region.
"""
from __future__ import annotations

import torch

from rlcourse import losses
from rlcourse.classic import trpo
from rlcourse.grading._core import assert_close, fail, passed, to_numpy

__all__ = ["check_surrogate_objective", "check_conjugate_gradient", "check_natural_step"]


def _f64(*xs):
    return [torch.as_tensor(x, dtype=torch.float64) for x in xs]


def check_surrogate_objective(fn) -> None:
    """``fn(logprobs, old_logprobs, advantages) -> mean(pi/pi_old * A)``, a scalar tensor with grad."""
    name = "check_surrogate_objective"
    gen = torch.Generator().manual_seed(50)
    cases = [("no change yet (ratio 1)", *_f64([-0.5, -1.2], [-0.5, -1.2], [1.0, -2.0])),
             ("a few ratios", *_f64([-0.2, -2.0, -0.7], [-0.5, -1.5, -0.7], [2.0, 1.0, -1.0])),
             ("very unlikely actions (log-probs near -800)", *_f64([-799.5, -800.0], [-800.0, -799.0], [1.0, 3.0]))]
    cases += [(f"random batch #{i}", -torch.rand(8, generator=gen, dtype=torch.float64) * 3,
               -torch.rand(8, generator=gen, dtype=torch.float64) * 3, torch.randn(8, generator=gen, dtype=torch.float64))
              for i in range(3)]
    for case, logp, old, adv in cases:
        logp = logp.clone().requires_grad_(True)
        got = fn(logp, old, adv)
        want = (losses.importance_ratio(logp.detach(), old) * adv).mean()
        assert_close(name, case, want, got.detach() if hasattr(got, "detach") else got,
                     hint="ratio = exp(logprobs - old_logprobs) (a difference of logs: exp(-800) is 0 in floating "
                          "point), then the mean of ratio * advantages")
        if not (hasattr(got, "requires_grad") and got.requires_grad):
            fail(name, case, "a tensor connected to logprobs (requires_grad=True)", got,
                 "build the result with torch operations on logprobs, without .item() or NumPy")
        (grad,) = torch.autograd.grad(got, logp)
        want_grad = losses.importance_ratio(logp.detach(), old) * adv / len(adv)
        assert_close(name, f"{case}: the gradient with respect to logprobs", want_grad, grad,
                     hint="d/d logprobs of mean(exp(logprobs - old) * A) is ratio * A / N; old_logprobs and "
                          "advantages are constants")
    passed(name, len(cases))


def _spd(gen: torch.Generator, n: int, cond: float) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    eig = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    return Q @ torch.diag(eig) @ Q.T


def check_conjugate_gradient(fn) -> None:
    """``fn(Avp, b, iters) -> x`` solving ``A x = b`` with at most ``iters`` calls of ``Avp``."""
    name = "check_conjugate_gradient"
    gen = torch.Generator().manual_seed(51)
    cases = [("a 1x1 system", torch.tensor([[4.0]], dtype=torch.float64), 1),
             ("a diagonal 3x3 system", torch.diag(torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)), 3)]
    cases += [(f"a random {n}x{n} SPD system (condition number {c:g})", _spd(gen, n, c), n)
              for n, c in ((4, 10.0), (8, 30.0), (10, 100.0))]
    for case, A, iters in cases:
        b = torch.randn(A.shape[0], generator=gen, dtype=torch.float64)
        calls = []

        def Avp(v):
            calls.append(1)
            return A @ v
        got = fn(Avp, b.clone(), iters)
        if len(calls) > iters:
            fail(name, case, f"at most {iters} matrix-vector products", f"{len(calls)} calls of Avp",
                 "one product A p per iteration: keep A r and A x updated from it, do not recompute them")
        assert_close(name, f"{case} after {iters} iterations", torch.linalg.solve(A, b), got, atol=1e-6, rtol=1e-6,
                     hint="x=0, r=b, p=r; repeat: alpha = r.r / p.Ap, x += alpha p, r -= alpha Ap, "
                          "beta = r_new.r_new / r.r, p = r_new + beta p")
    # fewer iterations than the dimension must match the reference's partial solution too
    A = _spd(gen, 10, 50.0)
    b = torch.randn(10, generator=gen, dtype=torch.float64)
    assert_close(name, "a 10x10 system stopped after 3 iterations", trpo.conjugate_gradient(lambda v: A @ v, b, 3, tol=0.0),
                 fn(lambda v: A @ v, b.clone(), 3), atol=1e-8, rtol=1e-6,
                 hint="start from x = 0 and take exactly `iters` conjugate-gradient steps")
    passed(name, len(cases) + 1)


def check_natural_step(fn) -> None:
    """``fn(direction, Fd, max_kl) -> step`` with ``1/2 step^T F step = max_kl``."""
    name = "check_natural_step"
    gen = torch.Generator().manual_seed(52)
    n = 0
    for i, dim in enumerate((1, 2, 5, 9)):
        M = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
        F = M @ M.T + 0.1 * torch.eye(dim, dtype=torch.float64)
        d = torch.randn(dim, generator=gen, dtype=torch.float64)
        for max_kl in (0.01, 0.05):
            got = fn(d.clone(), F @ d, max_kl)
            case = f"case #{i}: dimension {dim}, max_kl={max_kl}"
            assert_close(name, case, trpo.natural_step(d, F @ d, max_kl), got,
                         hint="step = sqrt(2 * max_kl / (d . Fd)) * d: the quadratic KL 1/2 step^T F step "
                              "then equals max_kl")
            kl = 0.5 * to_numpy(got) @ to_numpy(F) @ to_numpy(got)
            if abs(kl - max_kl) > 1e-9:
                fail(name, case, f"1/2 step^T F step = {max_kl}", kl)
            n += 1
    passed(name, n)
