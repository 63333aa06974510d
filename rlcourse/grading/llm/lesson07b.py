"""Checks for lesson 07b (KL to a reference): the exact KL over a vocabulary, the k3 estimator, the
experiment that measures k1 against k3 on samples, and the expected gradient each estimator puts in a loss.

Each check compares the learner's function with the reference in :mod:`rlcourse.kl` on inputs
built to expose one plausible mistake each: the KL's direction reversed, the ratio inverted,
``log(softmax(x))`` underflowing where ``log_softmax`` stays finite, a mean over the vocabulary
instead of a sum; and on the families every check probes: extreme magnitudes, inputs written in
place (the caller's own tensors are compared after the call), and a KL whose gradient does not
reach the logits.

:func:`check_expected_kl_gradient` recognises, each with its own hint: the gradient of the expected value
(the weights left with their gradient), the sampler ignored, a flipped sign, a mean over the vocabulary,
the KL's own gradient whatever the estimator, the gradient with respect to the log-probs instead of the
logits, k2 without its 1/2, k3's ratio inverted or held constant, the importance ratio detached, made
identically 1 (``exp(log pi - log pi)``) or inverted; and an answer that samples (two calls differ).
"""
from __future__ import annotations

import numpy as np

import torch

from rlcourse import kl
from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references, to_numpy)
from rlcourse.grading.llm.lesson07 import _grad_free

__all__ = ["check_exact_kl", "check_kl_k3", "check_kl_estimators", "check_expected_kl_gradient"]


def kept_float64(name: str, case: str, got, *inputs) -> None:
    """Fail when every floating input is float64 and the answer came back in a narrower float.

    A float64 input is a request for float64 precision; ``torch.tensor(x.tolist())``, ``.float()``
    or a float32 NumPy array loses half the digits silently. A Python float is a float64 and
    passes; so does any result computed from float32 (or integer) inputs.
    """
    __tracebackhide__ = True
    floats = [x for x in inputs if getattr(x, "dtype", None) is not None and getattr(x.dtype, "is_floating_point", False)]
    if not floats or any(x.dtype != torch.float64 for x in floats):
        return
    dtype = getattr(got, "dtype", None)
    if dtype is None:
        return
    narrow = (dtype in (torch.float32, torch.float16, torch.bfloat16) if isinstance(dtype, torch.dtype)
              else np.dtype(dtype) in (np.float32, np.float16))
    if narrow:
        fail(name, case, "a float64 result for float64 inputs", f"dtype {dtype}",
             "the inputs are float64 and the answer came back in a narrower float: keep the inputs' dtype "
             "(no .float(), no torch.tensor(..., dtype=torch.float32), no float32 NumPy arrays)")


# Borderline convention accepted: logits are finite. A -inf logit (a vocabulary masked by top-k)
# gives p(v) = 0 exactly and log p(v) = -inf; the lesson's formula p * (log p - log q) is nan there
# and the reference (which zeroes such terms) is not, so no case holds -inf logits.
@references("rlcourse.kl:exact_kl", "rlcourse.measure.categorical_bandit:CategoricalBandit.kl")
def check_exact_kl(fn) -> None:
    """``fn(logits_p, logits_q) -> (...)``: ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` over the
    last dimension, with ``p = softmax(logits_p)`` and ``q = softmax(logits_q)``, differentiable.

    Terms with ``p(v) = 0`` count 0 (the limit of ``p log p``): a probability that underflows to 0
    must not make the KL nan through ``0 * log 0``. Float64 logits give a float64 KL. Accepted
    borderline: the logits are finite (no case masks a token with ``-inf``)."""
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
              120 * torch.randn(2, 2, V, generator=gen)),
             ("float64 logits, one of them far below the rest (p(v) = exp(-800) underflows to 0)",
              torch.tensor([[0.0, 1.0, -800.0, 2.0]], dtype=torch.float64),
              torch.tensor([[0.5, 0.0, 1.0, -1.0]], dtype=torch.float64))]
    answers = []
    for case, logits_p, logits_q in cases:
        logits_p = logits_p.clone().requires_grad_(True)
        got = call_unmutated(name, case, fn, logits_p, logits_q)
        kept_float64(name, case, got, logits_p, logits_q)
        logp, logq = torch.log_softmax(logits_p.detach().double(), -1), torch.log_softmax(logits_q.double(), -1)
        expected = kl.exact_kl(logp, logq)
        hint = ("KL(p || q) = sum_v p(v) (log p(v) - log q(v)) over the last dimension, with log p and log q "
                "from torch.log_softmax of the logits")
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        if got_np is not None and got_np.shape == tuple(expected.shape):
            reverse = to_numpy(kl.exact_kl(logq, logp))
            if not np.isfinite(got_np).all():
                hint = ("0 * log 0 is nan in floating point (0 * -inf), though p log p -> 0 as p -> 0: a "
                        "probability that underflows to 0 makes log(softmax(x)) or log(p / q) -inf. Take log p "
                        "and log q from torch.log_softmax (finite), or count the terms with p(v) = 0 as 0")
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


def _k3_through_exponentials(logp, logq):
    """The two ``exp``-then-``log`` forms of k3, in the inputs' dtype: ``log(exp(d))`` and ``exp(q) / exp(p)``."""
    rho = torch.exp(logq - logp)
    ratio = torch.exp(logq) / torch.exp(logp)
    return [rho - 1 - torch.log(rho), ratio - 1 - torch.log(ratio), ratio - 1 - (logq - logp)]


# Borderline convention accepted: no case has log r = logq - logp above 20. There the reference
# clamps the exponential's argument (rlcourse.kl.LOG_RATIO_BOUND; verl does too), while TRL's
# unclamped exp(log r) - 1 - log r, the lesson's formula, does not.
@references("rlcourse.kl:kl_k3")
def check_kl_k3(fn) -> None:
    """``fn(logp, logq) -> tensor``: ``k3 = (rho - 1) - log rho`` with ``rho = exp(logq - logp)``.

    ``log rho`` must be the log-ratio itself: ``log(exp(d))`` and ``exp(logq) / exp(logp)`` lose it
    once an exponential underflows (log-ratios of -100 in float32, log-probs near -700 in float64).
    k3 sits in GRPO's loss, so its gradient must reach ``logp``; float64 inputs give a float64
    result. Accepted borderline: no case has ``log rho > 20`` (the reference clamps the exponential's
    argument there, as verl does; TRL does not).
    """
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
    # exp(-100) = 3.7e-44 is a subnormal float32 (a few bits left): log(exp(-100)) is -99.98, not -100.
    cases.append(("log-ratios of -100 (float32: exp(-100) is subnormal, log(exp(d)) is no longer d)",
                  torch.tensor([-1.0, -0.5, -3.0]), torch.tensor([-101.0, -100.5, -3.5])))
    # exp(-660) is 1e-287 but exp(-760) underflows to 0: exp(logq) / exp(logp) is 0, its log -inf.
    cases.append(("log-probs near -700 with log-ratios of -100 (float64: exp(-760) underflows to 0)",
                  torch.tensor([-660.0, -700.0], dtype=torch.float64), torch.tensor([-760.0, -799.0], dtype=torch.float64)))
    answers = []
    for case, logp, logq in cases:
        logp = logp.clone().requires_grad_(True)
        got = call_unmutated(name, case, fn, logp, logq)
        expected = kl.kl_k3(logp.detach(), logq)
        kept_float64(name, case, got, logp, logq)
        hint = ("k3 = (rho - 1) - log rho with rho = pi_ref / pi_theta = exp(logq - logp) (a difference of logs: "
                "exp(-800) / exp(-800) is 0/0); it is never negative")
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        plain = logp.detach()
        if got_np is not None and got_np.shape == tuple(expected.shape):
            if np.allclose(got_np, to_numpy(kl.kl_k3(logq, plain)), atol=1e-7) and not torch.equal(plain, logq):
                hint = ("the ratio is inverted: rho = pi_ref(x) / pi_theta(x) = exp(logq - logp), "
                        "since the samples come from pi_theta")
            elif np.allclose(got_np, to_numpy(kl.kl_k1(plain, logq)), atol=1e-7) and not torch.equal(plain, logq):
                hint = "that is k1 = -log rho; k3 adds the zero-mean control variate (rho - 1)"
            elif not np.isfinite(got_np).all() or any(
                    np.allclose(got_np, to_numpy(w), rtol=1e-5, atol=1e-8, equal_nan=True)
                    for w in _k3_through_exponentials(plain, logq)):
                hint = ("log(rho) with rho = exp(logq - logp) (or exp(logq) / exp(logp)) loses the log-ratio once "
                        "an exponential underflows to 0 or to a subnormal: use the log-ratio logq - logp itself for "
                        "log rho, and exp only for rho - 1")
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-7, rtol=1e-6)
        answers.append((case, logp, logq, got))
    # The values first, then the gradients of the same answers: k3 is a term of GRPO's loss.
    for case, logp, logq, got in answers:
        (grad,) = gradient_flowing(name, case, got, [logp],
                                   "k3 is a term of GRPO's loss, differentiated with respect to logp: compute it with "
                                   "torch operations on logp (no .item(), NumPy or .detach())")
        ref = logp.detach().clone().requires_grad_(True)
        (want,) = torch.autograd.grad(kl.kl_k3(ref, logq).sum(), [ref])
        assert_close(name, f"{case}: the gradient with respect to logp", want, grad, atol=1e-6, rtol=1e-5,
                     hint="d k3 / d logp = 1 - rho: detach neither term")
    passed(name, len(cases))


@references("rlcourse.kl:kl_k1", "rlcourse.kl:kl_k3", "rlcourse.kl:kl_k2")
def check_kl_estimators(fn) -> None:
    """``fn(logits_p, logits_q, n_samples, seed) -> {"k1": (mean, std), "k3": (mean, std)}``: a measurement.

    The experiment: draw ``n_samples`` tokens from ``p = softmax(logits_p)`` (a ``torch.Generator``
    seeded with ``seed``), evaluate k1 = -log rho and k3 = (rho - 1) - log rho with rho = q(x) / p(x) on each,
    and report each estimator's mean and standard deviation. Both means must estimate the exact
    KL(p || q) (within 4 standard errors), k3 must spread less than k1 when p and q are close,
    and no k3 sample is negative. The seed and the number of samples are varied: the same seed
    twice gives the same numbers, and 40 seeds of 20 samples each spread their k1 means as 20
    samples do (``sd(k1) / sqrt(20)``, between 0.55 and 1.6 times it).
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
    # What the measurement must depend on: its seed (the same seed twice gives the same numbers,
    # other seeds other numbers) and its number of samples (a mean of 20 draws wanders as much as
    # 20 draws allow: sd(k1) / sqrt(20) across seeds, not 0 and not sd / sqrt(20000)).
    case = "the same seed (3) twice, 500 samples"
    first, again = (call_unmutated(name, case, fn, logits_p, logits_q, 500, 3) for _ in range(2))
    if [float(to_numpy(v)) for v in first["k1"]] != [float(to_numpy(v)) for v in again["k1"]]:
        fail(name, case, "the same result twice", f"k1 {first['k1']} then {again['k1']}",
             "draw from a torch.Generator seeded with seed (torch.Generator().manual_seed(seed), passed to "
             "torch.multinomial), not from torch's global random state: a seeded measurement must repeat")
    small, seeds = 20, range(100, 140)
    means = np.array([float(to_numpy(call_unmutated(name, f"seed {s}, {small} samples", fn, logits_p, logits_q,
                                                    small, s)["k1"][0])) for s in seeds])
    k1 = (logp - logq).double()
    sd = float(((logp.exp() * k1 ** 2).sum() - exact ** 2).sqrt())
    ratio = float(means.std(ddof=1)) / (sd / np.sqrt(small))
    case = f"k1's mean over {small} samples at seeds {seeds.start}..{seeds.stop - 1}"
    if not 0.55 < ratio < 1.6:
        hint = (f"the means vary {ratio:.2f} times as much as {small} samples allow (1 expected): draw exactly "
                f"n_samples tokens")
        if ratio < 1e-9:
            hint = ("every seed gave the same mean: seed the generator with the seed you are given, "
                    "torch.Generator().manual_seed(seed), not a constant")
        fail(name, case, f"a spread across seeds near sd(k1) / sqrt({small}) = {sd / np.sqrt(small):.4f}",
             f"{float(means.std(ddof=1)):.4f}", hint)
    passed(name, n + 2)


def _estimator_gradient_mistakes(logits, ref_logits, estimator, sampler_logits):
    """What the usual mistakes give for ``sum_v mu(v) d k(v) / d logits`` on one case (float64), each with
    the hint that names it: differentiated by autograd, one surrogate per mistake."""
    __tracebackhide__ = True
    z = logits.detach().double().clone().requires_grad_(True)
    logq = torch.log_softmax(ref_logits.detach().double(), -1)
    on_policy = sampler_logits is None
    logp0 = torch.log_softmax(z.detach(), -1)
    logmu = logp0 if on_policy else torch.log_softmax(sampler_logits.detach().double(), -1)
    mu, V = logmu.exp(), logits.shape[-1]

    def k(lp, r_inverted=False, r_constant=False, rho="kept", mu_log=logmu):
        log_r = (lp - logq) if r_inverted else (logq - lp)
        r = log_r.detach().exp() if r_constant else log_r.exp()
        if estimator == "k1":
            return -log_r
        if estimator == "k2":
            return 0.5 * log_r ** 2
        k3 = r - 1 - log_r
        if estimator == "k3":
            return k3
        log_rho = lp - mu_log
        return {"kept": log_rho.exp(), "detached": log_rho.exp().detach(), "inverted": (-log_rho).exp()}[rho] * k3

    def grad(surrogate):
        (g,) = torch.autograd.grad(surrogate(torch.log_softmax(z, -1)), z)
        return g

    right = kl.expected_loss_gradient(logp0, logq, estimator, None if on_policy else logmu)
    keep_rho = ("the ratio rho = pi / mu is 1 in value on-policy, but its gradient rho * grad log pi is the point of "
                "rho * k3: it adds the score-function term that turns k3's gradient (the forward KL's) into the "
                "reverse KL's. Keep pi's gradient in rho and hold only mu constant (on-policy mu is pi detached: "
                "rho = exp(log pi - log pi.detach()), never exp(log pi - log pi), which is 1 with no gradient, nor "
                "rho.detach())")
    mistakes = [
        (grad(lambda lp: (lp.exp() * k(lp)).sum()),
         "that is the gradient of the expected value, grad sum_v pi(v) k(v)"
         + (" (for k1 and k3, whose mean is the KL, that is grad KL(pi || pi_ref) itself)" if estimator in ("k1", "k3")
            else "") + ": it adds the score-function term "
         "sum_v k(v) grad pi(v), which a loss on sampled tokens never sees (autograd differentiates k at tokens "
         "already drawn). Weight each token by its sampling probability as a constant (detached) and "
         "differentiate k only"),
        (grad(lambda lp: (lp.exp().detach() * k(lp)).sum()),
         "the tokens come from the sampler mu = softmax(sampler_logits): weight each token by mu(v), a constant"
         + (" (rho = pi / mu already turns the expectation under mu into one under pi: weighting by pi as well "
            "counts it twice)" if estimator == "rho_k3" else "")),
        (-right, "the sign is flipped: differentiate k itself, as a loss does (d k1 / d log pi = +1)"),
        (right / V, "sum over every token, each weighted by its probability: an expectation is a weighted sum, "
                    "not a mean over the vocabulary"),
        (grad(lambda lp: kl.exact_kl(lp, logq).sum()),
         "that is grad KL(pi || pi_ref) itself: the exercise asks for the expected gradient of the estimator you "
         "are given, sum_v mu(v) grad k(v), which equals the KL's only for some estimators and samplers (the "
         "cell after the check measures which)"),
    ]
    lp_leaf = logp0.clone().requires_grad_(True)
    (wrt_logp,) = torch.autograd.grad((mu * k(lp_leaf)).sum(), lp_leaf)
    mistakes.append((wrt_logp, "that is the gradient with respect to the log-probs; the answer is with respect to "
                               "the logits z: log pi(v) = z_v - logsumexp(z) moves with every logit, "
                               "d log pi(v) / d z = e_v - pi (differentiate through log_softmax)"))
    if estimator == "k2":
        mistakes.append((2 * right, "k2 = (log(pi / pi_ref))^2 / 2: mind the 1/2"))
    if estimator in ("k3", "rho_k3"):
        mistakes += [
            (grad(lambda lp: (mu * k(lp, r_inverted=True)).sum()),
             "k3 = (r - 1) - log r with r = pi_ref(v) / pi(v): the reference over the policy"),
            (grad(lambda lp: (mu * k(lp, r_constant=True)).sum()),
             "r = pi_ref / pi depends on the logits through pi: keep its gradient (d k3 / d log pi = 1 - r); "
             "with r held constant k3's gradient is k1's"),
        ]
    if estimator == "rho_k3":
        mistakes += [
            (grad(lambda lp: (mu * k(lp, rho="detached")).sum()), keep_rho),
            (grad(lambda lp: (mu * k(lp, mu_log=lp)).sum()), keep_rho),      # rho = exp(log pi - log pi) = 1
            (grad(lambda lp: (mu * k(lp, rho="inverted")).sum()),
             "rho = pi(v) / mu(v), the policy over the sampler: the importance ratio that turns an expectation "
             "under mu into one under pi"),
        ]
    return right, mistakes


@references("rlcourse.kl:expected_loss_gradient", "rlcourse.kl:kl_k1", "rlcourse.kl:kl_k2", "rlcourse.kl:kl_k3",
            "rlcourse.losses.grpo:per_token_loss")
def check_expected_kl_gradient(fn) -> None:
    """``fn(logits, ref_logits, estimator, sampler_logits=None) -> (..., V)``: the gradient a KL estimator put in
    a loss follows, in expectation over the sampled token, exactly:
    ``sum_v mu(v) d k(v) / d logits`` with ``pi = softmax(logits)``, ``pi_ref = softmax(ref_logits)`` and the
    sampler ``mu = softmax(sampler_logits)`` (``pi`` itself, held constant, when ``sampler_logits`` is None);
    ``estimator`` is ``"k1"``, ``"k2"``, ``"k3"`` or ``"rho_k3"`` (k3 times ``rho = pi / mu``, TRL's
    ``use_bias_correction_kl``).

    Every input is varied: the estimator (strings built at run time), the vocabulary size (2 to 17), the
    batch shape, the logits' scale, the reference, the sampler (none, the policy itself passed explicitly,
    another distribution), float32 and float64. Two cases have ``rho = 1`` in value (no sampler, and a
    sampler equal to the policy), so a detached ratio gives the value of the right answer's terms but not
    its gradient. The same call twice must give the same answer (a sum, not a sample).
    """
    __tracebackhide__ = True
    name = "check_expected_kl_gradient"
    gen = torch.Generator().manual_seed(77)

    def randn(*shape, scale=1.5, dtype=torch.float64):
        return scale * torch.randn(*shape, generator=gen, dtype=dtype)

    def est(s):                                   # a string built at run time: `is` is not `==`
        return "".join(list(s))

    p5, p7, p17 = randn(5), randn(4, 7), randn(3, 17)
    p9 = randn(2, 3, 9)
    same = randn(6, 2)
    cases = [
        ("k1 on-policy, V=5, one state (no sampler_logits passed)", p5, randn(5), est("k1"), "omit"),
        ("k2 on-policy, V=6, shape (3, 6), sampler_logits=None", randn(3, 6), randn(3, 6), est("k2"), None),
        ("k3 on-policy, V=9, shape (2, 3, 9), a reference flatter than the policy", p9, p9 / 2.5 + randn(2, 3, 9, scale=0.3),
         est("k3"), "omit"),
        ("rho_k3 on-policy (rho = 1 in value), V=7, shape (4, 7)", p7, randn(4, 7), est("rho_k3"), None),
        ("rho_k3 with sampler_logits equal to the policy's (rho = 1 in value), V=7", p7, randn(4, 7), est("rho_k3"),
         p7.clone()),
        ("rho_k3 from another sampler, V=17, shape (3, 17)", p17, randn(3, 17), est("rho_k3"), p17 + randn(3, 17, scale=1.0)),
        ("k1 from another sampler (E_mu[grad log pi] is not 0), V=5, shape (2, 5)", randn(2, 5), randn(2, 5), est("k1"),
         randn(2, 5)),
        ("k2 from another sampler, V=4, shape (3, 4)", randn(3, 4), randn(3, 4), est("k2"), randn(3, 4)),
        ("k3 from another sampler, V=2, shape (6, 2)", same, randn(6, 2), est("k3"), same + randn(6, 2, scale=0.7)),
        ("k3 with sampler_logits equal to the policy's, V=2, shape (6, 2)", same, randn(6, 2), est("k3"), same.clone()),
        ("rho_k3, the reference equal to the policy (KL = 0), V=8", randn(2, 8), None, est("rho_k3"), None),
        ("k2 on-policy, a confident policy (logits of scale 6), V=12", randn(2, 12, scale=6.0), randn(2, 12), est("k2"),
         "omit"),
        ("rho_k3 on-policy in float32 (rho = 1 in value), V=10", randn(2, 10, dtype=torch.float32),
         randn(2, 10, dtype=torch.float32), est("rho_k3"), None),
        ("k3 from another sampler in float32, V=10", randn(2, 10, dtype=torch.float32), randn(2, 10, dtype=torch.float32),
         est("k3"), randn(2, 10, dtype=torch.float32)),
    ]
    generic = ("sum_v mu(v) grad_logits k(v): every token of the vocabulary weighted by its sampling probability mu(v) "
               "(pi itself, held constant, when sampler_logits is None), summed exactly (a sampled average is noisy), "
               "with k differentiated with respect to the logits")
    for case, logits, ref_logits, estimator, sampler in cases:
        ref_logits = logits.clone() if ref_logits is None else ref_logits
        args = (logits, ref_logits, estimator) if isinstance(sampler, str) else (logits, ref_logits, estimator, sampler)
        got = call_unmutated(name, case, fn, *args)
        if got is None:
            fail(name, case, "a tensor of the logits' shape", None, "the function returned None: did you forget `return`?")
        kept_float64(name, case, got, logits, ref_logits)
        right, mistakes = _estimator_gradient_mistakes(logits, ref_logits, estimator,
                                                       None if isinstance(sampler, str) else sampler)
        right = right.to(logits.dtype)
        float32 = logits.dtype == torch.float32
        tol = dict(atol=1e-5, rtol=1e-4) if float32 else dict(atol=1e-9, rtol=1e-7)
        got_np = to_numpy(_grad_free(got))
        if got_np.shape == tuple(right.shape) and not np.allclose(got_np, to_numpy(right), **tol):
            again = call_unmutated(name, case, fn, *args)       # a second call: does the answer sample?
            if again is not None and not np.array_equal(to_numpy(_grad_free(again)), got_np, equal_nan=True):
                fail(name, case, "the same answer from two calls on the same inputs", "two different answers",
                     "the answer changed from one call to the next: it samples. Sum over all V tokens, each weighted "
                     "by its probability: the expectation is exact, not estimated")
        for value, hint in mistakes:
            fail_if_mistake(name, case, right, _grad_free(got), value, hint)
        assert_close(name, case, right, _grad_free(got), hint=generic, **tol)
    passed(name, len(cases))
