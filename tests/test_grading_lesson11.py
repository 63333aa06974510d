"""Lesson 11's checks pass the reference answers and catch each plausible wrong answer."""
import functools

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch
import torch.nn.functional as F

from grading_asserts import grading_tests, mistake_tests
from rlcourse.grading.llm.lesson11 import (check_completion_logprobs, check_dpo_loss, check_dpo_step, check_fit_dpo_policy,
                                       check_implicit_reward, check_ipo_loss)
from rlcourse.grading import CheckFailed
from rlcourse.lm import sequence_logprobs
from rlcourse.measure.categorical_bandit import train_tabular_policy


# --- the DPO loss ------------------------------------------------------------------------------

def dpo_ok(cw, cl, rw, rl, beta):
    return -F.logsigmoid(beta * ((cw - rw) - (cl - rl)))


def dpo_ok_softplus(cw, cl, rw, rl, beta):
    return F.softplus(-beta * ((cw - rw) - (cl - rl))).numpy()     # NumPy is fine too


def dpo_no_beta(cw, cl, rw, rl, beta):
    return -F.logsigmoid((cw - rw) - (cl - rl))


def dpo_no_reference(cw, cl, rw, rl, beta):
    return -F.logsigmoid(beta * (cw - cl))


def dpo_swapped(cw, cl, rw, rl, beta):
    return -F.logsigmoid(beta * ((cl - rl) - (cw - rw)))


def dpo_wrong_sign(cw, cl, rw, rl, beta):
    return F.logsigmoid(beta * ((cw - rw) - (cl - rl)))


def dpo_divides_beta(cw, cl, rw, rl, beta):
    return -F.logsigmoid(((cw - rw) - (cl - rl)) / beta)


def dpo_unstable(cw, cl, rw, rl, beta):
    return -torch.log(torch.sigmoid(beta * ((cw - rw) - (cl - rl))))


def dpo_batch_mean(cw, cl, rw, rl, beta):
    return dpo_ok(cw, cl, rw, rl, beta).mean()


def dpo_in_place(cw, cl, rw, rl, beta):
    cw -= rw
    cl -= rl
    return -F.logsigmoid(beta * (cw - cl))


def dpo_forgot_return(cw, cl, rw, rl, beta):
    dpo_ok(cw, cl, rw, rl, beta)


# --- the implicit reward -----------------------------------------------------------------------

def reward_ok(logp, ref, beta):
    return beta * (logp - ref)


def reward_no_beta(logp, ref, beta):
    return logp - ref


def reward_reversed(logp, ref, beta):
    return beta * (ref - logp)


def reward_divides(logp, ref, beta):
    return (logp - ref) / beta


def reward_no_reference(logp, ref, beta):
    return beta * logp


def reward_ratio_of_probs(logp, ref, beta):   # underflows: exp(-1e4) = 0
    return beta * torch.log(torch.exp(logp) / torch.exp(ref))


# --- IPO ----------------------------------------------------------------------------------------

def ipo_ok(cw, cl, rw, rl, beta):
    return ((cw - rw) - (cl - rl) - 1 / (2 * beta)) ** 2


def ipo_without_graph(cw, cl, rw, rl, beta):   # right numbers, but no gradient: nothing can be fitted with it
    h = (cw - rw) - (cl - rl) - 1 / (2 * beta)
    return torch.tensor((h ** 2).tolist(), dtype=cw.dtype)


def ipo_target_one_over_beta(cw, cl, rw, rl, beta):
    return ((cw - rw) - (cl - rl) - 1 / beta) ** 2


def ipo_scaled_margin(cw, cl, rw, rl, beta):
    return (beta * ((cw - rw) - (cl - rl)) - 1 / (2 * beta)) ** 2


def ipo_plus_target(cw, cl, rw, rl, beta):
    return ((cw - rw) - (cl - rl) + 1 / (2 * beta)) ** 2


def ipo_no_square(cw, cl, rw, rl, beta):
    return (cw - rw) - (cl - rl) - 1 / (2 * beta)


def ipo_no_reference(cw, cl, rw, rl, beta):
    return ((cw - cl) - 1 / (2 * beta)) ** 2


def ipo_dpo_instead(cw, cl, rw, rl, beta):
    return dpo_ok(cw, cl, rw, rl, beta)


# --- the experiment -----------------------------------------------------------------------------

def fit_ok(bandit, pairs, beta):
    return train_tabular_policy(bandit, pairs, beta, steps=300, lr=0.3)["logprobs"]


def _fit(bandit, pairs, beta, steps=300, use_reference=True, scale=1.0):
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=0.3)
    p, w, l = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    ref = bandit.ref_logprobs if use_reference else torch.zeros_like(bandit.ref_logprobs)
    for _ in range(steps):
        logp = torch.log_softmax(logits, -1)
        h = (logp[p, w] - ref[p, w]) - (logp[p, l] - ref[p, l])
        loss = -F.logsigmoid(scale * beta * h).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.log_softmax(logits.detach(), -1)


def fit_own_loop(bandit, pairs, beta):
    return _fit(bandit, pairs, beta)


def fit_no_reference(bandit, pairs, beta):
    return _fit(bandit, pairs, beta, use_reference=False)


def fit_too_short(bandit, pairs, beta):
    return _fit(bandit, pairs, beta, steps=3)


def fit_wrong_beta(bandit, pairs, beta):
    return _fit(bandit, pairs, beta, scale=4.0)


def fit_returns_logits(bandit, pairs, beta):
    return fit_ok(bandit, pairs, beta) + 1.0


def fit_reference(bandit, pairs, beta):
    return bandit.ref_logprobs.clone()


def fit_lbfgs(bandit, pairs, beta):               # another optimiser, in float64 throughout
    logits = bandit.ref_logprobs.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([logits], lr=1, max_iter=200, tolerance_grad=1e-12, line_search_fn="strong_wolfe")
    p, w, l = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    ref = bandit.ref_logprobs

    def closure():
        logp = torch.log_softmax(logits, -1)
        loss = -F.logsigmoid(beta * ((logp[p, w] - ref[p, w]) - (logp[p, l] - ref[p, l]))).mean()
        opt.zero_grad()
        loss.backward()
        return loss
    opt.step(closure)
    return torch.log_softmax(logits.detach(), -1)


def fit_closed_form(bandit, pairs, beta):         # reads no comparison: pi* from the hidden reward
    return torch.log_softmax(bandit.ref_logprobs + bandit.reward / beta, -1)


def fit_closed_form_by_the_library(bandit, pairs, beta):
    return bandit.optimal_logprobs(beta)


RIGHT = [
    (check_dpo_loss, dpo_ok), (check_dpo_loss, dpo_ok_softplus),
    (check_implicit_reward, reward_ok),
    (check_ipo_loss, ipo_ok),
    (check_fit_dpo_policy, fit_ok), (check_fit_dpo_policy, fit_own_loop), (check_fit_dpo_policy, fit_lbfgs),
]

WRONG = [
    (check_dpo_loss, dpo_no_beta, "beta is missing"),
    (check_dpo_loss, dpo_no_reference, "reference"),
    (check_dpo_loss, dpo_swapped, "swapped"),
    (check_dpo_loss, dpo_wrong_sign, "MINUS"),
    (check_dpo_loss, dpo_divides_beta, "divide"),
    (check_dpo_loss, dpo_unstable, "logsigmoid"),
    (check_dpo_loss, dpo_batch_mean, "per-pair"),
    (check_dpo_loss, dpo_in_place, "in place"),
    (check_dpo_loss, dpo_forgot_return, "return"),
    (check_implicit_reward, reward_no_beta, "beta is missing"),
    (check_implicit_reward, reward_reversed, "sign"),
    (check_implicit_reward, reward_divides, "do not divide"),
    (check_implicit_reward, reward_no_reference, "reference"),
    (check_implicit_reward, reward_ratio_of_probs, "underflows"),
    (check_ipo_loss, ipo_target_one_over_beta, "not 1 / beta"),
    (check_ipo_loss, ipo_scaled_margin, "not beta"),
    (check_ipo_loss, ipo_plus_target, "AHEAD"),
    (check_ipo_loss, ipo_no_square, "square"),
    (check_ipo_loss, ipo_no_reference, "reference"),
    (check_ipo_loss, ipo_dpo_instead, "expected"),
    (check_ipo_loss, ipo_without_graph, "keep the loss differentiable"),
    (check_fit_dpo_policy, fit_no_reference, "reference"),
    (check_fit_dpo_policy, fit_too_short, "KL"),
    (check_fit_dpo_policy, fit_wrong_beta, "KL"),
    (check_fit_dpo_policy, fit_returns_logits, "log_softmax"),
    (check_fit_dpo_policy, fit_reference, "never left"),
    (check_fit_dpo_policy, fit_closed_form, "not a fit to these comparisons"),
    (check_fit_dpo_policy, fit_closed_form_by_the_library, "computed from the bandit's reward"),
]

test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)


# ------------------------------------------------------------------ one DPO step
def dpo_step_ok(model, ref_model, optimizer, batch, beta, *, mistake=None):
    """A correct step (the pair loss written out); ``mistake`` turns one plausible slip on."""
    args = (batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"], batch["prompt_mask"])
    tokens = sequence_logprobs(model, *args)
    seq = tokens.sum(-1) / batch["completion_mask"].sum(-1) if mistake == "token mean" else tokens.sum(-1)
    chosen, rejected = seq.chunk(2)
    if mistake == "swapped":
        chosen, rejected = rejected, chosen
    if mistake == "the checkpoint as reference":         # ref_model ignored: the start loaded again
        from rlcourse.lm import load_checkpoint
        ref_model = load_checkpoint("preference-sft", device="cpu")[0]
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logprobs(model if mistake == "policy as reference" else ref_model,
                                                     *args).sum(-1).chunk(2)
    if mistake == "no reference":
        ref_chosen, ref_rejected = torch.zeros_like(ref_chosen), torch.zeros_like(ref_rejected)
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    per_pair = -torch.nn.functional.logsigmoid((1.0 if mistake == "beta left out" else beta) * margin)
    loss = per_pair.sum() if mistake == "sum over pairs" else per_pair.mean()
    if mistake != "no zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


DPO_STEP_MISTAKES = ["token mean", "swapped", "policy as reference", "the checkpoint as reference", "no reference",
                     "beta left out", "sum over pairs", "no zero_grad"]


test_dpo_step_check, test_dpo_step_check_catches = mistake_tests(
    check_dpo_step, dpo_step_ok, DPO_STEP_MISTAKES, "held-out pairs")


# ------------------------------------------------------------------ find the bug: completion log-probs
def completion_logprobs_ok(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, mistake=None):
    if mistake == "the checkpoint, not the model given":
        from rlcourse.lm import load_checkpoint
        model = load_checkpoint("preference-sft", device="cpu")[0].eval()
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    positions = None if mistake == "default positions" else (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.set_grad_enabled(mistake != "under no_grad"):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
    if mistake == "detached":
        logits = logits.detach()
    P = prompt_ids.shape[1]
    window = logits[:, P:] if mistake == "the shipped off-by-one" else logits[:, P - 1:-1]
    if mistake == "probabilities":
        scores = torch.softmax(window, -1)
    elif mistake == "log-softmax over the positions":
        scores = torch.log_softmax(window, 1)
    else:
        scores = torch.log_softmax(window, -1)
    if mistake == "log-softmax summed over the vocabulary":
        token = scores.sum(-1)
    else:
        token = scores.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    if mistake == "padding kept":
        return token
    return token * completion_mask


COMPLETION_MISTAKES = ["the shipped off-by-one", "default positions", "probabilities",
                       "log-softmax summed over the vocabulary", "padding kept", "log-softmax over the positions",
                       "under no_grad", "detached", "the checkpoint, not the model given"]


def test_log_probs_without_a_graph_are_told_so():
    with pytest.raises(CheckFailed, match="without torch.no_grad"):
        check_completion_logprobs(functools.partial(completion_logprobs_ok, mistake="under no_grad"))


test_completion_logprobs_check, test_completion_logprobs_check_catches = mistake_tests(
    check_completion_logprobs, completion_logprobs_ok, COMPLETION_MISTAKES, "passed")
