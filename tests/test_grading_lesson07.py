"""Lesson 07's checks pass the reference answers and catch each plausible wrong answer."""

import rlcourse  # noqa: F401  (before torch)
import torch

from grading_asserts import grading_tests
from rlcourse.grading.llm.lesson07 import (check_entropy_by_sampling, check_gather_token_logprobs,
                                       check_sequence_logprob, check_token_entropy)


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


# --- the entropy measurement (the experiment) ------------------------------------------------

def entropy_sampled(logits, temperatures, n_samples, seed, sample_temp=True, logp_temp=True, sign=-1.0,
                    uniform=False):
    out = {}
    for temp in temperatures:
        g = torch.Generator().manual_seed(seed)
        logp = torch.log_softmax(logits / (temp if logp_temp else 1.0), -1)
        weights = torch.ones_like(logp) if uniform else torch.softmax(logits / (temp if sample_temp else 1.0), -1)
        y = torch.multinomial(weights, n_samples, replacement=True, generator=g)
        surprise = sign * logp[y]
        out[temp] = (surprise.mean(), surprise.std())
    return out


def with_(fn, **options):
    def answer(*args):
        return fn(*args, **options)
    answer.__name__ = f"{fn.__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
    return answer


def entropy_sampled_numpy(logits, temperatures, n_samples, seed):
    """Another right answer: NumPy floats, one generator shared by all temperatures."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for temp in temperatures:
        logp = torch.log_softmax(logits / temp, -1)
        y = torch.multinomial(logp.exp(), n_samples, replacement=True, generator=g)
        out[temp] = (float(-logp[y].mean()), float(logp[y].std()))
    return out


def entropy_exact_not_sampled(logits, temperatures, n_samples, seed):
    """Not a measurement: the exact entropy, with a made-up spread of 0."""
    out = {}
    for temp in temperatures:
        logp = torch.log_softmax(logits / temp, -1)
        out[temp] = (-(logp.exp() * logp).sum(), 0.0)
    return out


def entropy_one_temperature(logits, temperatures, n_samples, seed):
    return {temperatures[1]: entropy_sampled(logits, temperatures, n_samples, seed)[temperatures[1]]}


def gather_assumes_right_padding(logits, tokens, mask, temperature=1.0):
    """Keeps the first mask.sum() positions: right for padding after EOS, wrong for left padding."""
    taken = torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return taken * (torch.arange(mask.shape[-1]) < mask.sum(-1, keepdim=True))


def entropy_global_rng(logits, temperatures, n_samples, seed):
    """Draws from torch's global RNG, ignoring ``seed``: every call measures other samples."""
    out = {}
    for temp in temperatures:
        logp = torch.log_softmax(logits / temp, -1)
        y = torch.multinomial(logp.exp(), n_samples, replacement=True)
        out[temp] = (float(-logp[y].mean()), float(logp[y].std()))
    return out


def entropy_constant_seed(logits, temperatures, n_samples, seed):
    """Reseeds with a constant, ignoring ``seed``: every seed measures the same samples."""
    return entropy_sampled(logits, temperatures, n_samples, 0)


# -----------------------------------------------------------------------------------------------

RIGHT = [(check_gather_token_logprobs, gather_ok), (check_gather_token_logprobs, gather_ok_where),
         (check_sequence_logprob, seq_ok), (check_sequence_logprob, seq_ok_via_package),
         (check_token_entropy, entropy_ok), (check_token_entropy, entropy_ok_distributions),
         (check_entropy_by_sampling, entropy_sampled), (check_entropy_by_sampling, entropy_sampled_numpy)]

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
    (check_entropy_by_sampling, with_(entropy_sampled, sample_temp=False), "the same temperature"),
    (check_entropy_by_sampling, with_(entropy_sampled, logp_temp=False), "the same temperature"),
    (check_entropy_by_sampling, with_(entropy_sampled, sign=1.0), "minus sign"),
    (check_entropy_by_sampling, with_(entropy_sampled, uniform=True), "4 standard errors"),
    (check_entropy_by_sampling, entropy_exact_not_sampled, "std 0"),
    (check_entropy_by_sampling, entropy_one_temperature, "a key per temperature"),
    (check_entropy_by_sampling, entropy_global_rng, "the global RNG"),
    (check_gather_token_logprobs, gather_assumes_right_padding, "padding can sit on either side"),
    (check_entropy_by_sampling, entropy_constant_seed, "not a constant"),
]


test_right_answers_pass, test_wrong_answers_fail_with_a_hint = grading_tests(RIGHT, WRONG)
