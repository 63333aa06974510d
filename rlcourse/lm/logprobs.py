"""Log-probabilities of tokens under a causal language model, with masks.

A language model is a policy over tokens: at step ``t`` the state is the prompt plus the
completion so far, the action is the next token ``y_t``, and

    log pi(y_t | x, y_<t) = logits_t[y_t] / T - logsumexp_v(logits_t[v] / T)

for sampling temperature ``T``. The log-probability of a whole completion is the sum over its
tokens, ``log pi(y | x) = sum_t m_t log pi(y_t | x, y_<t)``, where the mask ``m_t`` is 1 for the
real tokens (up to and including EOS) and 0 for the padding after it.

The right computation is a log-softmax over the vocabulary *followed by a gather of the token that
was actually sampled*. A common slip (it is in the syllabus' pseudocode) keeps the log-softmax of
the whole vocabulary, or sums it, as if it were the action's log-prob: that is a different number
with no gradient meaning.

Left padding: GPT-2 learns absolute position embeddings. A left-padded prompt must give its first
real token position 0, so position ids are computed from the attention mask, ``cumsum - 1``
(clamped at 0 for the pads, which nothing attends to). Without this the log-probs of the same
tokens differ between the sampler and the trainer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row: ``cumsum(mask) - 1``, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _check_batch(prompt_ids, completion_ids, completion_mask=None, prompt_mask=None):
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2:
        raise ValueError(f"prompt_ids and completion_ids must be 2-D (B, P) and (B, T), got "
                         f"{tuple(prompt_ids.shape)} and {tuple(completion_ids.shape)}")
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"prompt_ids and completion_ids must have the same batch size, got "
                         f"{prompt_ids.shape[0]} and {completion_ids.shape[0]}")
    if completion_mask is not None and completion_mask.shape != completion_ids.shape:
        raise ValueError(f"completion_mask must have completion_ids' shape "
                         f"{tuple(completion_ids.shape)}, got {tuple(completion_mask.shape)}")
    if prompt_mask is not None and prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask must have prompt_ids' shape {tuple(prompt_ids.shape)}, "
                         f"got {tuple(prompt_mask.shape)}")


def completion_logits(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                      prompt_mask: torch.Tensor | None = None,
                      completion_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) that predict each completion token, from one full forward pass.

    The input is ``[prompt | completion]``. The logit at column ``P - 1 + t`` predicts
    completion token ``t``, so we keep the ``T`` columns starting at the prompt's last one.
    """
    _check_batch(prompt_ids, completion_ids, completion_mask, prompt_mask)
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)
    if completion_mask is None:
        completion_mask = torch.ones_like(completion_ids)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    n_new = completion_ids.shape[1]
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                logits_to_keep=n_new + 1)
    # The last column predicts a token after the completion: not needed.
    return out.logits[:, :-1]


def sequence_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor, prompt_mask: torch.Tensor | None = None,
                      temperature: float = 1.0) -> torch.Tensor:
    """Per-token ``log pi(y_t | x, y_<t)`` of the completion, shape (B, T), 0 where masked.

    Differentiable (call it under ``torch.no_grad()`` for the old or reference policy). Sum over
    the last axis for the sequence log-prob ``log pi(y | x)``.
    """
    logits = completion_logits(model, prompt_ids, completion_ids, prompt_mask, completion_mask)
    logp = token_logprobs_from_logits(logits, completion_ids, temperature)
    return logp * completion_mask.to(logp.dtype)


def next_token_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor,
                        prompt_mask: torch.Tensor | None = None,
                        temperature: float = 1.0) -> torch.Tensor:
    """The full next-token log-distribution at each completion position, shape (B, T, V).

    Row ``[b, t]`` is ``log softmax(logits / T)`` over the vocabulary given the prompt and the
    first ``t`` completion tokens: what exact KL and entropy need.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    logits = completion_logits(model, prompt_ids, completion_ids, prompt_mask)
    return F.log_softmax(logits.float() / temperature, dim=-1)
