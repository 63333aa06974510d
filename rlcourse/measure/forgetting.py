"""What fine-tuning changes in a model: the forward KL from the base model, and the frontier of two accuracies (lesson 12b).

"RL's Razor" (Shenfeld, Pari and Agrawal, 2025, arXiv 2509.04259) reports that how much a model
forgets of its old tasks follows the forward KL from the base model ``pi_0`` to the fine-tuned
``pi``, measured on the *new* task's prompts, whatever the algorithm that moved it. The quantity
computed here:

    KL_new(pi_0 || pi) = E_{x ~ new-task prompts} E_{y ~ pi_0(.|x)} [ sum_t KL(pi_0(.|x, y_<t) || pi(.|x, y_<t)) ]

    KL(pi_0(.|h) || pi(.|h)) = sum_v pi_0(v|h) (log pi_0(v|h) - log pi(v|h))      exact, over the vocabulary

* the completions ``y`` are drawn **once from the base model** (fixed prompts, fixed seed) and reused
  for every fine-tuned model, so that every run is measured on the same token positions;
* at each position of ``y`` (its tokens and its ``<eos>``; padding excluded) the KL between the two
  next-token distributions is summed over the whole vocabulary, not estimated from the sampled token;
* by the chain rule, the sum over positions has expectation ``KL(pi_0(.|x) || pi(.|x))`` over whole
  completions: an unbiased estimate of the sequence-level forward KL, with less variance than the
  sampled log-ratio ``log pi_0(y|x) - log pi(y|x)`` (lesson 07b's k1) because each position's sum is exact.

Pure functions: :func:`forward_kl_per_token` (logits in, ``(B, T)`` out), :func:`base_completions`
and :func:`forward_kl_on_prompts` (models in, one number out), :func:`pareto_front` (which runs no
other run beats on both accuracies) and :func:`correlation_interval` (Pearson's r with Fisher's 95% interval).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rlcourse.kl import exact_kl
from rlcourse.lm.logprobs import completion_logits
from rlcourse.lm.sampling import sample

__all__ = ["forward_kl_per_token", "base_completions", "forward_kl_on_prompts", "pareto_front",
           "correlation_interval"]


def forward_kl_per_token(base_logits: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``KL(pi_0(.|h_t) || pi(.|h_t))`` at each position, exactly over the vocabulary, 0 where ``mask`` is 0.

    Args:
        base_logits: ``(B, T, V)`` the base model's logits at the completion's positions.
        logits: ``(B, T, V)`` the fine-tuned model's logits at the same positions.
        mask: ``(B, T)`` 1 on the completion's tokens (its ``<eos>`` included), 0 on padding.

    Returns ``(B, T)``: ``sum_v pi_0(v) (log pi_0(v) - log pi(v))``, in nats. Forward: the expectation is
    under the **base** model (``pi_0`` first), the direction "RL's Razor" measures.
    """
    if base_logits.shape != logits.shape or base_logits.ndim != 3:
        raise ValueError(f"base_logits and logits must both be (B, T, V), got {tuple(base_logits.shape)} and "
                         f"{tuple(logits.shape)}")
    if tuple(mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"mask must be (B, T) = {tuple(logits.shape[:2])}, got {tuple(mask.shape)}")
    logp0 = torch.log_softmax(base_logits.float(), -1)
    logp = torch.log_softmax(logits.float(), -1)
    return exact_kl(logp0, logp, dim=-1, mask=mask.bool())


@torch.no_grad()
def base_completions(base_model, tokenizer, prompts: list[str], samples_per_prompt: int, max_new_tokens: int,
                     seed: int = 0):
    """The base model's completions (T=1) of each prompt ``samples_per_prompt`` times: the positions the KL is read at.

    Returns :func:`rlcourse.lm.sample`'s ``Rollout`` (prompt-major rows); draw it once and pass it to
    :func:`forward_kl_on_prompts` for every model to compare.
    """
    if not isinstance(samples_per_prompt, int) or samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be an integer >= 1, got {samples_per_prompt!r}")
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    return sample(base_model, tokenizer, rows, max_new_tokens, temperature=1.0,
                  generator=torch.Generator(device=next(base_model.parameters()).device).manual_seed(seed))


@torch.no_grad()
def forward_kl_on_prompts(base_model, model, rollout) -> float:
    """Mean over the rollout's completions of ``sum_t KL(pi_0 || pi)`` (:func:`forward_kl_per_token`): nats per completion.

    ``rollout`` comes from :func:`base_completions` (the base model's samples). 0 exactly when ``model``
    gives the base model's next-token distributions at every counted position.
    """
    args = (rollout.prompt_ids, rollout.completion_ids, rollout.prompt_mask, rollout.completion_mask)
    base_logits = completion_logits(base_model.eval(), *args)
    logits = completion_logits(model.eval(), *args)
    per_token = forward_kl_per_token(base_logits, logits, rollout.completion_mask)
    return float(per_token.sum(-1).mean())


def pareto_front(points) -> np.ndarray:
    """Which of ``points`` (``(N, 2)``, both coordinates to maximise) no other point dominates: ``(N,)`` bools.

    ``q`` dominates ``p`` when ``q >= p`` in both coordinates and ``q > p`` in at least one. Equal points do
    not dominate each other (both stay on the front); NaN is refused.
    """
    pts = np.asarray(points, dtype=float)
    if pts.ndim != 2 or pts.shape[1] != 2 or len(pts) == 0:
        raise ValueError(f"points must be a non-empty (N, 2) array, got shape {pts.shape}")
    if np.isnan(pts).any():
        raise ValueError("points must not hold NaN")
    ge = (pts[None, :, :] >= pts[:, None, :]).all(-1)    # ge[i, j]: point j >= point i in both
    gt = (pts[None, :, :] > pts[:, None, :]).any(-1)     # gt[i, j]: point j > point i in one
    return ~(ge & gt).any(1)


def correlation_interval(x, y, level: float = 0.95) -> tuple[float, float, float]:
    """Pearson's ``r`` of paired values and its interval by Fisher's ``z = atanh(r)`` (``se = 1 / sqrt(n - 3)``).

    Returns ``(r, low, high)``. Assumes independent pairs (one per training run); needs ``n >= 4``.
    """
    from statistics import NormalDist

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 4:
        raise ValueError(f"x and y must be 1-D of one length >= 4, got shapes {x.shape} and {y.shape}")
    if x.std() == 0 or y.std() == 0:
        raise ValueError("x and y must both vary: a constant has no correlation")
    r = float(np.corrcoef(x, y)[0, 1])
    z, half = math.atanh(max(min(r, 1 - 1e-12), -1 + 1e-12)), NormalDist().inv_cdf(0.5 + level / 2) / math.sqrt(len(x) - 3)
    return r, math.tanh(z - half), math.tanh(z + half)
