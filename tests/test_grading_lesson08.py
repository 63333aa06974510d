"""The lesson-08 checks pass the reference answers and catch plausible mistakes."""
import copy
import re

import rlcourse  # noqa: F401  (before torch)
import pytest
import torch
import torch.nn.functional as F

from rlcourse.grading import (CheckFailed, check_bradley_terry_loss, check_eos_experiment,
                              check_kl_shaped_rewards, check_ppo_losses, check_ppo_update, check_score_at_last_token,
                              check_token_gae)
from rlcourse.trainers.ppo_rlhf import kl_shaped_rewards
from rlcourse.lm.scalar_head import score_at_last_token
from rlcourse.losses import bradley_terry_loss
from rlcourse.returns import gae
from grading_asserts import mistake_tests


def _fails(check, fn, *args, match=None):
    with pytest.raises(CheckFailed, match=match):
        check(fn, *args)


def test_bradley_terry(capsys):
    check_bradley_terry_loss(bradley_terry_loss)
    assert "check_bradley_terry_loss: all" in capsys.readouterr().out
    _fails(check_bradley_terry_loss, lambda c, r, m=None: -torch.log(torch.sigmoid(c - r - (0 if m is None else m))).mean(),
           match="logsigmoid")
    _fails(check_bradley_terry_loss, lambda c, r, m=None: -F.logsigmoid(r - c - (0 if m is None else m)).mean(),
           match="sign")
    _fails(check_bradley_terry_loss, lambda c, r, m=None: -F.logsigmoid(c - r + (0 if m is None else m)).mean(),
           match="margin")
    _fails(check_bradley_terry_loss, lambda c, r, m=None: -F.logsigmoid(c - r - (0 if m is None else m)).sum(),
           match="mean")
    _fails(check_bradley_terry_loss, lambda c, r, m=None: -F.logsigmoid(c - r).mean())   # margin ignored

    def in_place(c, r, m=None):
        c -= r
        return -F.logsigmoid(c - (0 if m is None else m)).mean()
    _fails(check_bradley_terry_loss, in_place, match="in place")


def test_score_at_last_token(capsys):
    check_score_at_last_token(score_at_last_token)
    assert "all" in capsys.readouterr().out
    _fails(check_score_at_last_token, lambda v, m: v[:, -1], match="last column")
    _fails(check_score_at_last_token, lambda v, m: v.gather(1, (m.long().sum(1) - 1)[:, None]).squeeze(1),
           match="mask.sum")
    _fails(check_score_at_last_token, lambda v, m: (v * m).sum(1))
    _fails(check_score_at_last_token, lambda v, m: v[torch.arange(len(v)), m.long().argmax(1)])   # first real token


def test_kl_shaped_rewards(capsys):
    check_kl_shaped_rewards(lambda s, lp, ref, m, c: kl_shaped_rewards(s, lp, ref, m, c)[0])
    assert "all" in capsys.readouterr().out
    reference = lambda s, lp, ref, m, c: kl_shaped_rewards(s, lp, ref, m, c)[0]  # noqa: E731
    _fails(check_kl_shaped_rewards, lambda s, lp, ref, m, c: -c * (lp - ref) * m + s[:, None] * 0
           + reference(s, lp, ref, m, 0.0), match="gradient")
    _fails(check_kl_shaped_rewards, lambda s, lp, ref, m, c: (-c * (lp.detach() - ref) + s[:, None]) * m,
           match="every token")

    def last_column(s, lp, ref, m, c):
        r = -c * (lp.detach() - ref) * m
        r[:, -1] += s
        return r
    _fails(check_kl_shaped_rewards, last_column, match="last column")
    _fails(check_kl_shaped_rewards, lambda s, lp, ref, m, c: reference(s, lp, ref, m, -c), match="KL_t")
    _fails(check_kl_shaped_rewards, lambda s, lp, ref, m, c: reference(s, lp, ref, m, c)
           - c * (lp.detach() - ref) * (1 - m.float()), match="padding")
    _fails(check_kl_shaped_rewards, lambda s, lp, ref, m, c: reference(s, ref, lp.detach(), m, c))  # ratio inverted


def test_token_gae(capsys):
    check_token_gae(lambda r, v, m, g, lam: gae(r, v, g, lam, mask=m))
    assert "all" in capsys.readouterr().out

    def leaky(r, v, m, g, lam):   # bootstraps from the value in the pad after <eos>
        nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
        delta = r + g * nxt - v
        out, run = torch.zeros_like(r), torch.zeros(r.shape[0])
        for t in reversed(range(r.shape[1])):
            run = delta[:, t] + g * lam * run
            out[:, t] = run
        return out * m
    _fails(check_token_gae, leaky, match="terminal")
    _fails(check_token_gae, lambda r, v, m, g, lam: gae(r, v, g, 1.0, mask=m))      # lambda ignored
    _fails(check_token_gae, lambda r, v, m, g, lam: gae(r, v, g, lam, mask=m) + v * m)  # returns, not advantages
    _fails(check_token_gae, lambda r, v, m, g, lam: gae(r, v, g, lam))                # no mask


@pytest.fixture(scope="module")
def eos_setup():
    from rlcourse.tasks import PreferenceTask
    from rlcourse.lm import load_checkpoint
    from rlcourse.lm.scalar_head import ScalarHeadModel
    from rlcourse.tasks.reward_model import train_reward_model

    task = PreferenceTask()
    policy, tok = load_checkpoint("preference-sft", device="cpu")
    torch.manual_seed(0)
    rm = ScalarHeadModel(policy)
    train_reward_model(rm, tok, task.preference_pairs(1000, rng=1), steps=50, lr=3e-3, progress=False)
    return task, policy, tok, rm


def test_eos_experiment(eos_setup, capsys):
    from rlcourse.lm import load_checkpoint
    from rlcourse.trainers.ppo_rlhf import PPOConfig, PPORLHFTrainer
    from rlcourse.lm.value_model import make_value_model

    task, policy, tok, rm = eos_setup

    def run(start, penalty, honour_penalty=True, in_place=False):
        torch.manual_seed(0)
        config = PPOConfig(batch_size=32, response_length=5,
                           missing_eos_penalty=penalty if honour_penalty else None)
        student = start if in_place else copy.deepcopy(start)
        trainer = PPORLHFTrainer(config, student, tok, rm, make_value_model("reward", reward_model=rm), task.prompts)
        trainer.train(6, progress=False)
        return trainer.policy

    check_eos_experiment(run)
    assert "EOS trick" in capsys.readouterr().out
    _fails(check_eos_experiment, lambda s, p: run(s, p, honour_penalty=False), match="measured effect")
    # the old check took a reported share: a hard-coded one passed it
    _fails(check_eos_experiment, lambda s, p: 0.9 if p else 0.1, match="return the policy")
    # training the reference model itself (the caller's policy) instead of a copy
    _fails(check_eos_experiment, lambda s, p: run(s, p, in_place=True), match="train a copy")
    # `policy` ignored: the SFT checkpoint loaded again (the check hands over a policy of its own)
    _fails(check_eos_experiment, lambda s, p: run(load_checkpoint("preference-sft", device="cpu")[0], p),
           match="trained from the one handed over")


def test_unfinished_exercises_raise_not_implemented():
    def todo(*args):
        raise NotImplementedError
    for check in (check_bradley_terry_loss, check_score_at_last_token, check_kl_shaped_rewards, check_token_gae):
        with pytest.raises(NotImplementedError):
            check(todo)
    with pytest.raises(NotImplementedError):
        check_eos_experiment(todo)


# --- families the checks now vary (catalogue: tests/grading_catalogue_llm.py) ------------------

def bt_through_item(c, r, m=None):          # right value, a number the optimiser cannot step on
    return torch.tensor(float(-F.logsigmoid(c - r - (0 if m is None else m)).mean()), dtype=c.dtype)


def bt_in_float32(c, r, m=None):
    return -F.logsigmoid((c - r - (0 if m is None else m)).float()).mean()


def score_by_one_hot(v, m):                 # 0 * nan is nan where the padding holds nan
    idx = torch.where(m.bool(), torch.arange(m.shape[1]), -1).max(1).values
    return (v * F.one_hot(idx, m.shape[1])).sum(1)


def score_detached(v, m):
    return score_at_last_token(v.detach(), m)


def kl_rewards_score_at_count(s, lp, ref, m, c):     # right padding assumed: the score at mask.sum() - 1
    r = -c * (lp.detach() - ref) * m
    return r.index_put((torch.arange(len(s)), m.long().sum(1) - 1), s, accumulate=True)


def gae_over_prefix(r, v, m, g, lam):       # right padding assumed: the first mask.sum() positions
    prefix = (torch.arange(m.shape[1]) < m.long().sum(1, keepdim=True)).long()
    return gae(r, v, g, lam, mask=prefix)


@pytest.mark.parametrize("check, wrong, hint", [
    (check_bradley_terry_loss, bt_through_item, "grad_fn"),
    (check_bradley_terry_loss, bt_in_float32, "float64"),
    (check_score_at_last_token, score_by_one_hot, "0 * nan is nan"),
    (check_score_at_last_token, score_detached, "grad_fn"),
    (check_kl_shaped_rewards, kl_rewards_score_at_count, "either side"),
    (check_token_gae, gae_over_prefix, "either side"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_families_the_checks_now_vary(check, wrong, hint):
    with pytest.raises(CheckFailed, match=re.escape(hint)):
        check(wrong)


# ------------------------------------------------------------------ the PPO-RLHF update
def ppo_update_ok(policy, value_model, optimizer, batch, kl_coef=0.05, lam=0.95, cliprange=0.2, cliprange_value=0.2,
                  vf_coef=0.1, *, mistake=None):
    """A correct update from the course's shaping and GAE; ``mistake`` turns one plausible slip on."""
    from rlcourse.lm import sequence_logprobs
    from rlcourse.lm.value_model import token_values
    from rlcourse.returns import whiten

    mask = batch["completion_mask"]
    real = mask.bool()
    rewards = kl_shaped_rewards(batch["scores"], batch["logprobs"], batch["ref_logprobs"], mask, kl_coef)[0]
    advantages = gae(rewards, batch["values"], 1.0, lam, mask=mask)
    white = whiten(advantages, mask)
    returns = ((white if mistake == "returns from whitened advantages" else advantages) + batch["values"]) * mask
    advantages = advantages if mistake == "no whitening" else white
    logprobs = sequence_logprobs(policy, batch["prompt_ids"], batch["completion_ids"], mask, batch["prompt_mask"])
    values = token_values(value_model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask)
    ratio = torch.exp(logprobs - (batch["ref_logprobs"] if mistake == "ratio against the reference" else batch["logprobs"]))
    pick = torch.minimum if mistake == "min of the losses" else torch.maximum
    policy_loss = pick(-advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange))
    old = batch["values"]
    moved = old + (values - old).clamp(-cliprange_value, cliprange_value)
    critic_loss = 0.5 * ((values - returns) ** 2 if mistake == "no value clip"
                         else torch.maximum((values - returns) ** 2, (moved - returns) ** 2))
    if mistake == "means over padding":
        loss = policy_loss.mean() + vf_coef * critic_loss.mean()
    else:
        loss = policy_loss[real].mean() + (1.0 if mistake == "vf_coef left out" else vf_coef) * critic_loss[real].mean()
    if mistake != "no zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


PPO_UPDATE_MISTAKES = ["returns from whitened advantages", "no whitening", "ratio against the reference",
                       "min of the losses", "no value clip", "means over padding", "vf_coef left out", "no zero_grad"]


test_ppo_update_check, test_ppo_update_check_catches = mistake_tests(
    check_ppo_update, ppo_update_ok, PPO_UPDATE_MISTAKES, "raised held-out exact match")


# ------------------------------------------------------------------ find the bug: the PPO losses
def ppo_losses_ok(policy, value_model, mb, cliprange=0.2, cliprange_value=0.2, *, mistake=None):
    """The fixed losses; ``mistake`` turns one slip on (``"critic over padding"`` is the bug as shipped)."""
    from rlcourse.lm import sequence_logprobs
    from rlcourse.lm.value_model import token_values

    mask = mb["completion_mask"]
    real = mask.bool()
    logprobs = sequence_logprobs(policy, mb["prompt_ids"], mb["completion_ids"], mask, mb["prompt_mask"])
    values = token_values(value_model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mask)
    ratio = torch.exp(logprobs - mb["logprobs"])
    a = mb["advantages"]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cliprange, 1 + cliprange))
    policy_loss = pg.mean() if mistake == "policy over padding" else pg[real].mean()
    moved = mb["values"] + (values - mb["values"]).clamp(-cliprange_value, cliprange_value)
    if mistake == "no value clip":
        vf = 0.5 * (values - mb["returns"]) ** 2
    elif mistake == "value clip around the returns":
        vf = 0.5 * torch.maximum((values - mb["returns"]) ** 2,
                                 (mb["returns"] + (values - mb["returns"]).clamp(-cliprange_value, cliprange_value)
                                  - mb["returns"]) ** 2)
    else:
        vf = 0.5 * torch.maximum((values - mb["returns"]) ** 2, (moved - mb["returns"]) ** 2)
    value_loss = vf.mean() if mistake == "critic over padding" else vf[real].mean()
    if mistake == "halves left out":
        value_loss = 2 * value_loss
    if mistake == "detached critic":
        value_loss = value_loss.detach().requires_grad_()
    return policy_loss, value_loss


def ppo_losses_whitened_again(policy, value_model, mb, cliprange=0.2, cliprange_value=0.2):
    """Whitens the minibatch's advantages once more: a no-op on the whole rollout, not on a minibatch of it."""
    from rlcourse.returns import whiten

    return ppo_losses_ok(policy, value_model, {**mb, "advantages": whiten(mb["advantages"], mb["completion_mask"])},
                         cliprange, cliprange_value)


def test_a_minibatch_is_not_the_whole_rollout():
    with pytest.raises(CheckFailed, match="a minibatch of 8 of a rollout's 24 completions"):
        check_ppo_losses(ppo_losses_whitened_again)


PPO_LOSSES_MISTAKES = ["critic over padding", "policy over padding", "no value clip", "value clip around the returns",
                       "halves left out", "detached critic"]


test_ppo_losses_check, test_ppo_losses_check_catches = mistake_tests(
    check_ppo_losses, ppo_losses_ok, PPO_LOSSES_MISTAKES, "passed")


def test_the_shipped_critic_bug_is_told_by_its_symptom():
    with pytest.raises(CheckFailed, match="positions are padding"):
        check_ppo_losses(lambda *a: ppo_losses_ok(*a, mistake="critic over padding"))
