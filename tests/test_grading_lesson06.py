"""The lesson-06 checks accept the reference and reject plausible wrong answers."""
import pytest
import torch

from grading_asserts import assert_fails, assert_passes
from rlcourse.grading import check_adaptive_kl_beta, check_clipped_value_loss, check_ppo_clip_loss


def ppo_clip_loss(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages).mean()


def clipped_value_loss(values, returns, old_values, clip_coef):
    clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()


def adaptive_kl_beta(beta, kl, kl_target):
    if kl < kl_target / 1.5:
        return beta / 2
    if kl > kl_target * 1.5:
        return beta * 2
    return beta


# ----------------------------------------------------------------------------- plausible mistakes
def clip_with_max(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    return -torch.maximum(ratio * advantages, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages).mean()


def clip_the_advantage(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    return -torch.minimum(ratio * advantages, ratio * torch.clamp(advantages, 1 - clip_coef, 1 + clip_coef)).mean()


def min_of_ratios(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    return -(torch.minimum(ratio, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)) * advantages).mean()


def ratio_of_probabilities(logprobs, old_logprobs, advantages, clip_coef):
    ratio = logprobs.exp() / old_logprobs.exp()
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages).mean()


def missing_minus(logprobs, old_logprobs, advantages, clip_coef):
    return -ppo_clip_loss(logprobs, old_logprobs, advantages, clip_coef)


def clip_only(logprobs, old_logprobs, advantages, clip_coef):
    ratio = torch.exp(logprobs - old_logprobs)
    return -(torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages).mean()


def value_loss_with_min(values, returns, old_values, clip_coef):
    clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
    return 0.5 * torch.minimum((values - returns) ** 2, (clipped - returns) ** 2).mean()


def value_loss_clips_returns(values, returns, old_values, clip_coef):
    clipped = torch.clamp(returns, old_values - clip_coef, old_values + clip_coef)
    return 0.5 * torch.maximum((values - returns) ** 2, (values - clipped) ** 2).mean()


def value_loss_unclipped(values, returns, old_values, clip_coef):
    return 0.5 * ((values - returns) ** 2).mean()


def beta_inverted(beta, kl, kl_target):
    if kl < kl_target / 1.5:
        return beta * 2
    if kl > kl_target * 1.5:
        return beta / 2
    return beta


def beta_without_tolerance(beta, kl, kl_target):
    return beta / 2 if kl < kl_target else beta * 2


@pytest.mark.parametrize("check, fn", [(check_ppo_clip_loss, ppo_clip_loss),
                                       (check_clipped_value_loss, clipped_value_loss),
                                       (check_adaptive_kl_beta, adaptive_kl_beta)])
def test_reference_passes_with_one_line(check, fn, capsys):
    assert_passes(check, fn, capsys)


@pytest.mark.parametrize("check, wrong", [
    (check_ppo_clip_loss, clip_with_max),
    (check_ppo_clip_loss, clip_the_advantage),
    (check_ppo_clip_loss, min_of_ratios),
    (check_ppo_clip_loss, ratio_of_probabilities),
    (check_ppo_clip_loss, missing_minus),
    (check_ppo_clip_loss, clip_only),
    (check_clipped_value_loss, value_loss_with_min),
    (check_clipped_value_loss, value_loss_clips_returns),
    (check_clipped_value_loss, value_loss_unclipped),
    (check_adaptive_kl_beta, beta_inverted),
    (check_adaptive_kl_beta, beta_without_tolerance),
])
def test_wrong_answers_fail(check, wrong):
    assert_fails(check, wrong)


# ------------------------------------------------------------------ witnesses: misstated constants get their hint
def beta_thresholds_two(beta, kl, kl_target):  # kl_target / 2 and 2 * kl_target
    return beta / 2 if kl < kl_target / 2 else beta * 2 if kl > kl_target * 2 else beta


def beta_factor_one_and_a_half(beta, kl, kl_target):  # right thresholds, beta scaled by 1.5
    return beta / 1.5 if kl < kl_target / 1.5 else beta * 1.5 if kl > kl_target * 1.5 else beta


@pytest.mark.parametrize("wrong, hint", [(beta_thresholds_two, "thresholds kl_target / 2 and 2 * kl_target"),
                                         (beta_factor_one_and_a_half, "multiplies/divides beta by 1.5")])
def test_misstated_adaptive_kl_constants_are_named(wrong, hint):
    assert_fails(check_adaptive_kl_beta, wrong, hint=hint)
