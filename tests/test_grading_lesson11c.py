"""Lesson 11c's checks pass right answers written in other ways and catch plausible wrong ones.

The right answers are written from the exercise texts, independently of the solution notebook."""
import functools
import math

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from rlcourse.grading.llm.lesson11c import (check_distillation_step, check_distillation_step_fixed, check_gkd_jsd,
                                            check_masked_reverse_kl)
from rlcourse.lm.logprobs import completion_logits
from rlcourse.lm.sampling import sample
from grading_asserts import assert_fails, assert_passes


# ----------------------------------------------------------------- exercises 1 and 2: per-token divergences
def _dists(student_logits, teacher_logits, mask, detach=True, where=True):
    keep = mask.bool()[..., None]
    teacher = teacher_logits.detach() if detach else teacher_logits
    if where:
        student_logits = torch.where(keep, student_logits, 0.0)
        teacher = torch.where(keep, teacher, 0.0)
    return F.log_softmax(student_logits, -1), F.log_softmax(teacher, -1)


def reverse_kl_with_kl_div(student_logits, teacher_logits, mask):
    """F.kl_div(input, target) = KL(target || input): the student is the target."""
    log_s, log_t = _dists(student_logits, teacher_logits, mask)
    per_token = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    return torch.where(mask.bool(), per_token, torch.zeros_like(per_token))


def reverse_kl(student_logits, teacher_logits, mask, mistake=None):
    log_s, log_t = _dists(student_logits, teacher_logits, mask, detach=mistake != "no_detach",
                          where=mistake != "multiply_mask")
    p_s = log_s.exp()
    if mistake == "forward":
        per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif mistake == "sign":
        per_token = (p_s * (log_t - log_s)).sum(-1)
    elif mistake == "probabilities":
        per_token = (p_s * (p_s - log_t.exp())).sum(-1)
    elif mistake == "raw_teacher":
        per_token = (p_s * (log_s - torch.where(mask.bool()[..., None], teacher_logits.detach(), 0.0))).sum(-1)
    elif mistake == "mean_vocab":
        per_token = (p_s * (log_s - log_t)).mean(-1)
    elif mistake == "per_completion":
        return (p_s * (log_s - log_t)).sum(-1).mul(mask).sum(-1)
    elif mistake == "detached":
        return reverse_kl(student_logits, teacher_logits, mask).detach()
    else:
        per_token = (p_s * (log_s - log_t)).sum(-1)
    if mistake == "no_mask":
        full_s, full_t = F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits.detach(), -1)
        return (full_s.exp() * (full_s - full_t)).sum(-1)
    if mistake == "multiply_mask":
        return per_token * mask
    return torch.where(mask.bool(), per_token, torch.zeros_like(per_token))


REVERSE_MISTAKES = {"forward": "forward KL", "sign": "the sign", "probabilities": "log-probabilities, not probabilities",
                    "raw_teacher": "normalise the teacher's logits", "mean_vocab": "do not average over it",
                    "no_mask": "mask is 0 are not there", "multiply_mask": "torch.where",
                    "no_detach": "stop-gradient", "per_completion": "one divergence per position",
                    "detached": "graph"}


def test_masked_reverse_kl_right_answers_pass(capsys):
    assert_passes(check_masked_reverse_kl, reverse_kl, capsys)
    assert_passes(check_masked_reverse_kl, reverse_kl_with_kl_div, capsys)


@pytest.mark.parametrize("mistake", list(REVERSE_MISTAKES))
def test_masked_reverse_kl_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(reverse_kl, mistake=mistake)
    wrong.__name__ = mistake
    assert_fails(check_masked_reverse_kl, wrong, REVERSE_MISTAKES[mistake])


def jsd(student_logits, teacher_logits, mask, beta, mistake=None):
    log_s, log_t = _dists(student_logits, teacher_logits, mask, where=mistake != "no_mask")

    def kl(a, b):
        return (a.exp() * (a - b)).sum(-1)

    def mix(w):
        return torch.log(w * log_t.exp() + (1 - w) * log_s.exp())

    ends = mistake not in ("mixture_at_ends", "swapped_ends")
    if beta == 0 and ends:
        value = kl(log_t, log_s)
    elif beta == 1 and ends:
        value = kl(log_s, log_t)
    elif beta in (0, 1) and mistake == "swapped_ends":
        value = kl(log_s, log_t) if beta == 0 else kl(log_t, log_s)
    elif mistake == "mixture_at_ends" and beta in (0, 1):
        value = torch.zeros(mask.shape, dtype=log_s.dtype) + 0 * log_s.sum(-1)
    else:
        log_m = mix(1 - beta) if mistake == "swapped_mixture" else mix(beta)
        if mistake == "swapped_weights":
            value = (1 - beta) * kl(log_t, log_m) + beta * kl(log_s, log_m)
        elif mistake == "kl_to_mixture_reversed":
            value = beta * kl(log_m, log_t) + (1 - beta) * kl(log_m, log_s)
        elif mistake == "ignores_beta":
            log_m = mix(0.5)
            value = 0.5 * kl(log_t, log_m) + 0.5 * kl(log_s, log_m)
        else:
            value = beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)
    if mistake == "no_mask":
        return value
    return torch.where(mask.bool(), value, torch.zeros_like(value))


def jsd_logspace(student_logits, teacher_logits, mask, beta):
    """The mixture kept in log space, the ends through the library-free F.kl_div."""
    log_s, log_t = _dists(student_logits, teacher_logits, mask)
    if beta == 0:
        value = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        value = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
        value = (beta * F.kl_div(log_m, log_t, reduction="none", log_target=True).sum(-1)
                 + (1 - beta) * F.kl_div(log_m, log_s, reduction="none", log_target=True).sum(-1))
    return torch.where(mask.bool(), value, torch.zeros_like(value))


JSD_MISTAKES = {"swapped_mixture": "beta weighs the teacher", "swapped_weights": "the terms' weights",
                "kl_to_mixture_reversed": "each model's distribution first", "ignores_beta": "use beta",
                "swapped_ends": "TRL's convention", "mixture_at_ends": "TRL computes the KL itself",
                "no_mask": "mask is 0"}


def test_gkd_jsd_right_answers_pass(capsys):
    assert_passes(check_gkd_jsd, jsd, capsys)
    assert_passes(check_gkd_jsd, jsd_logspace, capsys)


@pytest.mark.parametrize("mistake", list(JSD_MISTAKES))
def test_gkd_jsd_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(jsd, mistake=mistake)
    wrong.__name__ = mistake
    assert_fails(check_gkd_jsd, wrong, JSD_MISTAKES[mistake])


# ------------------------------------------------------------------ exercises 3 and 4: the step
def step(model, teacher, optimizer, tokenizer, task, prompts, generator, mistake=None):
    roll = sample(model, tokenizer, prompts, task.max_new_tokens, temperature=0.0 if mistake == "greedy" else 1.0,
                  generator=generator)
    args = (roll.prompt_ids, roll.completion_ids, roll.prompt_mask, roll.completion_mask)
    z_s = completion_logits(model, *args)
    with torch.no_grad():
        z_t = completion_logits(teacher, *args)
    mask = roll.completion_mask
    if mistake == "forward":
        per_token = reverse_kl(z_s, z_t, mask, mistake="forward")
    elif mistake == "sampled_k1":
        ids = roll.completion_ids[..., None]
        per_token = (F.log_softmax(z_s, -1).gather(-1, ids) - F.log_softmax(z_t, -1).gather(-1, ids)).squeeze(-1)
        per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    elif mistake == "nll_on_own_samples":
        ids = roll.completion_ids[..., None]
        per_token = torch.where(mask.bool(), -F.log_softmax(z_s, -1).gather(-1, ids).squeeze(-1), 0.0)
    else:
        per_token = reverse_kl(z_s, z_t, mask)
    if mistake == "all_positions":
        loss = per_token.mean()
    elif mistake == "per_completion":
        loss = (per_token.sum(1) / mask.sum(1)).mean()
    else:
        loss = per_token.sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if mistake == "returns_after_step":
        with torch.no_grad():
            return float(reverse_kl(completion_logits(model, *args), z_t, mask).sum() / mask.sum())
    return float(loss.detach())


STEP_MISTAKES = {"forward": "another direction", "sampled_k1": "another direction",
                 "nll_on_own_samples": "another direction", "all_positions": "another length",
                 "per_completion": "the reference step's gradient", "greedy": "temperature 1",
                 "returns_after_step": "before optimizer.step()"}


def test_distillation_step_right_answer_passes(capsys):
    assert_passes(check_distillation_step, step, capsys)


@pytest.mark.parametrize("mistake", list(STEP_MISTAKES))
def test_distillation_step_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(step, mistake=mistake)
    wrong.__name__ = mistake
    assert_fails(check_distillation_step, wrong, STEP_MISTAKES[mistake])


def test_the_buggy_step_of_exercise_4_fails_and_names_kl_div():
    assert_fails(check_distillation_step_fixed, functools.partial(step, mistake="forward"), "F.kl_div(input, target")
