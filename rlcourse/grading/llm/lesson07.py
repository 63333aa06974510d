"""Checks for lesson 07 (an LLM as a policy): token log-probs, sequence log-probs, entropy, and the
experiment that measures entropy by sampling. (The KL checks of lesson 07b live in ``lesson07b.py``.)

Each check compares the learner's function with the reference in :mod:`rlcourse.lm.logprobs` or
:mod:`rlcourse.kl` on inputs built to expose one plausible mistake each: a log-softmax summed over
the vocabulary instead of gathered, logits shifted by one against their targets, padding after
EOS counted, the temperature forgotten; and on the families every check
probes: very large logits and log-probs near -800, boolean masks, inputs written in place (the
caller's own tensors are compared after the call), and a log-prob whose gradient does not really
reach the model's weights.
"""
from __future__ import annotations

import numpy as np

import torch

from rlcourse import kl
from rlcourse.grading._core import (assert_close, call_unmutated, fail, fail_if_mistake, gradient_flowing, passed,
                                    references, to_numpy)

__all__ = ["check_gather_token_logprobs", "check_sequence_logprob", "check_token_entropy",
           "check_entropy_by_sampling"]

_GATHER_HINT = ("log pi(token) = log_softmax(logits / temperature, dim=-1) gathered at the token "
                "taken (torch.gather or .gather(-1, tokens.unsqueeze(-1))), then multiplied by the "
                "mask; not a sum over the vocabulary")


def token_logprobs_from_logits(logits, tokens, temperature=1.0):
    __tracebackhide__ = True
    # Imported on first use: `import rlcourse.grading` should not load transformers for lesson 01.
    from rlcourse.lm.logprobs import token_logprobs_from_logits as reference

    return reference(logits, tokens, temperature)


def _random_mask(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Completion masks: 1 up to and including each row's EOS, 0 after (one row always full)."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    return (torch.arange(length) < lengths[:, None]).long()


def _grad_free(x):
    return x.detach() if hasattr(x, "detach") else x


@references("rlcourse.lm.logprobs:token_logprobs_from_logits")
def check_gather_token_logprobs(fn) -> None:
    """``fn(logits, tokens, mask, temperature) -> (B, T)``: masked log-probs of the tokens taken.

    ``logits[:, t]`` (shape (B, T, V)) predicts ``tokens[:, t]``; the result is
    ``log softmax(logits / temperature)[token]`` where ``mask`` is 1 and 0 where it is 0.
    """
    __tracebackhide__ = True
    name = "check_gather_token_logprobs"
    gen = torch.Generator().manual_seed(70)
    cases = []
    for i, (B, T, V, temp) in enumerate([(1, 1, 5, 1.0), (2, 4, 7, 1.0), (3, 6, 11, 0.7),
                                         (4, 5, 13, 2.0)]):
        logits = 2 * torch.randn(B, T, V, generator=gen)
        tokens = torch.randint(0, V, (B, T), generator=gen)
        mask = torch.ones(B, T, dtype=torch.long) if i < 2 else _random_mask(gen, B, T)
        what = "no padding" if i < 2 else "padding after EOS (mask 0)"
        cases.append((f"random logits #{i} (B={B}, T={T}, V={V}, temperature={temp}, {what})",
                      logits, tokens, mask, temp))
    # Very confident logits: log(softmax(x)) underflows to -inf where log_softmax stays finite.
    logits = 60 * torch.randn(2, 4, 9, generator=gen)
    tokens = logits.argmin(-1)
    cases.append(("very confident logits with unlikely tokens taken (log of softmax underflows)",
                  logits, tokens, torch.ones(2, 4, dtype=torch.long), 1.0))
    logits = 2 * torch.randn(2, 5, 6, generator=gen)
    cases.append(("a boolean mask, padding after EOS", logits, torch.randint(0, 6, (2, 5), generator=gen),
                  _random_mask(gen, 2, 5).bool() | torch.tensor([[True], [False]]), 0.8))
    logits = 2 * torch.randn(3, 6, 8, generator=gen)
    cases.append(("a float mask with left padding (0s before the first real token, not after EOS)", logits,
                  torch.randint(0, 8, (3, 6), generator=gen), _random_mask(gen, 3, 6).flip(-1).double(), 1.0))
    for case, logits, tokens, mask, temp in cases:
        got = call_unmutated(name, case, fn, logits, tokens, mask, temp)
        expected = token_logprobs_from_logits(logits, tokens, temp) * mask
        lengths = mask.sum(-1, keepdim=True)
        right_padded = token_logprobs_from_logits(logits, tokens, temp) * (torch.arange(mask.shape[-1]) < lengths)
        fail_if_mistake(name, case, expected, _grad_free(got), right_padded,
                        "that assumes the padding comes last (a prefix of mask.sum() real tokens); padding "
                        "can sit on either side: use the mask itself, position by position")
        hint = _GATHER_HINT
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        if got_np is not None and got_np.shape == tuple(mask.shape):
            if temp != 1.0 and np.allclose(got_np, to_numpy(token_logprobs_from_logits(logits, tokens) * mask),
                                           atol=1e-5):
                hint = "the policy sampled at this temperature is softmax(logits / temperature)"
            elif (mask == 0).any() and np.allclose(got_np, to_numpy(token_logprobs_from_logits(logits, tokens, temp)),
                                                   atol=1e-5):
                hint = "positions where mask is 0 (after EOS) must be 0, not counted"
            elif not np.isfinite(got_np).all():
                hint = ("log(softmax(x)) underflows to -inf for unlikely tokens; "
                        "torch.log_softmax computes it stably")
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-5, rtol=1e-5)
    passed(name, len(cases))


def _sequence_cases(seed: int = 71):
    """A small random GPT-2 (large init, so its next-token distributions are far from uniform)
    and left-padded batches of prompts with completions that stop at EOS."""
    from rlcourse.lm.model import make_model
    from rlcourse.lm.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+=:")
    with torch.random.fork_rng(devices=[]):       # leave the learner's global RNG untouched
        model = make_model("tiny", tokenizer, seed=seed, initializer_range=0.3)
    gen = torch.Generator().manual_seed(seed)
    chars = "0123456789+="
    cases = []
    for i, (n_prompts, T, temp, same_length) in enumerate([(1, 3, 1.0, True), (3, 5, 1.0, True),
                                                          (4, 6, 1.0, False), (4, 6, 0.7, False)]):
        lengths = [5] * n_prompts if same_length else torch.randint(2, 9, (n_prompts,), generator=gen).tolist()
        if not same_length:
            lengths[0], lengths[1] = 2, 8            # make sure the prompts differ in length
        prompts = ["".join(chars[j] for j in torch.randint(0, len(chars), (n,), generator=gen)) for n in lengths]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        completion_mask = _random_mask(gen, n_prompts, T)
        completion_ids = torch.randint(4, len(tokenizer), (n_prompts, T), generator=gen)
        ends = completion_mask.sum(1) - 1
        completion_ids[torch.arange(n_prompts), ends] = tokenizer.eos_token_id
        completion_ids[completion_mask == 0] = tokenizer.pad_token_id
        what = ("prompts of one length, no padding" if same_length and i == 0 else
                "prompts of one length, completions padded after EOS" if same_length else
                f"left-padded prompts of lengths {lengths}, completions padded after EOS")
        cases.append((f"batch #{i}: {what}, temperature={temp}", batch["input_ids"], batch["attention_mask"],
                      completion_ids, completion_mask, temp))
    return model, cases


@references("rlcourse.lm.logprobs:sequence_logprobs", "rlcourse.lm.logprobs:token_logprobs_from_logits")
def check_sequence_logprob(fn) -> None:
    """``fn(model, prompt_ids, completion_ids, completion_mask, prompt_mask, temperature) -> (B,)``:
    ``log pi(y | x) = sum_t mask_t log pi(y_t | x, y_<t)``, differentiable."""
    __tracebackhide__ = True
    name = "check_sequence_logprob"
    model, cases = _sequence_cases()
    for k, (case, prompt_ids, prompt_mask, completion_ids, completion_mask, temp) in enumerate(cases):
        got = call_unmutated(name, case, fn, model, prompt_ids, completion_ids, completion_mask, prompt_mask, temp)
        from rlcourse.lm.logprobs import sequence_logprobs

        with torch.no_grad():
            per_token = sequence_logprobs(model, prompt_ids, completion_ids, completion_mask,
                                          prompt_mask=prompt_mask, temperature=temp)
        expected = per_token.sum(-1)
        hint = ("feed [prompt | completion] with an attention mask and position_ids = "
                "(mask.cumsum(-1) - 1).clamp(min=0); the logit at column P-1+t predicts "
                "completion token t; gather, mask and sum over t")
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        if got_np is not None and got_np.shape == tuple(expected.shape):
            hint = _diagnose_sequence(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      temp, got_np) or hint
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-4, rtol=1e-4)
        weight = model.get_input_embeddings().weight
        (grad,) = gradient_flowing(name, case, got, [weight],
                                   "do not wrap the forward pass in torch.no_grad(), call .detach()/.item() or "
                                   "rebuild the result with torch.tensor(...): the trainer differentiates this log-prob")
        if k == len(cases) - 1:
            from rlcourse.lm.logprobs import sequence_logprobs

            reference = sequence_logprobs(model, prompt_ids, completion_ids, completion_mask,
                                          prompt_mask=prompt_mask, temperature=temp).sum()
            (want_grad,) = torch.autograd.grad(reference, [weight])
            assert_close(name, f"{case}: the gradient with respect to the token embeddings", want_grad, grad,
                         atol=1e-4, rtol=1e-3, hint="the gradient must flow through the model's forward pass")
    passed(name, len(cases))


def _diagnose_sequence(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temp, got):
    """Name the mistake when the answer equals a known wrong computation."""
    __tracebackhide__ = True
    with torch.no_grad():
        ids = torch.cat([prompt_ids, completion_ids], 1)
        attn = torch.cat([prompt_mask, completion_mask], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        P = prompt_ids.shape[1]
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        aligned = logits[:, P - 1:-1]
        m = completion_mask.float()
        wrong = {
            "the logits are shifted by one: the logit at column P-1+t predicts completion token t, "
            "so take logits[:, P-1:-1], not logits[:, P:]":
                (token_logprobs_from_logits(logits[:, P:], completion_ids, temp) * m).sum(-1),
            "tokens after EOS (completion_mask 0) were counted":
                token_logprobs_from_logits(aligned, completion_ids, temp).sum(-1),
            "the temperature is missing: the policy that sampled is softmax(logits / temperature)":
                (token_logprobs_from_logits(aligned, completion_ids) * m).sum(-1),
            "under left padding GPT-2 needs position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0), "
            "or every real token sits at the wrong position":
                (token_logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1],
                                            completion_ids, temp) * m).sum(-1),
            "log_softmax over the vocabulary was summed instead of gathering the sampled token":
                ((torch.log_softmax(aligned / temp, -1).sum(-1)) * m).sum(-1),
        }
    for message, value in wrong.items():
        if np.allclose(got, to_numpy(value), atol=1e-4, rtol=1e-4):
            return message
    return None


@references("rlcourse.kl:entropy", "rlcourse.losses.policy_gradient:entropy_bonus")
def check_token_entropy(fn) -> None:
    """``fn(logits, temperature) -> (B, T)``: entropy of ``softmax(logits / temperature)`` per position."""
    __tracebackhide__ = True
    name = "check_token_entropy"
    gen = torch.Generator().manual_seed(72)
    V = 9
    cases = [("uniform logits (entropy log V)", torch.zeros(1, 2, V), 1.0),
             ("one dominant token", torch.tensor([[[50.0] + [0.0] * (V - 1)]]), 1.0),
             ("random logits", 2 * torch.randn(3, 4, V, generator=gen), 1.0),
             ("random logits at temperature 0.5", 2 * torch.randn(2, 3, V, generator=gen), 0.5),
             ("random logits at temperature 3", 2 * torch.randn(2, 3, V, generator=gen), 3.0),
             ("very confident logits (softmax underflows to exactly 0)", 200 * torch.randn(2, 3, V, generator=gen), 1.0)]
    for case, logits, temp in cases:
        logits = logits.clone().requires_grad_(True)
        got = call_unmutated(name, case, fn, logits, temp)
        expected = kl.entropy(torch.log_softmax(logits.detach().double() / temp, -1))
        hint = "H = -sum_v p(v) log p(v) with p = softmax(logits / temperature); use log_softmax for log p"
        got_np = to_numpy(_grad_free(got)) if got is not None else None
        if got_np is not None and got_np.shape == tuple(expected.shape):
            if not np.isfinite(got_np).all():
                hint = ("0 * log(0) gives nan: compute log p with torch.log_softmax (finite), "
                        "so p * log p is 0 where p underflows")
            elif (got_np < -1e-6).any():
                hint = "entropy is never negative: H = -sum p log p (mind the minus sign)"
        assert_close(name, case, expected, _grad_free(got), hint=hint, atol=1e-5, rtol=1e-5)
        (grad,) = gradient_flowing(name, case, got, [logits],
                                   "an entropy bonus is differentiated: compute it with torch operations on logits")
        ref = logits.detach().clone().requires_grad_(True)
        (want_grad,) = torch.autograd.grad(kl.entropy(torch.log_softmax(ref / temp, -1)).sum(), [ref])
        assert_close(name, f"{case}: the gradient with respect to logits", want_grad, grad, atol=1e-4, rtol=1e-4,
                     hint="compute H from log_softmax(logits / temperature) without detaching anything")
    passed(name, len(cases))


@references("rlcourse.kl:entropy")
def check_entropy_by_sampling(fn) -> None:
    """``fn(logits, temperatures, n_samples, seed) -> {temp: (mean, std)}``: a measurement.

    The experiment: for each temperature, draw ``n_samples`` tokens from
    ``pi_temp = softmax(logits / temp)`` (a ``torch.Generator`` seeded with ``seed``) and report the
    mean and standard deviation of their surprise ``-log pi_temp(y)``. Its mean is the entropy
    ``H(pi_temp)``: each estimate must land within 4 standard errors of the exact entropy, and the
    measured entropies must rise with the temperature.
    """
    __tracebackhide__ = True
    name = "check_entropy_by_sampling"
    gen = torch.Generator().manual_seed(75)
    temperatures = [0.5, 1.0, 2.0]
    n_samples = 20000
    n = 0
    for V in (12, 40):
        logits = 2.5 * torch.randn(V, generator=gen, dtype=torch.float64)
        case = f"a {V}-token vocabulary, temperatures {temperatures}, {n_samples} samples, seed=0"
        got = call_unmutated(name, case, fn, logits, list(temperatures), n_samples, 0)
        if not isinstance(got, dict) or not set(temperatures) <= set(got):
            fail(name, case, "a dict {temperature: (mean, std)} with a key per temperature", got,
                 "loop over the temperatures and return the mean and std of -log pi_temp(y) for each")
        measured = []
        for temp in temperatures:
            try:
                mean, std = (float(to_numpy(v)) for v in got[temp])
            except (TypeError, ValueError):
                fail(name, f"{case}, temperature {temp}", "(mean, std), two numbers", got[temp],
                     "return a pair: the mean and the standard deviation of the surprise")
            exact = float(kl.entropy(torch.log_softmax(logits / temp, -1)))
            if not (std > 0 and abs(mean - exact) < 4 * std / np.sqrt(n_samples) + 1e-12):
                fail(name, f"{case}, temperature {temp}",
                     f"a mean surprise within 4 standard errors of the entropy H = {exact:.5f}",
                     f"mean {mean:.5f}, std {std:.5f}",
                     "sample y ~ softmax(logits / temp) with torch.multinomial(p, n, replacement=True, "
                     "generator=g), then surprise = -log_softmax(logits / temp)[y]: the same temperature "
                     "for sampling and for the log-prob, and a minus sign")
            measured.append(mean)
        if not all(a < b for a, b in zip(measured, measured[1:])):
            fail(name, case, "entropies rising with the temperature", measured,
                 "a higher temperature flattens the distribution, so its entropy is larger")
        n += 1
    n += _seed_is_used(name, fn, logits, temperatures, n_samples)
    passed(name, n)


def _seed_is_used(name, fn, logits, temperatures, n_samples) -> int:
    """A sampled measurement must depend on ``seed`` and on nothing else random: the same seed
    twice gives the same numbers (no draw from the global RNG), two seeds give different ones (no
    generator reseeded with a constant). Returns the number of cases run."""
    __tracebackhide__ = True
    runs = {seed: [call_unmutated(name, f"seed={seed}", fn, logits, list(temperatures), n_samples, seed)
                   for _ in range(2 if seed == 1 else 1)] for seed in (1, 2)}
    means = {seed: [[float(to_numpy(got[t][0])) for t in temperatures] for got in outs] for seed, outs in runs.items()}
    if means[1][0] != means[1][1]:
        fail(name, "the same seed (1) twice", means[1][0], means[1][1],
             "draw with a torch.Generator seeded with `seed` (g = torch.Generator().manual_seed(seed); "
             "torch.multinomial(..., generator=g)): the global RNG gives another answer at every call")
    if means[1][0] == means[2][0]:
        fail(name, "seeds 1 and 2", "two different measurements", means[2][0],
             "seed the generator with the `seed` argument, not a constant: another seed must draw other samples")
    return 2

