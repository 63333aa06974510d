"""Samplers that are not the trained policy (lesson 10c): a low-precision copy, a quantised copy, a stale copy.

Each is a function with :func:`rlcourse.lm.sample`'s signature, handed to a trainer as ``sampler=``
(:class:`~rlcourse.trainers.policy_gradient.PolicyGradientTrainer` and
:class:`~rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer`). On every call it builds the
copy it samples from out of the trainer's current model (a weight sync, as an inference engine
receives new weights), samples with that copy, and returns the :class:`~rlcourse.lm.sampling.Rollout`
whose ``logprobs`` are the copy's: the trainer's ``sampler_logprobs``. The trainer then scores the
same tokens with its own float32 forward; the difference is the sampler-trainer mismatch that
:mod:`rlcourse.losses.off_policy` corrects.

* :func:`cast_copy` - the weights in bfloat16 or float16 (what an inference engine runs);
* :func:`quantised_copy` - the weights rounded to ``bits`` bits per row (round to nearest, one
  scale per row of each matrix, symmetric): fewer bits, a larger gap, a knob to turn;
* :class:`CopySampler` - samples from ``make_copy(model)``;
* :class:`StaleSampler` - samples from the model as it was ``k`` calls ago (an asynchronous
  queue of rollouts, simulated in one process: the sampler is ``k`` updates behind the trainer).

Device-agnostic: copies stay on the model's device.
"""
from __future__ import annotations

import collections
import copy

import torch

from rlcourse.lm import fast_gpt2
from rlcourse.lm.sampling import sample

__all__ = ["cast_copy", "quantised_copy", "CopySampler", "StaleSampler"]


def cast_copy(model, dtype: torch.dtype = torch.bfloat16):
    """A copy of ``model`` with every floating-point parameter and buffer in ``dtype``, in eval mode.

    The copy's forward runs in ``dtype``, its logits included; :func:`rlcourse.lm.sample` (and
    :func:`rlcourse.lm.logprobs.sequence_logprobs`) cast those logits to float32 before the softmax and
    the log-softmax, as an inference engine such as vLLM does. So the gap to a float32 trainer comes
    from the rounded weights, activations and logits, not from a low-precision log-softmax.
    """
    out = copy.deepcopy(model)
    for t in list(out.parameters()) + list(out.buffers()):
        if t.is_floating_point():
            t.data = t.data.to(dtype)
    return out.eval().requires_grad_(False)


@torch.no_grad()
def quantised_copy(model, bits: int):
    """A float32 copy of ``model`` whose weight matrices are rounded to ``bits`` bits.

    Every parameter with at least two dimensions (the embeddings and the attention and MLP
    matrices; biases and layer norms are kept) becomes ``s * round(W / s)`` with one scale
    ``s = max|W_row| / (2^(bits-1) - 1)`` per row of its last dimension (a seed-stacked model's
    seeds are rounded separately, row by row). ``bits`` is an integer >= 2.
    """
    if not isinstance(bits, int) or isinstance(bits, bool) or bits < 2:
        raise ValueError(f"bits must be an integer >= 2, got {bits!r}")
    out = copy.deepcopy(model)
    levels = 2 ** (bits - 1) - 1
    stacked = 0 if fast_gpt2.num_seeds(model) is None else 1     # a seed-stacked model's own leading dimension
    for p in out.parameters():
        if p.dim() - stacked >= 2:
            scale = p.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / levels
            p.copy_(torch.round(p / scale) * scale)
    return out.eval().requires_grad_(False)


class CopySampler:
    """``sampler(model, tokenizer, prompts, max_new_tokens, ...)``: :func:`rlcourse.lm.sample` from
    ``make_copy(model)``; the rollout's ``logprobs`` (the copy's, cast to float32) are the sampler's."""

    def __init__(self, make_copy):
        self.make_copy = make_copy

    def __call__(self, model, tokenizer, prompts, max_new_tokens, **kwargs):
        roll = sample(self.make_copy(model), tokenizer, prompts, max_new_tokens, **kwargs)
        roll.logprobs = roll.logprobs.float()
        return roll


class StaleSampler:
    """Samples from the trainer's model as it was ``k`` calls (updates) ago: an asynchronous queue of depth ``k``.

    The first ``k`` calls sample from the oldest copy held (the start). ``make_copy`` (default: an
    exact float32 copy) may add a precision gap on top of the staleness.
    """

    def __init__(self, k: int, make_copy=None):
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0 (how many updates the sampler is behind), got {k!r}")
        self.k = k
        self.make_copy = make_copy or (lambda m: copy.deepcopy(m).eval().requires_grad_(False))
        self.queue: collections.deque = collections.deque(maxlen=k + 1)

    def __call__(self, model, tokenizer, prompts, max_new_tokens, **kwargs):
        self.queue.append(self.make_copy(model))
        roll = sample(self.queue[0], tokenizer, prompts, max_new_tokens, **kwargs)
        roll.logprobs = roll.logprobs.float()
        return roll
