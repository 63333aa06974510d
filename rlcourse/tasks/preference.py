"""A preference task with a hidden "gold" score, for reward models, RLHF and DPO.

Prompts are two letters and a colon, ``"ce:"``; a completion is a short word over the letters
``a``-``h``. A hidden gold score says how good a completion is:

    gold(x, y) = mean_i [1 - min_j |y_i - x_j| / 7]  -  0.25 |len(y) - 4|

(letters are numbered a=0 ... h=7): letters close to the prompt's letters are good and four
letters is the best length. Empty words or words with other characters score -1.

Nobody shows the learner this formula. As with human feedback, they only see *comparisons*: two
completions of the same prompt, and which one a rater preferred. Raters follow the
Bradley-Terry model with the gold score as the latent utility,

    P(y_a preferred to y_b | x) = sigmoid(beta * (gold(x, y_a) - gold(x, y_b))),

so a large ``beta`` means reliable raters and a small one noisy raters. A reward model trained on
these pairs is a *proxy* for the gold score; lessons 08 and 11 measure both as a policy optimises
the proxy.

Raters can also have a taste the gold score does not share. With ``length_bias = b`` they rate by

    utility(x, y) = gold(x, y) + b * len(y)

instead of the gold score: a verbosity bias, the best documented flaw of human and AI raters
(Singhal et al. 2023, "A Long Way to Go: Investigating Length Correlations in RLHF", arXiv
2310.03716). A reward model learns it from their labels, and a policy that optimises the reward
model can exploit it (lesson 08b).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rlcourse.tasks._checks import as_rng, check_count, check_pairs

LETTERS = "abcdefgh"


class PreferenceTask:
    """Hidden gold score over short words, and Bradley-Terry comparisons of pairs of them."""

    def __init__(self, target_length: int = 4, max_length: int = 7, beta: float = 4.0, length_bias: float = 0.0):
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        if not isinstance(target_length, int) or not 1 <= target_length <= max_length:
            raise ValueError(f"target_length must be an integer in [1, max_length={max_length}], "
                             f"got {target_length!r}")
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta!r}")
        if not math.isfinite(length_bias):
            raise ValueError(f"length_bias must be a finite number (the raters' utility per letter), got {length_bias!r}")
        self.target_length, self.max_length, self.beta = target_length, max_length, beta
        self.length_bias = float(length_bias)
        self.max_new_tokens = max_length + 1

    def __repr__(self):
        bias = f", length_bias={self.length_bias}" if self.length_bias else ""
        return (f"PreferenceTask(target_length={self.target_length}, max_length={self.max_length}, "
                f"beta={self.beta}{bias})")

    def prompts(self, n: int, rng=None) -> list[str]:
        """``n`` prompts of two random letters, e.g. ``"ce:"``."""
        check_count(n)
        idx = as_rng(rng).integers(0, len(LETTERS), size=(n, 2))
        return [f"{LETTERS[i]}{LETTERS[j]}:" for i, j in idx]

    def test_prompts(self, n: int = 64) -> list[str]:
        """All 64 letter pairs in a fixed order, cycled to length ``n``."""
        check_count(n)
        pool = [f"{a}{b}:" for a in LETTERS for b in LETTERS]
        return [pool[i % len(pool)] for i in range(n)]

    def _letters(self, prompt: str) -> list[int]:
        if len(prompt) != 3 or prompt[2] != ":" or any(c not in LETTERS for c in prompt[:2]):
            raise ValueError(f"prompt must be two letters from {LETTERS!r} and ':', got {prompt!r}")
        return [LETTERS.index(c) for c in prompt[:2]]

    def gold_score(self, prompt: str, completion: str) -> float:
        """The hidden score of one completion (see the module docstring)."""
        anchors = self._letters(prompt)
        if not completion or len(completion) > self.max_length or any(c not in LETTERS for c in completion):
            return -1.0
        span = len(LETTERS) - 1
        closeness = np.mean([1 - min(abs(LETTERS.index(c) - a) for a in anchors) / span
                             for c in completion])
        return float(closeness - 0.25 * abs(len(completion) - self.target_length))

    def reward(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """The gold score of each completion (what a perfect reward model would output)."""
        check_pairs(prompts, completions)
        return torch.tensor([self.gold_score(p, c) for p, c in zip(prompts, completions)],
                            dtype=torch.float32)

    gold = reward

    def reference_completion(self, rng=None) -> str:
        """What an untrained "base policy" writes: a random word of 1..max_length letters."""
        rng = as_rng(rng)
        length = int(rng.integers(1, self.max_length + 1))
        return "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), size=length))

    def word_classes(self, prompt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lengths, gold, probabilities)``: every base-policy word of ``prompt``, grouped exactly.

        A word's gold score depends only on its length ``L`` and on the sum ``S`` of its letters'
        distances to the nearer prompt letter, ``gold = 1 - S / (7 L) - 0.25 |L - target_length|``;
        so do the raters' utility and the reward of any policy that treats such words alike. The
        law of ``S`` for ``L`` uniform letters is the ``L``-fold convolution of one letter's distance
        law, and ``L`` is uniform on ``1..max_length``: one entry per class ``(L, S)``, no sampling.
        """
        anchors = self._letters(prompt)
        span = len(LETTERS) - 1
        distance = np.zeros(span + 1)
        for letter in range(len(LETTERS)):
            distance[min(abs(letter - a) for a in anchors)] += 1.0 / len(LETTERS)
        lengths, gold, probs = [], [], []
        law = np.array([1.0])  # law of the summed distance S over L letters (L = 0 to start)
        for length in range(1, self.max_length + 1):
            law = np.convolve(law, distance)
            total = np.arange(law.size)
            lengths.append(np.full(law.size, length))
            gold.append(1 - total / (span * length) - 0.25 * abs(length - self.target_length))
            probs.append(law / self.max_length)
        return np.concatenate(lengths), np.concatenate(gold), np.concatenate(probs)

    def sft_dataset(self, n: int, rng=None) -> list[dict]:
        """``n`` base-policy examples ``{"prompt", "completion"}``: random words, no preference."""
        rng = as_rng(rng)
        return [{"prompt": p, "completion": self.reference_completion(rng)} for p in self.prompts(n, rng)]

    def rater_utility(self, prompt: str, completion: str) -> float:
        """What the raters maximise: ``gold(x, y) + length_bias * len(y)`` (the gold score when unbiased)."""
        return self.gold_score(prompt, completion) + self.length_bias * len(completion)

    def preference_probability(self, prompt: str, a: str, b: str) -> float:
        """Bradley-Terry ``P(a preferred to b) = sigmoid(beta * (utility(a) - utility(b)))``."""
        diff = self.beta * (self.rater_utility(prompt, a) - self.rater_utility(prompt, b))
        return 1.0 / (1.0 + math.exp(-diff))

    def preference_pairs(self, n: int, rng=None) -> list[dict]:
        """``n`` rated comparisons ``{"prompt", "chosen", "rejected"}`` (TRL's preference format).

        For each prompt two different base-policy completions are drawn, and a simulated rater
        picks the chosen one with the Bradley-Terry probability: sometimes the worse one.
        """
        rng = as_rng(rng)
        pairs = []
        for prompt in self.prompts(n, rng):
            a = self.reference_completion(rng)
            b = self.reference_completion(rng)
            while b == a:
                b = self.reference_completion(rng)
            if rng.random() < self.preference_probability(prompt, a, b):
                pairs.append({"prompt": prompt, "chosen": a, "rejected": b})
            else:
                pairs.append({"prompt": prompt, "chosen": b, "rejected": a})
        return pairs
