"""Lesson 07b's checks pass the reference answers and catch each plausible wrong answer.
(The experiment check, check_kl_estimators, is tested in test_grading_experiments.py.)"""

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import pytest
import torch

from grading_asserts import assert_fails, assert_passes, grading_tests
from rlcourse.grading.llm.lesson07b import check_exact_kl, check_expected_kl_gradient, check_kl_estimators, check_kl_k3


# --- the exact KL over the vocabulary ------------------------------------------------------------

def exact_kl_ok(logits_p, logits_q):
    logp, logq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def exact_kl_ok_functional(logits_p, logits_q):
    return torch.nn.functional.kl_div(torch.log_softmax(logits_q, -1), torch.log_softmax(logits_p, -1),
                                      reduction="none", log_target=True).sum(-1)


def exact_kl_reversed(logits_p, logits_q):
    return exact_kl_ok(logits_q, logits_p)


def exact_kl_log_of_softmax(logits_p, logits_q):
    p, q = torch.softmax(logits_p, -1), torch.softmax(logits_q, -1)
    return (p * (torch.log(p) - torch.log(q))).sum(-1)


def exact_kl_wrong_sign(logits_p, logits_q):
    return -exact_kl_ok(logits_p, logits_q)


def exact_kl_mean_over_vocabulary(logits_p, logits_q):
    logp, logq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return (logp.exp() * (logp - logq)).mean(-1)


def exact_kl_unweighted(logits_p, logits_q):
    return (torch.log_softmax(logits_p, -1) - torch.log_softmax(logits_q, -1)).sum(-1)


def exact_kl_detached_weights(logits_p, logits_q):
    logp, logq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    return (logp.exp().detach() * (logp - logq)).sum(-1)


def exact_kl_no_grad(logits_p, logits_q):
    with torch.no_grad():
        return exact_kl_ok(logits_p, logits_q)


def exact_kl_in_place(logits_p, logits_q):
    logits_q -= logits_q.max(-1, keepdim=True).values
    return exact_kl_ok(logits_p, logits_q)


# --- k3 ----------------------------------------------------------------------------------------

def k3_ok(logp, logq):
    log_r = logq - logp
    return torch.exp(log_r) - 1 - log_r


def k3_ok_trl_style(logp, logq):
    return torch.exp(logq - logp) - (logq - logp) - 1


def k3_inverted(logp, logq):
    log_r = logp - logq
    return torch.exp(log_r) - 1 - log_r


def k3_is_k1(logp, logq):
    return logp - logq


def k3_is_k2(logp, logq):
    return 0.5 * (logq - logp) ** 2


def k3_wrong_sign(logp, logq):
    return -k3_ok(logp, logq)


def k3_probability_ratio_without_log(logp, logq):
    r = torch.exp(logq - logp)
    return (r - 1) - r


# -----------------------------------------------------------------------------------------------

RIGHT = [(check_exact_kl, exact_kl_ok), (check_exact_kl, exact_kl_ok_functional),
         (check_kl_k3, k3_ok), (check_kl_k3, k3_ok_trl_style)]

WRONG = [
    (check_exact_kl, exact_kl_reversed, "reversed"),
    (check_exact_kl, exact_kl_log_of_softmax, "nan"),
    (check_exact_kl, exact_kl_wrong_sign, "never negative"),
    (check_exact_kl, exact_kl_mean_over_vocabulary, "sum_v"),
    (check_exact_kl, exact_kl_unweighted, "weight each log-ratio by p(v)"),
    (check_exact_kl, exact_kl_detached_weights, "detach neither"),
    (check_exact_kl, exact_kl_no_grad, "grad_fn"),
    (check_exact_kl, exact_kl_in_place, "modified in place"),
    (check_kl_k3, k3_inverted, "inverted"),
    (check_kl_k3, k3_is_k1, "that is k1"),
    (check_kl_k3, k3_is_k2, "never negative"),
    (check_kl_k3, k3_wrong_sign, "never negative"),
    (check_kl_k3, k3_probability_ratio_without_log, "never negative"),
]


test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


def k3_log_of_exp(logp, logq):       # log(exp(d)) instead of d: -inf once exp(d) underflows
    rho = torch.exp(logq - logp)
    return rho - 1 - torch.log(rho)


def test_k3_through_log_of_exp_overflows_and_is_told_why():
    assert_fails(check_kl_k3, k3_log_of_exp, hint="underflows to 0")


# --- families the checks now vary (catalogue: tests/grading_catalogue_llm.py) ------------------

def exact_kl_p_log_p_over_q(logits_p, logits_q):      # 0 * log 0 = nan once p(v) underflows to 0
    p, q = torch.softmax(logits_p, -1), torch.softmax(logits_q, -1)
    return (p * torch.log(p / q)).sum(-1)


def exact_kl_float32(logits_p, logits_q):             # float64 logits, a float32 KL
    return exact_kl_ok(logits_p.float(), logits_q.float())


def k3_ratio_of_exponentials(logp, logq):             # exp(-760) / exp(-660) = 0: log 0 = -inf
    rho = torch.exp(logq) / torch.exp(logp)
    return rho - 1 - torch.log(rho)


def k3_through_numpy(logp, logq):                     # right values, no gradient for GRPO's loss
    log_r = (logq - logp).detach().numpy()
    return torch.from_numpy(np.exp(log_r) - 1 - log_r)


def k3_in_float32(logp, logq):
    return k3_ok(logp.float(), logq.float())


def kl_estimators_ok(logits_p, logits_q, n_samples, seed):
    g = torch.Generator().manual_seed(seed)
    logp_all, logq_all = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    x = torch.multinomial(logp_all.exp(), n_samples, replacement=True, generator=g)
    log_r = logq_all[x] - logp_all[x]
    k1, k3 = -log_r, log_r.exp() - 1 - log_r
    return {"k1": (k1.mean(), k1.std()), "k3": (k3.mean(), k3.std())}


def kl_estimators_numpy(logits_p, logits_q, n_samples, seed):    # right too: NumPy's generator, seeded
    rng = np.random.default_rng(seed)
    logp_all = torch.log_softmax(logits_p, -1).numpy()
    logq_all = torch.log_softmax(logits_q, -1).numpy()
    x = rng.choice(len(logp_all), size=n_samples, p=np.exp(logp_all) / np.exp(logp_all).sum())
    log_r = logq_all[x] - logp_all[x]
    k1, k3 = -log_r, np.exp(log_r) - 1 - log_r
    return {"k1": (k1.mean(), k1.std(ddof=1)), "k3": (k3.mean(), k3.std(ddof=1))}


def kl_estimators_constant_seed(logits_p, logits_q, n_samples, seed):
    return kl_estimators_ok(logits_p, logits_q, n_samples, 0)


def kl_estimators_fixed_count(logits_p, logits_q, n_samples, seed):
    return kl_estimators_ok(logits_p, logits_q, 20000, seed)


def kl_estimators_unseeded(logits_p, logits_q, n_samples, seed):
    return kl_estimators_ok(logits_p, logits_q, n_samples, int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("answer", [kl_estimators_ok, kl_estimators_numpy])
def test_kl_estimators_right_answers_pass(answer, capsys):
    assert_passes(check_kl_estimators, answer, capsys)


@pytest.mark.parametrize("check, wrong, hint", [
    (check_exact_kl, exact_kl_p_log_p_over_q, "0 * log 0"),
    (check_exact_kl, exact_kl_float32, "float64"),
    (check_kl_k3, k3_ratio_of_exponentials, "underflows"),
    (check_kl_k3, k3_through_numpy, "grad_fn"),
    (check_kl_k3, k3_in_float32, "float64"),
    (check_kl_estimators, kl_estimators_constant_seed, "every seed gave the same mean"),
    (check_kl_estimators, kl_estimators_fixed_count, "draw exactly n_samples"),
    (check_kl_estimators, kl_estimators_unseeded, "must repeat"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_families_the_checks_now_vary(check, wrong, hint):
    assert_fails(check, wrong, hint)


# --- the expected gradient of an estimator in a loss ------------------------------------------------

def _k(lp, lq, estimator, log_rho):
    log_r = lq - lp
    k3 = log_r.exp() - 1 - log_r
    return {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": k3, "rho_k3": log_rho.exp() * k3}[estimator]


def expected_gradient_ok(logits, ref_logits, estimator, sampler_logits=None):
    """By autograd: the sampled tokens' weights mu(v) are constants, k is differentiated."""
    z = logits.detach().clone().requires_grad_(True)
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(ref_logits, -1)
    lmu = lp.detach() if sampler_logits is None else torch.log_softmax(sampler_logits, -1)
    (g,) = torch.autograd.grad((lmu.exp() * _k(lp, lq, estimator, lp - lmu)).sum(), z)
    return g


def expected_gradient_ok_closed_form(logits, ref_logits, estimator, sampler_logits=None):
    """d log pi(v) / dz = e_v - pi, so the answer is c - pi * sum(c) with c(v) = mu(v) dk/dlog pi(v)."""
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    lmu = lp if sampler_logits is None else torch.log_softmax(sampler_logits, -1)
    mu, d = lmu.exp(), lp - lq
    c = {"k1": mu, "k2": mu * d, "k3": mu * (1 - (-d).exp()), "rho_k3": lp.exp() * d}[estimator]
    return c - lp.exp() * c.sum(-1, keepdim=True)


def _variant(logits, ref_logits, estimator, sampler_logits=None, *, weights="mu", rho="kept", r="kept",
             scale=1.0, wrt="logits", k2_half=0.5):
    z = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)
    leaf = lp.detach().clone().requires_grad_(True) if wrt == "logp" else None
    lp = leaf if leaf is not None else lp
    lq = torch.log_softmax(ref_logits, -1)
    lmu = lp.detach() if sampler_logits is None else torch.log_softmax(sampler_logits, -1)
    log_r = {"kept": lq - lp, "inverted": lp - lq}.get(r, lq - lp)
    ratio = log_r.detach().exp() if r == "detached" else log_r.exp()
    k3 = ratio - 1 - log_r
    log_rho = {"kept": lp - lmu, "detached": (lp - lmu).detach(), "itself": lp - lp, "inverted": lmu - lp}[rho]
    k = {"k1": -log_r, "k2": k2_half * log_r ** 2, "k3": k3, "rho_k3": log_rho.exp() * k3}[estimator]
    w = {"mu": lmu.exp(), "pi with its gradient": lp.exp(), "pi": lp.exp().detach()}[weights]
    (g,) = torch.autograd.grad((w * k).sum(), leaf if leaf is not None else z)
    return scale * g


def _wrong(**mistake):
    def fn(logits, ref_logits, estimator, sampler_logits=None):
        return _variant(logits, ref_logits, estimator, sampler_logits, **mistake)
    fn.__name__ = "expected_gradient_" + "_".join(f"{k}={v}" for k, v in mistake.items()).replace(" ", "_")
    return fn


def expected_gradient_of_the_kl(logits, ref_logits, estimator, sampler_logits=None):
    z = logits.detach().clone().requires_grad_(True)
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(ref_logits, -1)
    (g,) = torch.autograd.grad((lp.exp() * (lp - lq)).sum(), z)
    return g


def expected_gradient_mean_over_vocabulary(logits, ref_logits, estimator, sampler_logits=None):
    return expected_gradient_ok(logits, ref_logits, estimator, sampler_logits) / logits.shape[-1]


def expected_gradient_sampled(logits, ref_logits, estimator, sampler_logits=None):     # Monte Carlo, unseeded
    z = logits.detach().clone().requires_grad_(True)
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(ref_logits, -1)
    lmu = lp.detach() if sampler_logits is None else torch.log_softmax(sampler_logits, -1)
    flat_mu = lmu.exp().reshape(-1, logits.shape[-1])
    counts = torch.stack([torch.bincount(torch.multinomial(row.float(), 4000, replacement=True),
                                         minlength=logits.shape[-1]) for row in flat_mu]).view_as(lp)
    (g,) = torch.autograd.grad((counts.to(lp.dtype) / 4000 * _k(lp, lq, estimator, lp - lmu)).sum(), z)
    return g


def expected_gradient_sampled_seeded(logits, ref_logits, estimator, sampler_logits=None):   # repeatable, still noisy
    torch.manual_seed(0)
    return expected_gradient_sampled(logits, ref_logits, estimator, sampler_logits)


RATIO_WEIGHTED = "rho_k3"


def expected_gradient_with_is(logits, ref_logits, estimator, sampler_logits=None):
    if estimator is RATIO_WEIGHTED:          # the mistake: identity, not equality (False for a string built at run time)
        return expected_gradient_ok(logits, ref_logits, "rho_k3", sampler_logits)
    return expected_gradient_ok(logits, ref_logits, "k3" if estimator == "rho_k3" else estimator, sampler_logits)


def expected_gradient_in_float32(logits, ref_logits, estimator, sampler_logits=None):
    return expected_gradient_ok(logits.float(), ref_logits.float(), estimator,
                                None if sampler_logits is None else sampler_logits.float())


def expected_gradient_in_place(logits, ref_logits, estimator, sampler_logits=None):
    ref_logits -= ref_logits.max(-1, keepdim=True).values
    return expected_gradient_ok(logits, ref_logits, estimator, sampler_logits)


@pytest.mark.parametrize("answer", [expected_gradient_ok, expected_gradient_ok_closed_form])
def test_expected_gradient_right_answers_pass(answer, capsys):
    assert_passes(check_expected_kl_gradient, answer, capsys)


@pytest.mark.parametrize("wrong, hint", [
    (_wrong(weights="pi with its gradient"), "gradient of the expected value"),       # the value's gradient
    (_wrong(weights="pi"), "the tokens come from the sampler"),                         # the sampler ignored
    (_wrong(rho="detached"), "rho.detach()"),                                           # the score-function term lost
    (_wrong(rho="itself"), "never exp(log pi - log pi)"),                               # mu not held constant
    (_wrong(rho="inverted"), "the policy over the sampler"),
    (_wrong(r="inverted"), "the reference over the policy"),
    (_wrong(r="detached"), "keep its gradient"),                                       # k3's ratio detached
    (_wrong(scale=-1.0), "the sign is flipped"),
    (_wrong(wrt="logp"), "with respect to the logits"),
    (_wrong(k2_half=1.0), "mind the 1/2"),
    (expected_gradient_of_the_kl, "grad KL(pi || pi_ref) itself"),
    (expected_gradient_mean_over_vocabulary, "not a mean over the vocabulary"),
    (expected_gradient_sampled, "it samples"),
    (expected_gradient_sampled_seeded, "summed exactly"),
    (expected_gradient_with_is, None),
    (expected_gradient_in_float32, "float64"),
    (expected_gradient_in_place, "modified in place"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_expected_gradient_wrong_answers_fail_with_a_hint(wrong, hint):
    assert_fails(check_expected_kl_gradient, wrong, hint)
