"""Lesson 10e's checks pass right answers written in other ways and catch plausible wrong ones.

The right answers are written from the exercise texts, independently of the solution notebook."""
import functools

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.grading.llm.lesson10e import (check_episode_logprobs, check_multi_turn_step, check_multi_turn_update,
                                            check_policy_mask)
from rlcourse.lm.multi_turn import rollout
from rlcourse.losses import group_advantages
from grading_asserts import assert_fails, assert_passes


# ---------------------------------------------------------------------------- exercise 1: the policy mask
def mask_cumsum(segments, width, mistake=None):
    """Vectorised: each token's piece index from the cumulative piece ends; even pieces are the policy's."""
    rows = []
    for pieces in segments:
        pieces = [int(n) for n in pieces]
        ends = torch.tensor(pieces).cumsum(0)
        t = torch.arange(width)
        piece = torch.searchsorted(ends, t, right=True)
        real = t < (ends[-1] if len(pieces) else 0)
        row = ((piece % 2 == 0) & real).long()
        if mistake == "inverted":
            row = (real.long() - row)
        elif mistake == "all_real":
            row = real.long()
        elif mistake == "padding":
            row = row | (~real).long()
        elif mistake == "first_observation":
            row[1:] = row[1:] | (row[:-1] & real[1:].long())
        elif mistake == "last_dropped":
            row[:-1] = row[:-1] & row[1:]
            row[-1] = 0
        elif mistake == "contiguous":
            row = (t < sum(pieces[0::2])).long()
        elif mistake == "first_turn_only":
            row = (t < pieces[0]).long() if pieces else torch.zeros(width, dtype=torch.long)
        rows.append(row)
    return torch.stack(rows).float()


def mask_loop(segments, width):
    out = [[0.0] * width for _ in segments]
    for b, pieces in enumerate(segments):
        t = 0
        for k, n in enumerate(pieces):
            for _ in range(n):
                out[b][t] = 1.0 if k % 2 == 0 else 0.0
                t += 1
    return out


MASK_MISTAKES = {"inverted": "observation mask", "all_real": "odd ones", "padding": "padding after the episode",
                 "first_observation": "first token of each observation", "last_dropped": "last token of each turn",
                 "contiguous": "advance past the observations", "first_turn_only": "not only the first"}


def test_policy_mask_right_answers_pass(capsys):
    assert_passes(check_policy_mask, mask_cumsum, capsys)
    assert_passes(check_policy_mask, mask_loop, capsys)


@pytest.mark.parametrize("mistake", list(MASK_MISTAKES))
def test_policy_mask_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(mask_cumsum, mistake=mistake)
    wrong.__name__ = mistake
    assert_fails(check_policy_mask, wrong, MASK_MISTAKES[mistake])


def test_policy_mask_in_place_mutation_is_caught():
    def mutating(segments, width):
        segments.append([1])
        return mask_loop(segments[:-1], width)
    assert_fails(check_policy_mask, mutating, "modified in place")


# ------------------------------------------------------------------ exercise 2: log-probs over the episode
def logprobs_right(model, prompt_ids, prompt_mask, completion_ids, completion_mask, policy_mask, temperature,
                   mistake=None):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    kwargs = {} if mistake == "no_positions" else {"position_ids": (attention.cumsum(1) - 1).clamp(min=0)}
    logits = model(input_ids=ids, attention_mask=attention, **kwargs).logits
    if mistake != "no_temperature":
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    start = P if mistake == "no_shift" else P - 1
    window = logp_all[:, start:start + T]
    if mistake == "summed":
        logp = window.sum(-1)
    elif mistake == "argmax":
        logp = window.max(-1).values
    else:
        logp = window.gather(-1, completion_ids[..., None]).squeeze(-1)
    if mistake == "probabilities":
        logp = logp.exp()
    keep = completion_mask if mistake == "observations" else policy_mask
    out = logp * keep
    return out.detach() if mistake == "detached" else out


def logprobs_per_row(model, prompt_ids, prompt_mask, completion_ids, completion_mask, policy_mask, temperature):
    """Row by row, each row's real tokens only (no padding at all)."""
    rows = []
    for b in range(prompt_ids.shape[0]):
        p = prompt_ids[b][prompt_mask[b].bool()]
        n = int(completion_mask[b].sum())
        ids = torch.cat([p, completion_ids[b, :n]])[None]
        logits = model(input_ids=ids).logits[0, len(p) - 1:len(p) - 1 + n] / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, completion_ids[b, :n, None]).squeeze(-1)
        row = torch.zeros(completion_ids.shape[1])
        row = torch.cat([lp * policy_mask[b, :n], row[n:]])
        rows.append(row)
    return torch.stack(rows)


LOGPROB_MISTAKES = {"no_shift": "no shift", "no_positions": "left padding", "no_temperature": "temperature",
                    "observations": "environment's tokens were not sampled", "summed": "do not sum",
                    "argmax": "not of the most likely", "probabilities": "not probabilities", "detached": "graph"}


def test_episode_logprobs_right_answers_pass(capsys):
    assert_passes(check_episode_logprobs, logprobs_right, capsys)
    assert_passes(check_episode_logprobs, logprobs_per_row, capsys)


@pytest.mark.parametrize("mistake", list(LOGPROB_MISTAKES))
def test_episode_logprobs_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(logprobs_right, mistake=mistake)
    assert_fails(check_episode_logprobs, wrong, LOGPROB_MISTAKES[mistake])


# ----------------------------------------------------------------- exercise 3: a GRPO step on episodes
def _all_logprobs(model, ep, keep_positions=True):
    ids = torch.cat([ep.prompt_ids, ep.completion_ids], 1)
    attention = torch.cat([ep.prompt_mask, ep.completion_mask], 1)
    kwargs = {"position_ids": (attention.cumsum(1) - 1).clamp(min=0)} if keep_positions else {}
    logits = model(input_ids=ids, attention_mask=attention, **kwargs).logits
    return ids, torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def step_right(model, optimizer, tokenizer, task, prompts, generator, num_generations=8, mask_observations=True,
               mistake=None):
    group = [p for p in prompts for _ in range(num_generations)]
    ep = rollout(model, tokenizer, group, task.make_env, generator=generator)
    rewards = ep.rewards
    if mistake == "text_reward":
        rewards = task.reward(group, ep.completions)
    adv = group_advantages(rewards, num_generations) if mistake != "batch_baseline" else rewards - rewards.mean()
    _, logp_all = _all_logprobs(model, ep)
    P = ep.prompt_ids.shape[1]
    logp = logp_all[:, P - 1:]
    if mistake == "sampler_logprobs":
        logp = ep.logprobs
    use_completion = (not mask_observations) != (mistake == "flag_inverted")
    if mistake == "always_masked":
        use_completion = False
    learn = (ep.completion_mask if use_completion else ep.policy_mask).float()
    ratio = torch.exp(logp - logp.detach())
    loss = -(torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * learn).sum()
    loss = loss / (ep.completion_mask.sum() if mistake == "span" else learn.sum())
    if mistake == "sign":
        loss = -loss
    if mistake != "no_zero_grad":
        optimizer.zero_grad()
    if loss.requires_grad:
        loss.backward()
    optimizer.step()
    return float(rewards.mean())


STEP_MISTAKES = {"flag_inverted": "another direction", "always_masked": "another direction",
                 "span": "not by the episode's span", "batch_baseline": "another direction",
                 "sign": "other way", "no_zero_grad": "zero them before backward",
                 "sampler_logprobs": "norm 0", "text_reward": "mean final reward"}


def test_multi_turn_step_right_answer_passes(capsys):
    assert_passes(check_multi_turn_step, step_right, capsys)


@pytest.mark.parametrize("mistake", list(STEP_MISTAKES))
def test_multi_turn_step_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(step_right, mistake=mistake)
    assert_fails(check_multi_turn_step, wrong, STEP_MISTAKES[mistake])


# ------------------------------------------------------------------- exercise 4: find the bug, fixed
def update(model, optimizer, tokenizer, task, prompts, generator, num_generations=8, mistake=None):
    group = [p for p in prompts for _ in range(num_generations)]
    ep = rollout(model, tokenizer, group, task.make_env, generator=generator)
    adv = group_advantages(ep.rewards, num_generations)
    ids, logp = _all_logprobs(model, ep, keep_positions=mistake != "no_positions")
    learn = torch.cat([torch.zeros_like(ep.prompt_mask),
                       ep.completion_mask if mistake == "observations" else ep.policy_mask], 1).float()
    mask = learn[:, :-1] if mistake == "unchanged" else learn[:, 1:]
    denominator = torch.cat([torch.zeros_like(ep.prompt_mask), ep.completion_mask], 1)[:, 1:].sum() \
        if mistake == "span" else mask.sum()
    loss = -(adv[:, None] * logp * mask).sum() / denominator
    if mistake == "sign":
        loss = -loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(ep.rewards.mean())


def update_shifted_logits(model, optimizer, tokenizer, task, prompts, generator, num_generations=8):
    """A wrong fix: keep the mask and shift the logits instead (the log-probs then predict the wrong tokens)."""
    group = [p for p in prompts for _ in range(num_generations)]
    ep = rollout(model, tokenizer, group, task.make_env, generator=generator)
    adv = group_advantages(ep.rewards, num_generations)
    ids = torch.cat([ep.prompt_ids, ep.completion_ids], 1)
    attention = torch.cat([ep.prompt_mask, ep.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, 1:], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = torch.cat([torch.zeros_like(ep.prompt_mask), ep.policy_mask], 1)[:, 1:].float()
    loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(ep.rewards.mean())


UPDATE_MISTAKES = {"unchanged": "token j + 1", "observations": "token j + 1", "span": "not by the episode's span",
                   "sign": "other way", "no_positions": "another direction"}


def test_multi_turn_update_right_answer_passes(capsys):
    assert_passes(check_multi_turn_update, update, capsys)


@pytest.mark.parametrize("mistake", list(UPDATE_MISTAKES))
def test_multi_turn_update_mistakes_fail_with_their_hint(mistake):
    wrong = functools.partial(update, mistake=mistake)
    assert_fails(check_multi_turn_update, wrong, UPDATE_MISTAKES[mistake])


def test_multi_turn_update_wrong_fix_fails():
    assert_fails(check_multi_turn_update, update_shifted_logits, "another direction")
