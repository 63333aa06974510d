"""Lesson 10's checks pass reference answers and catch plausible wrong ones."""
import pytest

import rlcourse  # noqa: F401
import torch

from rlcourse.grading import CheckFailed
from rlcourse.grading.lesson10 import (check_aggregate_loss, check_group_advantages, check_length_bias_experiment,
                                       check_sequence_ratio)
from rlcourse.lm.exact_oracle import EnumerablePolicy
from rlcourse.losses import aggregate_loss, group_advantages, per_token_loss


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


def _length_run(loss_type, seed, aggregate=aggregate_loss, steps=60):
    pol = EnumerablePolicy(vocab_size=3, max_len=6, seed=seed, init_scale=0.5)
    ids, m = pol.completions, pol.mask
    R = ((ids[:, 0] == 1) & (ids[:, 1] == 0)).float()
    wrong, L = R == 0, pol.lengths.float()
    opt = torch.optim.Adam(pol.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = pol.sample(128, gen)[0]
        lp = pol.token_logprobs()[0, idx]
        loss = aggregate(per_token_loss(lp, lp.detach(), group_advantages(R[idx], 8), m[idx], loss_type),
                         m[idx], loss_type, 6)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            p = pol.probs()[0]
        out.append(float((p * L * wrong).sum() / (p * wrong).sum()))
    return out


def test_length_bias_experiment_check(capsys):
    check_length_bias_experiment(_length_run)
    assert "longer" in capsys.readouterr().out
    with pytest.raises(CheckFailed):       # one aggregation for both: no gap
        check_length_bias_experiment(lambda lt, s: _length_run("dapo", s))
