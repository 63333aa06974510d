"""Lesson 09's checks pass reference answers and catch plausible wrong ones."""
import pytest

import rlcourse  # noqa: F401
import torch

from rlcourse.grading import CheckFailed
from rlcourse.grading.llm.lesson09 import (check_leave_one_out_advantages, check_policy_gradient_loss,
                                       check_rloo_gradient_estimate, check_rloo_kl_step, check_rloo_step)
from rlcourse.lm import sample, sequence_logprobs
from grading_asserts import mistake_tests


def loo_ok(rewards, K):
    g = rewards.double().view(-1, K)
    return (g - (g.sum(1, keepdim=True) - g) / (K - 1)).reshape(-1)


def loo_scaled_form(rewards, K):
    g = rewards.double().view(-1, K)
    return (K / (K - 1) * (g - g.mean(1, keepdim=True))).reshape(-1).numpy()


def loo_includes_self(rewards, K):
    g = rewards.double().view(-1, K)
    return (g - g.mean(1, keepdim=True)).reshape(-1)


def loo_divides_by_k(rewards, K):
    g = rewards.double().view(-1, K)
    return (g - (g.sum(1, keepdim=True) - g) / K).reshape(-1)


def loo_whole_batch(rewards, K):
    r = rewards.double()
    return r - (r.sum() - r) / (r.numel() - 1)


def loo_interleaved(rewards, K):
    g = rewards.double().view(K, -1)
    return (g - (g.sum(0, keepdim=True) - g) / (K - 1)).reshape(-1)


def loo_in_place(rewards, K):
    g = rewards.view(-1, K)
    g -= 0.0 + (g.sum(1, keepdim=True) - g) / (K - 1)
    return rewards


def test_loo_check_passes_references(capsys):
    check_leave_one_out_advantages(loo_ok)
    check_leave_one_out_advantages(loo_scaled_form)
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("wrong", [loo_includes_self, loo_divides_by_k, loo_whole_batch, loo_interleaved,
                                   loo_in_place])
def test_loo_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_leave_one_out_advantages(wrong)


def pg_ok(logprobs, mask, advantages):
    real = torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
    return -(advantages.detach()[:, None] * real).sum() / logprobs.shape[0]


def pg_multiplies_by_the_mask(logprobs, mask, advantages):       # nan where padding holds -inf
    return -(advantages.detach()[:, None] * logprobs * mask).sum() / logprobs.shape[0]


def test_a_loss_that_multiplies_by_the_mask_is_told_why():
    with pytest.raises(CheckFailed, match=r"-inf \* 0 is nan"):
        check_policy_gradient_loss(pg_multiplies_by_the_mask)


def pg_not_detached(logprobs, mask, advantages):
    return -(advantages[:, None] * logprobs * mask).sum() / logprobs.shape[0]


def pg_wrong_sign(logprobs, mask, advantages):
    return (advantages.detach()[:, None] * logprobs * mask).sum() / logprobs.shape[0]


def pg_token_mean(logprobs, mask, advantages):
    return -(advantages.detach()[:, None] * logprobs * mask).sum() / mask.sum()


def pg_no_mask(logprobs, mask, advantages):
    return -(advantages.detach()[:, None] * logprobs).sum() / logprobs.shape[0]


def test_pg_check_passes_reference(capsys):
    check_policy_gradient_loss(pg_ok)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [pg_not_detached, pg_wrong_sign, pg_token_mean, pg_no_mask])
def test_pg_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_policy_gradient_loss(wrong)


def _estimate(policy, rewards, K, generator, baseline):
    idx = policy.sample(K, generator)[0]
    r = rewards[0, idx]
    if baseline == "rloo":
        adv = r - (r.sum() - r) / (K - 1)
    elif baseline == "mean":
        adv = r - r.mean()
    else:
        adv = r
    return (adv[:, None] * policy.score_matrix()[0, idx]).mean(0)


def test_an_estimate_that_ignores_the_generator_is_told_to_use_it():
    def global_rng(p, r, K, g):
        return _estimate(p, r, K, torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))), "rloo")
    with pytest.raises(CheckFailed, match="the generator you are given"):
        check_rloo_gradient_estimate(global_rng)


def test_rloo_estimate_check(capsys):
    check_rloo_gradient_estimate(lambda p, r, K, g: _estimate(p, r, K, g, "rloo"))
    assert "passed" in capsys.readouterr().out
    for wrong in ("mean", "none"):
        with pytest.raises(CheckFailed):
            check_rloo_gradient_estimate(lambda p, r, K, g, w=wrong: _estimate(p, r, K, g, w))


# ------------------------------------------------------------------ one RLOO step
def rloo_step_ok(model, optimizer, tokenizer, task, prompts, generator, K=8, *, mistake=None):
    """A correct step written with a loop over groups; ``mistake`` turns one plausible slip on."""
    group = list(prompts) * K if mistake == "prompts tiled" else [p for p in prompts for _ in range(K)]
    roll = sample(model, tokenizer, group, task.max_new_tokens, generator=generator)
    rewards = task.reward(group, roll.completions).float()
    adv = []
    for i in range(0, len(group), K):
        r = rewards[i:i + K]
        baseline = r.mean() if mistake == "baseline includes the sample" else (r.sum() - r) / (K - 1)
        adv.append(r - baseline)
    adv = torch.cat(adv)
    if mistake == "no baseline":
        adv = rewards
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    real = torch.where(roll.completion_mask.bool(), logp, torch.zeros_like(logp))
    if mistake == "token mean":
        seq = real.sum(1) / roll.completion_mask.sum(1)
    else:
        seq = real.sum(1)
    loss = -(adv * seq).mean()
    if mistake == "ascent":
        loss = -loss
    if mistake != "no zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(rewards.mean())


RLOO_STEP_MISTAKES = ["prompts tiled", "baseline includes the sample", "no baseline", "token mean", "ascent",
                      "no zero_grad"]


test_rloo_step_check, test_rloo_step_check_catches = mistake_tests(
    check_rloo_step, rloo_step_ok, RLOO_STEP_MISTAKES, "raised held-out exact match")


# ------------------------------------------------------------------ find the bug: the KL in the reward
def rloo_kl_step_ok(model, optimizer, tokenizer, task, prompts, generator, K, ref_model, beta, *, mistake=None):
    """The fixed step; ``mistake`` turns one slip on (``"penalty with its graph"`` is the bug as shipped)."""
    group = [p for p in prompts for _ in range(K)]
    roll = sample(model, tokenizer, group, task.max_new_tokens, generator=generator)
    mask = roll.completion_mask
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask)
    if mistake == "the checkpoint as reference":             # ref_model ignored: the start loaded again
        from rlcourse.lm import load_checkpoint
        ref_model = load_checkpoint("addition-partial", device="cpu")[0]
    with torch.no_grad():
        ref = sequence_logprobs(model if mistake == "the policy as reference" else ref_model, roll.prompt_ids,
                                roll.completion_ids, mask, roll.prompt_mask)
    task_rewards = task.reward(group, roll.completions).float()
    diff = (logp if mistake == "penalty with its graph" else logp.detach()) - ref
    kl = diff.sum(1) / mask.sum(1) if mistake == "mean over tokens" else diff.sum(1)
    sign = -1.0 if mistake == "penalty added" else 1.0
    rewards = task_rewards if mistake == "no penalty" else task_rewards - sign * beta * kl
    g = rewards.view(-1, K)
    adv = (g - (g.sum(1, keepdim=True) - g) / (K - 1)).reshape(-1)
    loss = -(adv * logp.sum(1)).mean()
    if mistake != "no zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(task_rewards.mean())


RLOO_KL_MISTAKES = ["penalty with its graph", "the policy as reference", "the checkpoint as reference",
                    "mean over tokens", "penalty added", "no penalty", "no zero_grad"]


test_rloo_kl_step_check, test_rloo_kl_step_check_catches = mistake_tests(
    check_rloo_kl_step, rloo_kl_step_ok, RLOO_KL_MISTAKES, "raised held-out exact match")


def loo_in_float32(rewards, K):                # .float() on everything: float64 rewards lose their digits
    g = rewards.float().view(-1, K)
    return (g - (g.sum(1, keepdim=True) - g) / (K - 1)).reshape(-1)


def test_a_float32_baseline_is_told_about_precision():
    with pytest.raises(CheckFailed, match="float32 keeps only about 7 digits"):
        check_leave_one_out_advantages(loo_in_float32)


def test_an_unchanged_nan_is_not_a_mutation():
    """NaN != NaN: an input holding NaN, left as it was, is not reported as written into."""
    from rlcourse.grading.llm.lesson09 import _call_unmutated

    x = torch.tensor([1.0, float("nan"), 2.0])
    assert _call_unmutated("check", "case", lambda t: t * 2, x).isnan().sum() == 1
    with pytest.raises(CheckFailed, match="modified in place"):
        _call_unmutated("check", "case", lambda t: t.nan_to_num_(0.0), x.clone())
    with pytest.raises(CheckFailed, match="modified in place"):       # a NaN moved to another position is a change
        _call_unmutated("check", "case", lambda t: t.copy_(t.flip(0)), torch.tensor([float("nan"), 1.0, 2.0]))

