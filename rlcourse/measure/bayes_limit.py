"""Exact facts about :class:`~rlcourse.tasks.preference.PreferenceTask`: the Bayes limit of a reward model.

Raters prefer ``a`` to ``b`` with probability ``p = sigmoid(beta (gold(a) - gold(b)))``. No
predictor of their choice can beat always naming the completion with the higher gold score, which
is right with probability ``max(p, 1 - p) = sigmoid(beta |gold(a) - gold(b)|)``. Averaged over the
pairs the task draws, that is the **Bayes limit** of pairwise accuracy: a reward model's held-out
accuracy can approach it, never exceed it (beyond sampling noise).

The pairs are two different base-policy words for a uniform prompt; a word has a uniform length
``L`` in ``1..max_length`` and uniform letters. Its gold score depends only on ``L`` and on the sum
``S`` of the letters' distances to the nearer prompt letter,
``gold = 1 - S / (7 L) - 0.25 |L - target_length|``, so the distribution of gold scores is exact by
convolving the distance distribution of one letter ``L`` times. With ``q`` that distribution and
``C = sum_w P(w)^2`` the chance that two independent draws are the same word (redrawn by the task):

    Bayes = ( sum_{g, g'} q(g) q(g') sigmoid(beta |g - g'|) - C / 2 ) / (1 - C),

averaged over the 64 prompts. No sampling anywhere. Raters with a ``length_bias`` ``b`` rate by
``gold + b L`` instead: the same formula holds with that utility in place of the gold score (the
best predictor of a rater is the rater's own utility, whatever the gold score thinks).
"""
from __future__ import annotations

import numpy as np

from rlcourse.tasks.preference import LETTERS

__all__ = ["gold_score_distribution", "rater_utility_distribution", "bayes_accuracy"]


def gold_score_distribution(task, prompt: str) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, probabilities)``: the exact law of ``gold(prompt, y)`` for a base-policy word ``y``."""
    _, gold, probs = task.word_classes(prompt)
    return gold, probs


def rater_utility_distribution(task, prompt: str) -> tuple[np.ndarray, np.ndarray]:
    """``(utilities, probabilities)``: the exact law of ``task.rater_utility(prompt, y)`` for a base-policy word."""
    lengths, gold, probs = task.word_classes(prompt)
    return gold + task.length_bias * lengths, probs


def bayes_accuracy(task) -> float:
    """The best pairwise accuracy any reward model can reach on ``task.preference_pairs`` (exact)."""
    n_letters, n_lengths = len(LETTERS), task.max_length
    collision = sum((1.0 / n_lengths) ** 2 * float(n_letters) ** -length for length in range(1, n_lengths + 1))
    accuracies = []
    for prompt in task.test_prompts(64):
        g, q = rater_utility_distribution(task, prompt)
        best = 1.0 / (1.0 + np.exp(-task.beta * np.abs(g[:, None] - g[None, :])))
        accuracies.append((q @ best @ q - collision / 2) / (1 - collision))
    return float(np.mean(accuracies))
