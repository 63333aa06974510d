"""Lesson 07b's checks pass the reference answers and catch each plausible wrong answer.
(The experiment check, check_kl_estimators, is tested in test_grading_experiments.py.)"""

import rlcourse  # noqa: F401  (before torch)
import torch

from grading_asserts import assert_fails, grading_tests
from rlcourse.grading.lesson07b import check_exact_kl, check_kl_k3


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
