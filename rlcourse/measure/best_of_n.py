"""Best-of-n sampling: the baseline that every RLHF method has to beat at equal KL.

Draw ``n`` completions per prompt from the reference policy, score them with the reward model,
keep the best. No training at all. The policy this defines, ``pi_n``, moves away from the
reference by at most

    KL(pi_n || pi_ref) <= log n - (n - 1) / n

(Stiennon et al. 2020, arXiv 2009.01325, appendix). The formula is the KL only when no two of the
``n`` draws can be the same completion (no completion has positive probability); where completions
repeat, as they do for a language model, it is an upper bound (Beirami et al. 2024, "Theoretical
guarantees on the best-of-n alignment policy", arXiv 2401.01879), and :func:`best_of_n_kl_exact`
computes the exact KL over a finite set of outcomes. Gao et al. (2022, arXiv 2210.10760) measured
reward-model over-optimisation for both best-of-n and RL as a function of this KL.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rlcourse.lm.scalar_head import score_completions
from rlcourse.lm.sampling import sample

__all__ = ["best_of_n_kl", "best_of_n_kl_exact", "best_of_n"]


def best_of_n_kl(n: int) -> float:
    """``log n - (n - 1) / n`` (nats; 0 for ``n = 1``): the KL of best-of-n to the sampling policy when no two
    draws can coincide, an upper bound on it otherwise (:func:`best_of_n_kl_exact`)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return math.log(n) - (n - 1) / n


def best_of_n_kl_exact(ref_probs, rewards, n: int) -> float:
    """The exact ``KL(pi_n || pi_ref)`` of best-of-n over finitely many outcomes, repeats and ties included.

    ``ref_probs`` (K,) are the outcomes' reference probabilities (summing to 1), ``rewards`` (K,) their
    rewards. With the distinct reward levels ``r`` in increasing order and ``F(r) = P_ref(reward <= r)``,
    the best of ``n`` independent draws lands on level ``r`` with probability

        P_n(r) = F(r)^n - F(r^-)^n,

    and, among the outcomes tied at that level, falls as the reference does (the draws are
    exchangeable, so a tie-break by draw order picks each tied outcome in proportion to its
    probability). Hence ``KL = sum_r P_n(r) log(P_n(r) / P_ref(r))``, never above
    :func:`best_of_n_kl` and below it whenever an outcome has positive probability (Beirami et al. 2024).
    """
    best_of_n_kl(n)  # validates n
    p = np.asarray(ref_probs, dtype=np.float64)
    r = np.asarray(rewards, dtype=np.float64)
    if p.ndim != 1 or r.shape != p.shape or not np.isfinite(r).all():
        raise ValueError("ref_probs and rewards must be finite 1-D arrays of the same length")
    if (p < 0).any() or abs(p.sum() - 1) > 1e-9:
        raise ValueError(f"ref_probs must be >= 0 and sum to 1, got a sum of {p.sum()!r}")
    levels, level_of = np.unique(r[p > 0], return_inverse=True)
    mass = np.bincount(level_of, weights=p[p > 0], minlength=len(levels))
    below = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
    p_n = (below + mass) ** n - below ** n
    kept = p_n > 0
    return float(np.sum(p_n[kept] * np.log(p_n[kept] / mass[kept])))


@torch.no_grad()
def best_of_n(policy, tokenizer, reward_model, prompts: list[str], n: int, max_new_tokens: int,
              temperature: float = 1.0, generator: torch.Generator | None = None,
              chunk: int = 4096) -> dict:
    """For each prompt, the highest-scoring of ``n`` samples: ``{"completions", "scores", "all_scores"}``.

    ``scores`` is ``(len(prompts),)``, the reward model's score of the kept completion;
    ``all_scores`` is ``(len(prompts), n)``. Sampling and scoring run in chunks of ``chunk`` rows.
    """
    best_of_n_kl(n)  # validates n
    repeated = [p for p in prompts for _ in range(n)]
    texts, scores = [], []
    for start in range(0, len(repeated), chunk):
        ro = sample(policy, tokenizer, repeated[start:start + chunk], max_new_tokens, temperature=temperature,
                    generator=generator)
        scores.append(score_completions(reward_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                        ro.completion_mask))
        texts += ro.completions
    all_scores = torch.cat(scores).view(len(prompts), n)
    best = all_scores.argmax(dim=1)
    chosen = [texts[i * n + int(j)] for i, j in enumerate(best)]
    return {"completions": chosen, "scores": all_scores.max(dim=1).values, "all_scores": all_scores}
