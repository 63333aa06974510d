"""Lesson 07's checks pass the reference answers and catch each plausible wrong answer."""
import re

import pytest

import rlcourse  # noqa: F401  (before torch)
import torch

from rlcourse.grading import CheckFailed
from rlcourse.grading.lesson07 import (check_gather_token_logprobs, check_kl_k3, check_sequence_logprob,
                                       check_token_entropy)


# --- the masked gather -------------------------------------------------------------------------

def gather_ok(logits, tokens, mask, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask


def gather_ok_where(logits, tokens, mask, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = torch.take_along_dim(logp, tokens[..., None], dim=-1)[..., 0]
    return torch.where(mask.bool(), picked, torch.zeros_like(picked)).numpy()   # NumPy is fine too


def gather_sums_vocabulary(logits, tokens, mask, temperature=1.0):
    return torch.log_softmax(logits / temperature, dim=-1).sum(-1) * mask


def gather_no_mask(logits, tokens, mask, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def gather_no_temperature(logits, tokens, mask, temperature=1.0):
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask


def gather_temperature_after(logits, tokens, mask, temperature=1.0):
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) / temperature * mask


def gather_log_of_softmax(logits, tokens, mask, temperature=1.0):
    return torch.log(torch.softmax(logits / temperature, -1)).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask


def gather_shifted(logits, tokens, mask, temperature=1.0):
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1) * mask[:, 1:]


def gather_keeps_last_dim(logits, tokens, mask, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)) * mask.unsqueeze(-1)


def gather_in_place(logits, tokens, mask, temperature=1.0):
    logits /= temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask


def gather_forgot_return(logits, tokens, mask, temperature=1.0):
    torch.log_softmax(logits / temperature, -1)


# --- the sequence log-prob ---------------------------------------------------------------------

def _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask, positions=True, attention=True):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    kwargs = {}
    if attention:
        kwargs["attention_mask"] = attn
    if positions:
        kwargs["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, **kwargs).logits


def seq_ok(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask)[:, P - 1:-1]
    return gather_ok(logits, completion_ids, completion_mask, temperature).sum(-1)


def seq_ok_via_package(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    from rlcourse.lm.logprobs import sequence_logprobs
    return sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature).sum(-1)


def seq_shifted(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask)[:, P:]
    return gather_ok(logits, completion_ids, completion_mask, temperature).sum(-1)


def seq_counts_after_eos(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask)[:, P - 1:-1]
    return gather_ok(logits, completion_ids, torch.ones_like(completion_mask), temperature).sum(-1)


def seq_no_temperature(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    return seq_ok(model, prompt_ids, completion_ids, completion_mask, prompt_mask, 1.0)


def seq_no_position_ids(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask, positions=False)[:, P - 1:-1]
    return gather_ok(logits, completion_ids, completion_mask, temperature).sum(-1)


def seq_no_attention_mask(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask,
                      positions=False, attention=False)[:, P - 1:-1]
    return gather_ok(logits, completion_ids, completion_mask, temperature).sum(-1)


def seq_sums_vocabulary(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask)[:, P - 1:-1]
    return gather_sums_vocabulary(logits, completion_ids, completion_mask, temperature).sum(-1)


def seq_counts_prompt(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask)[:, :-1]
    return gather_ok(logits, ids[:, 1:], mask[:, 1:], temperature).sum(-1)


def seq_per_token(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    P = prompt_ids.shape[1]
    logits = _forward(model, prompt_ids, completion_ids, completion_mask, prompt_mask)[:, P - 1:-1]
    return gather_ok(logits, completion_ids, completion_mask, temperature)


def seq_no_grad(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature=1.0):
    with torch.no_grad():
        return seq_ok(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature)


# --- entropy -----------------------------------------------------------------------------------

def entropy_ok(logits, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def entropy_ok_distributions(logits, temperature=1.0):
    return torch.distributions.Categorical(logits=logits / temperature).entropy()


def entropy_missing_minus(logits, temperature=1.0):
    return -entropy_ok(logits, temperature)


def entropy_log_of_softmax(logits, temperature=1.0):
    p = torch.softmax(logits / temperature, -1)
    return -(p * torch.log(p)).sum(-1)


def entropy_no_temperature(logits, temperature=1.0):
    return entropy_ok(logits, 1.0)


def entropy_unweighted(logits, temperature=1.0):
    return -torch.log_softmax(logits / temperature, -1).sum(-1)


def entropy_mean_not_sum(logits, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, -1)
    return -(logp.exp() * logp).mean(-1)


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

RIGHT = [(check_gather_token_logprobs, gather_ok), (check_gather_token_logprobs, gather_ok_where),
         (check_sequence_logprob, seq_ok), (check_sequence_logprob, seq_ok_via_package),
         (check_token_entropy, entropy_ok), (check_token_entropy, entropy_ok_distributions),
         (check_kl_k3, k3_ok), (check_kl_k3, k3_ok_trl_style)]

WRONG = [
    (check_gather_token_logprobs, gather_sums_vocabulary, "gathered at the token"),
    (check_gather_token_logprobs, gather_no_mask, "mask is 0"),
    (check_gather_token_logprobs, gather_no_temperature, "temperature"),
    (check_gather_token_logprobs, gather_temperature_after, "gathered at the token"),
    (check_gather_token_logprobs, gather_log_of_softmax, "underflows"),
    (check_gather_token_logprobs, gather_shifted, "shape"),
    (check_gather_token_logprobs, gather_keeps_last_dim, "shape"),
    (check_gather_token_logprobs, gather_in_place, "modified in place"),
    (check_gather_token_logprobs, gather_forgot_return, "return"),
    (check_sequence_logprob, seq_shifted, "shifted by one"),
    (check_sequence_logprob, seq_counts_after_eos, "after EOS"),
    (check_sequence_logprob, seq_no_temperature, "temperature is missing"),
    (check_sequence_logprob, seq_no_position_ids, "position_ids"),
    (check_sequence_logprob, seq_no_attention_mask, "position_ids"),
    (check_sequence_logprob, seq_sums_vocabulary, "summed"),
    (check_sequence_logprob, seq_counts_prompt, "predicts"),
    (check_sequence_logprob, seq_per_token, "shape"),
    (check_sequence_logprob, seq_no_grad, "grad_fn"),
    (check_token_entropy, entropy_missing_minus, "minus sign"),
    (check_token_entropy, entropy_log_of_softmax, "nan"),
    (check_token_entropy, entropy_no_temperature, "temperature"),
    (check_token_entropy, entropy_unweighted, "H = "),
    (check_token_entropy, entropy_mean_not_sum, "H = "),
    (check_kl_k3, k3_inverted, "inverted"),
    (check_kl_k3, k3_is_k1, "that is k1"),
    (check_kl_k3, k3_is_k2, "never negative"),
    (check_kl_k3, k3_wrong_sign, "never negative"),
    (check_kl_k3, k3_probability_ratio_without_log, "never negative"),
]


@pytest.mark.parametrize("check, answer", RIGHT, ids=[a.__name__ for _, a in RIGHT])
def test_reference_answers_pass(check, answer, capsys):
    check(answer)
    out = capsys.readouterr().out
    assert re.fullmatch(rf"✔ {check.__name__}: all \d+ cases passed\n", out)


@pytest.mark.parametrize("check, answer, hint", WRONG, ids=[a.__name__ for _, a, _ in WRONG])
def test_wrong_answers_fail_with_a_useful_message(check, answer, hint):
    with pytest.raises(CheckFailed) as info:
        check(answer)
    assert hint in str(info.value), str(info.value)
