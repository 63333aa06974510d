"""Measurements for lesson 10b: draw many samples per held-out prompt from every seed of a run, judge
them with several verifiers at once, and turn the judgements into pass@k and per-seed rates.

A seed-batched run (:class:`~rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer`) holds S
policies in one stacked model. :func:`draw` samples ``n`` completions of each held-out prompt from
every seed (one decoding loop for all of them, each seed with its own generator seeded alike, so two
runs of the same seeds are judged on equally drawn samples), and returns them as a :class:`Draw`:
``completions[s][p][j]`` is the j-th sample of prompt p from seed s. :meth:`Draw.judge` applies
a verifier (any TRL-style reward function ``f(prompts, completions) -> list[float]``) and returns
an ``(S, P, n)`` array; :func:`pass_at_k_curve` turns a boolean one into pass@k for every k.

:func:`batch_drift` measures what one step's ``num_iterations`` updates did to the log-probs of the
batch they were computed on, split by how likely each token was and by its advantage's sign: the
quantity PPO's clip acts on (lesson 10b: the clip under random rewards).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlcourse.measure.coverage import pass_at_k
from rlcourse.lm.fast_gpt2 import num_seeds
from rlcourse.lm.logprobs import completion_logits, token_logprobs_from_logits
from rlcourse.lm.sampling import sample

__all__ = ["Draw", "draw", "pass_at_k_curve", "per_seed_series", "DRIFT_GROUPS", "batch_drift"]

DRIFT_GROUPS = ("likely", "rare, A > 0", "rare, A < 0")


@dataclass
class Draw:
    """``n`` samples of each of ``prompts`` from each of ``num_seeds`` policies.

    ``completions`` is a nested list ``[seed][prompt][sample]`` of strings; ``lengths``,
    ``truncated`` and ``logprobs`` are ``(S, P, n)`` arrays (tokens including ``<eos>``; cut at the
    length limit; ``log pi(y | x)`` of the whole completion at the sampling temperature).
    """

    prompts: list[str]
    completions: list
    lengths: np.ndarray
    truncated: np.ndarray
    logprobs: np.ndarray

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.lengths.shape

    def judge(self, verifier) -> np.ndarray:
        """``verifier(prompts, completions)`` on every sample, as an ``(S, P, n)`` float array."""
        S, P, n = self.shape
        flat_prompts = [p for p in self.prompts for _ in range(n)] * S
        flat = [c for seed in self.completions for row in seed for c in row]
        values = np.asarray(verifier(flat_prompts, flat), dtype=float)
        if values.shape != (S * P * n,):
            raise ValueError(f"verifier must return one value per completion ({S * P * n}), got shape {values.shape}")
        return values.reshape(S, P, n)


def draw(model, tokenizer, prompts: list[str], n: int, max_new_tokens: int, temperature: float = 1.0,
         seed: int = 0) -> Draw:
    """``n`` samples of each prompt from each seed of ``model`` (a seed-stacked model, or a plain one as 1 seed).

    Every seed samples with its own ``torch.Generator`` seeded with ``seed``.
    """
    if not prompts or isinstance(prompts, str):
        raise ValueError("prompts must be a non-empty list of strings")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    S = num_seeds(model) or 1
    device = next(model.parameters()).device
    block = [p for p in prompts for _ in range(n)]
    generators = [torch.Generator(device=device).manual_seed(seed) for _ in range(S)]
    roll = sample(model, tokenizer, block * S, max_new_tokens, temperature=temperature,
                  generator=generators if num_seeds(model) else generators[0])
    P = len(prompts)
    texts = roll.completions
    completions = [[texts[(s * P + p) * n:(s * P + p + 1) * n] for p in range(P)] for s in range(S)]
    lengths = roll.completion_mask.sum(1).view(S, P, n).cpu().numpy()
    truncated = (~roll.finished).view(S, P, n).cpu().numpy()
    logprobs = (roll.logprobs * roll.completion_mask).sum(1).view(S, P, n).double().cpu().numpy()
    return Draw(list(prompts), completions, lengths, truncated, logprobs)


def pass_at_k_curve(correct: np.ndarray, ks) -> np.ndarray:
    """pass@k of each seed, ``(S, len(ks))``: Chen et al.'s unbiased estimator from the ``n`` samples of each
    prompt (:func:`rlcourse.measure.coverage.pass_at_k`), averaged over the prompts. ``correct`` is ``(S, P, n)``."""
    correct = np.asarray(correct)
    if correct.ndim != 3:
        raise ValueError(f"correct must be an (S, P, n) array, got shape {correct.shape}")
    S, P, n = correct.shape
    counts = correct.astype(bool).sum(2)
    return np.array([[np.mean([pass_at_k(n, int(c), int(k)) for c in counts[s]]) for k in ks] for s in range(S)])


def per_seed_series(history, key: str) -> np.ndarray:
    """A logged metric of a seed-batched run as an ``(S, steps)`` array (NaN where a step did not log it)."""
    return np.array([[h.get(key, np.nan) for h in seed] for seed in history], dtype=float)


@torch.no_grad()
def batch_drift(trainer, rare_below: float = 0.2, likely_above: float = 0.5) -> np.ndarray:
    """What the last step did to its own batch: ``(S, 3)``, each seed's mean ``log pi_new(y_t) - log pi_old(y_t)``.

    ``trainer`` is a :class:`~rlcourse.trainers.policy_gradient_seeds.SeedBatchedPolicyGradientTrainer` after
    a step with ``num_iterations > 1`` (its ``last_batch`` keeps the step's tokens, advantages and the
    log-probs ``log pi_old`` they were sampled with); ``log pi_new`` is its policy now, at the trainer's
    temperature. Columns (:data:`DRIFT_GROUPS`), over the real tokens of each seed's rows:

    * ``likely``: tokens with ``pi_old(y_t) >= likely_above``, whatever their advantage;
    * ``rare, A > 0`` and ``rare, A < 0``: tokens with ``pi_old(y_t) < rare_below`` whose completion's
      advantage is positive, resp. negative.

    PPO's clip stops pushing a token once ``pi / pi_old`` leaves ``[1 - epsilon, 1 + epsilon]`` in the
    direction its advantage pushes. NaN where a seed's batch holds no such token.
    """
    b = trainer.last_batch
    if b is None or b.old_logprobs is None:
        raise ValueError("batch_drift needs a trainer that has taken a step with num_iterations > 1 "
                         "(its last_batch, with the log-probs the batch was sampled with)")
    if not 0.0 < rare_below <= likely_above <= 1.0:
        raise ValueError(f"need 0 < rare_below <= likely_above <= 1, got {rare_below!r}, {likely_above!r}")
    logits = completion_logits(trainer.model, b.prompt_ids, b.completion_ids, b.prompt_mask, b.loss_mask)
    change = (token_logprobs_from_logits(logits, b.completion_ids, trainer.config.temperature)
              - b.old_logprobs).double()
    real = b.loss_mask.bool()
    p_old = b.old_logprobs.double().exp()
    sign = b.advantages.double()[:, None].expand_as(change)
    groups = (real & (p_old >= likely_above), real & (p_old < rare_below) & (sign > 0),
              real & (p_old < rare_below) & (sign < 0))
    rows = change.shape[0] // trainer.num_seeds
    out = np.full((trainer.num_seeds, len(groups)), np.nan)
    for s in range(trainer.num_seeds):
        block = slice(s * rows, (s + 1) * rows)
        for j, keep in enumerate(groups):
            if bool(keep[block].any()):
                out[s, j] = float(change[block][keep[block]].mean())
    return out
