"""Best-of-n sampling: the baseline that every RLHF method has to beat at equal KL.

Draw ``n`` completions per prompt from the reference policy, score them with the reward model,
keep the best. No training at all. The policy this defines, ``pi_n``, moves away from the
reference by at most

    KL(pi_n || pi_ref) <= log n - (n - 1) / n

(Stiennon et al. 2020, arXiv 2009.01325, appendix; exact when the reward has no ties, and an upper
bound in general, Beirami et al. 2024, arXiv 2401.01879). Gao et al. (2022, arXiv 2210.10760)
measured reward-model over-optimisation for both best-of-n and RL as a function of this KL.
"""
from __future__ import annotations

import math

import torch

from rlcourse.lm.scalar_head import score_completions
from rlcourse.lm.sampling import sample

__all__ = ["best_of_n_kl", "best_of_n"]


def best_of_n_kl(n: int) -> float:
    """``log n - (n - 1) / n``: the KL of best-of-n to the sampling policy (nats; 0 for ``n = 1``)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return math.log(n) - (n - 1) / n


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
