"""Checks for lesson 05 (TRPO): the importance-sampled surrogate, conjugate gradient, the natural step.

Inputs are torch tensors (float64). The surrogate's cases include log-probabilities near -800,
where a ratio of probabilities is 0/0; conjugate gradient gets only a matrix-vector product and
must use at most ``iters`` of them (and stop, not divide by zero, once the residual is exactly 0);
the natural step must land on the quadratic trust region. Every input is the caller's own tensor,
compared with a copy after the call, and gradients must really flow back to the log-probs.
"""
from __future__ import annotations

import torch

from rlcourse import losses
from rlcourse.classic import trpo
from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references, to_numpy)

__all__ = ["check_surrogate_objective", "check_conjugate_gradient", "check_natural_step", "check_cg_residual_curve"]


def _f64(*xs):
    return [torch.as_tensor(x, dtype=torch.float64) for x in xs]


@references("rlcourse.losses:importance_ratio", "rlcourse.losses.policy_gradient:importance_ratio")
def check_surrogate_objective(fn) -> None:
    """``fn(logprobs, old_logprobs, advantages) -> mean(pi/pi_old * A)``, a scalar tensor with grad."""
    __tracebackhide__ = True
    name = "check_surrogate_objective"
    gen = torch.Generator().manual_seed(50)
    cases = [("no change yet (ratio 1)", *_f64([-0.5, -1.2], [-0.5, -1.2], [1.0, -2.0])),
             ("a few ratios", *_f64([-0.2, -2.0, -0.7], [-0.5, -1.5, -0.7], [2.0, 1.0, -1.0])),
             ("very unlikely actions (log-probs near -800)", *_f64([-799.5, -800.0], [-800.0, -799.0], [1.0, 3.0])),
             ("integer advantages", *_f64([-0.3, -1.0], [-0.5, -0.9], [0.0, 0.0]))]
    cases[-1] = (*cases[-1][:3], torch.tensor([2, -1]))
    cases += [(f"random batch #{i}", -torch.rand(8, generator=gen, dtype=torch.float64) * 3,
               -torch.rand(8, generator=gen, dtype=torch.float64) * 3, torch.randn(8, generator=gen, dtype=torch.float64))
              for i in range(3)]
    for case, logp, old, adv in cases:
        logp = logp.clone().requires_grad_(True)
        got = call_unmutated(name, case, fn, logp, old, adv)
        want = (losses.importance_ratio(logp.detach(), old) * adv).mean()
        got_value = got.detach() if hasattr(got, "detach") else got
        fail_if_mistake(name, case, want, got_value, (logp.detach() * adv).mean(),
                        "that is mean(logprobs * A), the on-policy (REINFORCE) surrogate, which assumes the "
                        "samples came from the new policy; they came from the old one, so weight each by "
                        "pi_theta / pi_old = exp(logprobs - old_logprobs)")
        fail_if_mistake(name, case, want, got_value, (torch.exp(logp.detach()) * adv).mean(),
                        "that is mean(pi_theta * A): the samples were drawn by the old policy, so divide by "
                        "pi_old: ratio = exp(logprobs - old_logprobs)")
        assert_close(name, case, want, got.detach() if hasattr(got, "detach") else got,
                     hint="ratio = exp(logprobs - old_logprobs) (a difference of logs: exp(-800) is 0 in floating "
                          "point), then the mean of ratio * advantages (as they are: not normalised)")
        (grad,) = gradient_flowing(name, case, got, [logp])
        want_grad = losses.importance_ratio(logp.detach(), old) * adv / len(adv)
        assert_close(name, f"{case}: the gradient with respect to logprobs", want_grad, grad,
                     hint="d/d logprobs of mean(exp(logprobs - old) * A) is ratio * A / N; old_logprobs and "
                          "advantages are constants")
    passed(name, len(cases))


def _spd(gen: torch.Generator, n: int, cond: float) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    eig = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    return Q @ torch.diag(eig) @ Q.T


@references("rlcourse.classic.trpo:conjugate_gradient")
def check_conjugate_gradient(fn) -> None:
    """``fn(Avp, b, iters) -> x`` solving ``A x = b`` with at most ``iters`` calls of ``Avp``."""
    __tracebackhide__ = True
    name = "check_conjugate_gradient"
    gen = torch.Generator().manual_seed(51)
    cases = [("a 1x1 system", torch.tensor([[4.0]], dtype=torch.float64), 1),
             ("a diagonal 3x3 system", torch.diag(torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)), 3)]
    cases += [(f"a random {n}x{n} SPD system (condition number {c:g})", _spd(gen, n, c), n)
              for n, c in ((4, 10.0), (8, 30.0), (10, 100.0))]
    cases.append(("A = 2 I: the residual is exactly 0 after one step (then stop, 0/0 is NaN)",
                  2 * torch.eye(4, dtype=torch.float64), 4))
    for case, A, iters in cases:
        b = torch.randn(A.shape[0], generator=gen, dtype=torch.float64)
        calls = []

        def Avp(v):
            calls.append(1)
            return A @ v
        got = call_unmutated(name, case, fn, Avp, b, iters)
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
                 call_unmutated(name, "a 10x10 system stopped after 3 iterations", fn, lambda v: A @ v, b, 3),
                 atol=1e-8, rtol=1e-6, hint="start from x = 0 and take exactly `iters` conjugate-gradient steps")
    zero = torch.zeros(3, dtype=torch.float64)
    assert_close(name, "b = 0 (the answer is x = 0; the residual is 0 from the start)", zero,
                 call_unmutated(name, "b = 0", fn, lambda v: 3.0 * v, zero, 3),
                 hint="stop when r.r == 0 instead of dividing by it")
    passed(name, len(cases) + 2)


@references("rlcourse.classic.trpo:natural_step")
def check_natural_step(fn) -> None:
    """``fn(direction, Fd, max_kl) -> step`` with ``1/2 step^T F step = max_kl``."""
    __tracebackhide__ = True
    name = "check_natural_step"
    gen = torch.Generator().manual_seed(52)
    n = 0
    for i, dim in enumerate((1, 2, 5, 9)):
        M = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
        F = M @ M.T + 0.1 * torch.eye(dim, dtype=torch.float64)
        d = torch.randn(dim, generator=gen, dtype=torch.float64)
        if i == 3:
            d = d * 1e-6                              # a tiny direction: d.Fd ~ 1e-11, the step is still finite
        for max_kl in (0.01, 0.05):
            Fd = F @ d
            got = call_unmutated(name, f"case #{i}: dimension {dim}, max_kl={max_kl}", fn, d, Fd, max_kl)
            case = f"case #{i}: dimension {dim}, max_kl={max_kl}"
            assert_close(name, case, trpo.natural_step(d, Fd, max_kl), got,
                         hint="step = sqrt(2 * max_kl / (d . Fd)) * d: the quadratic KL 1/2 step^T F step "
                              "then equals max_kl")
            kl = 0.5 * to_numpy(got) @ to_numpy(F) @ to_numpy(got)
            if abs(kl - max_kl) > 1e-9:
                fail(name, case, f"1/2 step^T F step = {max_kl}", kl)
            n += 1
    passed(name, n)


@references("rlcourse.classic.trpo:conjugate_gradient")
def check_cg_residual_curve(fn) -> None:
    """``fn(A, b, max_iters) -> residuals``: ``||b - A x_k||`` after k = 0, 1, ..., max_iters CG steps.

    The measurement: on two 20x20 systems with the same eigenvectors, one well conditioned
    (condition number 10) and one badly (10^4), the residual curves must match conjugate gradient's,
    and show what conditioning costs: after 6 steps the badly conditioned residual is still far above
    the well conditioned one. (TRPO adds damping to the Fisher matrix for this reason.)
    """
    __tracebackhide__ = True
    name = "check_cg_residual_curve"
    curves = {}
    for cond in (10.0, 1e4):
        gen = torch.Generator().manual_seed(53)
        A = _spd(gen, 20, cond)
        b = torch.randn(20, generator=gen, dtype=torch.float64)
        case = f"a 20x20 SPD system with condition number {cond:g}, max_iters=10"
        got = call_unmutated(name, case, fn, A, b, 10)
        want = [float(torch.linalg.norm(b))] + [
            float(torch.linalg.norm(b - A @ trpo.conjugate_gradient(lambda v: A @ v, b, k, tol=0.0))) for k in range(1, 11)]
        assert_close(name, case, want, got, rtol=1e-6, atol=1e-9,
                     hint="residuals[k] = norm(b - A @ conjugate_gradient(lambda v: A @ v, b, k)) for k = 0..max_iters "
                          "(k = 0 is norm(b): x starts at 0)")
        curves[cond] = to_numpy(got)
    if not curves[1e4][6] > 10 * curves[10.0][6]:
        fail(name, "the two curves after 6 steps", "the badly conditioned residual > 10 x the well conditioned one",
             f"{curves[1e4][6]:.3g} vs {curves[10.0][6]:.3g}", "compute both curves on the matrices given")
    passed(name, 3)
