"""Log-probabilities of tokens under a causal language model, with masks.

A language model is a policy over tokens: at step ``t`` the state is the prompt plus the
completion so far, the action is the next token ``y_t``, and

    log pi(y_t | x, y_<t) = logits_t[y_t] / T - logsumexp_v(logits_t[v] / T)

for sampling temperature ``T``. The log-probability of a whole completion is the sum over its
tokens, ``log pi(y | x) = sum_t m_t log pi(y_t | x, y_<t)``, where the mask ``m_t`` is 1 for the
real tokens (up to and including EOS) and 0 for the padding after it.

The right computation is a log-softmax over the vocabulary *followed by a gather of the token that
was actually sampled*. A common slip (it appears in published pseudocode) keeps the log-softmax of
the whole vocabulary, or sums it, as if it were the action's log-prob: that is a different number
with no gradient meaning.

Left padding: GPT-2 learns absolute position embeddings. A left-padded prompt must give its first
real token position 0, so position ids are computed from the attention mask, ``cumsum - 1``
(clamped at 0 for the pads, which nothing attends to). Without this the log-probs of the same
tokens differ between the sampler and the trainer.

Masks mean "not there": a masked token (a prompt's left pad, a completion's pad after EOS, or a
hole) is not attended to, takes no position, and its id is never looked up, so whatever id it
holds cannot change a real token's log-prob; its own log-prob comes back as exactly 0. Prompts
must be *left*-padded (the last prompt column real in every row): with a pad after the prompt,
the first completion token would be predicted from the pad's column. Bad input (right-padded
prompts, ids outside the vocabulary, more real tokens than the model has positions, a temperature
that is not a positive number) raises a ``ValueError`` naming the argument, before the model runs.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from rlcourse.kl import as_mask
from rlcourse.lm import fast_gpt2


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row: ``cumsum(mask) - 1``, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or \
            not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _check_ids(name: str, ids, vocab_size: int | None = None, mask=None) -> None:
    """``ids`` is an integer tensor whose real entries (``mask`` 1) lie in ``[0, vocab_size)``."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of token ids, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if vocab_size is None:
        return
    real = ids if mask is None else ids[mask.bool()]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}) (the model's vocabulary) where "
                         f"the mask is 1, got ids from {int(real.min())} to {int(real.max())}")


def _check_mask(name: str, mask, ids: torch.Tensor) -> torch.Tensor:
    """``mask`` checked by the package's one mask check (:func:`rlcourse.kl.as_mask`: ``ids``' shape,
    0 and 1 only; 1 = a real token, 0 = not there), as a long tensor on ``ids``' device."""
    return as_mask(mask, ids, name).long()


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are upcast before a log-softmax (bf16 keeps ~3 digits); float64 stays float64."""
    return logits if logits.dtype == torch.float64 else logits.float()


def token_logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor,
                               temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)[token]`` for each position: the log-prob of the token taken.

    ``logits`` has shape (B, T, V) and ``logits[:, t]`` is the model's prediction for
    ``tokens[:, t]`` (shape (B, T)). Returns (B, T). The division by the temperature matters: the
    policy that sampled at ``T != 1`` is ``softmax(logits / T)``, so the importance ratio must use
    the same distribution.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(f"tokens must have shape {tuple(logits.shape[:2])} to match logits, "
                         f"got {tuple(tokens.shape)}")
    temperature = _check_temperature(temperature)
    _check_ids("tokens", tokens, logits.shape[-1])
    logp_all = F.log_softmax(_at_least_float32(logits) / temperature, dim=-1)
    return logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _model_inputs(model, prompt_ids, completion_ids, prompt_mask=None, completion_mask=None):
    """Validate a ``[prompt | completion]`` batch for ``model``; return ``(input_ids, attention_mask)``.

    Masked ids are replaced by 0 (any id in the vocabulary would do: nothing attends to them), so
    a pad id of -100 or one past the vocabulary cannot crash the embedding lookup.
    """
    _check_ids("prompt_ids", prompt_ids)
    _check_ids("completion_ids", completion_ids)
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2:
        raise ValueError(f"prompt_ids and completion_ids must be 2-D (B, P) and (B, T), got "
                         f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}")
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"prompt_ids and completion_ids must have the same batch size, got "
                         f"{prompt_ids.shape[0]} and {completion_ids.shape[0]}")
    prompt_mask = (torch.ones_like(prompt_ids) if prompt_mask is None
                   else _check_mask("prompt_mask", prompt_mask, prompt_ids))
    completion_mask = (torch.ones_like(completion_ids) if completion_mask is None
                       else _check_mask("completion_mask", completion_mask, completion_ids))
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompt_ids has no columns: every prompt needs at least one token (e.g. BOS), "
                         "since the first completion token is predicted from the prompt's last one")
    if (prompt_mask[:, -1] == 0).any():
        row = int((prompt_mask[:, -1] == 0).nonzero()[0])
        raise ValueError(f"prompt_mask must be 1 in the last column of every row (prompts left-padded), but "
                         f"row {row} is {prompt_mask[row].tolist()}: the first completion token would be "
                         f"predicted from a pad. Tokenize prompts with padding_side='left'.")
    vocab_size = model.get_input_embeddings().num_embeddings
    _check_ids("prompt_ids", prompt_ids, vocab_size, prompt_mask)
    _check_ids("completion_ids", completion_ids, vocab_size, completion_mask)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).to(prompt_ids.device)
    n_positions = getattr(model.config, "max_position_embeddings", None)
    longest = int(attention_mask.sum(1).max()) if attention_mask.numel() else 0
    if n_positions is not None and longest > n_positions:
        raise ValueError(f"prompt_ids and completion_ids hold up to {longest} real tokens in a row, more than "
                         f"the model's {n_positions} positions (max_position_embeddings)")
    input_ids = torch.cat([prompt_ids, completion_ids.to(prompt_ids.device)], dim=1).long()
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def completion_logits(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                      prompt_mask: torch.Tensor | None = None,
                      completion_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) that predict each completion token, from one full forward pass.

    The input is ``[prompt | completion]``. The logit at column ``P - 1 + t`` predicts
    completion token ``t``, so we keep the ``T`` columns starting at the prompt's last one.
    (A completion with holes, masked tokens inside it, is read from the last *real* column
    before each token instead: a hole is not there.)
    """
    input_ids, attention_mask = _model_inputs(model, prompt_ids, completion_ids, prompt_mask, completion_mask)
    n_new, n_prompt = completion_ids.shape[1], prompt_ids.shape[1]
    # Columns P-1 .. P+T-1; the last predicts a token after the completion.
    if fast_gpt2.supports(model):   # the same numbers, each distinct prompt computed once
        logits = fast_gpt2.completion_window_logits(model, input_ids[:, :n_prompt], attention_mask[:, :n_prompt],
                                                    input_ids[:, n_prompt:], attention_mask[:, n_prompt:])
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                       logits_to_keep=n_new + 1).logits
    # Column of the last real token at or before each column of the kept window (the prompt's last
    # column is real, so there always is one): the predictor of the token that follows it.
    window = attention_mask[:, -(n_new + 1):-1]
    steps = torch.arange(n_new, device=window.device).expand_as(window)
    predictor = torch.where(window.bool(), steps, torch.zeros_like(steps)).cummax(-1).values
    return logits.gather(1, predictor[..., None].expand(-1, -1, logits.shape[-1]))


def sequence_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor, prompt_mask: torch.Tensor | None = None,
                      temperature: float = 1.0) -> torch.Tensor:
    """Per-token ``log pi(y_t | x, y_<t)`` of the completion, shape (B, T), exactly 0 where masked.

    Differentiable (call it under ``torch.no_grad()`` for the old or reference policy). Sum over
    the last axis for the sequence log-prob ``log pi(y | x)``; an empty completion (T = 0) gives a
    (B, 0) tensor, whose sum is 0 = log 1. Prompts must be left-padded (see the module docstring).
    """
    temperature = _check_temperature(temperature)
    if completion_mask is None:
        raise ValueError("completion_mask is required: 1 on the completion's real tokens (up to and "
                         "including EOS), 0 on padding")
    logits = completion_logits(model, prompt_ids, completion_ids, prompt_mask, completion_mask)
    real = completion_mask.bool()
    logp = token_logprobs_from_logits(logits, completion_ids.masked_fill(~real, 0), temperature)
    # where, not a product: a pad's log-prob (even -inf or NaN) must give exactly 0, not NaN
    return torch.where(real, logp, torch.zeros_like(logp))


def next_token_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                        prompt_mask: torch.Tensor | None = None,
                        temperature: float = 1.0) -> torch.Tensor:
    """The full next-token log-distribution at each completion position, shape (B, T, V).

    Row ``[b, t]`` is ``log softmax(logits / T)`` over the vocabulary given the prompt and the
    first ``t`` completion tokens: what exact KL and entropy need.
    """
    temperature = _check_temperature(temperature)
    logits = completion_logits(model, prompt_ids, completion_ids, prompt_mask)
    return F.log_softmax(_at_least_float32(logits) / temperature, dim=-1)
