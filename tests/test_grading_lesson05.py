"""The lesson-05 checks accept the reference and reject plausible wrong answers."""
import pytest
import torch

from grading_asserts import assert_fails, assert_passes
from rlcourse.grading import check_conjugate_gradient, check_natural_step, check_surrogate_objective


def surrogate(logprobs, old_logprobs, advantages):
    return (torch.exp(logprobs - old_logprobs) * advantages).mean()


def conjugate_gradient(Avp, b, iters):
    x, r, p = torch.zeros_like(b), b.clone(), b.clone()
    rr = r @ r
    for _ in range(iters):
        if rr == 0:
            break
        Ap = Avp(p)
        alpha = rr / (p @ Ap)
        x, r = x + alpha * p, r - alpha * Ap
        rr_new = r @ r
        p, rr = r + rr_new / rr * p, rr_new
    return x


def natural_step(direction, Fd, max_kl):
    return torch.sqrt(2 * max_kl / (direction @ Fd)) * direction


# ----------------------------------------------------------------------------- plausible mistakes
def surrogate_prob_ratio(logprobs, old_logprobs, advantages):
    return (logprobs.exp() / old_logprobs.exp() * advantages).mean()


def surrogate_detached(logprobs, old_logprobs, advantages):
    return torch.tensor(float((torch.exp(logprobs - old_logprobs) * advantages).mean().detach()), dtype=torch.float64)


def surrogate_log_ratio(logprobs, old_logprobs, advantages):
    return ((logprobs - old_logprobs) * advantages).mean()


def cg_steepest_descent(Avp, b, iters):
    x, r = torch.zeros_like(b), b.clone()
    for _ in range(iters):
        Ar = Avp(r)
        alpha = (r @ r) / (r @ Ar)
        x, r = x + alpha * r, r - alpha * Ar
    return x


def cg_too_many_products(Avp, b, iters):
    x = conjugate_gradient(Avp, b, iters)
    Avp(x)  # "checking the residual" costs one more product than allowed
    return x


def natural_step_without_two(direction, Fd, max_kl):
    return torch.sqrt(max_kl / (direction @ Fd)) * direction


def natural_step_without_sqrt(direction, Fd, max_kl):
    return 2 * max_kl / (direction @ Fd) * direction


@pytest.mark.parametrize("check, fn", [(check_surrogate_objective, surrogate),
                                       (check_conjugate_gradient, conjugate_gradient),
                                       (check_natural_step, natural_step)])
def test_reference_passes_with_one_line(check, fn, capsys):
    assert_passes(check, fn, capsys)


@pytest.mark.parametrize("check, wrong", [
    (check_surrogate_objective, surrogate_prob_ratio),
    (check_surrogate_objective, surrogate_detached),
    (check_surrogate_objective, surrogate_log_ratio),
    (check_conjugate_gradient, cg_steepest_descent),
    (check_conjugate_gradient, cg_too_many_products),
    (check_natural_step, natural_step_without_two),
    (check_natural_step, natural_step_without_sqrt),
])
def test_wrong_answers_fail(check, wrong):
    assert_fails(check, wrong)


# ------------------------------------------------------------------ witnesses: named mistakes get their hint
def surrogate_on_policy(logprobs, old_logprobs, advantages):  # as if the samples came from the new policy
    return (logprobs * advantages).mean()


def surrogate_unweighted_probs(logprobs, old_logprobs, advantages):
    return (torch.exp(logprobs) * advantages).mean()


@pytest.mark.parametrize("wrong, hint", [(surrogate_on_policy, "came from the old one"),
                                         (surrogate_unweighted_probs, "divide by pi_old")])
def test_surrogate_without_importance_weights_is_named(wrong, hint):
    assert_fails(check_surrogate_objective, wrong, hint=hint)
