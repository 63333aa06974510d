"""How much of the answer space a sampled policy covers: pass@k and the share of distinct valid answers.

Validity (pass@1) asks how often one sample is right. Two other questions matter once a task has
many right answers:

* **pass@k**: is *at least one* of k samples right? The unbiased estimator of Chen et al. 2021
  ("Evaluating Large Language Models Trained on Code", arXiv:2107.03374) draws n >= k samples of
  which c are right and averages over all k-subsets of them: ``1 - C(n-c, k) / C(n, k)``.
  It is unbiased for ``1 - (1-p)^k`` whatever the per-prompt success rate p, and uses all n
  samples, where "draw exactly k and check" would throw information away.
* **distinct among valid**: of the valid answers given, the fraction that are different. A policy
  that repeats one right answer scores 1/c, one whose c right answers all differ scores 1. Unlike
  "the number of distinct valid answers" it is not capped by validity: a half-valid policy and a
  fully valid one can both score 1.
* **pass@k by cell**: when almost every prompt is solved within k samples, pass@k saturates and
  cannot show a policy losing reach. A harder question splits each prompt's right answers into
  cells (for an answer of digits, by its first digit) and asks, cell by cell, whether k samples
  hold a right answer *in that cell*. A policy that piles its mass on a few cells can beat its
  start at k = 1 and fall behind it at large k.
"""
from __future__ import annotations

import math
import numbers
from collections import Counter, defaultdict

import numpy as np

__all__ = ["pass_at_k", "coverage", "pass_at_k_by_cell"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are right: ``1 - C(n-c, k) / C(n, k)``.

    The probability that a k-subset drawn uniformly without replacement from the n samples holds at
    least one right one (Chen et al. 2021, arXiv:2107.03374, eq. 1). Its expectation over the n
    samples is ``1 - (1-p)^k`` for a success rate p. Computed with exact integers; ``k = 1`` gives
    ``c / n`` and ``n - c < k`` gives 1 (every k-subset holds a right sample). NumPy integers are
    integers (a count from ``array.sum()`` is an ``np.int64``); bools are not.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    n, c, k = int(n), int(c), int(k)
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _samples_per_prompt(prompts: list[str], completions: list[str], valid: list[bool]) -> int:
    """The number n of samples each distinct prompt has; refuses mismatched lists, none, or unequal n."""
    if not len(prompts) == len(completions) == len(valid):
        raise ValueError(f"prompts, completions and valid must have one entry each, got "
                         f"{len(prompts)}, {len(completions)}, {len(valid)}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    sizes = set(Counter(prompts).values())
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples, got counts {sorted(sizes)}")
    return sizes.pop()


def coverage(prompts: list[str], completions: list[str], valid: list[bool], ks=(1,)) -> dict:
    """pass@k (for each k in ``ks``, mean over prompts) and the distinct-among-valid share of a sample.

    Every distinct prompt must appear the same number n of times (n samples each) with n >= max(ks).
    Returns ``{"pass@k": ..., "distinct_among_valid": ..., "valid_answers": ...}``, where
    ``distinct_among_valid`` is the total number of different valid answers (counted per prompt)
    over the total number of valid answers, and NaN when no answer is valid.
    """
    n = _samples_per_prompt(prompts, completions, valid)
    right: dict[str, list[str]] = defaultdict(list)
    for p, c, ok in zip(prompts, completions, valid):
        if ok:
            right[p].append(c)
    distinct_prompts = dict.fromkeys(prompts)
    out = {f"pass@{k}": sum(pass_at_k(n, len(right[p]), k) for p in distinct_prompts) / len(distinct_prompts)
           for k in ks}
    n_valid = sum(len(v) for v in right.values())
    out["distinct_among_valid"] = (sum(len(set(v)) for v in right.values()) / n_valid) if n_valid else math.nan
    out["valid_answers"] = n_valid
    return out


def pass_at_k_by_cell(prompts: list[str], completions: list[str], valid: list[bool], cells: dict,
                      cell_of, ks=(1,)) -> dict:
    """pass@k where a problem is a (prompt, cell) and a sample solves it when it is right and in the cell.

    ``cells`` maps each prompt to the cells its right answers can fall in (every one counts, also
    those no sample reached); ``cell_of(completion)`` names a completion's cell. For the (prompt, cell)
    with n samples of which c are right and in the cell, :func:`pass_at_k` gives ``1 - C(n-c, k)/C(n, k)``,
    unbiased for ``1 - (1 - p_cell)^k``; the result is its mean over all (prompt, cell) problems, one
    key ``"pass@k"`` per k, and ``"cells"``, their number. Every prompt needs the same n >= max(ks).
    """
    n = _samples_per_prompt(prompts, completions, valid)
    missing = sorted(set(prompts) - set(cells))
    if missing:
        raise ValueError(f"cells must list the cells of every prompt; missing {missing[:3]}")
    hits: dict[tuple, int] = defaultdict(int)
    for p, c, ok in zip(prompts, completions, valid):
        if ok:
            hits[p, cell_of(c)] += 1
    problems = [(p, cell) for p in dict.fromkeys(prompts) for cell in cells[p]]
    if not problems:
        raise ValueError("cells must give at least one cell for some prompt")
    out = {f"pass@{k}": sum(pass_at_k(n, hits[problem], k) for problem in problems) / len(problems) for k in ks}
    out["cells"] = len(problems)
    return out
