"""Lesson 07b's checks pass the reference answers and catch each plausible wrong answer.
(The experiment check, check_kl_estimators, is tested in test_grading_experiments.py.)"""

import rlcourse  # noqa: F401  (before torch)
import numpy as np
import pytest
import torch

from grading_asserts import assert_fails, assert_passes, grading_tests
from rlcourse.grading.llm.lesson07b import check_exact_kl, check_kl_estimators, check_kl_k3


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
