"""Lesson 10's checks pass reference answers and catch plausible wrong ones."""
import functools

import pytest
from grading_asserts import assert_fails

import rlcourse  # noqa: F401
import torch

from rlcourse.grading import CheckFailed
from rlcourse.grading.llm.lesson10 import (check_aggregate_loss, check_group_advantages, check_grpo_loss, check_grpo_step,
                                       check_grpo_update,
                                       check_length_bias_experiment, check_sequence_ratio, check_variant_losses)
from rlcourse.lm import sample, sequence_logprobs
from rlcourse.measure.length_bias import wrong_answer_lengths
from rlcourse.losses import group_advantages


def adv_ok(rewards, K, std_floor):
    g = rewards.double().view(-1, K)
    a = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + std_floor)
    return torch.where((g.max(1, keepdim=True).values == g.min(1, keepdim=True).values), 0.0, a).reshape(-1)


def adv_population_std(rewards, K, std_floor):
    g = rewards.double().view(-1, K)
    a = (g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + std_floor)
    return torch.where((g.max(1, keepdim=True).values == g.min(1, keepdim=True).values), 0.0, a).reshape(-1)


def adv_no_floor(rewards, K, std_floor):
    g = rewards.double().view(-1, K)
    return ((g - g.mean(1, keepdim=True)) / g.std(1, keepdim=True)).reshape(-1)


def adv_floor_in_sqrt(rewards, K, std_floor):
    g = rewards.double().view(-1, K)
    a = (g - g.mean(1, keepdim=True)) / (g.var(1, keepdim=True) + std_floor).sqrt()
    return torch.where((g.max(1, keepdim=True).values == g.min(1, keepdim=True).values), 0.0, a).reshape(-1)


def adv_leftovers(rewards, K, std_floor):
    g = rewards.float().view(-1, K)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + std_floor)).reshape(-1)


def adv_batch(rewards, K, std_floor):
    r = rewards.double()
    return (r - r.mean()) / (r.std() + std_floor)


def test_group_advantages_check(capsys):
    check_group_advantages(adv_ok)
    check_group_advantages(lambda r, K, f: group_advantages(r, K, std_floor=f))
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("wrong", [adv_population_std, adv_no_floor, adv_floor_in_sqrt, adv_leftovers, adv_batch])
def test_group_advantages_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_group_advantages(wrong)


def agg_ok(x, mask, loss_type, L, select=True):
    m = mask.to(x.dtype)
    real = torch.where(mask.bool(), x, torch.zeros_like(x)) if select else x * m
    if loss_type == "grpo":
        return (real.sum(1) / m.sum(1)).mean()
    if loss_type == "dapo":
        return real.sum() / m.sum()
    return real.sum() / (x.shape[0] * L)


def agg_multiplies_by_the_mask(x, mask, loss_type, L):     # nan where padding holds inf
    return agg_ok(x, mask, loss_type, L, select=False)


def agg_compares_with_is(x, mask, loss_type, L):          # the right loss only for interned strings
    for name in ("grpo", "dapo"):
        if loss_type is name:
            return agg_ok(x, mask, name, L)
    return agg_ok(x, mask, "dr_grpo", L)


@pytest.mark.parametrize("wrong, hint", [(agg_multiplies_by_the_mask, "0 * inf is nan"),
                                         (agg_compares_with_is, "compared with ==, not `is`")])
def test_aggregate_mistakes_the_old_check_passed_are_told_their_cause(wrong, hint):
    with pytest.raises(CheckFailed, match=hint.replace("*", r"\*")):
        check_aggregate_loss(wrong)


def agg_grpo_token_mean(x, mask, loss_type, L):
    return agg_ok(x, mask, "dapo" if loss_type == "grpo" else loss_type, L)


def agg_dr_by_width(x, mask, loss_type, L):
    return agg_ok(x, mask, loss_type, x.shape[1])


def agg_no_mask(x, mask, loss_type, L):
    return agg_ok(x, torch.ones_like(mask), loss_type, L)


def test_aggregate_check(capsys):
    check_aggregate_loss(agg_ok)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [agg_grpo_token_mean, agg_dr_by_width, agg_no_mask])
def test_aggregate_check_catches(wrong):
    with pytest.raises(CheckFailed):
        check_aggregate_loss(wrong)


def ratio_ok(logp, old, mask):
    m = mask.to(logp.dtype)
    d = torch.where(mask.bool(), logp - old, torch.zeros_like(logp))
    return torch.exp(d.sum(1, keepdim=True) / m.sum(1, keepdim=True))


def ratio_multiplies_by_the_mask(logp, old, mask):       # nan where padding holds inf
    m = mask.to(logp.dtype)
    return torch.exp(((logp - old) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True))


def test_a_sequence_ratio_that_multiplies_by_the_mask_is_told_why():
    with pytest.raises(CheckFailed, match=r"0 \* inf is nan"):
        check_sequence_ratio(ratio_multiplies_by_the_mask)


def ratio_sum(logp, old, mask):
    return torch.exp(((logp - old) * mask).sum(1, keepdim=True))


def ratio_width(logp, old, mask):
    return torch.exp(((logp - old) * mask).sum(1, keepdim=True) / mask.shape[1])


def ratio_mean_of_ratios(logp, old, mask):
    return ((logp - old).exp() * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)


def ratio_detached(logp, old, mask):
    return ratio_ok(logp.detach(), old, mask)


def test_sequence_ratio_check(capsys):
    check_sequence_ratio(ratio_ok)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [ratio_sum, ratio_width, ratio_mean_of_ratios, ratio_detached])
def test_sequence_ratio_check_catches(wrong):
    with pytest.raises((CheckFailed, RuntimeError)):
        check_sequence_ratio(wrong)


def length_bias_run(loss_type, seed, *, aggregate_as=None, steps=60, seed_used=None):
    """Exercise 4 as its text states it, with the course's loss pieces: the trained policy's logits."""
    from rlcourse.measure.exact_gradient import EnumerablePolicy
    from rlcourse.losses import aggregate_loss, per_token_loss

    seed = seed if seed_used is None else seed_used
    policy = EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)
    ids, mask = policy.completions, policy.mask
    right = ((ids[:, 0] == 1) & (ids[:, 1] == 0)).float()
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = policy.sample(128, gen)[0]
        logp = policy.token_logprobs()[0, idx]
        kind = aggregate_as or loss_type
        loss = aggregate_loss(per_token_loss(logp, logp.detach(), group_advantages(right[idx], 8), mask[idx], kind),
                              mask[idx], kind, 6)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return policy.logits


def length_bias_reported(loss_type, seed):
    """Trains nothing: the lesson's curve, as numbers (the exercise's earlier contract)."""
    return wrong_answer_lengths(loss_type, seed)


def length_bias_module(loss_type, seed):
    """The trained module itself: the check asks for its table."""
    from rlcourse.measure.exact_gradient import EnumerablePolicy
    trained = length_bias_run(loss_type, seed)
    policy = EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)
    with torch.no_grad():
        policy.logits.copy_(trained)
    return policy


def test_length_bias_experiment_check(capsys):
    check_length_bias_experiment(length_bias_run)
    assert "longer under grpo" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (length_bias_reported, "return policy.logits"),
    (length_bias_module, "return policy.logits"),
    (functools.partial(length_bias_run, steps=0), "train the policy whose logits you return"),
    (functools.partial(length_bias_run, aggregate_as="dapo"), "the normalisation is the experiment"),
    (functools.partial(length_bias_run, seed_used=0), "the same policy twice"),
], ids=["plausible-numbers", "a-module-not-its-logits", "untrained", "one-aggregation", "seed-ignored"])
def test_length_bias_experiment_check_catches(wrong, hint):
    assert_fails(check_length_bias_experiment, wrong, hint)


# ------------------------------------------------------------------ the GRPO loss
def grpo_loss_ok(logp, old, ref, adv, mask, loss_type, epsilon=0.2, epsilon_high=None, beta=0.0, L=None, *,
                 sign=-1.0, pick=torch.minimum, ratio_to="old", clip=None, kl="ratio k3", select=True, detach=False,
                 normaliser=None):
    """A correct answer; each keyword turns one plausible mistake on."""
    real = mask.bool()
    zero = torch.zeros_like(logp)
    lp = torch.where(real, logp, zero) if select else logp * mask
    lp = lp.detach() if detach else lp
    base = {"old": old, "ref": ref}[ratio_to]
    rho = torch.exp(lp - (torch.where(real, base, zero) if select else base * mask))
    high = epsilon if epsilon_high is None else epsilon_high
    lo, hi = clip(epsilon, high) if clip else (epsilon, high)
    a = adv.detach()[:, None]
    per_token = sign * pick(rho * a, rho.clamp(1 - lo, 1 + hi) * a)
    if beta:
        r = torch.where(real, ref, zero)
        d = r - lp
        k3 = d.exp() - d - 1
        per_token = per_token + beta * {"ratio k3": rho * k3, "k3": k3, "ratio k3 reversed": rho * ((-d).exp() + d - 1),
                                        "ratio k1": rho * -d, "detached ratio k3": rho.detach() * k3,
                                        "clipped ratio k3": rho.clamp(1 - lo, 1 + hi) * k3}[kl]
    m = mask.to(per_token.dtype)
    total = torch.where(real, per_token, zero) if select else per_token * m
    loss_type = normaliser or loss_type
    if loss_type == "grpo":
        return (total.sum(1) / m.sum(1)).mean()
    if loss_type == "dapo":
        return total.sum() / m.sum()
    return total.sum() / (per_token.shape[0] * L)


def _wrong_loss(**mistake):
    def fn(*args):
        return grpo_loss_ok(*args, **mistake)
    fn.__name__ = "_".join(f"{k}={getattr(v, '__name__', v)}" for k, v in mistake.items())
    return fn


GRPO_LOSS_MISTAKES = {
    "the sign: J instead of -J": dict(sign=1.0),
    "max instead of min": dict(pick=torch.maximum),
    "the ratio against the reference": dict(ratio_to="ref"),
    "no clip": dict(clip=lambda e, h: (1e9, 1e9)),
    "the clip's sides swapped": dict(clip=lambda e, h: (h, e)),
    "epsilon_high ignored": dict(clip=lambda e, h: (e, e)),
    "k3 of the reverse direction": dict(kl="ratio k3 reversed"),
    "k1 for k3": dict(kl="ratio k1"),
    "DeepSeekMath's plain k3": dict(kl="k3"),
    "the ratio detached in the KL term": dict(kl="detached ratio k3"),
    "the clipped ratio in the KL term": dict(kl="clipped ratio k3"),
    "padding multiplied by the mask (nan)": dict(select=False),
    "the ratio of detached log-probs": dict(detach=True),
    "always the token mean": dict(normaliser="dapo"),
}


def test_grpo_loss_check(capsys):
    check_grpo_loss(grpo_loss_ok)
    check_grpo_loss(lambda *a: grpo_loss_ok(*(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point()
                                              else x for x in a)))            # float64 is fine
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("mistake", GRPO_LOSS_MISTAKES.values(), ids=GRPO_LOSS_MISTAKES.keys())
def test_grpo_loss_check_catches(mistake):
    with pytest.raises(CheckFailed):
        check_grpo_loss(_wrong_loss(**mistake))


@pytest.mark.parametrize("mistake, hint", [
    (dict(kl="k3"), "DeepSeekMath's plain k3"),
    (dict(kl="clipped ratio k3"), "unclipped ratio"),
    (dict(kl="detached ratio k3"), "Keep the ratio's gradient in the KL term"),
], ids=["plain-k3", "clipped-ratio-on-k3", "detached-ratio-on-k3"])
def test_grpo_loss_check_names_the_kl_terms_mistakes(mistake, hint):
    assert_fails(check_grpo_loss, _wrong_loss(**mistake), hint)


def test_on_policy_batch_fails_plain_k3_and_a_detached_ratio_by_the_gradient_only():
    """Where every ratio is 1, rho * k3 = k3 in value: only the gradient tells them apart."""
    from rlcourse.grading.llm.lesson10 import _loss_cases, _on_policy_batch

    ((case, logp, old, ref, adv, mask),) = _on_policy_batch(_loss_cases(103))
    assert torch.equal(old.nan_to_num(), logp.nan_to_num()) and "on-policy" in case
    for kl in ("k3", "detached ratio k3"):
        mine, right = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        wrong = grpo_loss_ok(mine, old, ref, adv, mask, "dapo", 0.2, None, 0.1, 8, kl=kl)
        expected = grpo_loss_ok(right, old, ref, adv, mask, "dapo", 0.2, None, 0.1, 8)
        assert torch.equal(wrong, expected)
        wrong.backward()
        expected.backward()
        assert not torch.allclose(torch.where(mask.bool(), mine.grad, 0.0), torch.where(mask.bool(), right.grad, 0.0))
    message = assert_fails(check_grpo_loss, lambda *a: grpo_loss_ok(*a, kl="k3")      # plain k3 where rho = 1 only
                           if torch.equal(a[0].detach().nan_to_num(), a[1].nan_to_num()) else grpo_loss_ok(*a))
    assert "on-policy" in message and "gradient" in message and "Keep the ratio's gradient" in message


# ------------------------------------------------------------------ CISPO and SAPO
def variant_ok(logp, old, adv, mask, loss_type, eps_max=5.0, tau_pos=1.0, tau_neg=1.05, *, sign=-1.0,
               detach_weight=True, cap=True, weigh="log pi", tau_rule="by sign", scale=True, shift=1.0, select=True,
               detach_ratio=False):
    """A correct answer; each keyword turns one plausible mistake on."""
    real = mask.bool()
    zero = torch.zeros_like(logp)
    lp = torch.where(real, logp, zero) if select else logp * mask
    rho = torch.exp((lp.detach() if detach_ratio else lp) - (torch.where(real, old, zero) if select else old * mask))
    a = adv[:, None].to(lp.dtype)
    if loss_type == "cispo":
        w = rho.clamp(max=eps_max) if cap else rho
        w = w.detach() if detach_weight else w
        if weigh == "ppo clip":
            loss = -torch.minimum(rho * a, rho.clamp(0.8, 1 + eps_max) * a)
        else:
            loss = sign * w * a * (lp if weigh == "log pi" else 1.0)
    else:
        pos, neg = {"by sign": (tau_pos, tau_neg), "swapped": (tau_neg, tau_pos), "one": (tau_pos, tau_pos)}[tau_rule]
        tau = torch.where(a > 0, torch.full_like(a, pos), torch.full_like(a, neg))
        loss = sign * torch.sigmoid(tau * (rho - shift)) * (4 / tau if scale else 1.0) * a
    return torch.where(real, loss, zero) if select else loss * mask


def variant_float64_other_order(logp, old, adv, mask, loss_type, eps_max=5.0, tau_pos=1.0, tau_neg=1.05):
    """Right, written differently: float64, the weight detached before the cap, sigmoid by hand."""
    real = mask.bool()
    lp = logp.double().masked_fill(~real, 0.0)
    rho = (lp - old.double().masked_fill(~real, 0.0)).exp()
    a = adv.double().unsqueeze(1)
    if loss_type == "cispo":
        out = (-a) * torch.minimum(rho.detach(), torch.tensor(eps_max, dtype=torch.float64)) * lp
    else:
        tau = tau_neg + (tau_pos - tau_neg) * (a > 0).double()
        out = -(4 / tau) * a / (1 + torch.exp(-tau * (rho - 1)))
    return out.masked_fill(~real, 0.0)


def _wrong_variant(**mistake):
    def fn(*args):
        return variant_ok(*args, **mistake)
    fn.__name__ = "_".join(f"{k}={v}" for k, v in mistake.items())
    return fn


VARIANT_MISTAKES = {       # name: (the slip, a phrase the check's message must contain)
    "cispo: the weight keeps its gradient": (dict(detach_weight=False), "stops its gradient"),
    "cispo: the weight uncapped": (dict(cap=False), "the weight is capped"),
    "cispo: PPO's clipped surrogate": (dict(weigh="ppo clip"), "PPO's clipped surrogate"),
    "cispo: the ratio weighed, not log pi": (dict(weigh="none"), "times A times log pi"),
    "cispo and sapo: the sign": (dict(sign=1.0), "the optimiser minimises"),
    "sapo: one temperature": (dict(tau_rule="one"), "tau is tau_pos where A > 0"),
    "sapo: the temperatures swapped": (dict(tau_rule="swapped"), "swapped"),
    "sapo: no 4 / tau": (dict(scale=False), "4 / tau"),
    "sapo: the gate at rho, not rho - 1": (dict(shift=0.0), "centred at rho = 1"),
    "padding multiplied by the mask (nan)": (dict(select=False), "padded positions get 0"),
    "sapo: the ratio of detached log-probs": (dict(detach_ratio=True), "keeping its graph"),
}


@pytest.mark.parametrize("answer", [variant_ok, variant_float64_other_order], ids=["as written", "float64, other order"])
def test_variant_losses_check(answer, capsys):
    check_variant_losses(answer)
    out = capsys.readouterr().out
    assert "check_variant_losses" in out and "(cispo)" in out and "(sapo)" in out


@pytest.mark.parametrize("mistake, hint", VARIANT_MISTAKES.values(), ids=VARIANT_MISTAKES.keys())
def test_variant_losses_check_catches(mistake, hint):
    assert_fails(check_variant_losses, _wrong_variant(**mistake), hint)


# ------------------------------------------------------------------ one GRPO step
def grpo_step_ok(model, optimizer, tokenizer, task, prompts, generator, K=8, loss_type="dapo", epsilon=0.2,
                 epsilon_high=None, *, tile=False, batch_advantages=False, zero_grad=True, sampler_logprobs=False,
                 flip=False, normaliser=None, step_first=False, budget_from_width=False):
    """A correct step written another way (a loop over groups); each keyword turns one mistake on."""
    group = list(prompts) * K if tile else [p for p in prompts for _ in range(K)]
    roll = sample(model, tokenizer, group, task.max_new_tokens, generator=generator)
    rewards = task.reward(group, roll.completions).float()
    if batch_advantages:
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    else:
        adv = torch.cat([group_advantages(rewards[i:i + K], K) for i in range(0, len(group), K)])
    logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, roll.prompt_mask)
    if sampler_logprobs:
        logp = roll.logprobs.clone().requires_grad_()
    budget = roll.completion_mask.shape[1] if budget_from_width else task.max_new_tokens
    loss = grpo_loss_ok(logp, roll.logprobs, None, adv, roll.completion_mask, normaliser or loss_type, epsilon,
                        epsilon_high, 0.0, budget)
    if flip:
        loss = -loss
    if step_first:
        optimizer.step()
    if zero_grad:
        optimizer.zero_grad()
    loss.backward()
    if not step_first:
        optimizer.step()
    return float(rewards.mean())


GRPO_STEP_MISTAKES = {
    "prompts tiled, not grouped": dict(tile=True),
    "advantages over the whole batch": dict(batch_advantages=True),
    "no zero_grad": dict(zero_grad=False),
    "the sampler's log-probs as the model's": dict(sampler_logprobs=True),
    "gradient ascent on the loss": dict(flip=True),
    "always the sequence mean": dict(normaliser="grpo"),
    "step before backward": dict(step_first=True),
    "dr_grpo's constant from the batch's padded width, not the budget": dict(budget_from_width=True),
}


def test_grpo_step_check(capsys):
    check_grpo_step(grpo_step_ok)
    assert "raised held-out exact match" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", GRPO_STEP_MISTAKES.values(), ids=GRPO_STEP_MISTAKES.keys())
def test_grpo_step_check_catches(mistake):
    def fn(*args):
        return grpo_step_ok(*args, **mistake)
    with pytest.raises(CheckFailed):
        check_grpo_step(fn)


# ------------------------------------------------------------------ find the bug: the temperature
def grpo_update_ok(model, optimizer, tokenizer, task, prompts, generator, K=8, temperature=0.7, iterations=2,
                   epsilon=0.2, *, score_at=None, sample_at=None, old_at=None, zero_grad=True, loops=None,
                   share_over_padding=False, flip=False, epsilon_as=None, groups_of=None):
    """The fixed update; each keyword turns one mistake on (``score_at=1.0`` is the bug as shipped)."""
    epsilon = epsilon if epsilon_as is None else epsilon_as
    group = [p for p in prompts for _ in range(K)]
    t_sample = temperature if sample_at is None else sample_at
    roll = sample(model, tokenizer, group, task.max_new_tokens, temperature=t_sample, generator=generator)
    adv = group_advantages(task.reward(group, roll.completions).float(), K if groups_of is None else groups_of)
    mask = roll.completion_mask
    old = roll.logprobs
    if old_at is not None:
        with torch.no_grad():
            old = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask, old_at)
    shares = []
    for _ in range(iterations if loops is None else loops):
        logp = sequence_logprobs(model, roll.prompt_ids, roll.completion_ids, mask, roll.prompt_mask,
                                 temperature if score_at is None else score_at)
        loss = grpo_loss_ok(logp, old, None, adv, mask, "dapo", epsilon, None, 0.0, task.max_new_tokens)
        if flip:
            loss = -loss
        if zero_grad:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            ratio = torch.exp(logp - old)
            outside = ((ratio - 1).abs() > epsilon) & mask.bool()
            shares.append(float(outside.sum() / (mask.numel() if share_over_padding else mask.sum())))
    return shares


GRPO_UPDATE_MISTAKES = {
    "the bug as shipped: scored at temperature 1": dict(score_at=1.0),
    "sampled at temperature 1 as well": dict(sample_at=1.0, score_at=1.0),
    "old log-probs recomputed at temperature 1": dict(old_at=1.0, score_at=1.0),
    "no zero_grad": dict(zero_grad=False),
    "one step, whatever num_iterations says": dict(loops=1),
    "the share counted over padding too": dict(share_over_padding=True),
    "gradient ascent": dict(flip=True),
    "epsilon held at 0.2": dict(epsilon_as=0.2),
    "groups of 8 whatever num_generations says": dict(groups_of=8),
}


def test_grpo_update_check(capsys):
    check_grpo_update(grpo_update_ok)
    assert "every ratio is 1" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", GRPO_UPDATE_MISTAKES.values(), ids=GRPO_UPDATE_MISTAKES.keys())
def test_grpo_update_check_catches(mistake):
    def fn(*args):
        return grpo_update_ok(*args, **mistake)
    with pytest.raises(CheckFailed):
        check_grpo_update(fn)


def test_the_shipped_bug_is_told_by_its_symptom():
    with pytest.raises(CheckFailed, match="before any update"):
        check_grpo_update(lambda *a: grpo_update_ok(*a, score_at=1.0))
